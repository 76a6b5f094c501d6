"""Appendix C: dropout in one pass, its mask a hash of the seed and the position.

``F.dropout`` on a CPU draws a random number per element from PyTorch's generator (a
Mersenne Twister: one stream, one thread), makes a mask, multiplies, and keeps the mask for
backward. Here each element's 16 random bits are SplitMix64's hash of one seed (drawn from
PyTorch's seeded generator) and the element's position, so ``dropout_kernel.c`` computes
mask and product together, on every thread, vectorised, and backward recomputes the mask from
the seed instead of storing it. The feed-forward network's ReLU joins the same pass
(``relu=True``), and its gradient is read off the output, positive exactly where an element
passed both (:func:`relu_backward`). An element is kept when its 16 bits reach ``p`` rounded to a
multiple of 1/65536 (0.1 becomes 0.100006), and the kept values are scaled by
``1 / (1 - p)``, as ``nn.Dropout`` does.

The C file is compiled on first use (see ``_native``). Where it cannot be, computes wrongly,
or ``TRANSFORMER_BOOK_DROPOUT_KERNEL=0``, :func:`apply` computes the same bits with
PyTorch's integer operators: the same results, more slowly.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch
from torch import Tensor

from ..checks import shape_of
from . import _native

SOURCE = Path(__file__).with_name("dropout_kernel.c")
_GOLDEN, _MIX1, _MIX2 = (
    0x9E3779B97F4A7C15,
    0xBF58476D1CE4E5B9,
    0x94D049BB133111EB,
)  # as in the C file
_library: ctypes.CDLL | None = None
_unavailable: str | None = None  # why not, once tried and failed


def available() -> bool:
    """Whether the C kernel is compiled, loaded and correct here (tried once per process)."""
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (``None`` when it is True or not yet tried)."""
    return _unavailable


def draw_seed() -> int:
    """A seed for one mask, drawn from PyTorch's default (seeded) generator: 63 random bits."""
    return int(torch.empty((), dtype=torch.int64).random_())


def keep_mask(shape: torch.Size | tuple[int, ...], p: float, seed: int) -> Tensor:
    """The boolean mask :func:`apply` uses, computed with PyTorch's operators: element ``i``
    (in row-major order) is kept when lane ``i % 4`` of SplitMix64's word ``i // 4`` (lane 0
    the low 16 bits), read as a signed 16-bit number, is at least ``round(p * 65536) - 32768``:
    65536 - round(p * 65536) of its 65536 values."""
    numel = math.prod(shape)
    words = torch.arange(1, (numel + 3) // 4 + 1, dtype=torch.int64)
    z = words.mul_(_signed(_GOLDEN)).add_(
        _signed(seed)
    )  # int64 arithmetic wraps, as uint64's does
    z = (z ^ _shift_right(z, 30)).mul_(_signed(_MIX1))
    z = (z ^ _shift_right(z, 27)).mul_(_signed(_MIX2))
    z = z ^ _shift_right(z, 31)
    lanes = z.view(torch.int16)[:numel].view(
        shape
    )  # lane 0 first: these CPUs are little-endian
    return lanes >= round(p * 65536) - 32768


def apply(x: Tensor, p: float, seed: int, relu: bool = False) -> Tensor:
    """``x (...)`` → ``x * keep_mask(x.shape, p, seed) / (1 - p)``, same shape, contiguous;
    with ``relu``, ``x.relu()`` in place of ``x`` (ReLU, then dropout, in one pass).
    ``x`` is float32 on the CPU; ``0 <= p < 1``."""
    _check(x, "x", p)
    x = x.contiguous()
    if _load() is None:
        return _apply_with_operators(x, p, seed, relu)
    y = torch.empty_like(x)
    lowest, scale = round(p * 65536) - 32768, 1.0 / (1.0 - p)
    threads = torch.get_num_threads()
    _library.dropout_apply(
        x.data_ptr(),
        y.data_ptr(),
        x.numel(),
        seed % 2**64,
        lowest,
        scale,
        relu,
        threads,
    )
    return y


def relu_backward(grad: Tensor, y: Tensor, p: float) -> Tensor:
    """The gradient of ``apply(x, p, seed, relu=True)`` from its output ``y`` and the output's
    gradient ``grad`` (both ``(...)``, the same shape): ``grad / (1 - p)`` where ``y > 0`` (the
    input was positive and the element kept), else 0. No seed: ``y`` says where."""
    _check(grad, "grad", p)
    _check(y, "y", p)
    if grad.shape != y.shape:
        raise ValueError(
            f"grad and y must have the same shape, got grad {shape_of(grad)} and y {shape_of(y)}"
        )
    grad, y = grad.contiguous(), y.contiguous()
    if _load() is None:
        return _relu_backward_with_operators(grad, y, p)
    grad_x = torch.empty_like(grad)
    threads = torch.get_num_threads()
    _library.relu_dropout_backward(
        grad.data_ptr(),
        y.data_ptr(),
        grad_x.data_ptr(),
        y.numel(),
        1 / (1 - p),
        threads,
    )
    return grad_x


def _check(x: Tensor, name: str, p: float) -> None:
    if x.dtype != torch.float32 or not x.is_cpu:
        raise ValueError(
            f"{name} must be float32 on the CPU, got {x.dtype} {shape_of(x)} on {x.device}"
        )
    if (
        torch.is_grad_enabled() and x.requires_grad
    ):  # the kernel has no backward: never drop a gradient
        raise ValueError(
            f"{name} {shape_of(x)} requires grad; use kernels.dropout, which carries it"
        )
    if not 0.0 <= p < 1.0:
        raise ValueError(f"p must be in [0, 1), got {p!r}")


def _apply_with_operators(x: Tensor, p: float, seed: int, relu: bool = False) -> Tensor:
    """:func:`apply` with PyTorch's operators: the fallback, and the C kernel's reference."""
    return (
        (x.relu() if relu else x).mul(keep_mask(x.shape, p, seed)).mul_(1.0 / (1.0 - p))
    )


def _relu_backward_with_operators(grad: Tensor, y: Tensor, p: float) -> Tensor:
    """:func:`relu_backward` with PyTorch's operators."""
    return torch.where(y > 0, grad * (1.0 / (1.0 - p)), 0.0)


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    value %= 2**64
    return value - 2**64 if value >= 2**63 else value


def _shift_right(z: Tensor, bits: int) -> Tensor:
    """The unsigned (logical) shift of int64 ``z``: ``>>`` on int64 copies the sign bit."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _load() -> ctypes.CDLL | None:
    global _library, _unavailable
    if _library is not None or _unavailable is not None:
        return _library
    library, _unavailable = _native.load(SOURCE, "TRANSFORMER_BOOK_DROPOUT_KERNEL")
    if library is None:
        return None
    library.dropout_apply.argtypes = [ctypes.c_void_p] * 2 + [
        ctypes.c_long,
        ctypes.c_uint64,
        ctypes.c_int32,
    ]
    library.dropout_apply.argtypes += [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    library.dropout_apply.restype = None
    library.relu_dropout_backward.argtypes = [ctypes.c_void_p] * 3 + [
        ctypes.c_long,
        ctypes.c_float,
        ctypes.c_int,
    ]
    library.relu_dropout_backward.restype = None
    _library = library
    wrong = _native.self_test_failure(_computes_correctly, "computes wrong masks")
    if wrong is not None:
        _library, _unavailable = None, f"{SOURCE.name} compiled here {wrong}"
    return _library


def _computes_correctly() -> bool:
    """The C kernel's outputs against PyTorch's operators on the same bits, for a length that
    ends in a partial word, with a seed whose top bit is set: dropout, ReLU then dropout, and
    the latter's gradient."""
    x = torch.randn(
        1, 4099, generator=torch.Generator().manual_seed(0), dtype=torch.float32
    )  # any default dtype
    seed = 2**64 - 12345
    y = apply(x, 0.3, seed, relu=True)
    return (
        torch.equal(apply(x, 0.3, seed), _apply_with_operators(x, 0.3, seed))
        and torch.equal(y, _apply_with_operators(x, 0.3, seed, relu=True))
        and torch.equal(
            relu_backward(x, y, 0.3), _relu_backward_with_operators(x, y, 0.3)
        )
    )
