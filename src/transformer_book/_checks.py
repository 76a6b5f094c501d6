"""Input checks shared by the modules.

Every public function validates its arguments here so that bad input fails
early with a ``ValueError`` that names the argument and its shape, instead of a
stack trace from deep inside PyTorch.
"""

from __future__ import annotations

import torch
from torch import Tensor


def shape_of(tensor: Tensor) -> str:
    """``(2, 3, 4)``-style text for error messages."""
    return "(" + ", ".join(str(size) for size in tensor.shape) + ")"


def require_tensor(value: object, name: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_positive(value: int, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_probability(value: float, name: str) -> None:
    if not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")


def check_features(x: Tensor, name: str, d_model: int, ndim: int = 3) -> None:
    """``x`` must be a floating tensor ``(batch, seq, d_model)`` with batch and seq > 0."""
    require_tensor(x, name)
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype} with shape {shape_of(x)}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions (batch, seq, d_model), got shape {shape_of(x)}")
    if x.shape[-1] != d_model:
        raise ValueError(f"{name} must have last dimension d_model={d_model}, got shape {shape_of(x)}")
    if x.numel() == 0:
        raise ValueError(f"{name} is empty: shape {shape_of(x)}")


def check_tokens(tokens: Tensor, name: str, vocab_size: int, max_len: int | None = None) -> None:
    """``tokens`` must be integer ids ``(batch, seq)`` in ``[0, vocab_size)``."""
    require_tensor(tokens, name)
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool or tokens.is_complex():
        raise ValueError(f"{name} must hold integer token ids, got dtype {tokens.dtype} with shape {shape_of(tokens)}")
    if tokens.dim() != 2:
        raise ValueError(f"{name} must have shape (batch, seq), got {shape_of(tokens)}")
    if tokens.numel() == 0:
        raise ValueError(f"{name} is empty: shape {shape_of(tokens)}")
    low, high = map(int, tokens.aminmax())  # one pass, one op: decoding checks every step's ids
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"{name} holds ids in [{low}, {high}] but the vocabulary has {vocab_size} ids (0..{vocab_size - 1}); "
            f"shape {shape_of(tokens)}"
        )
    if max_len is not None and tokens.shape[1] > max_len:
        raise ValueError(
            f"{name} has {tokens.shape[1]} positions, more than max_len={max_len}; shape {shape_of(tokens)}"
        )


def check_mask(mask: Tensor | None, name: str, target: tuple[int, ...]) -> None:
    """A mask must be boolean (True = may attend) and broadcast to ``target``."""
    if mask is None:
        return
    require_tensor(mask, name)
    if mask.dtype != torch.bool:
        raise ValueError(
            f"{name} must be a boolean tensor (True = may attend), got dtype {mask.dtype} with shape {shape_of(mask)}"
        )
    if mask.dim() > len(target) or not _broadcasts(tuple(mask.shape), target):
        expected = "(" + ", ".join(str(size) for size in target) + ")"
        problem = "has more dimensions than" if mask.dim() > len(target) else "does not broadcast to"
        raise ValueError(f"{name} with shape {shape_of(mask)} {problem} {expected}")


def _broadcasts(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts to exactly ``target`` (``torch.broadcast_shapes`` is ~20x slower,
    and masks are checked in every attention call of every decoding step)."""
    return all(size in (1, goal) for size, goal in zip(reversed(shape), reversed(target)))
