"""Dropout in one pass (transformer_book.fast.dropout_kernel): the C kernel and PyTorch's
operators give the same bits, the drop rate is p on every lane, backward recomputes the same mask,
and without a compiler the results are the same (PyTorch's integer operators compute the bits:
every test but the first passes without one)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import transformer_book as tb
from transformer_book import fast
from transformer_book.fast import dropout_kernel, kernels
from transformer_book.fast.modules import FastFeedForward, FastMultiHeadAttention


@pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None,
    reason="no C compiler ($CC, else cc): dropout computes its masks with PyTorch's operators here",
)
def test_it_compiles_and_loads_here() -> None:
    """Where there is a compiler the kernel must be there, not silently replaced."""
    assert dropout_kernel.available(), dropout_kernel.unavailable_reason()
    assert fast.status()["dropout_kernel"] == "available"


@pytest.mark.parametrize("shape", [(1,), (3,), (4,), (5, 7), (2, 3, 1029), (8, 64, 512)])
@pytest.mark.parametrize("seed", [0, 1, 2**63 - 1, 2**64 - 1])
def test_the_c_kernel_and_pytorchs_operators_agree_bit_for_bit(shape: tuple[int, ...], seed: int) -> None:
    """apply() (the C kernel where it is available) is keep_mask()'s mask, PyTorch's operators."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
    expected = x.mul(dropout_kernel.keep_mask(shape, 0.25, seed)).mul_(1 / 0.75)
    assert torch.equal(dropout_kernel.apply(x, 0.25, seed), expected)


def test_each_lane_drops_p_and_the_threads_do_not_matter() -> None:
    x = torch.ones(1 << 20)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with_two = dropout_kernel.apply(x, 0.1, 12345)
        torch.set_num_threads(1)
        assert torch.equal(dropout_kernel.apply(x, 0.1, 12345), with_two)
    finally:
        torch.set_num_threads(before)
    dropped = (with_two == 0).view(-1, 4).float().mean(0)  # by lane: the 16-bit quarters of a word
    assert ((dropped - 0.1).abs() < 0.003).all(), dropped  # 5 standard deviations of 2^18 draws
    assert not torch.equal(dropout_kernel.apply(x, 0.1, 12346), with_two)  # another seed, another mask


def test_zeros_keep_their_sign_and_nan_goes_through_as_with_a_mask() -> None:
    x = torch.tensor([-1.0, float("nan")] * 512)
    y = dropout_kernel.apply(x, 0.5, 7)
    keep = dropout_kernel.keep_mask(x.shape, 0.5, 7)
    assert torch.isnan(y[1::2]).all()
    assert torch.equal(torch.signbit(y[0::2]), torch.ones(512, dtype=torch.bool))
    assert torch.equal(y[0::2] == 0, ~keep[0::2])


def test_backward_recomputes_the_forwards_mask() -> None:
    x = torch.randn(6, 50, 33, requires_grad=True)
    torch.manual_seed(3)
    y = kernels.dropout(x, 0.2)
    torch.manual_seed(3)
    keep = dropout_kernel.keep_mask(x.shape, 0.2, dropout_kernel.draw_seed())
    assert torch.equal(y, x.detach().mul(keep).mul_(1 / 0.8))
    grad = torch.randn(33, 50, 6).permute(2, 1, 0)  # not contiguous: read in the same order as x
    y.backward(grad)
    assert torch.equal(x.grad, grad.mul(keep).mul_(1 / 0.8))


@pytest.mark.parametrize("shape", [(3,), (5, 7), (8, 64, 2048)])
def test_relu_then_dropout_in_one_pass_is_the_two_steps(shape: tuple[int, ...]) -> None:
    """The feed-forward network's ReLU and dropout in one pass: the same numbers as ReLU, then
    dropout with the same seed; its gradient, read off the output, the same as the two steps'
    (recomputed mask, then ReLU's backward); NaN goes through ReLU as in PyTorch's."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    x.view(-1)[0] = float("nan")
    y = dropout_kernel.apply(x, 0.3, 2**64 - 5, relu=True)
    torch.testing.assert_close(y, dropout_kernel.apply(x.relu(), 0.3, 2**64 - 5), rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(y.view(-1)[0])  # NaN times the mask's 0 or scale
    grad = torch.randn(shape)
    expected = torch.ops.aten.threshold_backward(dropout_kernel.apply(grad, 0.3, 2**64 - 5), y, 0.0)
    fused = dropout_kernel.relu_backward(grad, y, 0.3)
    assert torch.equal(fused.view(-1)[1:], expected.view(-1)[1:])  # at the NaN: 0 here, grad there


def test_feed_forward_in_training_equals_relu_then_dropout_forward_and_backward() -> None:
    """The accelerated FeedForward fuses ReLU and dropout in training on a CPU: same output and
    gradients as the two modules one after the other, with the same random draws; no fusion where
    a hook watches the dropout module, in eval mode or on PyTorch's kernels."""
    ffn = fast.accelerate(tb.FeedForward(16, 64, dropout=0.2).train())
    assert type(ffn) is FastFeedForward
    x = torch.randn(3, 5, 16, requires_grad=True)
    torch.manual_seed(4)
    fused = ffn(x)
    fused.backward(torch.ones_like(fused))
    grads = [t.grad.clone() for t in (x, *ffn.parameters())]
    for t in (x, *ffn.parameters()):
        t.grad = None
    torch.manual_seed(4)
    two_steps = ffn.linear2(ffn.dropout(ffn.linear1(x).relu()))
    two_steps.backward(torch.ones_like(two_steps))
    assert torch.equal(fused, two_steps)
    assert all(torch.equal(a, t.grad) for a, t in zip(grads, (x, *ffn.parameters()), strict=True))
    seen = []
    hook = ffn.dropout.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0].min()))
    try:
        torch.manual_seed(4)
        assert torch.equal(ffn(x), fused) and seen and seen[0] >= 0  # the hook saw ReLU's output
    finally:
        hook.remove()
    assert torch.equal(ffn.eval()(x), ffn.linear2(ffn.linear1(x).relu()))


def test_bad_input_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="x must be float32 on the CPU, got torch.float64"):
        dropout_kernel.apply(torch.zeros(3, dtype=torch.float64), 0.1, 0)
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\), got 1.0"):
        dropout_kernel.apply(torch.zeros(3), 1.0, 0)
    with pytest.raises(ValueError, match=r"grad and y must have the same shape, got grad \(2, 3\) and y \(3, 2\)"):
        dropout_kernel.relu_backward(torch.zeros(2, 3), torch.zeros(3, 2), 0.1)
    needs_grad = torch.zeros(2, 3, requires_grad=True)  # the kernel has no backward: never drop a gradient
    with pytest.raises(ValueError, match=r"x \(2, 3\) requires grad; use kernels.dropout, which carries it"):
        dropout_kernel.apply(needs_grad, 0.1, 0)
    with pytest.raises(ValueError, match=r"grad \(2, 3\) requires grad"):
        dropout_kernel.relu_backward(needs_grad, torch.zeros(2, 3), 0.1)
    with torch.no_grad():  # no gradient to lose
        assert torch.equal(dropout_kernel.apply(needs_grad, 0.1, 0), torch.zeros(2, 3))


def test_without_the_kernel_the_results_are_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4, 1001)
    compiled = dropout_kernel.apply(x, 0.3, 99)
    compiled_relu = dropout_kernel.apply(x, 0.3, 99, relu=True)
    compiled_grad = dropout_kernel.relu_backward(x, compiled_relu, 0.3)
    monkeypatch.setattr(dropout_kernel, "_library", None)
    monkeypatch.setattr(dropout_kernel, "_unavailable", None)
    monkeypatch.setenv("TRANSFORMER_BOOK_DROPOUT_KERNEL", "0")
    assert not dropout_kernel.available()
    assert dropout_kernel.unavailable_reason() == "switched off by TRANSFORMER_BOOK_DROPOUT_KERNEL=0"
    assert torch.equal(dropout_kernel.apply(x, 0.3, 99), compiled)
    assert torch.equal(dropout_kernel.apply(x, 0.3, 99, relu=True), compiled_relu)
    assert torch.equal(dropout_kernel.relu_backward(x, compiled_relu, 0.3), compiled_grad)
    monkeypatch.setattr(dropout_kernel, "_unavailable", None)
    monkeypatch.delenv("TRANSFORMER_BOOK_DROPOUT_KERNEL")
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("TRANSFORMER_BOOK_CACHE", "/nonexistent/never-used")
    assert not dropout_kernel.available()
    assert "no C compiler 'no-such-compiler' on PATH" in dropout_kernel.unavailable_reason()
    assert torch.equal(dropout_kernel.apply(x, 0.3, 99), compiled)


def test_attention_in_training_drops_weights_with_the_same_masks() -> None:
    """On a CPU the accelerated attention computes its weights explicitly in training, and drops
    them with the wing's dropout: the output is softmax(QK^T/√d)·mask/(1-p) · V."""
    attention = fast.accelerate(tb.MultiHeadAttention(32, 4, dropout=0.1).train())
    assert type(attention) is FastMultiHeadAttention
    x = torch.randn(3, 6, 32)
    mask = tb.causal_mask(6)
    torch.manual_seed(11)
    out, _ = attention(x, x, x, mask)
    q, k, v = (attention.split_heads(p(x)) for p in (attention.q_proj, attention.k_proj, attention.v_proj))
    weights = torch.softmax((q @ k.mT / 8**0.5).masked_fill(~mask, float("-inf")), dim=-1)
    torch.manual_seed(11)
    weights = weights.mul(dropout_kernel.keep_mask(weights.shape, 0.1, dropout_kernel.draw_seed())) / 0.9
    expected = attention.out_proj(attention.merge_heads(weights @ v))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    with kernels.pytorch_kernels():  # PyTorch's fused kernel and its own dropout
        torch.manual_seed(11)
        assert not torch.allclose(attention(x, x, x, mask)[0], out)
