"""The package computes exactly what PyTorch's own modules compute, given the same weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import transformer_book as tb
from transformer_book.book.parity import to_pytorch

D_MODEL, HEADS, D_FF, LAYERS = 32, 4, 64, 3
TOL = dict(atol=1e-5, rtol=1e-5)


def tokens_with_padding(batch: int = 3, length: int = 7, vocab: int = 20) -> torch.Tensor:
    """Ids in [1, vocab) with rows padded (id 0) to different lengths."""
    tokens = torch.randint(1, vocab, (batch, length))
    for row in range(1, batch):
        tokens[row, length - 2 * row :] = 0
    return tokens


def key_padding(mask: torch.Tensor) -> torch.Tensor:
    """Our padding mask ``(batch, 1, seq)`` as PyTorch's ``key_padding_mask`` ``(batch, seq)``, True = ignore."""
    return tb.to_pytorch_mask(mask[:, 0, :])


@pytest.fixture(autouse=True)
def _seed():
    tb.seed_everything(1234)


def test_multi_head_attention_matches_pytorch_with_padding_mask():
    ours = tb.MultiHeadAttention(D_MODEL, HEADS).eval()
    theirs = to_pytorch(ours).eval()
    query, memory = torch.randn(3, 5, D_MODEL), torch.randn(3, 7, D_MODEL)
    mask = tb.padding_mask(tokens_with_padding())
    out, weights = ours(query, memory, memory, mask, need_weights=True)
    ref_out, ref_weights = theirs(query, memory, memory, key_padding_mask=key_padding(mask), average_attn_weights=False)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(weights, ref_weights, **TOL)


def test_multi_head_attention_matches_pytorch_with_causal_mask_and_no_bias():
    ours = tb.MultiHeadAttention(D_MODEL, HEADS, bias=False).eval()
    theirs = to_pytorch(ours).eval()
    x = torch.randn(2, 6, D_MODEL)
    mask = tb.causal_mask(6)
    out, _ = ours(x, x, x, mask)
    ref, _ = theirs(x, x, x, attn_mask=tb.to_pytorch_mask(mask[0]))
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_encoder_layer_and_stack_match_pytorch(norm_first):
    layer = tb.EncoderLayer(D_MODEL, HEADS, D_FF, dropout=0.1, norm_first=norm_first).eval()
    stack = tb.Encoder(layer, LAYERS).eval()
    tokens = tokens_with_padding()
    mask = tb.padding_mask(tokens)
    x = torch.randn(*tokens.shape, D_MODEL)
    torch.testing.assert_close(
        layer(x, mask), to_pytorch(layer).eval()(x, src_key_padding_mask=key_padding(mask)), **TOL
    )
    reference = to_pytorch(stack).eval()(x, src_key_padding_mask=key_padding(mask))
    torch.testing.assert_close(stack(x, mask), reference, **TOL)
    assert isinstance(stack.norm, nn.LayerNorm if norm_first else nn.Identity)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_decoder_layer_and_stack_match_pytorch(norm_first):
    layer = tb.DecoderLayer(D_MODEL, HEADS, D_FF, dropout=0.1, norm_first=norm_first).eval()
    stack = tb.Decoder(layer, LAYERS).eval()
    src = tokens_with_padding(length=7)
    tgt = tokens_with_padding(length=6)
    src_mask, tgt_mask = tb.padding_mask(src), tb.target_mask(tgt)
    x, memory = torch.randn(3, 6, D_MODEL), torch.randn(3, 7, D_MODEL)
    pytorch_masks = dict(
        tgt_mask=tb.to_pytorch_mask(tb.causal_mask(6)[0]),
        tgt_key_padding_mask=key_padding(tb.padding_mask(tgt)),
        memory_key_padding_mask=key_padding(src_mask),
    )
    torch.testing.assert_close(
        layer(x, memory, src_mask=src_mask, tgt_mask=tgt_mask),
        to_pytorch(layer).eval()(x, memory, **pytorch_masks),
        **TOL,
    )
    torch.testing.assert_close(
        stack(x, memory, src_mask=src_mask, tgt_mask=tgt_mask),
        to_pytorch(stack).eval()(x, memory, **pytorch_masks),
        **TOL,
    )


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_whole_model_matches_nn_transformer(norm_first):
    config = tb.ModelConfig(20, 20, d_model=D_MODEL, num_heads=HEADS, d_ff=D_FF, num_layers=2, norm_first=norm_first)
    model = tb.make_model(config).eval()
    theirs = to_pytorch(model).eval()
    src, tgt = tokens_with_padding(length=7), torch.randint(1, 20, (3, 5))
    src_mask = tb.padding_mask(src)
    hidden = model.decode(model.encode(src), tgt, src_mask=src_mask)
    reference = theirs(
        model.positional(model.src_embed(src)),
        model.positional(model.tgt_embed(tgt)),
        tgt_mask=tb.to_pytorch_mask(tb.causal_mask(5)[0]),
        src_key_padding_mask=key_padding(src_mask),
        memory_key_padding_mask=key_padding(src_mask),
    )
    torch.testing.assert_close(hidden, reference, **TOL)
    torch.testing.assert_close(model(src, tgt), model.generator(reference), **TOL)


def test_to_pytorch_rejects_other_modules():
    with pytest.raises(ValueError, match="Linear"):
        to_pytorch(nn.Linear(2, 2))
