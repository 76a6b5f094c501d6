"""The whole model: configuration, initialisation, parameter count, masks by default."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import transformer_book as tb


def test_base_configuration_has_about_63_million_parameters():
    config = tb.ModelConfig.base()
    model = tb.make_model(config)
    count = tb.count_parameters(model)
    print(f"\nbase model, shared vocabulary of {config.src_vocab_size:,}: {count:,} parameters (the paper says 65M)")
    assert (config.d_model, config.num_heads, config.d_ff, config.num_layers) == (512, 8, 2048, 6)
    assert config.d_head == 64
    # embeddings (tied, once) + 6 encoder layers + 6 decoder layers + the output layer's bias
    embedding = 37000 * 512
    encoder_layer = 4 * (512 * 512 + 512) + (512 * 2048 + 2048) + (2048 * 512 + 512) + 2 * 2 * 512
    decoder_layer = encoder_layer + 4 * (512 * 512 + 512) + 2 * 512
    assert count == embedding + 6 * encoder_layer + 6 * decoder_layer + 37000 == 63_119_496
    assert 62e6 < count < 64e6


def test_shared_embeddings_tie_three_matrices():
    model = tb.make_model(tb.ModelConfig.small(13, share_embeddings=True))
    assert model.src_embed.weight is model.tgt_embed.weight is model.generator.weight
    untied = tb.make_model(tb.ModelConfig.small(13))
    assert tb.count_parameters(untied) - tb.count_parameters(model) == 2 * 13 * 64


def test_make_model_uses_xavier_uniform():
    model = tb.make_model(tb.ModelConfig.small(50))
    weight = model.encoder.layers[0].feed_forward.linear1.weight  # (256, 64)
    bound = (6 / (64 + 256)) ** 0.5
    assert weight.abs().max() <= bound
    assert weight.abs().max() > 0.9 * bound  # uniform up to the bound, not PyTorch's default


def test_forward_shapes_and_generator():
    model = tb.make_model(tb.ModelConfig.small(11, 17)).eval()
    src, tgt = torch.randint(1, 11, (4, 9)), torch.randint(1, 17, (4, 6))
    memory = model.encode(src)
    assert memory.shape == (4, 9, 64)
    hidden = model.decode(memory, tgt, src_mask=tb.padding_mask(src))
    assert hidden.shape == (4, 6, 64)
    logits = model(src, tgt)
    assert logits.shape == (4, 6, 17)
    torch.testing.assert_close(logits, model.generator(hidden))


def test_default_masks_hide_padding_and_the_future():
    model = tb.make_model(tb.ModelConfig.small(11)).eval()
    src = torch.tensor([[3, 4, 5, 0, 0]])
    tgt = torch.tensor([[1, 6, 7, 8]])
    logits = model(src, tgt)
    # The padding contents do not matter ...
    torch.testing.assert_close(logits, model(src, tgt, src_mask=tb.padding_mask(src), tgt_mask=tb.target_mask(tgt)))
    torch.testing.assert_close(logits, model(src[:, :3], tgt), atol=1e-5, rtol=1e-5)
    # ... and changing the last target token leaves earlier positions unchanged.
    changed = model(src, torch.tensor([[1, 6, 7, 9]]))
    torch.testing.assert_close(changed[:, :3], logits[:, :3])
    assert not torch.allclose(changed[:, 3], logits[:, 3])


def test_pre_norm_stacks_end_with_a_layer_norm():
    pre = tb.make_model(tb.ModelConfig.small(11, norm_first=True))
    post = tb.make_model(tb.ModelConfig.small(11))
    assert isinstance(pre.encoder.norm, nn.LayerNorm) and isinstance(pre.decoder.norm, nn.LayerNorm)
    assert isinstance(post.encoder.norm, nn.Identity) and isinstance(post.decoder.norm, nn.Identity)


def test_positional_encoding_layouts_are_a_permutation_of_each_other():
    paper = tb.sinusoidal_positional_encoding(50, 16)
    t2t = tb.sinusoidal_positional_encoding(50, 16, interleaved=False)
    permutation = torch.cat([torch.arange(0, 16, 2), torch.arange(1, 16, 2)])
    torch.testing.assert_close(paper[:, permutation], t2t)
    assert (paper[0, 1::2] == 1).all() and (paper[0, 0::2] == 0).all()
    assert paper.abs().max() <= 1


def test_token_embedding_scales_by_sqrt_d_model():
    embedding = tb.TokenEmbedding(11, 16)
    tokens = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(embedding(tokens), embedding.weight[tokens] * 4.0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_model_moves_with_its_buffers(dtype):
    """``.to()`` carries the positional table (a buffer) along with the parameters; the meta
    device stands in for a GPU here, and a dtype change shows the buffer really moved."""
    model = tb.make_model(tb.ModelConfig.small(11))
    assert model.positional.pe.device.type == "cpu" and model.positional.pe.dtype == torch.float32
    model.to("meta")
    assert model.positional.pe.device.type == "meta"
    assert all(p.device.type == "meta" for p in model.parameters())
    model = tb.make_model(tb.ModelConfig.small(11)).to(dtype)
    assert model.positional.pe.dtype == dtype
    assert "positional.pe" not in model.state_dict()  # a fixed table, not saved
