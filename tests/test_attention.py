"""Scaled dot-product and multi-head attention: the two code paths, masks, recorded weights."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import transformer_book as tb


@pytest.fixture(autouse=True)
def _seed():
    tb.seed_everything(0)


def test_thinking_machines_numbers():
    """Scores 112 and 96 over sqrt(64) = 8 give 14 and 12, and softmax 0.88 / 0.12."""
    query = torch.zeros(1, 64)
    query[0, :2] = torch.tensor([8.0, 6.0])
    keys = torch.zeros(2, 64)
    keys[0, :2] = torch.tensor([8.0, 8.0])  # 8*8 + 6*8 = 112
    keys[1, :2] = torch.tensor([6.0, 8.0])  # 8*6 + 6*8 = 96
    values = torch.eye(2, 64)
    _, weights = tb.scaled_dot_product_attention(query, keys, values)
    torch.testing.assert_close((query @ keys.T)[0], torch.tensor([112.0, 96.0]))
    torch.testing.assert_close(weights[0], torch.softmax(torch.tensor([14.0, 12.0]), dim=0))
    assert [round(w, 2) for w in weights[0].tolist()] == [0.88, 0.12]


def test_explicit_attention_matches_pytorch_functional():
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 4)
    mask = torch.rand(2, 1, 5, 7) > 0.3
    mask[..., 0] = True  # every query keeps at least one key
    out, weights = tb.scaled_dot_product_attention(q, k, v, mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, 5))
    assert (weights[~mask.expand_as(weights)] == 0).all()


@pytest.mark.parametrize("mask_kind", ["none", "padding", "causal", "per-head"])
def test_fused_and_explicit_paths_agree(mask_kind):
    attention = tb.MultiHeadAttention(32, 4).eval()
    x = torch.randn(3, 6, 32)
    tokens = torch.tensor([[5, 4, 3, 2, 1, 1], [5, 4, 3, 0, 0, 0], [5, 0, 0, 0, 0, 0]])
    mask = {
        "none": None,
        "padding": tb.padding_mask(tokens),
        "causal": tb.causal_mask(6),
        "per-head": torch.rand(3, 4, 6, 6) > 0.5,
    }[mask_kind]
    fused, no_weights = attention(x, x, x, mask)
    explicit, weights = attention(x, x, x, mask, need_weights=True)
    assert no_weights is None and weights.shape == (3, 4, 6, 6)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)


def test_fully_masked_row_gives_zeros_not_nan_on_both_paths():
    attention = tb.MultiHeadAttention(16, 2).eval()
    x = torch.randn(1, 3, 16, requires_grad=True)
    mask = torch.tensor([[[True, True, False], [False, False, False], [True, False, False]]])
    explicit, weights = attention(x, x, x, mask, need_weights=True)
    fused, _ = attention(x, x, x, mask)
    assert not torch.isnan(explicit).any() and not torch.isnan(fused).any()
    assert (weights[0, :, 1] == 0).all()
    # A query that sees nothing outputs just the output projection's bias.
    torch.testing.assert_close(explicit[0, 1], attention.out_proj.bias)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)
    explicit.sum().backward()
    assert not torch.isnan(x.grad).any()


def test_variance_of_dot_product_grows_with_d_k():
    for d_k in (4, 64, 256):
        q, k = torch.randn(20000, d_k), torch.randn(20000, d_k)
        scores = (q * k).sum(-1)
        assert abs(scores.var().item() / d_k - 1) < 0.1
        assert abs((scores / math.sqrt(d_k)).var().item() - 1) < 0.1


def test_record_attention_collects_every_attention_of_the_model():
    model = tb.make_model(tb.ModelConfig.small(11)).eval()
    src, tgt = torch.randint(1, 11, (2, 5)), torch.randint(1, 11, (2, 4))
    plain = model(src, tgt)
    with tb.record_attention(model) as maps:
        recorded = model(src, tgt)
    torch.testing.assert_close(plain, recorded, atol=1e-5, rtol=1e-5)
    assert set(maps) == {
        f"{side}.layers.{i}.{kind}"
        for i in range(2)
        for side, kinds in (("encoder", ["self_attn"]), ("decoder", ["self_attn", "cross_attn"]))
        for kind in kinds
    }
    assert maps["encoder.layers.0.self_attn"].shape == (2, 4, 5, 5)
    assert maps["decoder.layers.1.cross_attn"].shape == (2, 4, 4, 5)
    # Causal: no decoder position attends to a later one.
    assert (maps["decoder.layers.0.self_attn"].triu(1) == 0).all()
    assert all(not m.record_weights for m in model.modules() if isinstance(m, tb.MultiHeadAttention))


def test_attention_dropout_only_in_training():
    attention = tb.MultiHeadAttention(16, 2, dropout=0.5)
    x = torch.randn(2, 4, 16)
    attention.eval()
    torch.testing.assert_close(attention(x, x, x)[0], attention(x, x, x)[0])
    attention.train()
    _, weights = attention(x, x, x, need_weights=True)
    assert (weights == 0).any()  # some weights dropped, the kept ones scaled by 1 / (1 - p):
    assert not torch.allclose(weights.sum(-1), torch.ones(2, 2, 4))  # rows no longer sum to 1
