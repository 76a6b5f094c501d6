"""The wing's CPU kernels (transformer_book.fast.kernels): nn.Linear's and nn.Dropout's results,
on other kernels, in every mode the model runs in. None of these needs a C compiler: the products
are oneDNN's and MKL's, and dropout falls back to PyTorch's operators."""

from __future__ import annotations

import copy
import gc
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import transformer_book as tb
from transformer_book import fast
from transformer_book.fast import few_rows, kernels
from transformer_book.fast.kernels import FastDropout, FastLinear, PackedWeight, affine, pytorch_kernels


@pytest.fixture(autouse=True)
def every_product_on_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests' products are small; in inference mode they would stay with MKL
    (``PACKED_MIN_MACS``), or go to the few-row kernel (``few_rows.MAX_ROWS``). With those
    lowered to 0, every product takes the packed oneDNN path (tests/test_few_rows.py tests
    the few-row kernel)."""
    monkeypatch.setattr(kernels, "PACKED_MIN_MACS", 0)
    monkeypatch.setattr(few_rows, "MAX_ROWS", 0)


def twins(bias: bool = True) -> tuple[FastLinear, nn.Linear]:
    torch.manual_seed(0)
    ours = fast.accelerate(nn.Linear(48, 80, bias=bias))
    theirs = nn.Linear(48, 80, bias=bias)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def small_model(**sizes) -> tb.Transformer:
    tb.seed_everything(0)
    return tb.make_model(tb.ModelConfig.small(20, **sizes)).eval()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 48), (3, 5, 48)])
def test_linear_matches_nn_linear_in_every_mode(bias: bool, shape: tuple[int, ...]) -> None:
    ours, theirs = twins(bias)
    assert type(ours) is FastLinear
    x = torch.randn(shape)
    expected = theirs(x).detach()
    with torch.inference_mode():
        torch.testing.assert_close(ours(x), expected)
        torch.testing.assert_close(ours(x), expected)  # the packed weight, reused
    with torch.no_grad():
        torch.testing.assert_close(ours(x), expected)
    mine, reference = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad = torch.randn(*shape[:-1], 80)
    ours(mine).backward(grad)
    theirs(reference).backward(grad)
    torch.testing.assert_close(mine.grad, reference.grad)
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad)
    if bias:
        torch.testing.assert_close(ours.bias.grad, theirs.bias.grad)


def test_linear_takes_strided_inputs_and_gradients() -> None:
    ours, theirs = twins()
    x = torch.randn(4, 6, 48)[:, -1]  # (4, 48), rows 6 * 48 apart: a decoder's last position
    with torch.inference_mode():
        torch.testing.assert_close(ours(x), theirs(x))
    x = torch.randn(5, 7, 48)[:, ::2].requires_grad_()
    reference = x.detach().clone().requires_grad_()
    grad = torch.randn(80, 4, 5).permute(2, 1, 0)  # (5, 4, 80), not contiguous
    ours(x).backward(grad)
    theirs(reference).backward(grad)
    torch.testing.assert_close(x.grad, reference.grad)
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad)


def test_packed_weight_follows_optimiser_steps_and_load_state_dict() -> None:
    ours, _ = twins()
    x = torch.randn(5, 48)
    optimiser = torch.optim.SGD(ours.parameters(), lr=0.5)
    for _ in range(2):
        with torch.inference_mode():
            torch.testing.assert_close(ours(x), F.linear(x, ours.weight, ours.bias))
        optimiser.zero_grad()
        ours(x).square().sum().backward()
        optimiser.step()
    ours.load_state_dict({"weight": torch.zeros(80, 48), "bias": torch.ones(80)})
    with torch.inference_mode():
        assert torch.equal(ours(x), torch.ones(5, 80))


def test_kernel_repacks_after_an_optimiser_step_changes_the_weight() -> None:
    """``PackedWeight.kernel`` binds a function to the packed copy of the weight as it is. Once an
    optimiser step has changed the weight, the next call packs it again and binds the new copy;
    a function bound before keeps the copy it was bound to (a decoding plan's, valid for its own
    cache only)."""
    ours, _ = twins()
    x = torch.randn(5, 48)
    old_weight = ours.weight.detach().clone()
    with torch.inference_mode():
        before = ours.packed.kernel(ours.weight, ours.bias, rows=5)
        packed_copy = ours.packed._onednn
        torch.testing.assert_close(before(x), F.linear(x, ours.weight, ours.bias))
        ours.packed.kernel(ours.weight, ours.bias, rows=5)
        assert ours.packed._onednn is packed_copy  # the weight is unchanged: not packed again
    optimiser = torch.optim.SGD([ours.weight], lr=1.0)
    ours(x).square().sum().backward()
    optimiser.step()
    with torch.inference_mode():
        after = ours.packed.kernel(ours.weight, ours.bias, rows=5)
        assert ours.packed._onednn is not packed_copy
        torch.testing.assert_close(after(x), F.linear(x, ours.weight, ours.bias))
        assert torch.equal(ours(x), after(x)) and torch.equal(ours.kernel(5)(x), after(x))
        torch.testing.assert_close(before(x), F.linear(x, old_weight, ours.bias))
        assert not torch.allclose(before(x), after(x))


def test_kernel_reads_the_size_rule_at_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """``None`` (MKL's ``F.linear`` is the choice) for a product under ``PACKED_MIN_MACS`` as the
    rule stands when the kernel is asked for, not when the weight was packed; ``None`` as well for
    a weight that is an inference tensor, whose changes are not tracked."""
    ours, _ = twins()
    x = torch.randn(6, 48)
    with torch.inference_mode():
        assert ours.packed.kernel(ours.weight, ours.bias, rows=6) is not None
        monkeypatch.setattr(kernels, "PACKED_MIN_MACS", 6 * 48 * 80 + 1)  # 6 rows are now too few
        assert ours.packed.kernel(ours.weight, ours.bias, rows=6) is None
        assert torch.equal(ours.kernel(6)(x), F.linear(x, ours.weight, ours.bias))
        assert ours.packed.kernel(ours.weight, ours.bias, rows=7) is not None
        inference_weight = torch.randn(80, 48)
        assert inference_weight.is_inference() and PackedWeight().kernel(inference_weight, None, rows=7) is None


def test_a_model_made_in_inference_mode_decodes() -> None:
    with torch.inference_mode():  # its parameters are inference tensors, whose changes are not tracked
        model = fast.accelerate(small_model())
        src = torch.randint(3, 20, (2, 6))
        cached = tb.greedy_decode(model, src, 8, 1, 2)
        assert torch.equal(tb.greedy_decode(model, src, 8, 1, 2, use_cache=False), cached)
        assert "empty" in repr(model.generator.packed)


def test_a_model_that_decoded_copies_and_saves() -> None:
    """Packed copies, stacked weights and decoding plans stay behind when the model is copied or
    saved (they are made again from the weights); the copy is accelerated and decodes alike."""
    model = fast.accelerate(small_model())
    src = torch.randint(3, 20, (2, 6))
    tokens = tb.greedy_decode(model, src, 8, 1, 2)
    assert "packed" in repr(model.generator.packed) and model.decoder.layers[0].self_attn.stacked
    twin = copy.deepcopy(model)
    assert "empty" in repr(twin.generator.packed) and not twin.decoder.layers[0].self_attn.stacked
    assert fast.is_accelerated(twin) and len(twin.plans) == 0
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded) is type(model) and "empty" in repr(loaded.generator.packed)
    assert torch.equal(tb.greedy_decode(twin, src, 8, 1, 2), tokens)
    assert torch.equal(tb.greedy_decode(loaded, src, 8, 1, 2), tokens)
    assert repr(pickle.loads(pickle.dumps(model.generator.packed))) == "PackedWeight(empty)"
    assert repr(copy.deepcopy(model.generator.packed)) == "PackedWeight(empty)"


def test_small_products_stay_with_mkl_in_inference_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "PACKED_MIN_MACS", 5 * 48 * 80 + 1)  # one row more than 5 reaches it
    ours, _ = twins()
    with torch.inference_mode():
        small, large = torch.randn(5, 48), torch.randn(6, 48)
        assert torch.equal(ours(small), F.linear(small, ours.weight, ours.bias))
        assert "empty" in repr(ours.packed)
        torch.testing.assert_close(ours(large), F.linear(large, ours.weight, ours.bias))
        assert "packed" in repr(ours.packed)


def test_a_plan_made_for_one_cache_does_not_leak_into_another() -> None:
    """A decoding plan is bound to the weights of its cache's first step. After an optimiser
    step a new cache gets a new plan on the new weights: the same hidden states as a fresh copy
    of the trained model, which never decoded; and a plan lives no longer than its cache."""
    model = fast.accelerate(small_model())
    src, tgt = torch.randint(3, 20, (2, 6)), torch.randint(3, 20, (2, 5))
    token = torch.full((2, 1), 1)

    def decode_steps(m: tb.Transformer, steps: int = 3) -> tuple[list, torch.Tensor]:
        with torch.inference_mode():
            memory, cache = m.encode(src), m.decoder.new_cache()
            for _ in range(steps):
                hidden = m.decode(memory, token, cache=cache)
        return cache, hidden

    old_cache, _ = decode_steps(model)
    old_plans = model.plans[old_cache[0]][1]
    tb.greedy_decode(model, src, 8, 1, 2)
    tb.beam_search(model, src, 8, 1, 2, beam_size=2)
    optimiser = torch.optim.SGD(model.parameters(), lr=1.0)
    model(src, tgt).square().mean().backward()
    optimiser.step()
    new_cache, hidden = decode_steps(model)
    new_plans = model.plans[new_cache[0]][1]
    assert all(new is not old for new, old in zip(new_plans, old_plans, strict=True))
    twin = copy.deepcopy(model)  # no packed copies, no plans
    _, expected = decode_steps(twin)
    assert torch.equal(hidden, expected)
    assert torch.equal(tb.greedy_decode(model, src, 8, 1, 2), tb.greedy_decode(twin, src, 8, 1, 2))
    assert torch.equal(
        tb.beam_search(model, src, 8, 1, 2, beam_size=2), tb.beam_search(twin, src, 8, 1, 2, beam_size=2)
    )
    assert len(model.plans) == 2
    del old_cache, old_plans
    gc.collect()
    assert len(model.plans) == 1 and new_cache[0] in model.plans


def test_pytorch_kernels_and_dispatch_modes_see_aten_ops() -> None:
    ours, _ = twins()
    x = torch.randn(5, 48)
    with pytorch_kernels():
        assert torch.equal(ours(x), F.linear(x, ours.weight, ours.bias))
    for mode in (torch.enable_grad, torch.inference_mode):
        with mode():
            ours(x)  # packs the weight in inference mode
            counter = FlopCounterMode(display=False)
            with counter:
                counted = ours(x)
            assert counter.get_total_flops() == 2 * 5 * 48 * 80
            assert torch.equal(counted, F.linear(x, ours.weight, ours.bias))
    assert not kernels.dispatch_mode_active()
    with FlopCounterMode(display=False):
        assert kernels.dispatch_mode_active() and not kernels.applies_to(x)


def test_other_dtypes_and_autocast_use_pytorch() -> None:
    ours, _ = twins()
    x = torch.randn(5, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ours(x).dtype == torch.bfloat16
    ours64 = copy.deepcopy(ours).double()
    assert torch.equal(ours64(x.double()), F.linear(x.double(), ours64.weight, ours64.bias))
    assert torch.equal(affine(x.double(), ours64.weight), F.linear(x.double(), ours64.weight))
    assert isinstance(ours, nn.Linear) and set(ours.state_dict()) == {"weight", "bias"}
    assert repr(PackedWeight()) == "PackedWeight(empty)"


def test_global_hooks_are_seen() -> None:
    assert not kernels.global_hooks_registered()
    handle = nn.modules.module.register_module_forward_hook(lambda module, inputs, output: None)
    try:
        assert kernels.global_hooks_registered()
    finally:
        handle.remove()
    assert not kernels.global_hooks_registered()


def test_dropout_drops_p_and_keeps_the_mean() -> None:
    torch.manual_seed(0)
    layer = fast.accelerate(nn.Dropout(0.1))
    assert type(layer) is FastDropout
    x = torch.ones(1000, 1000, requires_grad=True)
    y = layer(x)
    dropped = (y == 0).float().mean().item()
    assert abs(dropped - 0.1) < 0.0015  # 5 standard deviations of 10^6 draws
    assert abs(y.mean().item() - 1.0) < 0.002
    kept = y[y != 0]
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / 0.9))  # scaled by 1 / (1 - p), as nn.Dropout
    y.backward(torch.full_like(y, 2.0))
    assert torch.equal(x.grad, 2.0 * y.detach())  # the gradient flows through the same mask


def test_dropout_is_seeded_and_falls_back_where_it_should() -> None:
    layer = FastDropout(0.3)
    x = torch.randn(64, 33)
    torch.manual_seed(5)
    first = layer(x)
    torch.manual_seed(5)
    assert torch.equal(layer(x), first)
    assert torch.equal(FastDropout(0.0)(x), x) and torch.equal(FastDropout(1.0)(x), torch.zeros_like(x))
    assert layer.eval()(x) is x
    layer.train()
    torch.manual_seed(5)
    expected = F.dropout(x.double(), 0.3)
    torch.manual_seed(5)
    assert torch.equal(layer(x.double()), expected)  # float64: PyTorch's own dropout
    with pytorch_kernels():
        torch.manual_seed(5)
        expected = F.dropout(x, 0.3)
        torch.manual_seed(5)
        assert torch.equal(layer(x), expected)
    inplace = FastDropout(0.3, inplace=True)
    torch.manual_seed(5)
    expected = F.dropout(x, 0.3)
    torch.manual_seed(5)
    assert torch.equal(inplace(x.clone()), expected)  # in place: PyTorch's own
