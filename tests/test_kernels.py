"""The package's CPU kernels (transformer_book.kernels): nn.Linear's and nn.Dropout's results,
on other kernels, in every mode the model runs in."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import transformer_book as tb
from transformer_book import few_rows, kernels
from transformer_book.kernels import Dropout, Linear, PackedWeight, linear, pytorch_kernels


@pytest.fixture(autouse=True)
def every_product_on_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests' products are small; in inference mode they would stay with MKL
    (``PACKED_MIN_MACS``), or go to the few-row kernel (``few_rows.MAX_ROWS``). With those
    lowered to 0, every product takes the packed oneDNN path (tests/test_few_rows.py tests
    the few-row kernel)."""
    monkeypatch.setattr(kernels, "PACKED_MIN_MACS", 0)
    monkeypatch.setattr(few_rows, "MAX_ROWS", 0)


def twins(bias: bool) -> tuple[Linear, nn.Linear]:
    torch.manual_seed(0)
    ours = Linear(48, 80, bias=bias)
    theirs = nn.Linear(48, 80, bias=bias)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 48), (3, 5, 48)])
def test_linear_matches_nn_linear_in_every_mode(bias: bool, shape: tuple[int, ...]) -> None:
    ours, theirs = twins(bias)
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
    ours, theirs = twins(True)
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
    ours, _ = twins(True)
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


def test_a_model_made_in_inference_mode_decodes() -> None:
    with torch.inference_mode():  # its parameters are inference tensors, whose changes are not tracked
        model = tb.make_model(tb.ModelConfig.small(20)).eval()
        src = torch.randint(3, 20, (2, 6))
        cached = tb.greedy_decode(model, src, 8, 1, 2)
        assert torch.equal(tb.greedy_decode(model, src, 8, 1, 2, use_cache=False), cached)
        assert "empty" in repr(model.generator.packed)


def test_a_model_that_decoded_copies_and_saves() -> None:
    model = tb.make_model(tb.ModelConfig.small(20)).eval()
    src = torch.randint(3, 20, (2, 6))
    tokens = tb.greedy_decode(model, src, 8, 1, 2)
    assert "packed" in repr(model.generator.packed)
    twin = copy.deepcopy(model)
    assert "empty" in repr(twin.generator.packed)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(tb.greedy_decode(twin, src, 8, 1, 2), tokens)
    assert torch.equal(tb.greedy_decode(loaded, src, 8, 1, 2), tokens)


def test_small_products_stay_with_mkl_in_inference_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "PACKED_MIN_MACS", 5 * 48 * 80 + 1)  # one row more than 5 reaches it
    ours, _ = twins(True)
    with torch.inference_mode():
        small, large = torch.randn(5, 48), torch.randn(6, 48)
        assert torch.equal(ours(small), F.linear(small, ours.weight, ours.bias))
        assert "empty" in repr(ours.packed)
        torch.testing.assert_close(ours(large), F.linear(large, ours.weight, ours.bias))
        assert "packed" in repr(ours.packed)


def test_frozen_weights_skip_the_checks_not_the_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a frozen_weights() block a packed weight is checked once, then used without its
    stamp; the results are the unfrozen ones, a product too small for the packed kernel
    still goes to MKL, pytorch_kernels(), a dispatch mode and autograd still see PyTorch's
    product, and a weight changed between two blocks is packed again."""
    monkeypatch.setattr(kernels, "PACKED_MIN_MACS", 5 * 48 * 80 + 1)  # one row more than 5 reaches it
    stamps, stamp = [], kernels.weight_stamp

    def counted_stamp(*tensors: torch.Tensor | None) -> tuple | None:
        stamps.append(len(tensors))
        return stamp(*tensors)

    monkeypatch.setattr(kernels, "weight_stamp", counted_stamp)
    ours, _ = twins(True)
    small, large = torch.randn(5, 48), torch.randn(6, 48)
    with torch.inference_mode():
        expected = ours(large)
        with kernels.frozen_weights():
            assert not ours.packed.checked_in_this_block()
            assert torch.equal(ours(large), expected) and len(stamps) == 2  # checked in this block
            assert ours.packed.checked_in_this_block()
            assert torch.equal(ours(large), expected) and len(stamps) == 2  # not again
            assert torch.equal(ours(small), F.linear(small, ours.weight, ours.bias))
            with pytorch_kernels():
                assert not ours.packed.checked_in_this_block()
                assert torch.equal(ours(large), F.linear(large, ours.weight, ours.bias))
            assert torch.equal(ours(large), expected) and len(stamps) == 2
            with FlopCounterMode(display=False) as counter:  # a dispatch mode sees aten's product
                counted = ours(large)
            assert counter.get_total_flops() == 2 * 6 * 48 * 80
            assert torch.equal(counted, F.linear(large, ours.weight, ours.bias))
        assert not ours.packed.checked_in_this_block()
    with kernels.frozen_weights():
        with torch.inference_mode():
            ours(large)
        assert ours.packed.checked_in_this_block()
        x = large.clone().requires_grad_()
        ours(x).sum().backward()  # out of inference mode: the product joins the autograd graph
        torch.testing.assert_close(x.grad, ours.weight.sum(0).expand(6, 48))
    with torch.no_grad():
        ours.weight.mul_(-1.0)
    with torch.inference_mode(), kernels.frozen_weights():
        torch.testing.assert_close(ours(large), F.linear(large, ours.weight, ours.bias))
        assert len(stamps) == 4  # once in each of the three blocks, once before them


def test_a_new_block_reads_the_size_rule_anew(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shortcut's row threshold comes from PACKED_MIN_MACS as it is when a block checks
    the weight, not when the weight was packed: a rule changed between blocks holds."""
    onednn_calls, onednn = [], kernels._onednn_linear
    monkeypatch.setattr(kernels, "_onednn_linear", lambda *args: onednn_calls.append(1) or onednn(*args))
    ours, _ = twins(True)
    large = torch.randn(6, 48)
    with torch.inference_mode():
        with kernels.frozen_weights():  # packed and checked under PACKED_MIN_MACS = 0
            ours(large)
            ours(large)
        assert len(onednn_calls) == 2
        monkeypatch.setattr(kernels, "PACKED_MIN_MACS", 6 * 48 * 80 + 1)  # 6 rows are now too few
        with kernels.frozen_weights():
            assert torch.equal(ours(large), F.linear(large, ours.weight, ours.bias))
            assert torch.equal(ours(large), F.linear(large, ours.weight, ours.bias))
        assert len(onednn_calls) == 2  # MKL both times
        monkeypatch.setattr(kernels, "PACKED_MIN_MACS", 0)
        with kernels.frozen_weights():
            ours(large)
            assert ours.packed.checked_in_this_block()
            ours(large)
        assert len(onednn_calls) == 4


def test_a_model_decodes_with_its_new_weights_after_training() -> None:
    """Each decoding call is its own frozen_weights() block: an optimiser step between two
    calls reaches the second, as it reaches a copy that never decoded."""
    tb.seed_everything(0)
    model = tb.make_model(tb.ModelConfig.small(20)).eval()
    src, tgt = torch.randint(3, 20, (2, 6)), torch.randint(3, 20, (2, 5))
    tb.greedy_decode(model, src, 8, 1, 2)
    tb.beam_search(model, src, 8, 1, 2, beam_size=2)
    optimiser = torch.optim.SGD(model.parameters(), lr=1.0)
    model(src, tgt).square().mean().backward()
    optimiser.step()
    twin = copy.deepcopy(model)  # its packed weights are empty
    with torch.inference_mode(), kernels.frozen_weights():
        assert torch.equal(model(src, tgt), twin(src, tgt))
    assert torch.equal(tb.greedy_decode(model, src, 8, 1, 2), tb.greedy_decode(twin, src, 8, 1, 2))


def test_pytorch_kernels_and_dispatch_modes_see_aten_ops() -> None:
    ours, _ = twins(True)
    x = torch.randn(5, 48)
    with pytorch_kernels():
        assert torch.equal(ours(x), F.linear(x, ours.weight, ours.bias))
    counter = FlopCounterMode(display=False)
    with counter:
        ours(x)
    assert counter.get_total_flops() == 2 * 5 * 48 * 80


def test_other_dtypes_and_autocast_use_pytorch() -> None:
    ours, _ = twins(True)
    x = torch.randn(5, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ours(x).dtype == torch.bfloat16
    ours64 = copy.deepcopy(ours).double()
    assert torch.equal(ours64(x.double()), F.linear(x.double(), ours64.weight, ours64.bias))
    assert torch.equal(linear(x.double(), ours64.weight), F.linear(x.double(), ours64.weight))
    assert isinstance(ours, nn.Linear) and set(ours.state_dict()) == {"weight", "bias"}
    assert repr(PackedWeight()) == "PackedWeight(empty)"


def test_dropout_drops_p_and_keeps_the_mean() -> None:
    torch.manual_seed(0)
    layer = Dropout(0.1)
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
    layer = Dropout(0.3)
    x = torch.randn(64, 33)
    torch.manual_seed(5)
    first = layer(x)
    torch.manual_seed(5)
    assert torch.equal(layer(x), first)
    assert torch.equal(Dropout(0.0)(x), x) and torch.equal(Dropout(1.0)(x), torch.zeros_like(x))
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
