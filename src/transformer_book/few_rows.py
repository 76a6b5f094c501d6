"""Appendix C: the matrix products of a decoding step, which have only a few rows.

A cached decoding step multiplies one new position per sequence (a few rows: the batch) by
every weight matrix of the decoder. Each weight is then used a few times only, so the
product can be no faster than the weights arrive from memory, and PyTorch's libraries stream
them at well under that speed for so few rows (appendix C and ``benchmarks/bench_kernels.py``
measure both). ``few_rows.c`` is the product written for this case: the weight packed once
into panels of eight outputs, read once front to back, each output summed in a fixed order.

The C file is compiled on first use for the CPU it runs on (see ``_native``: ``$CC``,
``$TRANSFORMER_BOOK_CACHE``). Where there is no compiler, compiling fails, the result
computes wrongly, or ``TRANSFORMER_BOOK_FEW_ROWS=0``,
:func:`available` is False and :class:`~transformer_book.kernels.PackedWeight` keeps these
products with oneDNN: the same numbers to float rounding, more slowly.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _native
from ._checks import shape_of

#: In inference mode, a product of at most this many rows runs here (when :func:`available`).
#: Measured with ``benchmarks/bench_kernels.py`` on an AMD EPYC, it was 1.3 to 2.5 times as fast as
#: packed oneDNN on the base model's decoder matrices up to 16 rows, about even at 32.
MAX_ROWS = 16

#: In inference mode, a product runs here only if it has at least this many multiply-adds,
#: rows times in_features times out_features. For fewer, MKL's call costs less than this
#: one, which goes through a Python wrapper and a parallel region.
MIN_MACS = 1 << 18

SOURCE = Path(__file__).with_name("few_rows.c")
_library: ctypes.CDLL | None = None
_lanes = 0  # outputs per panel, read from the compiled library
_unavailable: str | None = None  # why not, once tried and failed


def available() -> bool:
    """Whether the kernel is compiled, loaded and correct here (tried once per process)."""
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (``None`` when it is True or not yet tried)."""
    return _unavailable


def pack(weight: Tensor) -> Tensor:
    """``weight (out, in)`` → panels ``(ceil(out / lanes), in, lanes)``: panel ``p`` holds
    outputs ``p * lanes ...`` side by side for each input feature, zeros past ``out``."""
    _require()
    out_features, in_features = weight.shape
    count = -(-out_features // _lanes)
    padded = F.pad(weight.detach().float(), (0, 0, 0, count * _lanes - out_features))
    return padded.view(count, _lanes, in_features).transpose(1, 2).contiguous()


def linear(x: Tensor, panels: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """``F.linear(x, weight, bias)`` with ``panels = pack(weight)``: ``x (..., in)`` → ``(..., out)``.

    ``x`` is float32 on the CPU; so are ``panels`` and ``bias`` (contiguous, ``(out,)``).
    """
    _require()
    if not (
        panels.dim() == 3
        and panels.shape[2] == _lanes
        and panels.dtype == torch.float32
        and panels.is_cpu
        and panels.is_contiguous()
        and 0 < out_features <= panels.shape[0] * _lanes
    ):
        raise ValueError(f"out_features={out_features} does not fit panels {shape_of(panels)} (use pack(weight))")
    if bias is not None and not (
        bias.shape == (out_features,) and bias.dtype == torch.float32 and bias.is_cpu and bias.is_contiguous()
    ):  # the C loop reads out_features floats from it
        raise ValueError(f"bias must be contiguous float32 ({out_features}) on the CPU, got {shape_of(bias)}")
    return product(x, panels, bias, out_features)


def product(x: Tensor, panels: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """:func:`linear` for ``panels`` and ``bias`` already known to fit (``PackedWeight``'s own,
    checked once): only ``x`` is checked, on every call of a decoding step."""
    if x.dtype != torch.float32 or not x.is_cpu or x.shape[-1:] != panels.shape[1:2]:
        raise ValueError(
            f"x must be float32 on the CPU with {panels.shape[1]} features, got {x.dtype} {shape_of(x)} on {x.device}"
        )
    x = x.contiguous()
    y = x.new_empty(*x.shape[:-1], out_features)
    in_features = panels.shape[1]
    _library.few_rows_linear(
        x.data_ptr(),
        panels.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        x.numel() // in_features,
        out_features,
        in_features,
        torch.get_num_threads(),
    )
    return y


def _require() -> None:
    if _load() is None:
        raise RuntimeError(f"the few-row kernel is unavailable here: {_unavailable}")


def _load() -> ctypes.CDLL | None:
    global _library, _lanes, _unavailable
    if _library is not None or _unavailable is not None:
        return _library
    library, _unavailable = _native.load(SOURCE, "TRANSFORMER_BOOK_FEW_ROWS")
    if library is None:
        return None
    library.few_rows_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    library.few_rows_linear.restype = None
    _library, _lanes = library, library.few_rows_lanes()
    if not _computes_correctly():
        _library, _unavailable = None, f"{SOURCE.name} compiled here computes wrong products"
    return _library


def _computes_correctly() -> bool:
    """A small product with odd sizes (partial panel, row counts below and above a block)
    against PyTorch's, and each row equal to the row computed alone."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(13, 37, generator=generator)
    bias = torch.randn(13, generator=generator)
    x = torch.randn(11, 37, generator=generator)
    with torch.inference_mode():
        panels = pack(weight)
        y = linear(x, panels, bias, 13)
        alone = torch.cat([linear(row[None], panels, bias, 13) for row in x])
        return torch.allclose(y, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5) and torch.equal(y, alone)
