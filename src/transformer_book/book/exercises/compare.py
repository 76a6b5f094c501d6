"""Comparing the reader's outputs with the package's, and saying where they differ."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .engine import Case, Part

_TOLERANCE = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-3),
}


def _as_tensor(value: Any) -> Tensor | None:
    if isinstance(value, Tensor):
        return value
    if (
        isinstance(value, (bool, int, float))
        or type(value).__module__ == "numpy"
        or isinstance(value, list)
    ):
        try:
            return torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            return None
    return None


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(size) for size in shape) + ")"


def _rows(got: Tensor, want: Tensor, most: int = 60) -> str:
    """Both small integer tensors in full (token rows say more than their shapes)."""
    small = max(got.numel(), want.numel()) <= most
    if small and not (got.is_floating_point() or want.is_floating_point()):
        if got.dtype != torch.bool and want.dtype != torch.bool:
            return f"; yours {got.tolist()}, the package's {want.tolist()}"
    return ""


def _value(x: float | bool | int) -> str:
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def _values(got: float | bool | int, want: float | bool | int) -> tuple[str, str]:
    """Both numbers, with enough digits to tell them apart."""
    yours, theirs = _value(got), _value(want)
    if yours == theirs and isinstance(got, float) and isinstance(want, float):
        return f"{got:.17g}", f"{want:.17g}"
    return yours, theirs


def _axis_names(ndim: int, names: tuple[str, ...]) -> list[str]:
    """Names for ``ndim`` axes from the names of the fullest layout: the first axis keeps its
    name (batch), the last ``ndim - 1`` take the last names; missing ones are numbered."""
    if ndim >= len(names):
        return [f"axis {i}" for i in range(ndim - len(names))] + list(names)
    if ndim <= 1:
        return list(names[len(names) - ndim :])
    return [names[0], *names[len(names) - ndim + 1 :]]


def _where(
    index: Sequence[int], axes: list[str], ticks: tuple[Sequence, ...] | None
) -> str:
    if not index:
        return "the value"
    parts = []
    for axis, i in enumerate(index):
        tick = ticks[axis] if ticks and axis < len(ticks) else None
        parts.append(
            f"{axes[axis]}={tick[i]}" if tick is not None else f"{axes[axis]} {i}"
        )
    return ", ".join(parts)


def _tensor_difference(
    key: str, got: Tensor, want: Tensor, spec: Part, ticks: tuple[Sequence, ...] | None
) -> tuple[str | None, str | None]:
    """``(difference, note)``: what differs between the reader's ``got`` and the package's ``want``
    (``None`` if they agree), and a remark for a result that agrees in a form of its own."""
    note = None
    if got.device.type == "meta":
        return (
            f"{key} is a tensor on the meta device, shape {_shape(got.shape)}: a shape without "
            "numbers (made with device='meta', or by a module built there), so there is nothing "
            "to compare",
            None,
        )
    if (
        spec.broadcast_equivalent
        and got.dim() < want.dim()
        and got.shape == want.shape[want.dim() - got.dim() :]
    ):
        if all(size == 1 for size in want.shape[: want.dim() - got.dim()]):
            note = (
                f"{key} has shape {_shape(got.shape)} where the package's has {_shape(want.shape)}; "
                "the two broadcast the same way, so they are compared as one."
            )
            got = got.reshape(want.shape)
    if got.shape != want.shape:
        return (
            f"{key} has shape {_shape(got.shape)} where the package's has shape "
            f"{_shape(want.shape)}" + _rows(got, want),
            None,
        )
    is_bool = want.dtype == torch.bool or got.dtype == torch.bool
    if (spec.strict_dtype or is_bool) and got.dtype != want.dtype:
        meaning = " (True = may attend)" if want.dtype == torch.bool else ""
        return (
            f"{key} has dtype {got.dtype} where the package's has {want.dtype}{meaning}",
            None,
        )
    if is_bool or not (want.is_floating_point() or got.is_floating_point()):
        bad = got.cpu() != want.cpu()
        error = bad.double()
    else:
        rtol, atol = spec.tolerance.get(want.dtype) or _TOLERANCE.get(
            want.dtype, (1e-4, 1e-5)
        )
        g, w = got.detach().cpu().double(), want.detach().cpu().double()
        bad = ~torch.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
        error = (g - w).abs().nan_to_num(nan=math.inf)
        error[g.isnan() & w.isnan()] = 0.0
    count = int(bad.sum())
    if count == 0:
        return None, note
    if want.dtype == torch.float64 and got.dtype == torch.float64:
        rtol, atol = _TOLERANCE[torch.float32]
        if torch.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True).all():
            return (
                f"{key}: {count} of {want.numel()} entries differ by float32's rounding only "
                f"(the largest difference is {error.max().item():.3g}): yours has dtype "
                "float64 but looks computed in float32 and cast at the end, so it keeps "
                "float32's precision; the package computes in float64 throughout",
                note,
            )
    if want.numel() == 1 and not ticks:  # a single number: no positions to speak of
        g0, w0 = (
            got.detach().cpu().flatten()[0].item(),
            want.detach().cpu().flatten()[0].item(),
        )
        gap = (
            f" (a difference of {error.max().item():.3g})"
            if isinstance(w0, float)
            else ""
        )
        yours, theirs = _values(g0, w0)
        return f"{key}: yours {yours}, the package's {theirs}{gap}", note
    axes = _axis_names(want.dim(), spec.axes.get(key, ()))
    positions = bad.nonzero().tolist()
    first = positions[0]
    g0, w0 = (
        got.detach().cpu()[tuple(first)].item(),
        want.detach().cpu()[tuple(first)].item(),
    )
    text = (
        f"{key}: {count} of {want.numel()} entries differ; the first at {_where(first, axes, ticks)}: "
        "yours {}, the package's {}".format(*_values(g0, w0))
    )
    if not is_bool and want.is_floating_point():
        worst = int(error.flatten().argmax())
        worst_index = (
            list(torch.unravel_index(torch.tensor(worst), error.shape))
            if error.dim()
            else []
        )
        largest = error.flatten()[worst].item()
        nans = int(got.detach().cpu().isnan().sum()) if got.is_floating_point() else 0
        if math.isinf(largest) and nans:
            text += f"; yours is NaN in {nans} entries"
        else:
            at = _where([int(i) for i in worst_index], axes, ticks)
            text += f"; the largest difference is {largest:.3g}, at {at}"
    confined = []
    for axis in range(want.dim()):
        hit = sorted({p[axis] for p in positions})
        if want.shape[axis] > 1 and len(hit) < want.shape[axis]:
            tick = ticks[axis] if ticks and axis < len(ticks) else None
            shown = [str(tick[i]) if tick is not None else str(i) for i in hit[:8]]
            confined.append(
                f"{axes[axis]} {', '.join(shown)}" + (", …" if len(hit) > 8 else "")
            )
    if confined:
        text += " (all differences lie at " + "; ".join(confined) + ")"
    text += _rows(got, want)
    return text, note


def _difference(
    spec: Part, case: Case, got: dict[str, Any], want: dict[str, Any]
) -> tuple[list[str], list[str]]:
    """Differences (and notes) between the reader's outputs and the package's on one case."""
    differences, notes = [], []
    for key, expected in want.items():
        if key not in got:
            if key == next(iter(want)):
                differences.append(f"your version gives no {key}")
            continue
        value = got[key]
        if key == "missing parameters":
            if value != expected:
                differences.append(
                    f"your module has no {', '.join(value)}, which the package's has"
                )
            continue
        if not isinstance(expected, Tensor):
            if isinstance(value, Tensor) or value != expected:
                differences.append(f"{key}: yours {value}, the package's {expected}")
            continue
        tensor = _as_tensor(value)
        if tensor is None:
            differences.append(
                f"your version returns {type(value).__name__} as {key} where the package returns a tensor "
                f"of shape {_shape(expected.shape)}"
            )
            continue
        difference, note = _tensor_difference(
            key, tensor, expected, spec, case.ticks.get(key)
        )
        differences += [difference] if difference else []
        notes += [note] if note else []
    return differences, notes


def _same(spec: Part, case: Case, got: dict[str, Any], other: dict[str, Any]) -> bool:
    """Whether two versions' outputs agree on every output both give (whatever parameters each has:
    a module may keep a projection it does not use)."""
    shared = {
        key: other[key] for key in got if key in other and key != "missing parameters"
    }
    if not shared:
        return False
    return not _difference(spec, case, got, shared)[0]
