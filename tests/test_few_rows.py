"""The few-row matrix product of a decoding step (transformer_book.fast.few_rows): F.linear's
numbers to float rounding, each row independent of the rows beside it, and a fallback; and the
step's attention of one query: PyTorch's fused kernel's numbers to float rounding.

The kernel is C, compiled on first use: tests that run it skip where there is no C compiler
(``$CC``, else ``cc``); the others check what happens without one."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import transformer_book as tb
from transformer_book import fast
from transformer_book.fast import _native, few_rows
from transformer_book.fast.kernels import FastLinear, PackedWeight, affine

needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None,
    reason="no C compiler ($CC, else cc): the few-row kernel cannot be built here",
)


@needs_compiler
def test_it_compiles_and_loads_here() -> None:
    """Where there is a compiler the kernel must be there, not silently replaced."""
    assert few_rows.available(), few_rows.unavailable_reason()
    assert fast.status()["few_rows"] == "available"


@needs_compiler
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17])
@pytest.mark.parametrize(("out_features", "in_features"), [(8, 5), (13, 37), (70, 256)])
@pytest.mark.parametrize("bias", [True, False])
def test_it_computes_f_linear(rows: int, out_features: int, in_features: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows * out_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None
    x = torch.randn(rows, in_features, generator=generator)
    panels = few_rows.pack(weight)
    assert panels.shape == (-(-out_features // 8), in_features, 8)
    expected = F.linear(x.double(), weight.double(), None if b is None else b.double()).float()
    torch.testing.assert_close(few_rows.product(x, panels, b, out_features), expected, rtol=1e-5, atol=1e-4)
    # leading axes and a strided input, as a decoder's last position is
    wide = torch.randn(2, rows, 3, in_features, generator=generator)[:, :, -1]
    expected = F.linear(wide.double(), weight.double(), None if b is None else b.double()).float()
    torch.testing.assert_close(few_rows.product(wide, panels, b, out_features), expected, rtol=1e-5, atol=1e-4)


def with_threads(count: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@needs_compiler
def test_a_row_is_summed_alike_whatever_the_rows_beside_it_and_the_threads() -> None:
    """One summation order for every output: the same bits alone, in a batch, on one thread or two."""
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(100, 300, generator=generator), torch.randn(100, generator=generator)
    x = torch.randn(12, 300, generator=generator)
    panels = few_rows.pack(weight)
    together = with_threads(2, lambda: few_rows.product(x, panels, bias, 100))
    assert torch.equal(together[:5], few_rows.product(x[:5], panels, bias, 100))
    assert all(torch.equal(together[i], few_rows.product(x[i], panels, bias, 100)) for i in range(12))
    assert torch.equal(with_threads(1, lambda: few_rows.product(x, panels, bias, 100)), together)


@needs_compiler
def test_bad_input_is_a_value_error_naming_it() -> None:
    """Everything the C loop reads is checked on every call: a buffer too small for what it is
    told to read is a ValueError, never a read past its end."""
    panels = few_rows.pack(torch.randn(10, 6))
    with pytest.raises(ValueError, match=r"x must be float32 on the CPU with 6 features, got torch.float64"):
        few_rows.product(torch.randn(2, 6, dtype=torch.float64), panels, None, 10)
    with pytest.raises(ValueError, match=r"with 6 features, got torch.float32 \(2, 7\)"):
        few_rows.product(torch.randn(2, 7), panels, None, 10)
    with pytest.raises(ValueError, match=r"out_features=17 does not fit panels \(2, 6, 8\)"):
        few_rows.product(torch.randn(2, 6), panels, None, 17)
    with pytest.raises(ValueError, match=r"out_features=0 does not fit"):
        few_rows.product(torch.randn(2, 6), panels, None, 0)
    with pytest.raises(ValueError, match=r"does not fit panels \(2, 6, 4\) \(use pack\(weight\)\)"):
        few_rows.product(torch.randn(2, 6), panels[..., :4], None, 10)
    with pytest.raises(ValueError, match=r"does not fit panels \(2, 6, 8\)"):  # not contiguous
        few_rows.product(torch.randn(2, 6), panels.transpose(0, 1).contiguous().transpose(0, 1), None, 10)
    with pytest.raises(ValueError, match=r"does not fit panels \(12, 8\)"):
        few_rows.product(torch.randn(2, 6), panels.view(-1, 8), None, 10)
    with pytest.raises(ValueError, match=r"does not fit panels"):
        few_rows.product(torch.randn(2, 6), panels.double(), None, 10)
    with pytest.raises(ValueError, match=r"bias must be contiguous float32 \(10,\) on the CPU, got \(5\)"):
        few_rows.product(torch.randn(2, 6), panels, torch.randn(5), 10)
    with pytest.raises(ValueError, match=r"bias must be contiguous float32"):
        few_rows.product(torch.randn(2, 6), panels, torch.randn(20)[::2], 10)


@needs_compiler
def test_packed_weight_routes_by_rows_and_size() -> None:
    """In inference mode: a few rows of a large enough product here, many rows on oneDNN, a
    small product on MKL; the bound kernel gives the same bits as the module."""
    torch.manual_seed(0)
    layer, tiny = fast.accelerate(nn.Linear(256, 512)), fast.accelerate(nn.Linear(16, 16))  # tiny: under MIN_MACS
    assert type(layer) is FastLinear
    few, many = torch.randn(8, 256), torch.randn(4 * few_rows.MAX_ROWS, 256)
    with torch.inference_mode():
        first = layer(few)
        assert repr(layer.packed) == "PackedWeight(packed for few rows)"
        torch.testing.assert_close(first, F.linear(few, layer.weight, layer.bias))
        torch.testing.assert_close(layer(many), F.linear(many, layer.weight, layer.bias))
        assert repr(layer.packed) == "PackedWeight(packed for oneDNN and few rows)"
        assert torch.equal(layer(few), first)
        assert torch.equal(layer.kernel(8)(few), first)
        assert torch.equal(layer.packed.kernel(layer.weight, layer.bias, 8)(few), first)
        x = torch.randn(8, 16)
        assert torch.equal(tiny(x), F.linear(x, tiny.weight, tiny.bias))
        assert repr(tiny.packed) == "PackedWeight(empty)"
    with torch.no_grad():
        layer.weight.mul_(2.0)
    with torch.inference_mode():  # a changed weight is packed again
        torch.testing.assert_close(layer(few), F.linear(few, layer.weight, layer.bias))


def test_without_the_kernel_the_products_stay_with_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRANSFORMER_BOOK_FEW_ROWS=0, or no compiler: unavailable, with the reason, and the
    products computed as before the kernel existed."""
    monkeypatch.setattr(few_rows, "_library", None)
    monkeypatch.setattr(few_rows, "_unavailable", None)
    monkeypatch.setenv("TRANSFORMER_BOOK_FEW_ROWS", "0")
    assert not few_rows.available()
    assert few_rows.unavailable_reason() == "switched off by TRANSFORMER_BOOK_FEW_ROWS=0"
    monkeypatch.setattr(few_rows, "_unavailable", None)
    monkeypatch.delenv("TRANSFORMER_BOOK_FEW_ROWS")
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("TRANSFORMER_BOOK_CACHE", "/nonexistent/never-used")
    assert not few_rows.available()
    assert "no C compiler 'no-such-compiler' on PATH" in few_rows.unavailable_reason()
    assert fast.status()["few_rows"] == few_rows.unavailable_reason()
    with pytest.raises(RuntimeError, match="the few-row kernel is unavailable here: .*no C compiler"):
        few_rows.pack(torch.randn(4, 4))
    with pytest.raises(RuntimeError, match="the few-row kernel is unavailable here"):
        few_rows.attention(*(torch.randn(1, 1, n, 4) for n in (1, 3, 3)))
    layer = fast.accelerate(nn.Linear(256, 512))  # 8 rows: 2**20 multiply-adds, PACKED_MIN_MACS
    x = torch.randn(8, 256)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        assert repr(layer.packed) == "PackedWeight(packed for oneDNN)"


@needs_compiler
def test_the_compiled_library_is_reused_from_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("TRANSFORMER_BOOK_CACHE", str(cache))
    built = _native.compiled(few_rows.SOURCE)
    assert built.parent == cache and built.exists()

    def no_compiling(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(_native.subprocess, "run", no_compiling)
    assert _native.compiled(few_rows.SOURCE) == built
    assert sorted(cache.iterdir()) == [built.with_suffix(".json"), built]  # the record; no scratch left behind
    assert oct(cache.stat().st_mode & 0o777) == "0o700"


def test_a_new_packed_weight_is_empty() -> None:
    assert repr(PackedWeight()) == "PackedWeight(empty)"


def test_a_bias_that_does_not_fit_never_reaches_a_kernel() -> None:
    """The few-row kernel and oneDNN read a bias as out_features contiguous floats: a bias of
    another shape, strided or broadcast (F.linear takes (1,) and ()) gets PyTorch's own product
    (and PyTorch's error where it has one), never a read of the wrong floats or past the end."""
    weight, x = torch.randn(512, 256), torch.randn(8, 256)  # 8 rows: the few-row kernel's, and oneDNN's size
    with torch.inference_mode(), pytest.raises(RuntimeError):
        PackedWeight().apply(x, weight, torch.randn(5))
    odd = {
        "strided": torch.randn(1024)[::2],
        "broadcast": torch.randn(1).expand(512),
        "one": torch.randn(1),
        "scalar": torch.randn(()),
    }
    for name, bias in odd.items():
        expected = F.linear(x, weight, bias)
        assert torch.equal(affine(x, weight, bias), expected), name
        with torch.inference_mode():
            packed = PackedWeight()
            assert torch.equal(packed.apply(x, weight, bias), expected), name
            assert repr(packed) == "PackedWeight(empty)", name


@needs_compiler
@pytest.mark.parametrize("length", [1, 3, 4, 17, 130])
@pytest.mark.parametrize("d_head", [64, 12])  # 12: features past the last full vector
def test_one_query_attention_is_pytorchs_fused_kernels(length: int, d_head: int) -> None:
    """A decoding step's attention: PyTorch's fused result, heads merged, from keys and values read
    where they lie (views into a larger buffer, as the KV cache's), with a padding mask, a row
    with nothing to attend to (zeros, as PyTorch's kernel gives), and broadcast masks."""
    generator = torch.Generator().manual_seed(length)
    batch, heads = 5, 3
    buffer = torch.randn(2, batch, heads, length + 7, d_head, generator=generator)
    k, v = buffer[0, :, :, :length], buffer[1, :, :, :length]  # strided, as the cache's views
    q = torch.randn(batch, 1, 3 * heads * d_head, generator=generator)[..., : heads * d_head]
    q = q.view(batch, heads, 1, d_head)  # a slice of a packed q/k/v projection
    mask = torch.rand(batch, 1, 1, length, generator=generator) > 0.3
    mask[1] = False  # nothing to attend to
    mask[2, ..., 0] = True
    for m in (None, mask, mask[:1], torch.ones(1, length, dtype=torch.bool)):
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=m).nan_to_num(0.0)
        got = few_rows.attention(q, k, v, m)
        torch.testing.assert_close(got, expected.transpose(1, 2).reshape(batch, 1, -1), rtol=1e-5, atol=1e-6)
    assert torch.equal(few_rows.attention(q, k, v, mask)[1], torch.zeros(1, heads * d_head))
    q[0, 1, 0, 0] = float("nan")  # NaN goes through, as in the formula: never a silent number
    expected = (torch.softmax(q @ k.mT / d_head**0.5, dim=-1) @ v).transpose(1, 2).reshape(batch, 1, -1)
    assert expected.isnan().any() and torch.equal(few_rows.attention(q, k, v).isnan(), expected.isnan())


@needs_compiler
def test_one_query_attention_does_not_depend_on_the_batch_or_the_threads() -> None:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, 4, n, 64, generator=generator) for n in (1, 40, 40))
    together = with_threads(2, lambda: few_rows.attention(q, k, v))
    assert torch.equal(together[2:3], few_rows.attention(q[2:3], k[2:3], v[2:3]))
    assert torch.equal(with_threads(1, lambda: few_rows.attention(q, k, v)), together)


@needs_compiler
def test_one_query_attention_names_bad_arguments() -> None:
    q, k = torch.randn(2, 3, 1, 8), torch.randn(2, 3, 5, 8)
    with pytest.raises(
        ValueError, match=r"q must be \(batch, heads, 1, d_head\) .* got q \(2, 3, 1, 8\), k \(2, 2, 5, 8\)"
    ):
        few_rows.attention(q, k[:, :2], k)
    with pytest.raises(ValueError, match=r"q must be \(batch, heads, 1, d_head\) .* got q \(2, 3, 2, 8\)"):
        few_rows.attention(torch.randn(2, 3, 2, 8), k, k)
    with pytest.raises(ValueError, match=r"k must be float32 on the CPU with contiguous features, got torch.float64"):
        few_rows.attention(q, k.double(), k)
    with pytest.raises(ValueError, match=r"v must be float32 on the CPU with contiguous features"):
        few_rows.attention(q, k, k.transpose(2, 3).contiguous().transpose(2, 3))
    with pytest.raises(ValueError, match=r"mask with shape \(2, 1, 1, 4\) does not broadcast to \(2, 3, 1, 5\)"):
        few_rows.attention(q, k, k, torch.ones(2, 1, 1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask must be a boolean tensor"):
        few_rows.attention(q, k, k, torch.ones(2, 1, 1, 5))


@needs_compiler
def test_a_decoding_step_attends_with_the_kernel_and_the_modules_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a cache and one new position the accelerated model attends with the kernel (the
    module path at the first step, the plan after it); without the kernel, PyTorch's fused
    kernel; the tokens are the same, and the plain model's."""
    tb.seed_everything(1)
    model = tb.make_model(tb.ModelConfig.small(20, num_layers=2)).eval()
    accelerated = fast.accelerate(tb.make_model(model.config).eval())
    accelerated.load_state_dict(model.state_dict())
    src = torch.randint(3, 20, (4, 9))
    calls = []
    original = few_rows.attention
    monkeypatch.setattr(few_rows, "attention", lambda *args: calls.append(1) or original(*args))
    with_kernel = tb.greedy_decode(accelerated, src, 12, 1, None)
    assert len(calls) == 11 * 2 * 2  # every step, both layers, self- and cross-attention
    assert torch.equal(tb.greedy_decode(model, src, 12, 1, None), with_kernel)
    assert len(calls) == 44  # the plain model never calls the wing
    monkeypatch.setattr(few_rows, "available", lambda: False)
    assert torch.equal(tb.greedy_decode(accelerated, src, 12, 1, None), with_kernel)
    assert len(calls) == 44
