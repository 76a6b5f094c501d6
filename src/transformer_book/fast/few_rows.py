"""Appendix C: the matrix products of a decoding step, which have only a few rows, and its attention.

A cached decoding step multiplies one new position per sequence (a few rows: the batch) by
every weight matrix of the decoder. Each weight is then used a few times only, so the
product can be no faster than the weights arrive from memory, and PyTorch's libraries stream
them at well under that speed for so few rows (appendix C and ``benchmarks/bench_kernels.py``
measure both). ``few_rows.c`` is the product written for this case: the weight packed once
into panels of eight outputs, read once front to back, each output summed in a fixed order.

The step's attention is alike: one query per sequence and head against every cached key and
value, read to be used once. PyTorch's fused kernel is written for blocks of many queries;
:func:`attention` reads the cache where it lies, one (sequence, head) per thread, and writes
the heads side by side, already merged.

The C file is compiled on first use for the CPU it runs on (see ``_native``: ``$CC``,
``$TRANSFORMER_BOOK_CACHE``). Where there is no compiler, compiling fails, the result
computes wrongly, or ``TRANSFORMER_BOOK_FEW_ROWS=0``,
:func:`available` is False, :class:`~transformer_book.fast.kernels.PackedWeight` keeps these
products with oneDNN and attention stays with PyTorch's fused kernel: the same numbers to
float rounding, more slowly.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import check_mask, shape_of
from . import _native

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


def product(
    x: Tensor, panels: Tensor, bias: Tensor | None, out_features: int
) -> Tensor:
    """``F.linear(x, weight, bias)`` with ``panels = pack(weight)``: ``x (..., in)`` → ``(..., out)``.

    ``x``, ``panels`` and ``bias`` (contiguous, ``(out,)``) are float32 on the CPU, and none
    needs a gradient (the kernel has no backward). Everything the C loop reads is checked
    first, on every call: a few attribute reads, against reading past the end of a buffer.
    """
    _require()
    in_features = panels.shape[1] if panels.dim() == 3 else -1
    if not (
        panels.dim() == 3
        and panels.shape[2] == _lanes
        and panels.dtype == torch.float32
        and panels.is_cpu
        and panels.is_contiguous()
        and 0 < out_features <= panels.shape[0] * _lanes
    ):
        raise ValueError(
            f"out_features={out_features} does not fit panels {shape_of(panels)} (use pack(weight))"
        )
    if bias is not None and not (
        bias.shape == (out_features,)
        and bias.dtype == torch.float32
        and bias.is_cpu
        and bias.is_contiguous()
    ):
        raise ValueError(
            f"bias must be contiguous float32 ({out_features},) on the CPU, got {shape_of(bias)}"
        )
    if (
        x.dtype != torch.float32
        or not x.is_cpu
        or x.dim() == 0
        or x.shape[-1] != in_features
    ):
        raise ValueError(
            f"x must be float32 on the CPU with {in_features} features, got {x.dtype} {shape_of(x)} on {x.device}"
        )
    _refuse_gradients(x=x, panels=panels, bias=bias)
    x = x.contiguous()
    y = x.new_empty(*x.shape[:-1], out_features)
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


def _refuse_gradients(**tensors: Tensor | None) -> None:
    """The C kernels have no backward: a tensor that needs a gradient must take PyTorch's path,
    never lose its gradient here."""
    if torch.is_grad_enabled():
        for name, t in tensors.items():
            if t is not None and t.requires_grad:
                raise ValueError(
                    f"{name} {shape_of(t)} requires grad; the few-row kernels have no backward"
                )


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """Scaled dot-product attention of one query per sequence and head, its heads merged:
    ``q (batch, heads, 1, d_head)``, ``k`` and ``v (batch, heads, len, d_head)``, ``mask``
    boolean (True = may attend) broadcastable to ``(batch, heads, 1, len)`` → ``(batch, 1,
    heads * d_head)``, which is ``merge_heads(F.scaled_dot_product_attention(q, k, v,
    attn_mask=mask))`` to float rounding (a query with no key to attend to gets zeros). A NaN in
    a query or key makes that output NaN, as the formula does (PyTorch's fused CPU kernel gives
    zeros there).

    A decoding step's attention: the new position against the KV cache or the source. ``q``, ``k``
    and ``v`` are float32 on the CPU, any strides with contiguous features (views into the
    cache's buffers are read where they lie).
    """
    _require()
    batch, heads, _, dim = q.shape if q.dim() == 4 else (0, 0, 0, 0)
    if (
        q.dim() != 4
        or q.shape[2] != 1
        or k.dim() != 4
        or k.shape[:2] != (batch, heads)
        or k.shape[3] != dim
        or v.shape != k.shape
    ):
        raise ValueError(
            "q must be (batch, heads, 1, d_head) and k, v (batch, heads, len, d_head), "
            f"got q {shape_of(q)}, k {shape_of(k)}, v {shape_of(v)}"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.float32 or not t.is_cpu or t.stride(-1) != 1:
            raise ValueError(
                f"{name} must be float32 on the CPU with contiguous features, got {t.dtype} {shape_of(t)}"
            )
    length = k.shape[2]
    _refuse_gradients(q=q, k=k, v=v)
    if mask is not None:
        check_mask(mask, "mask", (batch, heads, 1, length), q.device)
        mask = mask.expand(batch, heads, 1, length)  # strides of 0 where it broadcasts
    out, scores = q.new_empty(batch, 1, heads * dim), q.new_empty(batch * heads, length)
    _library.few_rows_attention(
        q.data_ptr(), q.stride(0), q.stride(1),
        k.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
        v.data_ptr(), v.stride(0), v.stride(1), v.stride(2),
        *((None, 0, 0, 0) if mask is None else (mask.data_ptr(), mask.stride(0), mask.stride(1), mask.stride(3))),
        out.data_ptr(), scores.data_ptr(), batch, heads, length, dim, 1.0 / math.sqrt(dim), torch.get_num_threads(),
    )  # fmt: skip
    return out


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
    library.few_rows_linear.argtypes = (
        [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    )
    library.few_rows_linear.restype = None
    strides = [ctypes.c_long] * 3
    library.few_rows_attention.argtypes = (
        [ctypes.c_void_p, ctypes.c_long, ctypes.c_long]  # q and its strides
        + [
            ctypes.c_void_p,
            *strides,
            ctypes.c_void_p,
            *strides,
            ctypes.c_void_p,
            *strides,
        ]  # k, v, mask
        + [
            ctypes.c_void_p,
            ctypes.c_void_p,
            *[ctypes.c_long] * 4,
        ]  # out, scratch for the scores, sizes
        + [ctypes.c_float, ctypes.c_int]  # scale, threads
    )
    library.few_rows_attention.restype = None
    _library, _lanes = library, library.few_rows_lanes()
    wrong = _native.self_test_failure(_computes_correctly, "computes wrong products")
    if wrong is not None:
        _library, _unavailable = None, f"{SOURCE.name} compiled here {wrong}"
    return _library


def _computes_correctly() -> bool:
    """A small product with odd sizes (partial panel, row counts below and above a block)
    against PyTorch's, and each row equal to the row computed alone."""
    generator = torch.Generator().manual_seed(0)
    f32 = torch.float32  # whatever the default dtype
    weight = torch.randn(13, 37, generator=generator, dtype=f32)
    bias = torch.randn(13, generator=generator, dtype=f32)
    x = torch.randn(11, 37, generator=generator, dtype=f32)
    with torch.inference_mode():
        panels = pack(weight)
        y = product(x, panels, bias, 13)
        alone = torch.cat([product(row[None], panels, bias, 13) for row in x])
        q, k, v = (
            torch.randn(3, 2, length, 9, generator=generator, dtype=f32)
            for length in (1, 5, 5)
        )
        mask = torch.rand(3, 1, 1, 5, generator=generator) > 0.5
        expected = (
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            .nan_to_num(0.0)
            .transpose(1, 2)
        )
        return (
            torch.allclose(y, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
            and torch.equal(y, alone)
            and torch.allclose(
                attention(q, k, v, mask),
                expected.reshape(3, 1, 18),
                rtol=1e-5,
                atol=1e-6,
            )
        )
