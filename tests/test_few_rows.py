"""The few-row matrix product of a decoding step (transformer_book.few_rows): F.linear's
numbers to float rounding, each row independent of the rows beside it, and a fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from transformer_book import _native, few_rows, kernels
from transformer_book.kernels import Linear, PackedWeight


def test_it_compiles_and_loads_here() -> None:
    """CI's machines have a C compiler: the kernel must be there, not silently replaced."""
    assert few_rows.available(), few_rows.unavailable_reason()


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
    torch.testing.assert_close(few_rows.linear(x, panels, b, out_features), expected, rtol=1e-5, atol=1e-4)
    # leading axes and a strided input, as a decoder's last position is
    wide = torch.randn(2, rows, 3, in_features, generator=generator)[:, :, -1]
    expected = F.linear(wide.double(), weight.double(), None if b is None else b.double()).float()
    torch.testing.assert_close(few_rows.linear(wide, panels, b, out_features), expected, rtol=1e-5, atol=1e-4)


def test_a_row_is_summed_alike_whatever_the_rows_beside_it_and_the_threads() -> None:
    """One summation order for every output: the same bits alone, in a batch and on one thread."""
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(100, 300, generator=generator), torch.randn(100, generator=generator)
    x = torch.randn(12, 300, generator=generator)
    panels = few_rows.pack(weight)
    together = few_rows.linear(x, panels, bias, 100)
    assert torch.equal(together[:5], few_rows.linear(x[:5], panels, bias, 100))
    assert all(torch.equal(together[i], few_rows.linear(x[i], panels, bias, 100)) for i in range(12))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(few_rows.linear(x, panels, bias, 100), together)
    finally:
        torch.set_num_threads(threads)


def test_bad_input_is_a_value_error_naming_it() -> None:
    panels = few_rows.pack(torch.randn(10, 6))
    with pytest.raises(ValueError, match=r"x must be float32 on the CPU with 6 features, got torch.float64"):
        few_rows.linear(torch.randn(2, 6, dtype=torch.float64), panels, None, 10)
    with pytest.raises(ValueError, match=r"with 6 features, got torch.float32 \(2, 7\)"):
        few_rows.linear(torch.randn(2, 7), panels, None, 10)
    with pytest.raises(ValueError, match=r"out_features=17 does not fit panels \(2, 6, 8\)"):
        few_rows.linear(torch.randn(2, 6), panels, None, 17)
    with pytest.raises(ValueError, match=r"does not fit panels \(2, 6, 4\) \(use pack\(weight\)\)"):
        few_rows.linear(torch.randn(2, 6), panels[..., :4], None, 10)
    with pytest.raises(ValueError, match=r"bias must be contiguous float32 \(10\) on the CPU, got \(5\)"):
        few_rows.linear(torch.randn(2, 6), panels, torch.randn(5), 10)


def test_packed_weight_routes_by_rows_and_size() -> None:
    """In inference mode: a few rows of a large enough product here, many rows on oneDNN, a
    small product on MKL; in a frozen_weights() block the shortcut gives the same bits."""
    torch.manual_seed(0)
    layer, tiny = Linear(256, 512), Linear(16, 16)  # tiny: 8 * 16 * 16 multiply-adds, under few_rows.MIN_MACS
    few, many = torch.randn(8, 256), torch.randn(4 * few_rows.MAX_ROWS, 256)
    with torch.inference_mode():
        first = layer(few)
        assert repr(layer.packed) == "PackedWeight(packed for few rows)"
        torch.testing.assert_close(first, F.linear(few, layer.weight, layer.bias))
        torch.testing.assert_close(layer(many), F.linear(many, layer.weight, layer.bias))
        assert repr(layer.packed) == "PackedWeight(packed for oneDNN and few rows)"
        with kernels.frozen_weights():
            assert torch.equal(layer(few), first)  # checks the weight
            assert torch.equal(layer(few), first)  # the shortcut
            assert torch.equal(layer.bind(few.numel())(few), first)
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
    with pytest.raises(RuntimeError, match="the few-row kernel is unavailable here: .*no C compiler"):
        few_rows.pack(torch.randn(4, 4))
    layer = Linear(256, 512)  # 8 rows: 2**20 multiply-adds, PACKED_MIN_MACS
    x = torch.randn(8, 256)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        assert repr(layer.packed) == "PackedWeight(packed for oneDNN)"


def test_the_compiled_library_is_reused_from_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("TRANSFORMER_BOOK_CACHE", str(tmp_path))
    built = _native.compiled(few_rows.SOURCE)
    assert built.parent == tmp_path and built.exists()

    def no_compiling(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(_native.subprocess, "run", no_compiling)
    assert _native.compiled(few_rows.SOURCE) == built
    assert list(tmp_path.iterdir()) == [built]  # no scratch left behind


def test_a_new_packed_weight_is_empty() -> None:
    assert repr(PackedWeight()) == "PackedWeight(empty)"


def test_a_bias_that_does_not_fit_never_reaches_the_kernel() -> None:
    """PackedWeight checks the bias's shape before choosing the few-row kernel (which reads
    out_features floats from it): a wrong one gets PyTorch's own error."""
    weight, bias = torch.randn(512, 256), torch.randn(5)
    with torch.inference_mode(), pytest.raises(RuntimeError):
        PackedWeight().linear(torch.randn(8, 256), weight, bias)
