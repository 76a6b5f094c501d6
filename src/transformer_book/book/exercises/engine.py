"""Build it: grade a reader's own version of a component against the package's, and name the mistake.

Each chapter ends with an exercise in which the reader writes the chapter's component
themselves, then runs::

    from transformer_book.book.exercises import check
    check("scaled_dot_product_attention", my_attention)

:func:`check` runs both versions on the same small inputs (random shapes, masks, batch size 1,
length 1, a query whose every key is hidden, float64, ... whatever the component needs) and
returns a :class:`CheckResult`. When the reader's version differs, the result says where
(which rows, columns or positions, the largest error, the shapes) and, when the difference has
the signature of a known mistake, names it: every component has a catalogue of broken versions,
and a reader's version that gives the same numbers as one of them on every input has made that
mistake. Mistakes that one of the book's source documents makes link to their row of the errata
appendix. The verdict never depends on the global random state, which checking leaves as it found.
"""

from __future__ import annotations

import contextlib
import copy
import html
import inspect
import math
import os
import re
import sysconfig
import time
import traceback
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention import MultiHeadAttention, scaled_dot_product_attention
from ..decoder import DecoderLayer
from ..embedding import TokenEmbedding
from ..encoder import EncoderLayer
from ..inference import beam_search, greedy_decode
from ..layers import sublayer_connection
from ..masking import causal_mask, padding_mask
from ..model import ModelConfig, Transformer
from ..positional import sinusoidal_positional_encoding
from ..training import LabelSmoothingLoss, noam_rate

__all__ = ["CheckResult", "Mistake", "Section", "catalogue", "check", "names"]

_SEED = 20240917  # every input of every check comes from generators seeded from this


# ---------------------------------------------------------------------------------------------
# What a check returns, and where it sends the reader
# ---------------------------------------------------------------------------------------------


def _anchor(title: str) -> str:
    """The HTML id Sphinx gives a section titled ``title`` (docutils' ``make_id``)."""
    text = (
        unicodedata.normalize("NFKD", title.lower())
        .encode("ascii", "ignore")
        .decode("ascii")
    )
    text = re.sub(r"[^a-z0-9]+", "-", " ".join(text.split()))
    return re.sub(r"^[-0-9]+|-+$", "", text)


@dataclass(frozen=True)
class Section:
    """A section of the book to re-read: the chapter (a number, or ``"A"`` for the errata
    appendix), its notebook's ``page`` under ``chapters/`` and the heading's ``title``."""

    chapter: int | str
    page: str
    title: str
    anchor: str = (
        ""  # when the section has a label of its own instead of the heading's id
    )

    @property
    def link(self) -> str:
        """The page and anchor, relative to a chapter's page (``03_attention.html#...``)."""
        return f"{self.page}.html#{self.anchor or _anchor(self.title)}"

    def __str__(self) -> str:
        where = "appendix A" if self.chapter == "A" else f"chapter {self.chapter}"
        return f"{where}, “{self.title}”"


def _errata_link(row: int) -> str:
    return f"errata row {row} (appendix A, appendix/a_errata.html#errata-{row})"


@dataclass(frozen=True)
class Mistake:
    """One mistake of the catalogue.

    ``does`` says what a version with this mistake computes, ``section`` where the book explains
    the right thing, ``errata`` the rows of the errata appendix whose source makes it. ``variants``
    are broken versions with the component's own signature: a reader's version that gives the
    same results as any one of them on every input has made this mistake.
    """

    name: str
    does: str
    variants: tuple[Any, ...]
    section: Section | None = None
    errata: tuple[int, ...] = ()


@dataclass
class CheckResult:
    """The verdict of :func:`check`. ``bool(result)`` is ``result.passed``.

    ``mistake`` is the name of the recognised mistake (``None`` when it passed or when the
    difference matches no mistake of the catalogue); ``message`` says what differs and where,
    and which section to re-read.
    """

    name: str
    passed: bool
    mistake: str | None
    message: str
    section: Section | None = None
    errata: tuple[int, ...] = ()
    cases: int = 0

    def __bool__(self) -> bool:
        return self.passed

    @property
    def headline(self) -> str:
        if self.passed:
            return f"✅ {self.name}: passed"
        return f"❌ {self.name}: " + (
            f"mistake “{self.mistake}”" if self.mistake else "not passed"
        )

    def __str__(self) -> str:
        return f"{self.headline}\n{self.message}"

    def __repr__(self) -> str:
        return f"CheckResult(name={self.name!r}, passed={self.passed}, mistake={self.mistake!r})\n{self.message}"

    def _repr_markdown_(self) -> str:
        body = re.sub(
            r"\(((?:[\w-]+/)*[\w-]+\.html#[\w-]+)\)", r"([\1](\1))", self.message
        )
        return f"**{self.headline}**\n\n" + body.replace("\n", "\n\n")

    def _repr_html_(self) -> str:
        colour = "#2e7d32" if self.passed else "#c62828"
        body = html.escape(self.message).replace("\n", "<br>")
        body = re.sub(
            r"((?:[\w-]+/)*[\w-]+\.html#[\w-]+)", r'<a href="\1">\1</a>', body
        )
        return (
            f'<div style="border-left: 4px solid {colour}; padding: 0.3em 0.8em; margin: 0.3em 0">'
            f"<strong>{html.escape(self.headline)}</strong><br>{body}</div>"
        )


# ---------------------------------------------------------------------------------------------
# The machinery: cases, runs, comparisons
# ---------------------------------------------------------------------------------------------


class _ReaderProblem(Exception):
    """Something about the reader's version that stops the comparison; its text is the message."""


class _ReaderError(_ReaderProblem):
    """The reader's code raised ``error`` while doing ``context``."""

    def __init__(self, context: str, error: BaseException) -> None:
        self.context, self.error = context, error
        super().__init__(f"{context} raised {type(error).__name__}")


@dataclass(frozen=True)
class _Case:
    """One input of a check. ``make()`` returns fresh inputs each time (so that a version that
    changes its inputs in place cannot change what the next one sees); ``needs`` lists the
    parameters the reader's callable must accept for the case to apply."""

    label: str
    make: Callable[[], Any]
    needs: tuple[str, ...] = ()
    on_error: str = (
        ""  # a fact worth adding when the reader's version raises on this case
    )
    ticks: dict[str, tuple[Sequence, ...]] = field(
        default_factory=dict
    )  # index → label, per output axis


@dataclass(frozen=True)
class _Spec:
    """Everything :func:`check` needs to know about one component."""

    name: str
    kind: str  # "function" or "class"
    reference: Any
    summary: str
    section: Section
    cases: Callable[[], list[_Case]]
    run: Callable[
        [Any, Any], dict[str, Any]
    ]  # (implementation, case inputs) → named outputs
    mistakes: tuple[Mistake, ...]
    axes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    strict_dtype: bool = True
    tolerance: dict[torch.dtype, tuple[float, float]] = field(default_factory=dict)
    broadcast_equivalent: bool = (
        False  # a result without the package's leading size-1 axes is the same
    )
    grad: bool = False


_TOLERANCE = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-3),
}


def _generator(offset: int) -> torch.Generator:
    return torch.Generator().manual_seed(_SEED + offset)


def _display(fn: Any) -> str:
    return (
        getattr(fn, "__qualname__", None)
        or getattr(fn, "__name__", None)
        or type(fn).__name__
    )


def _call(context: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``; what it raises becomes a :class:`_ReaderError` saying ``context``."""
    try:
        return fn(*args, **kwargs)
    except _ReaderProblem:
        raise
    except (
        Exception,
        SystemExit,
    ) as error:  # SystemExit too: a reader's sys.exit() must not end the session
        raise _ReaderError(context, error) from error


def _accepted(fn: Any) -> tuple[set[str], bool] | None:
    """The parameter names ``fn`` (a function, or a class's constructor) takes, and whether it
    takes ``**kwargs``; ``None`` when Python cannot tell."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    names = {p.name for p in signature.parameters.values()}
    return names, any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()
    )


def _takes(fn: Any, name: str) -> bool:
    accepted = _accepted(fn)
    return accepted is None or accepted[1] or name in accepted[0]


def _keywords(fn: Any, **wanted: Any) -> dict[str, Any]:
    """The keyword arguments of ``wanted`` that ``fn`` takes."""
    return {key: value for key, value in wanted.items() if _takes(fn, key)}


def _named(raw: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """Name what a call returned: a tuple's items in order (``None`` items dropped), else the value."""
    if (
        len(names) > 1
        and isinstance(raw, (tuple, list))
        and raw
        and isinstance(raw[0], Tensor)
    ):
        return {key: value for key, value in zip(names, raw) if value is not None}
    return {names[0]: raw}


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


def _value(x: float | bool | int) -> str:
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:.6g}" if isinstance(x, float) else str(x)


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
    key: str, got: Tensor, want: Tensor, spec: _Spec, ticks: tuple[Sequence, ...] | None
) -> tuple[str | None, str | None]:
    """``(difference, note)``: what differs between the reader's ``got`` and the package's ``want``
    (``None`` if they agree), and a remark for a result that agrees in a form of its own."""
    note = None
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
            f"{key} has shape {_shape(got.shape)} where the package's has shape {_shape(want.shape)}",
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
        return f"{key}: yours {_value(g0)}, the package's {_value(w0)}{gap}", note
    axes = _axis_names(want.dim(), spec.axes.get(key, ()))
    positions = bad.nonzero().tolist()
    first = positions[0]
    g0, w0 = (
        got.detach().cpu()[tuple(first)].item(),
        want.detach().cpu()[tuple(first)].item(),
    )
    text = (
        f"{key}: {count} of {want.numel()} entries differ; the first at {_where(first, axes, ticks)}: "
        f"yours {_value(g0)}, the package's {_value(w0)}"
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
    return text, note


def _difference(
    spec: _Spec, case: _Case, got: dict[str, Any], want: dict[str, Any]
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


def _same(spec: _Spec, case: _Case, got: dict[str, Any], other: dict[str, Any]) -> bool:
    """Whether two versions' outputs agree on every output both give (whatever parameters each has:
    a module may keep a projection it does not use)."""
    shared = {
        key: other[key] for key in got if key in other and key != "missing parameters"
    }
    if not shared:
        return False
    return not _difference(spec, case, got, shared)[0]


@contextlib.contextmanager
def _isolated(grad: bool) -> Iterator[None]:
    """Seed PyTorch's global generator for the check and put its state back afterwards; run on one
    thread (the inputs are tiny, and on a busy machine threads only wait for each other)."""
    threads = torch.get_num_threads()
    # The GPUs' generators too, when a reader's code may already have drawn from them.
    gpus = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=gpus), torch.set_grad_enabled(grad):
            torch.default_generator.manual_seed(
                _SEED
            )  # the CPU's only: torch.manual_seed would reseed GPUs
            yield
    finally:
        torch.set_num_threads(threads)


_LIBRARY_DIRS = tuple(
    os.path.realpath(path)
    for path in (
        os.path.dirname(torch.__file__),
        os.path.dirname(__file__),
        sysconfig.get_paths()["stdlib"],
    )
)


def _reader_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The last frame of the traceback in the reader's own code (not PyTorch, the package or Python)."""
    frames = traceback.extract_tb(error.__traceback__)
    own = [
        f for f in frames if not os.path.realpath(f.filename).startswith(_LIBRARY_DIRS)
    ]
    return own[-1] if own else None


def _describe_error(problem: _ReaderError, case: _Case) -> str:
    error = problem.error
    text = " ".join(str(error).split())
    text = text if len(text) <= 300 else text[:297] + "…"
    message = f"{problem.context} raised {type(error).__name__}" + (
        f": {text}" if text else ""
    )
    frame = _reader_frame(error)
    if frame is not None:
        source = f": `{frame.line.strip()}`" if frame.line else ""
        cell = "ipykernel_" in frame.filename or frame.filename.startswith(
            "<ipython-input"
        )
        place = "its cell" if cell else os.path.basename(frame.filename)
        message += f" (in {frame.name}, line {frame.lineno} of {place}{source})"
    message += f", on the input “{case.label}”."
    return message + (f" {case.on_error}" if case.on_error else "")


def _kind_problem(spec: _Spec, fn: Any) -> str | None:
    if spec.kind == "class" and not callable(fn):
        return f"check({spec.name!r}, ...) needs your class (not {type(fn).__name__}): it builds it like the package's."
    if spec.kind == "class" and isinstance(fn, nn.Module):
        return (
            f"check({spec.name!r}, ...) needs your class itself, not an instance of it: it builds one with the "
            f"package's arguments and copies the package's weights into it. Pass {type(fn).__name__}."
        )
    if spec.kind == "function" and (not callable(fn) or isinstance(fn, type)):
        return (
            f"check({spec.name!r}, ...) needs your function, got {type(fn).__name__}."
        )
    return None


def _recognise(
    spec: _Spec, cases: list[_Case], got: list[dict[str, Any]]
) -> Mistake | None:
    """The first mistake of the catalogue one of whose variants gives the reader's outputs on every case."""
    for mistake in spec.mistakes:
        for variant in mistake.variants:
            try:
                if all(
                    _same(spec, case, g, spec.run(variant, case.make()))
                    for case, g in zip(cases, got)
                ):
                    return mistake
            except (
                Exception
            ):  # a variant that cannot run on some input is not this reader's version
                continue
    return None


def _grade(spec: _Spec, fn: Any) -> CheckResult:
    cases, skipped = [], []
    for case in spec.cases():
        missing = [name for name in case.needs if not _takes(fn, name)]
        (skipped if missing else cases).append((case, missing))
    cases = [case for case, _ in cases]
    if not cases:
        lacking = sorted({name for _, missing in skipped for name in missing})
        message = (
            f"Every input of this check needs the parameter(s) {', '.join(lacking)}, which your {_display(fn)} "
            f"does not take; the package's {spec.name} is {spec.summary}."
        )
        return CheckResult(
            name=spec.name,
            passed=False,
            mistake=None,
            message=message,
            section=spec.section,
        )
    skipped_note = ""
    if skipped:
        lacking = sorted({name for _, missing in skipped for name in missing})
        skipped_note = (
            f"Not checked: {len(skipped)} input(s) that need the parameter(s) {', '.join(lacking)}, "
            f"which your {_display(fn)} does not take."
        )
    result = dict(name=spec.name, section=spec.section, cases=len(cases))
    want = [spec.run(spec.reference, case.make()) for case in cases]
    got = []
    for case in cases:
        try:
            got.append(spec.run(fn, case.make()))
        except _ReaderError as problem:
            message = f"{_describe_error(problem, case)} Re-read {spec.section} ({spec.section.link})."
            return CheckResult(passed=False, mistake=None, message=message, **result)
        except _ReaderProblem as problem:
            message = f"{problem} (on the input “{case.label}”). Re-read {spec.section} ({spec.section.link})."
            return CheckResult(passed=False, mistake=None, message=message, **result)
    failing, notes = [], []
    for case, g, w in zip(cases, got, want):
        differences, case_notes = _difference(spec, case, g, w)
        notes += [n for n in case_notes if n not in notes]
        if differences:
            failing.append((case, differences))
    if not failing:
        lines = [
            f"Your {spec.name} agrees with the package's on all {len(cases)} inputs: "
            + "; ".join(case.label for case in cases)
            + "."
        ]
        lines += notes + ([skipped_note] if skipped_note else [])
        return CheckResult(
            passed=True, mistake=None, message="\n".join(lines), **result
        )

    mistake = _recognise(spec, cases, got)
    lines = []
    if mistake is not None:
        lines.append(f"Recognised mistake “{mistake.name}”: {mistake.does}.")
    first_case, first_differences = failing[0]
    lines.append(
        f"{len(failing)} of {len(cases)} inputs give results that differ from the package's. "
        f"On “{first_case.label}”: " + "; ".join(first_differences) + "."
    )
    if len(failing) > 1:
        lines.append(
            "Also on: " + "; ".join(f"“{case.label}”" for case, _ in failing[1:]) + "."
        )
    section = (mistake.section if mistake and mistake.section else None) or spec.section
    lines.append(f"Re-read {section} ({section.link}).")
    errata = mistake.errata if mistake else ()
    if errata:
        rows = " and ".join(_errata_link(row) for row in errata)
        lines.append(
            f"The errata appendix discusses a source that does the same: {rows}."
        )
    lines += notes + ([skipped_note] if skipped_note else [])
    return CheckResult(
        name=spec.name,
        passed=False,
        mistake=mistake.name if mistake else None,
        message="\n".join(lines),
        section=section,
        errata=errata,
        cases=len(cases),
    )


# ---------------------------------------------------------------------------------------------
# Running a class: build it like the package's and give it the package's weights
# ---------------------------------------------------------------------------------------------


def _build(cls: Any, args: tuple, wanted: dict[str, Any]) -> nn.Module:
    """``cls(*args, **wanted)`` with only the keywords ``cls`` takes, in eval mode."""
    kwargs = _keywords(cls, **wanted)
    shown = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
    module = _call(f"Building your {_display(cls)}({shown})", cls, *args, **kwargs)
    if not isinstance(module, nn.Module):
        raise _ReaderProblem(
            f"{_display(cls)}({shown}) gave a {type(module).__name__}, not an nn.Module"
        )
    return module.eval()


def _load_state(module: nn.Module, state: dict[str, Tensor]) -> tuple[str, ...]:
    """Copy the package's ``state`` into the reader's ``module`` by name; returns the names the
    reader's module lacks. Parameters of its own, or of another shape, stop the check."""
    own = module.state_dict()
    extra = [name for name, _ in module.named_parameters() if name not in state]
    if extra:
        theirs = ", ".join(f"{name} {_shape(own[name].shape)}" for name in extra)
        ours = ", ".join(
            f"{name} {_shape(value.shape)}" for name, value in state.items()
        )
        raise _ReaderProblem(
            f"Your module has parameters the package's has not ({theirs}). The check copies the package's "
            f"weights into yours by name, so it needs the package's names: {ours}"
        )
    wrong = [
        name
        for name, value in state.items()
        if name in own and own[name].shape != value.shape
    ]
    if wrong:
        shapes = "; ".join(
            f"{n}: yours {_shape(own[n].shape)}, the package's {_shape(state[n].shape)}"
            for n in wrong
        )
        raise _ReaderProblem(
            f"Your module's parameters have other shapes than the package's ({shapes})"
        )
    module.load_state_dict(
        {name: value for name, value in state.items() if name in own}, strict=False
    )
    return tuple(sorted(name for name in state if name not in own))


def _random_state(module: nn.Module, generator: torch.Generator) -> dict[str, Tensor]:
    """A state for ``module`` with every entry random, so that no two parameters are alike
    (LayerNorm gains near 1, biases near 0)."""
    state = {}
    for name, value in module.state_dict().items():
        if value.dim() >= 2:
            state[name] = torch.randn(value.shape, generator=generator) / math.sqrt(
                value.shape[-1]
            )
        elif "norm" in name and name.endswith("weight"):
            state[name] = 1.0 + 0.3 * torch.randn(value.shape, generator=generator)
        else:
            state[name] = 0.3 * torch.randn(value.shape, generator=generator)
    return state


# ---------------------------------------------------------------------------------------------
# Chapter 1: TokenEmbedding
# ---------------------------------------------------------------------------------------------

_CH1 = Section(1, "01_embedding", "Why multiply by √d_model?")
_CH1_PAD = Section(1, "01_embedding", "The padding id")
_CH1_COPY = Section(1, "01_embedding", "The copy-task batch, embedded")


def _embedding_cases() -> list[_Case]:
    def make(
        offset: int,
        vocab: int,
        d_model: int,
        shape: tuple[int, ...],
        padding_idx=None,
        dtype=torch.float32,
    ):
        def inputs() -> dict[str, Any]:
            g = _generator(offset)
            tokens = torch.randint(0, vocab, shape, generator=g)
            tokens.view(-1)[0] = (
                vocab - 1
            )  # the last id is where a table one row short fails
            table = torch.randn(vocab, d_model, generator=g, dtype=torch.float64).to(
                dtype
            )
            if padding_idx is not None:
                table[padding_idx] = 0.0
                tokens.view(-1)[-1] = padding_idx
            return dict(
                vocab=vocab,
                d_model=d_model,
                tokens=tokens,
                table=table,
                padding_idx=padding_idx,
                dtype=dtype,
                upstream=torch.randn(
                    *shape, d_model, generator=g, dtype=torch.float64
                ).to(dtype),
            )

        return inputs

    return [
        _Case("vocabulary 11, d_model 8, tokens (2, 5)", make(1, 11, 8, (2, 5))),
        _Case("vocabulary 5, d_model 64, tokens (3, 2)", make(2, 5, 64, (3, 2))),
        _Case("batch 1, length 1: the last id", make(3, 11, 8, (1, 1))),
        _Case(
            "float64 table, vocabulary 7, d_model 6",
            make(4, 7, 6, (2, 3), dtype=torch.float64),
        ),
        _Case(
            "padding_idx=0, and the gradient of the table",
            make(5, 11, 8, (2, 6), padding_idx=0),
            needs=("padding_idx",),
        ),
    ]


def _run_embedding(cls: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    vocab, d_model, padding_idx = (
        inputs["vocab"],
        inputs["d_model"],
        inputs["padding_idx"],
    )
    wanted = {} if padding_idx is None else {"padding_idx": padding_idx}
    module = _build(cls, (vocab, d_model), wanted).to(inputs["dtype"])
    named = list(module.named_parameters())
    tables = [p for _, p in named if tuple(p.shape) == (vocab, d_model)]
    if len(tables) != 1:
        matrices = [tuple(p.shape) for _, p in named if p.dim() == 2]
        if len(matrices) == 1:  # one table, of the wrong size: that is the answer
            return {"table shape": matrices[0]}
        found = ", ".join(f"{name} {_shape(p.shape)}" for name, p in named) or "none"
        raise _ReaderProblem(
            f"The check looks for one table of shape (vocab_size, d_model) = {_shape((vocab, d_model))} in your "
            f"module, to copy the package's numbers into it; your module's parameters: {found}"
        )
    table = tables[0]
    with torch.no_grad():
        table.copy_(inputs["table"])
    tokens = inputs["tokens"]
    output = _call(f"Your {_display(cls)}'s forward", module, tokens)
    outputs = {"table shape": (vocab, d_model), "output": output}
    if (
        padding_idx is not None
        and isinstance(output, Tensor)
        and output.shape == inputs["upstream"].shape
    ):
        # The padding row must get no gradient: train a little and it would stop being zero.
        if output.requires_grad:
            (gradient,) = torch.autograd.grad(
                (output * inputs["upstream"]).sum(), table
            )
        else:
            gradient = torch.zeros_like(table)
        outputs["gradient of the table"] = gradient
    return outputs


def _embedding_variant(
    scale: Callable[[int, int], float], padding: bool = True, rows: int = 0
) -> type:
    """A TokenEmbedding that multiplies by ``scale(d_model, vocab_size)``, with ``rows`` rows more
    (or fewer) than the vocabulary, and with or without the padding row."""

    class Variant(nn.Module):
        def __init__(
            self, vocab_size: int, d_model: int, padding_idx: int | None = None
        ) -> None:
            super().__init__()
            self.factor = scale(d_model, vocab_size)
            self.lookup = nn.Embedding(
                vocab_size + rows, d_model, padding_idx=padding_idx if padding else None
            )

        def forward(self, tokens: Tensor) -> Tensor:
            return self.lookup(tokens) * self.factor

    return Variant


_EMBEDDING_MISTAKES = (
    Mistake(
        "missing_scale",
        "the vectors are not multiplied by √d_model; the package, like the paper, returns lookup(tokens) · √d_model",
        (_embedding_variant(lambda d, v: 1.0),),
        errata=(63,),
    ),
    Mistake(
        "scaled_by_d_model",
        "the vectors are multiplied by d_model itself, not by its square root",
        (_embedding_variant(lambda d, v: float(d)),),
    ),
    Mistake(
        "divided_by_sqrt_d_model",
        "the vectors are divided by √d_model, where the package multiplies by it",
        (_embedding_variant(lambda d, v: 1.0 / math.sqrt(d)),),
    ),
    Mistake(
        "scaled_by_sqrt_vocab_size",
        "the vectors are multiplied by √vocab_size; the factor is √d_model, the width of the vectors",
        (_embedding_variant(lambda d, v: math.sqrt(v)),),
    ),
    Mistake(
        "padding_idx_ignored",
        "the padding row receives a gradient: the table is built without padding_idx, so training "
        "would move the padding vector away from zero",
        (_embedding_variant(lambda d, v: math.sqrt(d), padding=False),),
        section=_CH1_PAD,
    ),
    Mistake(
        "table_one_row_short",
        "the table has vocab_size − 1 rows; ids count from 0, so the last id, vocab_size − 1, needs a row "
        "of its own (padding included)",
        (_embedding_variant(lambda d, v: math.sqrt(d), rows=-1),),
        section=_CH1_COPY,
        errata=(33,),
    ),
)


# ---------------------------------------------------------------------------------------------
# Chapter 2: sinusoidal_positional_encoding
# ---------------------------------------------------------------------------------------------

_CH2_FORMULA = Section(2, "02_positional_encoding", "2.2 The formula")
_CH2_WORKED = Section(
    2, "02_positional_encoding", "2.3 Worked examples: a single entry and a whole row"
)
_CH2_PICTURE = Section(
    2,
    "02_positional_encoding",
    "2.4 The picture, and a bug in the tutorial's plotting code",
)
_CH2_LAYOUT = Section(
    2,
    "02_positional_encoding",
    "2.6 Interleaved or concatenated: the same table, columns reordered",
)


def _pe_cases() -> list[_Case]:
    def make(*args: Any, **kwargs: Any) -> Callable[[], tuple]:
        return lambda: (args, kwargs)

    return [
        _Case("max_len 1, d_model 2", make(1, 2)),
        _Case("max_len 6, d_model 4", make(6, 4)),
        _Case("max_len 50, d_model 16", make(50, 16)),
        _Case("max_len 9, d_model 10 (five pairs)", make(9, 10)),
        _Case(
            "interleaved=False, max_len 5, d_model 8",
            make(5, 8, interleaved=False),
            needs=("interleaved",),
        ),
        _Case(
            "dtype=torch.float64, max_len 12, d_model 8",
            make(12, 8, dtype=torch.float64),
            needs=("dtype",),
        ),
    ]


def _run_function(names: tuple[str, ...]) -> Callable[[Any, Any], dict[str, Any]]:
    """A runner for a plain function: call it on the case's ``(args, kwargs)``."""

    def run(fn: Any, inputs: tuple[tuple, dict]) -> dict[str, Any]:
        args, kwargs = inputs
        return _named(_call(f"Your {_display(fn)}", fn, *args, **kwargs), names)

    return run


def _pe_variant(
    *,
    first_position: int = 0,
    cos_first: bool = False,
    concatenate: bool = False,
    index: str = "pair",
    exponent: Callable[[Tensor, int], Tensor] = lambda i, d: 2 * i / d,
    sign: float = -1.0,
    sine_only: bool = False,
) -> Callable[..., Tensor]:
    """A positional encoding with one thing changed: where positions start, which of sine and cosine
    comes first, the layout, what the exponent's ``i`` counts, the exponent, or cosines left out."""

    def encoding(
        max_len: int,
        d_model: int,
        interleaved: bool = True,
        dtype: torch.dtype = torch.float32,
    ) -> Tensor:
        position = torch.arange(
            first_position, first_position + max_len, dtype=torch.float64
        )[:, None]
        column = torch.arange(d_model)
        half = d_model // 2
        concatenated = concatenate or not interleaved
        pair = column % half if concatenated else column // 2
        is_sine = column < half if concatenated else column % 2 == 0
        i = pair if index == "pair" else column
        angle = position * 10000.0 ** (sign * exponent(i.double(), d_model))
        table = torch.where(is_sine != cos_first, angle.sin(), angle.cos())
        return (angle.sin() if sine_only else table).to(dtype)

    return encoding


def _pe_columns_from_one(
    max_len: int,
    d_model: int,
    interleaved: bool = True,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Entry (p, j), j counted from 1: sin(p / 10000^(j/d)) for even j, cos(p / 10000^((j-1)/d)) for odd j."""
    position = torch.arange(max_len, dtype=torch.float64)[:, None]
    j = torch.arange(1, d_model + 1, dtype=torch.float64)
    even = j % 2 == 0
    angle = position / 10000.0 ** (torch.where(even, j, j - 1) / d_model)
    return torch.where(even, angle.sin(), angle.cos()).to(dtype)


_PE_MISTAKES = (
    Mistake(
        "sine_cosine_swapped",
        "the even columns hold cosines and the odd columns sines; the paper puts the sine in column 2i",
        (_pe_variant(cos_first=True),),
    ),
    Mistake(
        "positions_from_one",
        "positions are counted from 1, so each row holds what the package's table has one row further down. "
        "The package counts from 0, as tensor2tensor and the Annotated Transformer do (its row 0 is sin 0 = 0, "
        "cos 0 = 1); either convention works on its own, but mixing the two shifts every position by one",
        (_pe_variant(first_position=1),),
        section=_CH2_WORKED,
        errata=(1, 22),
    ),
    Mistake(
        "halves_concatenated",
        "all sines come first and all cosines after them (tensor2tensor's column order): the same numbers, "
        "but the package and the paper interleave them, sine in column 2i and cosine in column 2i + 1",
        (_pe_variant(concatenate=True),),
        section=_CH2_LAYOUT,
    ),
    Mistake(
        "exponent_uses_column",
        "the i of 10000^(2i/d_model) is taken to be the column; it numbers the sine/cosine pair, so "
        "columns 2i and 2i + 1 share one frequency",
        (_pe_variant(index="column"),),
        section=_CH2_WORKED,
        errata=(23,),
    ),
    Mistake(
        "columns_counted_from_one",
        "the entry formula is read with columns counted from 1: column 0 is a cosine, and each sine is paired "
        "with the cosine of the next frequency; the paper's columns 2i and 2i + 1 count from 0",
        (_pe_columns_from_one,),
        section=_CH2_FORMULA,
        errata=(64,),
    ),
    Mistake(
        "exponent_without_two",
        "the exponent is i/d_model instead of 2i/d_model, so the wavelengths grow only to about "
        "10000^(1/2) instead of reaching 10000 · 2π",
        (_pe_variant(exponent=lambda i, d: i / d),),
        section=_CH2_FORMULA,
    ),
    Mistake(
        "frequency_inverted",
        "positions are multiplied by 10000^(2i/d_model) instead of divided by it, so the later pairs "
        "turn faster instead of slower",
        (_pe_variant(sign=1.0),),
        section=_CH2_FORMULA,
    ),
    Mistake(
        "sine_only",
        "every column holds a sine, so each odd column repeats the even column before it and row 0 is all zeros",
        (_pe_variant(sine_only=True),),
        section=_CH2_PICTURE,
        errata=(24,),
    ),
)


# ---------------------------------------------------------------------------------------------
# Chapter 3: scaled_dot_product_attention
# ---------------------------------------------------------------------------------------------

_CH3_MATRIX = Section(3, "03_attention", "3.3 Every query at once: the matrix form")
_CH3_WHY = Section(3, "03_attention", "3.4 Why divide by √d_k?")
_CH3_SOFTMAX = Section(3, "03_attention", "Step 4: softmax")
_CH5_ENTERS = Section(5, "05_masking", "How a mask enters attention")
_CH5_EMPTY = Section(5, "05_masking", "`-inf` or `-1e9`? The row with nothing to read")
_CH5_CONVENTIONS = Section(
    5, "05_masking", "Two conventions: ours and `nn.MultiheadAttention`'s"
)


def _attention_cases() -> list[_Case]:
    def make(
        offset: int,
        q: tuple,
        k: tuple,
        d_v: int,
        mask: Callable | None = None,
        dtype=torch.float32,
    ):
        def inputs() -> tuple[tuple, dict]:
            g = _generator(100 + offset)
            query = 2.0 * torch.randn(q, generator=g, dtype=torch.float64)
            key = 2.0 * torch.randn(k, generator=g, dtype=torch.float64)
            value = torch.randn((*k[:-1], d_v), generator=g, dtype=torch.float64)
            args = tuple(t.to(dtype) for t in (query, key, value))
            return (*args, mask()) if mask else args, {}

        return inputs

    def padding() -> Tensor:
        return torch.tensor(
            [[[True, True, True, False, False]], [[True, True, True, True, False]]]
        )

    def causal() -> Tensor:
        return torch.ones(4, 4, dtype=torch.bool).tril()[None]

    def one_empty_row() -> Tensor:
        mask = torch.tensor(
            [
                [
                    [True, False, True, True],
                    [True, True, False, True],
                    [False, True, True, False],
                ]
            ]
            * 2
        )
        mask[1, 1] = False  # query 1 of batch 1 may look at nothing
        return mask

    def float64_mask() -> Tensor:
        return torch.tensor(
            [
                [[True, True, False, True, True, False]],
                [[True, True, True, True, True, False]],
            ]
        )

    return [
        _Case(
            "batch 2, 3 queries, 5 keys, d_k 4, d_v 6, no mask",
            make(1, (2, 3, 4), (2, 5, 4), 6),
        ),
        _Case(
            "a padding mask of shape (2, 1, 5)",
            make(2, (2, 3, 4), (2, 5, 4), 6, padding),
        ),
        _Case(
            "2 heads, (1, 2, 4, 8), a causal mask (1, 4, 4)",
            make(3, (1, 2, 4, 8), (1, 2, 4, 8), 8, causal),
        ),
        _Case("batch 1, one query, one key", make(4, (1, 1, 8), (1, 1, 8), 3)),
        _Case(
            "query 1 of batch 1 has every key masked",
            make(5, (2, 3, 4), (2, 4, 4), 5, one_empty_row),
        ),
        _Case(
            "float64, d_k 16, a padding mask",
            make(6, (2, 3, 16), (2, 6, 16), 16, float64_mask, torch.float64),
        ),
    ]


def _attention_variant(
    *,
    scale: Callable[[Tensor, Tensor, Tensor], float] = lambda q, k, v: math.sqrt(
        q.shape[-1]
    ),
    axis: int = -1,
    fill: float = float("-inf"),
    invert: bool = False,
    empty_rows_zero: bool = True,
) -> Callable[..., tuple[Tensor, Tensor]]:
    """Attention with one thing changed: the scale, the softmax's axis, the mask's fill value or
    convention, or a query with no key left to read not given zero weights."""

    def attention(
        query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        scores = query @ key.transpose(-2, -1) / scale(query, key, value)
        hidden = None
        if mask is not None:
            hidden = mask if invert else ~mask
            scores = scores.masked_fill(hidden, fill)
        weights = scores.softmax(dim=axis)
        if hidden is not None and empty_rows_zero:
            weights = weights.masked_fill(hidden.all(dim=-1, keepdim=True), 0.0)
        return weights @ value, weights

    return attention


def _both_empty_row_handlings(**changes: Any) -> tuple[Callable, ...]:
    return (
        _attention_variant(**changes),
        _attention_variant(empty_rows_zero=False, **changes),
    )


_ATTENTION_MISTAKES = (
    Mistake(
        "no_scale",
        "the scores Q Kᵀ are not divided by √d_k, so with wide vectors the softmax saturates",
        _both_empty_row_handlings(scale=lambda q, k, v: 1.0),
        section=_CH3_WHY,
    ),
    Mistake(
        "divided_by_d_k",
        "the scores are divided by d_k instead of by its square root √d_k",
        _both_empty_row_handlings(scale=lambda q, k, v: float(q.shape[-1])),
        section=_CH3_WHY,
    ),
    Mistake(
        "scale_uses_d_v",
        "the scores are divided by the square root of the values' width d_v; the scale is √d_k, the width "
        "of the queries and keys (query.shape[-1])",
        _both_empty_row_handlings(scale=lambda q, k, v: math.sqrt(v.shape[-1])),
        section=_CH3_WHY,
    ),
    Mistake(
        "scale_uses_length",
        "the scores are divided by the square root of the number of keys (shape[-2]); the scale is √d_k, "
        "the width of the queries and keys (shape[-1])",
        _both_empty_row_handlings(scale=lambda q, k, v: math.sqrt(k.shape[-2])),
        section=_CH3_WHY,
    ),
    Mistake(
        "softmax_over_queries",
        "the softmax runs over the queries (dim=-2), so each key's column sums to 1 instead of each query's row",
        _both_empty_row_handlings(axis=-2),
        section=_CH3_SOFTMAX,
    ),
    Mistake(
        "mask_inverted",
        "the mask is read as True = hidden (nn.MultiheadAttention's convention); in the package True means "
        "may attend, so the keys the mask allows are the ones hidden",
        _both_empty_row_handlings(invert=True),
        section=_CH5_CONVENTIONS,
    ),
    Mistake(
        "masked_scores_zero",
        "hidden scores are set to 0 before the softmax, and e⁰ = 1 still gives them weight; a hidden key "
        "needs the score −∞ to get the weight 0",
        _both_empty_row_handlings(fill=0.0),
        section=_CH5_ENTERS,
        errata=(10,),
    ),
    Mistake(
        "empty_row_nan",
        "a query whose every key is masked gets NaN (a softmax over nothing but −∞ is 0/0); the package "
        "gives such a query zero weights and a zero output, as PyTorch's fused kernel does",
        (_attention_variant(empty_rows_zero=False),),
        section=_CH5_EMPTY,
    ),
    Mistake(
        "empty_row_average",
        "hidden scores are filled with a large negative number such as −1e9 and nothing more, so a query whose "
        "every key is masked gets the plain average of all the values instead of zero weights",
        (_attention_variant(fill=-1e9, empty_rows_zero=False),),
        section=_CH5_EMPTY,
        errata=(43,),
    ),
)


# ---------------------------------------------------------------------------------------------
# Chapter 4: MultiHeadAttention, split_heads, merge_heads
# ---------------------------------------------------------------------------------------------

_CH4_SPLIT = Section(4, "04_multi_head_attention", "The split, one shape at a time")
_CH4_VIEW = Section(4, "04_multi_head_attention", "Why `view` needs the `transpose`")
_CH4_CONCAT = Section(4, "04_multi_head_attention", "Concatenation, then $W^O$")
_HEADS_COUNT = Section(
    "A",
    "appendix/a_errata",
    "The split is into $h$ heads, not into $N$ parts",
    "errata-heads-count",
)


def _mha_cases() -> list[_Case]:
    def make(
        offset: int,
        d_model: int,
        heads: int,
        q_shape: tuple,
        k_len: int | None,
        mask=None,
        dtype=torch.float32,
    ):
        def inputs() -> dict[str, Any]:
            g = _generator(200 + offset)
            state = _random_state(MultiHeadAttention(d_model, heads), g)
            query = torch.randn(*q_shape, d_model, generator=g, dtype=torch.float64).to(
                dtype
            )
            if k_len is None:  # self-attention: one tensor for query, key and value
                key = value = query
            else:
                key = torch.randn(
                    q_shape[0], k_len, d_model, generator=g, dtype=torch.float64
                ).to(dtype)
                value = torch.randn(
                    q_shape[0], k_len, d_model, generator=g, dtype=torch.float64
                ).to(dtype)
            return dict(
                d_model=d_model,
                heads=heads,
                state=state,
                query=query,
                key=key,
                value=value,
                mask=mask() if mask else None,
                dtype=dtype,
            )

        return inputs

    def padding() -> Tensor:
        return torch.tensor(
            [[[True, True, True, False, False]], [[True, True, True, True, True]]]
        )

    def causal() -> Tensor:
        return torch.ones(4, 4, dtype=torch.bool).tril()[None]

    return [
        _Case(
            "self-attention, d_model 12, 3 heads, x (2, 4, 12)",
            make(1, 12, 3, (2, 4), None),
        ),
        _Case(
            "cross-attention, 4 heads, 3 queries, 5 keys, a padding mask",
            make(2, 12, 4, (2, 3), 5, padding),
        ),
        _Case(
            "self-attention, 2 heads, a causal mask (1, 4, 4)",
            make(3, 12, 2, (1, 4), None, causal),
        ),
        _Case("batch 1, length 1, 6 heads", make(4, 12, 6, (1, 1), None)),
        _Case(
            "float64, 4 heads, 3 queries, 5 keys, a padding mask",
            make(5, 12, 4, (2, 3), 5, padding, torch.float64),
        ),
    ]


def _run_mha(cls: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    module = _build(cls, (inputs["d_model"], inputs["heads"]), {}).to(inputs["dtype"])
    missing = _load_state(
        module, {k: v.to(inputs["dtype"]) for k, v in inputs["state"].items()}
    )
    args = (inputs["query"], inputs["key"], inputs["value"])
    args += (inputs["mask"],) if inputs["mask"] is not None else ()
    outputs = _named(
        _call(f"Your {_display(cls)}'s forward", module, *args), ("output", "weights")
    )
    return {"missing parameters": missing, **outputs}


def _mha_variant(
    split: str = "transpose",
    merge: str = "transpose",
    heads: int | None = None,
    scale: str = "d_head",
    project_values: bool = True,
    out_proj: bool = True,
) -> type:
    """Multi-head attention with one thing changed: how heads are split or merged, how many there
    are, the scale, or a projection left out."""

    class Variant(nn.Module):
        def __init__(
            self, d_model: int, num_heads: int, dropout: float = 0.0, bias: bool = True
        ) -> None:
            super().__init__()
            self.d_model, self.num_heads = d_model, heads or num_heads
            self.d_head = d_model // self.num_heads
            self.q_proj = nn.Linear(d_model, d_model)
            self.k_proj = nn.Linear(d_model, d_model)
            if project_values:
                self.v_proj = nn.Linear(d_model, d_model)
            if out_proj:
                self.out_proj = nn.Linear(d_model, d_model)

        def split(self, x: Tensor) -> Tensor:
            b, n, h, w = x.shape[0], x.shape[1], self.num_heads, self.d_head
            if (
                split == "view"
            ):  # (B, heads, len, d_head) read straight from (B, len, d_model)
                return x.reshape(b, h, n, w)
            if split == "swapped":  # d_head "heads" of num_heads features each
                return x.reshape(b, n, w, h).transpose(1, 2)
            return x.reshape(b, n, h, w).transpose(1, 2)

        def merge(self, x: Tensor) -> Tensor:
            b, n = x.shape[0], x.shape[2]
            if merge == "view":
                return x.reshape(b, n, self.d_model)
            return x.transpose(1, 2).reshape(b, n, self.d_model)

        def forward(
            self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None
        ) -> Tensor:
            q, k = self.split(self.q_proj(query)), self.split(self.k_proj(key))
            v = self.split(self.v_proj(value) if project_values else value)
            if mask is not None:
                mask = mask.unsqueeze(1)
            width = {
                "d_head": self.d_head,
                "d_model": self.d_model,
                "actual": q.shape[-1],
            }[scale]
            scores = q @ k.transpose(-2, -1) / math.sqrt(width)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            weights = scores.softmax(-1)
            if mask is not None:
                weights = weights.masked_fill(~mask.any(-1, keepdim=True), 0.0)
            merged = self.merge(weights @ v)
            return self.out_proj(merged) if out_proj else merged

    return Variant


_MHA_MISTAKES = (
    Mistake(
        "merge_without_transpose",
        "the heads are merged by reshaping (B, heads, len, d_head) straight to (B, len, d_model); without "
        "transposing heads and positions back first, each output row mixes pieces of several positions",
        (_mha_variant(merge="view"),),
        section=_CH4_VIEW,
    ),
    Mistake(
        "split_without_transpose",
        "the heads are split by viewing (B, len, d_model) straight as (B, heads, len, d_head); that reads "
        "consecutive numbers as one position, so each head sees pieces of several positions",
        (_mha_variant(split="view"), _mha_variant(split="view", merge="view")),
        section=_CH4_VIEW,
    ),
    Mistake(
        "heads_and_width_swapped",
        "the split uses (…, d_head, num_heads) where it needs (…, num_heads, d_head), which makes d_head "
        "heads of num_heads features each",
        (_mha_variant(split="swapped"), _mha_variant(split="swapped", scale="actual")),
        section=_CH4_SPLIT,
    ),
    Mistake(
        "split_by_layers",
        "the vectors are split into 6 parts, the number of layers, instead of into num_heads heads",
        (_mha_variant(heads=6),),
        section=_HEADS_COUNT,
        errata=(27,),
    ),
    Mistake(
        "missing_out_proj",
        "the block ends with the concatenation of the heads; the package then applies W^O (out_proj), "
        "which mixes the heads' columns",
        (_mha_variant(out_proj=False),),
        section=_CH4_CONCAT,
        errata=(31,),
    ),
    Mistake(
        "values_not_projected",
        "the values are the inputs themselves; each head weights v_proj(value), the values projected by W^V",
        (_mha_variant(project_values=False),),
        section=_CH3_MATRIX,
        errata=(26,),
    ),
    Mistake(
        "scaled_by_d_model",
        "the scores are divided by √d_model; each head divides by √d_head, the width of its own queries and keys",
        (_mha_variant(scale="d_model"),),
        section=_CH3_WHY,
    ),
)


def _split_reference(x: Tensor, num_heads: int) -> Tensor:
    return MultiHeadAttention(x.shape[-1], num_heads).split_heads(x)


def _merge_reference(x: Tensor, num_heads: int | None = None) -> Tensor:
    return MultiHeadAttention(x.shape[1] * x.shape[-1], x.shape[1]).merge_heads(x)


def _heads_cases(merge: bool) -> list[_Case]:
    def make(
        offset: int, batch: int, length: int, heads: int, d_model: int
    ) -> Callable[[], tuple]:
        def inputs() -> tuple[tuple, dict]:
            g = _generator(300 + offset)
            if merge:
                return (
                    torch.randn(batch, heads, length, d_model // heads, generator=g),
                    heads,
                ), {}
            return (torch.randn(batch, length, d_model, generator=g), heads), {}

        return inputs

    what = "heads (B, heads, len, d_head)" if merge else "x (B, len, d_model)"
    return [
        _Case(f"{what}, batch 2, length 4, 3 heads, d_model 12", make(1, 2, 4, 3, 12)),
        _Case(f"{what}, batch 2, length 5, 4 heads, d_model 12", make(2, 2, 5, 4, 12)),
        _Case(f"{what}, batch 1, length 1, 2 heads, d_model 12", make(3, 1, 1, 2, 12)),
    ]


def _run_heads(names: tuple[str, ...]) -> Callable[[Any, Any], dict[str, Any]]:
    """Call ``fn(x, num_heads)``, or ``fn(x)`` for a merge that takes only the tensor."""

    def run(fn: Any, inputs: tuple[tuple, dict]) -> dict[str, Any]:
        (x, heads), _ = inputs
        try:
            inspect.signature(fn).bind(x, heads)
            args = (x, heads)
        except TypeError:
            args = (x,)
        except ValueError:
            args = (x, heads)
        return _named(_call(f"Your {_display(fn)}", fn, *args), names)

    return run


def _split(layout: str, fixed_heads: int | None = None) -> Callable[..., Tensor]:
    def split_heads(x: Tensor, num_heads: int) -> Tensor:
        b, n, d = x.shape
        h = fixed_heads or num_heads
        if layout == "view":
            return x.reshape(b, h, n, d // h)
        if layout == "swapped":
            return x.reshape(b, n, d // h, h).transpose(1, 2)
        if layout == "strided":  # head i takes columns i, i + h, i + 2h, ...
            return x.reshape(b, n, d // h, h).permute(0, 3, 1, 2)
        if layout == "keys_transposed":
            return x.reshape(b, n, h, d // h).permute(0, 2, 3, 1)
        return x.reshape(b, n, h, d // h).transpose(1, 2)

    return split_heads


def _merge(layout: str) -> Callable[..., Tensor]:
    def merge_heads(x: Tensor, num_heads: int | None = None) -> Tensor:
        b, h, n, w = x.shape
        if layout == "view":
            return x.reshape(b, n, h * w)
        if layout == "strided":
            return x.permute(0, 2, 3, 1).reshape(b, n, h * w)
        if layout == "sum":
            return x.sum(dim=1)
        if layout == "mean":
            return x.mean(dim=1)
        if (
            layout == "sequence"
        ):  # heads concatenated one after another along the positions
            return x.reshape(b, h * n, w)
        return x.transpose(1, 2).reshape(b, n, h * w)

    return merge_heads


_SPLIT_MISTAKES = (
    Mistake(
        "split_without_transpose",
        "x is viewed straight as (B, heads, len, d_head); that reads consecutive numbers as one position, so "
        "each head's rows are pieces of several positions. The heads axis has to come from the features",
        (_split("view"),),
        section=_CH4_VIEW,
    ),
    Mistake(
        "heads_and_width_swapped",
        "the features are viewed as (…, d_head, num_heads), which makes d_head heads of num_heads features each",
        (_split("swapped"),),
        section=_CH4_SPLIT,
    ),
    Mistake(
        "strided_heads",
        "head i takes the columns i, i + h, i + 2h, …; each head is one contiguous block of d_head columns "
        "(the columns of its own W_i^Q)",
        (_split("strided"),),
        section=_CH4_SPLIT,
    ),
    Mistake(
        "keys_transposed",
        "the result is (B, heads, d_head, len), positions last; split_heads gives (B, heads, len, d_head), "
        "and attention transposes the keys itself",
        (_split("keys_transposed"),),
        section=_CH4_SPLIT,
    ),
    Mistake(
        "split_by_layers",
        "the vectors are split into 6 parts, the number of layers, instead of into num_heads heads",
        (_split("transpose", fixed_heads=6),),
        section=_HEADS_COUNT,
        errata=(27,),
    ),
)

_MERGE_MISTAKES = (
    Mistake(
        "merge_without_transpose",
        "(B, heads, len, d_head) is reshaped straight to (B, len, d_model); without first moving the heads "
        "axis next to d_head, each output row mixes pieces of several positions",
        (_merge("view"),),
        section=_CH4_VIEW,
    ),
    Mistake(
        "strided_merge",
        "the heads' columns are interleaved (head 0's first feature, head 1's first feature, …); the "
        "concatenation puts each head's d_head columns side by side as one block",
        (_merge("strided"),),
        section=_CH4_SPLIT,
    ),
    Mistake(
        "heads_summed",
        "the heads are added up, giving d_head features per position; they are concatenated, giving "
        "heads × d_head = d_model",
        (_merge("sum"),),
        section=_CH4_CONCAT,
    ),
    Mistake(
        "heads_averaged",
        "the heads are averaged, giving d_head features per position; they are concatenated, giving "
        "heads × d_head = d_model",
        (_merge("mean"),),
        section=_CH4_CONCAT,
    ),
    Mistake(
        "concatenated_along_positions",
        "the heads are concatenated along the positions, (B, heads · len, d_head); the concatenation is "
        "along the features, (B, len, heads · d_head)",
        (_merge("sequence"),),
        section=_CH4_CONCAT,
    ),
)


# ---------------------------------------------------------------------------------------------
# Chapter 5: padding_mask, causal_mask
# ---------------------------------------------------------------------------------------------

_CH5_PADDING = Section(5, "05_masking", "The padding mask")
_CH5_CAUSAL = Section(5, "05_masking", "The causal (subsequent) mask")


def _padding_cases() -> list[_Case]:
    def make(rows: list[list[int]], **kwargs: Any) -> Callable[[], tuple]:
        return lambda: ((torch.tensor(rows),), kwargs)

    return [
        _Case(
            "tokens (3, 5) with padding at the ends",
            make([[5, 3, 7, 0, 0], [4, 0, 0, 0, 0], [2, 6, 1, 8, 9]]),
        ),
        _Case("a row that is all padding", make([[3, 2, 0, 0], [0, 0, 0, 0]])),
        _Case("batch 1, length 1", make([[7]])),
        _Case(
            "pad_id=1, where 0 is a real token",
            make([[0, 4, 1, 1], [5, 0, 2, 1]], pad_id=1),
            needs=("pad_id",),
        ),
    ]


def _padding_variant(
    *,
    invert: bool = False,
    layout: str = "keys",
    dtype: torch.dtype = torch.bool,
    fixed_pad: int | None = None,
) -> Callable[..., Tensor]:
    def mask(tokens: Tensor, pad_id: int = 0) -> Tensor:
        real = tokens == (pad_id if fixed_pad is None else fixed_pad)
        real = real if invert else ~real
        shaped = {
            "keys": real[:, None, :],
            "none": real,
            "queries": real[:, :, None],
            "heads": real[:, None, None, :],
        }[layout]
        return shaped.to(dtype)

    return mask


_PADDING_MISTAKES = (
    Mistake(
        "inverted",
        "the mask is True at the padding (nn.MultiheadAttention's key_padding_mask convention); the package's "
        "masks are True where a token may be attended to, so True marks the real tokens",
        (_padding_variant(invert=True),),
        section=_CH5_CONVENTIONS,
    ),
    Mistake(
        "missing_query_axis",
        "the mask has shape (batch, seq); the package's is (batch, 1, seq), whose axis of size 1 broadcasts "
        "over the queries (a (batch, seq) mask would broadcast its batch axis against the queries)",
        (_padding_variant(layout="none"),),
        section=_CH5_PADDING,
    ),
    Mistake(
        "hides_queries",
        "the mask has shape (batch, seq, 1): it hides the padding's queries (rows) instead of its keys "
        "(columns), so real tokens still read the padding",
        (_padding_variant(layout="queries"),),
        section=_CH5_PADDING,
    ),
    Mistake(
        "head_axis_added",
        "the mask has shape (batch, 1, 1, seq); the package's masks are (batch, 1, seq), and multi-head "
        "attention inserts the heads axis itself",
        (_padding_variant(layout="heads"),),
        section=_CH5_PADDING,
    ),
    Mistake(
        "not_boolean",
        "the mask holds numbers; the package's masks are boolean (True = may attend)",
        tuple(
            _padding_variant(dtype=dtype)
            for dtype in (torch.float32, torch.int64, torch.int32, torch.uint8)
        ),
        section=_CH5_PADDING,
    ),
    Mistake(
        "pad_id_ignored",
        "the padding id is taken to be 0 whatever pad_id is given",
        (_padding_variant(fixed_pad=0),),
        section=_CH5_PADDING,
    ),
)


def _causal_cases() -> list[_Case]:
    return [
        _Case("size 1", lambda: ((1,), {})),
        _Case("size 2", lambda: ((2,), {})),
        _Case("size 5", lambda: ((5,), {})),
    ]


def _causal_variant(
    diagonal: int = 0, upper: bool = False, form: str = "bool"
) -> Callable[..., Tensor]:
    def mask(size: int, device: Any = None) -> Tensor:
        ones = torch.ones(size, size, dtype=torch.bool)
        allowed = ones.triu(diagonal) if upper else ones.tril(diagonal)
        if form == "additive":  # 0 where allowed, −∞ where hidden, as nn.Transformer's
            return torch.zeros(size, size).masked_fill(~allowed, float("-inf"))[None]
        return allowed[None].to(
            {"bool": torch.bool, "float": torch.float32, "long": torch.int64}[form]
        )

    return mask


_CAUSAL_MISTAKES = (
    Mistake(
        "transposed",
        "the mask is True on and above the diagonal, so each query sees the future and not the past",
        (_causal_variant(upper=True),),
        section=_CH5_CAUSAL,
    ),
    Mistake(
        "diagonal_hidden",
        "the diagonal is hidden: each position may also attend to itself, and position 0 would have "
        "nothing to read at all",
        (_causal_variant(diagonal=-1),),
        section=_CH5_CAUSAL,
        errata=(17,),
    ),
    Mistake(
        "blocked_convention",
        "the mask is True where attention is blocked (above the diagonal), the convention of nn.Transformer's "
        "boolean masks; the package's masks are True where a query may attend",
        (_causal_variant(diagonal=1, upper=True),),
        section=_CH5_CONVENTIONS,
    ),
    Mistake(
        "additive_float_mask",
        "the mask is a float tensor of 0 and −∞ to be added to the scores (what "
        "nn.Transformer.generate_square_subsequent_mask returns); the package's masks are boolean, True = may attend",
        (_causal_variant(form="additive"),),
        section=_CH5_CONVENTIONS,
    ),
    Mistake(
        "one_future_token_visible",
        "each position may also see the next one (tril with diagonal=1)",
        (_causal_variant(diagonal=1),),
        section=_CH5_CAUSAL,
    ),
    Mistake(
        "not_boolean",
        "the mask holds 1 and 0 as numbers; the package's masks are boolean (True = may attend)",
        (_causal_variant(form="float"), _causal_variant(form="long")),
        section=_CH5_CAUSAL,
    ),
)


# ---------------------------------------------------------------------------------------------
# Chapter 6: sublayer_connection, EncoderLayer
# ---------------------------------------------------------------------------------------------

_CH6_SUBLAYER = Section(6, "06_encoder", "The sublayer connection, two ways")
_CH6_LAYER = Section(6, "06_encoder", "One encoder layer, step by step, with shapes")


class _FixedDropout:
    """Dropout with a mask fixed by the shape of its input: where a reader applies dropout changes
    the result, and the same call always gives the same numbers."""

    def __call__(self, x: Tensor) -> Tensor:
        g = _generator(400 + x.numel())
        keep = torch.rand(x.shape, generator=g) > 0.4
        return x * keep.to(x.dtype) / 0.6


def _sublayer_cases() -> list[_Case]:
    def make(
        offset: int, shape: tuple[int, ...], norm_first: bool, dtype=torch.float32
    ) -> Callable[[], tuple]:
        def inputs() -> tuple[tuple, dict]:
            g = _generator(500 + offset)
            d = shape[-1]
            linear, norm = nn.Linear(d, d), nn.LayerNorm(d)
            with torch.no_grad():
                for p in [*linear.parameters(), *norm.parameters()]:
                    p.copy_(
                        torch.randn(p.shape, generator=g) * 0.5
                        + (1.0 if p is norm.weight else 0.0)
                    )
            linear, norm = linear.to(dtype), norm.to(dtype)
            x = (3.0 * torch.randn(shape, generator=g, dtype=torch.float64) + 1.0).to(
                dtype
            )
            return (x, linear, norm, _FixedDropout(), norm_first), {}

        return inputs

    return [
        _Case("post-norm (norm_first=False), x (2, 3, 8)", make(1, (2, 3, 8), False)),
        _Case("pre-norm (norm_first=True), x (2, 3, 8)", make(2, (2, 3, 8), True)),
        _Case("post-norm, batch 1, length 1", make(3, (1, 1, 8), False)),
        _Case("pre-norm, batch 1, length 1", make(4, (1, 1, 8), True)),
        _Case(
            "post-norm, float64, x (2, 4, 6)", make(5, (2, 4, 6), False, torch.float64)
        ),
        _Case(
            "pre-norm, float64, x (2, 4, 6)", make(6, (2, 4, 6), True, torch.float64)
        ),
    ]


def _sublayer_variant(
    post: Callable | None = None, pre: Callable | None = None, flip: bool = False
) -> Callable:
    """A sublayer connection with its post-norm and/or pre-norm branch replaced."""

    def connection(
        x: Tensor,
        sublayer: Callable,
        norm: Callable,
        dropout: Callable,
        norm_first: bool,
    ) -> Tensor:
        norm_first = norm_first != flip
        if norm_first:
            return (
                pre(x, sublayer, norm, dropout)
                if pre
                else x + dropout(sublayer(norm(x)))
            )
        return (
            post(x, sublayer, norm, dropout) if post else norm(x + dropout(sublayer(x)))
        )

    return connection


def _post(x: Tensor, f: Callable, norm: Callable, dropout: Callable) -> Tensor:
    return norm(x + dropout(f(x)))


def _pre(x: Tensor, f: Callable, norm: Callable, dropout: Callable) -> Tensor:
    return x + dropout(f(norm(x)))


_SUBLAYER_MISTAKES = (
    Mistake(
        "pre_post_swapped",
        "norm_first=False gives x + dropout(sublayer(norm(x))) and norm_first=True gives "
        "norm(x + dropout(sublayer(x))); post-norm (the paper's, norm_first=False) normalises after the sum",
        (_sublayer_variant(flip=True),),
    ),
    Mistake(
        "norm_first_ignored",
        "the result is the same for norm_first=True and False: one of the two orders is used for both",
        (_sublayer_variant(pre=_post), _sublayer_variant(post=_pre)),
    ),
    Mistake(
        "missing_residual",
        "the input x is not added back: the connection returns the (normalised) sublayer output alone",
        (
            _sublayer_variant(
                post=lambda x, f, n, d: n(d(f(x))), pre=lambda x, f, n, d: d(f(n(x)))
            ),
            _sublayer_variant(post=lambda x, f, n, d: n(d(f(x)))),
            _sublayer_variant(pre=lambda x, f, n, d: d(f(n(x)))),
        ),
    ),
    Mistake(
        "dropout_after_residual",
        "dropout is applied to the residual sum; it belongs on the sublayer's output, before x is added",
        (
            _sublayer_variant(
                post=lambda x, f, n, d: n(d(x + f(x))),
                pre=lambda x, f, n, d: d(x + f(n(x))),
            ),
            _sublayer_variant(post=lambda x, f, n, d: n(d(x + f(x)))),
            _sublayer_variant(pre=lambda x, f, n, d: d(x + f(n(x)))),
        ),
    ),
    Mistake(
        "residual_added_after_norm",
        "post-norm computes x + norm(dropout(sublayer(x))); the paper's post-norm normalises the sum, "
        "norm(x + dropout(sublayer(x)))",
        (_sublayer_variant(post=lambda x, f, n, d: x + n(d(f(x)))),),
    ),
    Mistake(
        "normalised_residual",
        "pre-norm computes norm(x) + dropout(sublayer(norm(x))): the normalised input replaces x on the "
        "residual path, which pre-norm leaves untouched",
        (_sublayer_variant(pre=lambda x, f, n, d: n(x) + d(f(n(x)))),),
        errata=(40,),
    ),
    Mistake(
        "dropout_missing",
        "dropout is never applied; the connection applies it to the sublayer's output",
        (
            _sublayer_variant(
                post=lambda x, f, n, d: n(x + f(x)), pre=lambda x, f, n, d: x + f(n(x))
            ),
        ),
    ),
)


def _encoder_cases() -> list[_Case]:
    def make(
        offset: int,
        shape: tuple[int, int],
        norm_first: bool,
        mask=None,
        dtype=torch.float32,
    ):
        def inputs() -> dict[str, Any]:
            g = _generator(600 + offset)
            state = _random_state(EncoderLayer(8, 2, 16, 0.0, norm_first), g)
            x = (
                2.0 * torch.randn(*shape, 8, generator=g, dtype=torch.float64) + 0.5
            ).to(dtype)
            return dict(
                state=state,
                x=x,
                mask=mask() if mask else None,
                norm_first=norm_first,
                dtype=dtype,
            )

        return inputs

    def padding() -> Tensor:
        return torch.tensor([[[True, True, True, False]], [[True, True, True, True]]])

    pre = ("norm_first",)
    return [
        _Case(
            "post-norm, d_model 8, 2 heads, d_ff 16, x (2, 4, 8)",
            make(1, (2, 4), False),
        ),
        _Case("post-norm, a padding mask (2, 1, 4)", make(2, (2, 4), False, padding)),
        _Case("post-norm, batch 1, length 1", make(3, (1, 1), False)),
        _Case("post-norm, float64", make(4, (2, 3), False, None, torch.float64)),
        _Case(
            "pre-norm (norm_first=True), a padding mask (2, 1, 4)",
            make(5, (2, 4), True, padding),
            needs=pre,
        ),
        _Case(
            "pre-norm, float64", make(6, (2, 3), True, None, torch.float64), needs=pre
        ),
    ]


def _run_encoder(cls: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    wanted = {"dropout": 0.0} | ({"norm_first": True} if inputs["norm_first"] else {})
    module = _build(cls, (8, 2, 16), wanted).to(inputs["dtype"])
    missing = _load_state(
        module, {k: v.to(inputs["dtype"]) for k, v in inputs["state"].items()}
    )
    args = (inputs["x"],) + ((inputs["mask"],) if inputs["mask"] is not None else ())
    output = _call(f"Your {_display(cls)}'s forward", module, *args)
    return {"missing parameters": missing, **_named(output, ("output",))}


def _encoder_variant(
    flip: bool = False,
    residual: str = "yes",
    swap_norms: bool = False,
    use_mask: bool = True,
    ffn_first: str = "",
) -> type:
    """An encoder layer (eval mode, so without dropout) with one thing changed."""

    class Variant(EncoderLayer):
        def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
            pre = self.norm_first != flip
            norm1, norm2 = (
                (self.norm2, self.norm1) if swap_norms else (self.norm1, self.norm2)
            )

            def attend(h: Tensor) -> Tensor:
                return self.self_attn(h, h, h, mask if use_mask else None)[0]

            steps = [(attend, norm1), (self.feed_forward, norm2)]
            if ffn_first == "with_norms":
                steps = steps[::-1]
            elif ffn_first == "in_place":
                steps = [(self.feed_forward, norm1), (attend, norm2)]
            for f, norm in steps:
                if residual == "no":
                    x = f(norm(x)) if pre else norm(f(x))
                elif residual == "normalised" and pre:
                    x = norm(x) + f(norm(x))
                else:
                    x = x + f(norm(x)) if pre else norm(x + f(x))
            return x

    return Variant


_ENCODER_MISTAKES = (
    Mistake(
        "pre_post_swapped",
        "norm_first=False normalises the sublayer's input and norm_first=True the sum; post-norm (the "
        "paper's, norm_first=False) is norm(x + sublayer(x))",
        (_encoder_variant(flip=True),),
        section=_CH6_SUBLAYER,
    ),
    Mistake(
        "missing_residual",
        "the sublayers' inputs are not added back (no residual connections)",
        (_encoder_variant(residual="no"),),
        section=_CH6_SUBLAYER,
    ),
    Mistake(
        "norms_swapped",
        "norm2 is used around the attention and norm1 around the feed-forward network; norm1 belongs to "
        "the first sublayer (self-attention), norm2 to the second",
        (_encoder_variant(swap_norms=True),),
        section=_CH6_LAYER,
    ),
    Mistake(
        "mask_ignored",
        "the mask is not passed to the self-attention, so every query also reads the padding",
        (_encoder_variant(use_mask=False),),
        section=_CH5_PADDING,
    ),
    Mistake(
        "feed_forward_first",
        "the feed-forward network runs before the self-attention; a layer attends first, then transforms each position",
        (
            _encoder_variant(ffn_first="with_norms"),
            _encoder_variant(ffn_first="in_place"),
        ),
        section=_CH6_LAYER,
    ),
    Mistake(
        "normalised_residual",
        "pre-norm computes norm(x) + sublayer(norm(x)): the normalised input replaces x on the residual path",
        (_encoder_variant(residual="normalised"),),
        section=_CH6_SUBLAYER,
        errata=(40,),
    ),
)


# ---------------------------------------------------------------------------------------------
# Chapter 7: DecoderLayer
# ---------------------------------------------------------------------------------------------

_CH7_LAYER = Section(7, "07_decoder", "7.2 One decoder layer, equation by equation")
_CH7_CROSS = Section(7, "07_decoder", "7.3 Cross-attention: four queries, three keys")
_CH7_MASKED = Section(7, "07_decoder", "7.4 Masked self-attention and teacher forcing")


def _decoder_cases() -> list[_Case]:
    """Masks come only with a memory as long as x, so that a version that gives each mask to the
    other attention still runs (and differs); the inputs without masks have lengths that differ."""

    def make(
        offset: int,
        shape: tuple[int, int, int],
        norm_first: bool,
        masks: bool = False,
        dtype=torch.float32,
    ):
        batch, tgt_len, src_len = shape

        def inputs() -> dict[str, Any]:
            g = _generator(700 + offset)
            state = _random_state(DecoderLayer(8, 2, 16, 0.0, norm_first), g)
            x = 2.0 * torch.randn(batch, tgt_len, 8, generator=g, dtype=torch.float64)
            memory = torch.randn(batch, src_len, 8, generator=g, dtype=torch.float64)
            src_mask = tgt_mask = None
            if masks:
                tgt_mask = causal_mask(tgt_len)
                lengths = torch.arange(batch) % 2 + src_len - 1 if src_len > 1 else 1
                src_mask = (torch.arange(src_len) < torch.as_tensor(lengths)[:, None])[
                    :, None, :
                ]
            return dict(
                state=state,
                x=(x + 0.5).to(dtype),
                memory=(1.5 * memory - 0.3).to(dtype),
                src_mask=src_mask,
                tgt_mask=tgt_mask,
                norm_first=norm_first,
                dtype=dtype,
            )

        return inputs

    pre = ("norm_first",)
    return [
        _Case(
            "post-norm, d_model 8, 2 heads, d_ff 16, x (2, 4, 8), memory (2, 3, 8)",
            make(1, (2, 4, 3), False),
        ),
        _Case(
            "post-norm, tgt_mask causal_mask(4), a source padding mask (2, 1, 4)",
            make(2, (2, 4, 4), False, True),
        ),
        _Case(
            "post-norm, batch 1, length 1, memory (1, 3, 8)", make(3, (1, 1, 3), False)
        ),
        _Case(
            "post-norm, float64, causal_mask(5), a source padding mask (2, 1, 5)",
            make(4, (2, 5, 5), False, True, torch.float64),
        ),
        _Case(
            "pre-norm (norm_first=True), causal_mask(4), a source padding mask (2, 1, 4)",
            make(5, (2, 4, 4), True, True),
            needs=pre,
        ),
        _Case(
            "pre-norm, float64, x (2, 3, 8), memory (2, 5, 8)",
            make(6, (2, 3, 5), True, False, torch.float64),
            needs=pre,
        ),
    ]


def _run_decoder(cls: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    wanted = {"dropout": 0.0} | ({"norm_first": True} if inputs["norm_first"] else {})
    module = _build(cls, (8, 2, 16), wanted).to(inputs["dtype"])
    missing = _load_state(
        module, {k: v.to(inputs["dtype"]) for k, v in inputs["state"].items()}
    )
    masks = {
        name: inputs[name]
        for name in ("src_mask", "tgt_mask")
        if inputs[name] is not None
    }
    output = _call(
        f"Your {_display(cls)}'s forward",
        module,
        inputs["x"],
        inputs["memory"],
        **masks,
    )
    return {"missing parameters": missing, **_named(output, ("output",))}


def _decoder_variant(
    flip: bool = False,
    residual: bool = True,
    norms: tuple[int, int, int] = (0, 1, 2),
    causal: bool = True,
    swap_masks: bool = False,
    cross_reads: str = "memory",
    cross_first: str = "",
) -> type:
    """A decoder layer (eval mode, so without dropout) with one thing changed. ``norms`` says
    which LayerNorm each sublayer uses; ``cross_reads`` is "memory", "itself" or
    "normalised memory" (the memory through the cross-attention's own norm, in pre-norm)."""

    class Variant(DecoderLayer):
        def forward(
            self,
            x: Tensor,
            memory: Tensor,
            *,
            src_mask: Tensor | None = None,
            tgt_mask: Tensor | None = None,
            cache: Any = None,
        ) -> Tensor:
            pre = self.norm_first != flip
            layer_norms = (self.norm1, self.norm2, self.norm3)
            norm1, norm2, norm3 = (layer_norms[i] for i in norms)
            self_mask, cross_mask = (
                (src_mask, tgt_mask) if swap_masks else (tgt_mask, src_mask)
            )

            def attend(h: Tensor, norm: Callable) -> Tensor:
                return self.self_attn(h, h, h, self_mask if causal else None)[0]

            def cross(h: Tensor, norm: Callable) -> Tensor:
                kv = memory
                if cross_reads == "itself":
                    kv = h
                elif cross_reads == "normalised memory" and pre:
                    kv = norm(memory)
                return self.cross_attn(h, kv, kv, cross_mask)[0]

            def feed_forward(h: Tensor, norm: Callable) -> Tensor:
                return self.feed_forward(h)

            steps = [(attend, norm1), (cross, norm2), (feed_forward, norm3)]
            if cross_first == "with_norms":
                steps = [steps[1], steps[0], steps[2]]
            elif cross_first == "in_place":
                steps = [(cross, norm1), (attend, norm2), (feed_forward, norm3)]
            for f, norm in steps:
                if pre:
                    out = f(norm(x), norm)
                    x = x + out if residual else out
                else:
                    out = f(x, norm)
                    x = norm(x + out) if residual else norm(out)
            return x

    return Variant


_DECODER_MISTAKES = (
    Mistake(
        "pre_post_swapped",
        "norm_first=False normalises each sublayer's input and norm_first=True the sum; post-norm (the "
        "paper's, norm_first=False) is norm(x + sublayer(x))",
        (_decoder_variant(flip=True),),
        section=_CH6_SUBLAYER,
    ),
    Mistake(
        "missing_residual",
        "the sublayers' inputs are not added back (no residual connections)",
        (_decoder_variant(residual=False),),
        section=_CH6_SUBLAYER,
    ),
    Mistake(
        "norms_swapped",
        "the three LayerNorms are used in another order; norm1 belongs to the self-attention, norm2 to "
        "the cross-attention and norm3 to the feed-forward network",
        tuple(
            _decoder_variant(norms=order)
            for order in ((1, 0, 2), (0, 2, 1), (2, 1, 0), (1, 2, 0), (2, 0, 1))
        ),
        section=_CH7_LAYER,
    ),
    Mistake(
        "causal_mask_ignored",
        "tgt_mask is not passed to the self-attention, so every target position also reads the "
        "positions after it",
        (_decoder_variant(causal=False),),
        section=_CH7_MASKED,
    ),
    Mistake(
        "masks_swapped",
        "src_mask is given to the self-attention and tgt_mask to the cross-attention; tgt_mask hides "
        "the target's future from its self-attention, src_mask the source's padding from the "
        "cross-attention",
        (_decoder_variant(swap_masks=True),),
        section=_CH7_LAYER,
    ),
    Mistake(
        "cross_attention_on_itself",
        "the cross-attention takes its keys and values from the decoder's own states instead of the "
        "encoder's memory, so the layer never reads the source",
        (_decoder_variant(cross_reads="itself"),),
        section=_CH7_CROSS,
    ),
    Mistake(
        "sublayers_reordered",
        "the cross-attention runs before the masked self-attention; the layer first attends to the "
        "target's own past, then to the memory, then transforms each position",
        (
            _decoder_variant(cross_first="with_norms"),
            _decoder_variant(cross_first="in_place"),
        ),
        section=_CH7_LAYER,
    ),
    Mistake(
        "memory_normalised",
        "pre-norm passes the memory through the cross-attention's LayerNorm too; norm2 normalises "
        "the decoder's queries only, the memory is the encoder's output as it is",
        (_decoder_variant(cross_reads="normalised memory"),),
        section=_CH7_CROSS,
    ),
)


# ---------------------------------------------------------------------------------------------
# Chapter 8: LabelSmoothingLoss, noam_rate
# ---------------------------------------------------------------------------------------------

_CH8_LOSS = Section(8, "08_training", "8.2 The loss, with label smoothing")
_CH8_FLOOR = Section(8, "08_training", "The floor of the loss")
_CH8_TORCH = Section(8, "08_training", "Checking against PyTorch")
_CH8_RATE = Section(8, "08_training", "8.3 The learning rate: warm up, then decay")


def _smoothing_cases() -> list[_Case]:
    def make(
        offset: int,
        vocab: int,
        smoothing: float,
        pad_id: int,
        shape: tuple,
        pads: float,
        dtype=torch.float32,
    ):
        def inputs() -> dict[str, Any]:
            g = _generator(700 + offset)
            logits = (
                2.0 * torch.randn(*shape, vocab, generator=g, dtype=torch.float64)
            ).to(dtype)
            target = torch.randint(0, vocab, shape, generator=g)
            target[target == pad_id] = (
                pad_id + 1
            ) % vocab  # padding only where the case puts it
            if pads:
                target[torch.rand(shape, generator=g) < pads] = pad_id
                target.view(-1)[-1] = pad_id
            target.view(-1)[0] = (pad_id + 2) % vocab
            return dict(
                vocab=vocab,
                smoothing=smoothing,
                pad_id=pad_id,
                logits=logits,
                target=target,
            )

        return inputs

    return [
        _Case(
            "vocabulary 7, smoothing 0.1, logits (2, 5, 7), some padding",
            make(1, 7, 0.1, 0, (2, 5), 0.3),
        ),
        _Case(
            "smoothing 0.3, logits (3, 4, 7), some padding",
            make(2, 7, 0.3, 0, (3, 4), 0.3),
        ),
        _Case("no padding at all, logits (6, 7)", make(3, 7, 0.2, 0, (6,), 0.0)),
        _Case("smoothing 0 (plain cross-entropy)", make(4, 7, 0.0, 0, (2, 4), 0.3)),
        _Case("batch 1, length 1", make(5, 7, 0.1, 0, (1, 1), 0.0)),
        _Case(
            "float64 logits, vocabulary 9",
            make(6, 9, 0.1, 0, (2, 3), 0.3, torch.float64),
        ),
        _Case(
            "pad_id=3, vocabulary 6",
            make(7, 6, 0.25, 3, (3, 4), 0.3),
            needs=("pad_id",),
        ),
    ]


def _run_smoothing(cls: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    module = _build(
        cls, (inputs["vocab"], inputs["smoothing"]), {"pad_id": inputs["pad_id"]}
    )
    loss = _call(
        f"Your {_display(cls)}'s forward", module, inputs["logits"], inputs["target"]
    )
    return {"loss": loss}


def _smoothing_variant(
    others: str = "V-2",
    pad_column: bool = False,
    confidence: str = "1-eps",
    average: str = "real",
    kl: bool = False,
    fixed_pad: int | None = None,
) -> type:
    """A label-smoothed loss with one thing changed: how ``smoothing`` is shared, whether padding
    gets a share, the right token's mass, what the mean is over, or KL instead of cross-entropy."""

    class Variant(nn.Module):
        def __init__(
            self, vocab_size: int, smoothing: float = 0.1, pad_id: int = 0
        ) -> None:
            super().__init__()
            self.vocab_size, self.smoothing = vocab_size, smoothing
            self.pad_id = pad_id if fixed_pad is None else fixed_pad

        def forward(self, logits: Tensor, target: Tensor) -> Tensor:
            v, eps = self.vocab_size, self.smoothing
            log_probs = logits.double().log_softmax(-1)
            if (
                others == "uniform"
            ):  # PyTorch's label_smoothing: ε spread over all V classes
                dist = torch.full(log_probs.shape, eps / v, dtype=torch.float64)
                dist.scatter_(-1, target[..., None], 1 - eps + eps / v)
            else:
                share = eps / {"V-2": v - 2, "V-1": v - 1, "V": v}[others]
                dist = torch.full(log_probs.shape, share, dtype=torch.float64)
                dist.scatter_(
                    -1, target[..., None], 1.0 if confidence == "one" else 1 - eps
                )
                if not pad_column:
                    dist[..., self.pad_id] = 0.0
            per_position = -(dist * log_probs).sum(-1)
            if kl:  # KL(q ‖ p) = cross-entropy − entropy of q
                per_position += (dist * dist.clamp(min=1e-300).log()).sum(-1)
            real = target != self.pad_id
            total = {"real": (per_position * real).sum(), "all": per_position.sum()}
            if average == "sum":
                return total["real"].float()
            numerator = (
                total["all"]
                if average in ("pad_loss_all", "pad_loss_real")
                else total["real"]
            )
            denominator = (
                real.sum().clamp(min=1)
                if average in ("real", "pad_loss_real")
                else target.numel()
            )
            return (numerator / denominator).float()

    return Variant


_SMOOTHING_MISTAKES = (
    Mistake(
        "mass_on_padding",
        "the padding column receives a share of the smoothing mass; padding is never a right answer, so the "
        "package gives it 0",
        (
            _smoothing_variant(pad_column=True),
            _smoothing_variant(others="V-1", pad_column=True),
        ),
    ),
    Mistake(
        "wrong_share",
        "each other token gets smoothing/(V − 1) (or smoothing/V); the package shares smoothing among the "
        "V − 2 tokens that are neither the right one nor padding",
        (_smoothing_variant(others="V-1"), _smoothing_variant(others="V")),
    ),
    Mistake(
        "pytorch_label_smoothing",
        "the target is PyTorch's label_smoothing= target, (1 − ε)·one-hot + ε/V over all V classes, padding "
        "included; the package's gives the right token 1 − ε, padding 0 and ε/(V − 2) to each other token",
        (_smoothing_variant(others="uniform"),),
        section=_CH8_TORCH,
    ),
    Mistake(
        "padding_positions_counted",
        "the mean is taken over every position, padding included; the package averages over the positions "
        "whose target is not padding, and padding positions add nothing",
        (
            _smoothing_variant(average="all"),
            _smoothing_variant(average="pad_loss_all"),
            _smoothing_variant(average="pad_loss_real"),
        ),
    ),
    Mistake(
        "confidence_not_one_minus_smoothing",
        "the right token keeps the mass 1 while the others receive the smoothing too, so the target sums to "
        "more than 1; the right token gets 1 − smoothing",
        (_smoothing_variant(confidence="one"),),
    ),
    Mistake(
        "summed_not_averaged",
        "the losses of the positions are added up; the package divides the sum by the number of positions "
        "that are not padding",
        (_smoothing_variant(average="sum"),),
    ),
    Mistake(
        "kl_divergence",
        "the loss is the KL divergence, lower than the cross-entropy by the entropy of the smoothed target: "
        "the same gradients, a different number, and a floor of 0 instead of that entropy",
        (_smoothing_variant(kl=True),),
        section=_CH8_FLOOR,
    ),
    Mistake(
        "pad_id_ignored",
        "the padding id is taken to be 0 whatever pad_id is given",
        (_smoothing_variant(fixed_pad=0),),
    ),
)


def _noam_cases() -> list[_Case]:
    def make(
        steps: list[int], d_model: int, warmup: int, **kwargs: Any
    ) -> Callable[[], dict]:
        return lambda: dict(steps=steps, d_model=d_model, warmup=warmup, kwargs=kwargs)

    paper = [1, 2, 100, 3999, 4000, 4001, 20000, 100000]
    small = [1, 5, 9, 10, 11, 50]
    factor = [1, 20, 40]
    taper = [1, 20, 50, 99, 100]
    return [
        _Case(
            "d_model 512, warmup 4000, steps " + ", ".join(map(str, paper)),
            make(paper, 512, 4000),
            ticks={"rate": (paper,)},
        ),
        _Case(
            "d_model 64, warmup 10, steps " + ", ".join(map(str, small)),
            make(small, 64, 10),
            ticks={"rate": (small,)},
        ),
        _Case(
            "factor=2.0, d_model 128, warmup 20",
            make(factor, 128, 20, factor=2.0),
            needs=("factor",),
            ticks={"rate": (factor,)},
        ),
        _Case(
            "total_steps=100, d_model 128, warmup 20",
            make(taper, 128, 20, total_steps=100),
            needs=("total_steps",),
            ticks={"rate": (taper,)},
        ),
        _Case(
            "step 0, d_model 16, warmup 5",
            make([0], 16, 5),
            ticks={"rate": ([0],)},
            on_error="The package counts step 0 as step 1 (its docstring says so).",
        ),
    ]


def _run_noam(fn: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    rates = []
    for step in inputs["steps"]:
        rate = _call(
            f"Your {_display(fn)}({step}, {inputs['d_model']}, {inputs['warmup']})",
            fn,
            step,
            inputs["d_model"],
            inputs["warmup"],
            **inputs["kwargs"],
        )
        try:
            rates.append(float(rate))
        except (TypeError, ValueError, RuntimeError):
            raise _ReaderProblem(
                f"Your {_display(fn)} returned {type(rate).__name__} for step={step}; the package returns a float"
            ) from None
    return {"rate": torch.tensor(rates, dtype=torch.float64)}


def _noam_variant(
    d_power: float = -0.5,
    warmup_power: float = -1.5,
    shift: int = 0,
    combine: Callable = min,
    warm_up: bool = True,
    use_factor: bool = True,
    use_total: bool = True,
    zero_at_zero: bool = False,
) -> Callable[..., float]:
    def rate(
        step: int,
        d_model: int,
        warmup: int,
        factor: float = 1.0,
        total_steps: int | None = None,
    ) -> float:
        if zero_at_zero and step == 0:
            return 0.0
        s = max(step + shift, 1)
        schedule = combine(s**-0.5, s * warmup**warmup_power) if warm_up else s**-0.5
        value = (factor if use_factor else 1.0) * d_model**d_power * schedule
        return (
            value * max(0.0, 1 - s / total_steps)
            if total_steps is not None and use_total
            else value
        )

    return rate


_NOAM_MISTAKES = (
    Mistake(
        "missing_d_model_factor",
        "the d_model^−0.5 factor is left out, so the rates are √d_model times too large",
        (_noam_variant(d_power=0.0),),
    ),
    Mistake(
        "wrong_warmup_power",
        "the warm-up term is not step · warmup^−1.5; with that power the two terms meet at step = warmup, "
        "where the rate peaks",
        tuple(_noam_variant(warmup_power=p) for p in (-0.5, -1.0, -2.0)),
    ),
    Mistake(
        "step_off_by_one",
        "the schedule is shifted by one step (the rate of step s is computed for s + 1 or s − 1)",
        (_noam_variant(shift=1), _noam_variant(shift=-1)),
    ),
    Mistake(
        "max_instead_of_min",
        "the two terms are combined with max, so the rate never stops growing; it is the smaller of "
        "step^−0.5 and step · warmup^−1.5",
        (_noam_variant(combine=max),),
    ),
    Mistake(
        "no_warmup",
        "the rate only decays as step^−0.5, with no linear warm-up",
        (_noam_variant(warm_up=False),),
    ),
    Mistake(
        "factor_ignored",
        "the factor argument does not multiply the rate",
        (_noam_variant(use_factor=False),),
    ),
    Mistake(
        "taper_ignored",
        "total_steps has no effect; the package multiplies the rate by 1 − step/total_steps",
        (_noam_variant(use_total=False),),
    ),
    Mistake(
        "zero_at_step_zero",
        "step 0 gets the rate 0; the package counts step 0 as step 1",
        (_noam_variant(zero_at_zero=True),),
    ),
)


# ---------------------------------------------------------------------------------------------
# Chapter 9: greedy_decode, beam_search, on a model whose next-token table is written by hand
# ---------------------------------------------------------------------------------------------

_CH9_LOOP = Section(9, "09_inference", "9.2 The decoding loop, one step at a time")
_CH9_STOP = Section(9, "09_inference", "When does decoding stop?")
_CH9_BEAM = Section(9, "09_inference", "9.5 Greedy decoding against beam search")

_PAD, _BOS, _EOS = 0, 1, 2
_TGT_VOCAB = 10  # 0 padding, 1 BOS, 2 EOS, 3..9 words
_SOURCES = 7  # source ids 1..7 (0 is padding); each names one script of next-token probabilities
_BEAM_RATIOS = {
    4: 0.585,
    5: 0.535,
    6: 0.3,
    7: 0.8,
}  # source → log P(short) / log P(long), see _script


def _beam_log_probs(ratio: float) -> tuple[float, float]:
    """``(log p_short, log p_long)`` with ``p_short + p_long = 1`` and ``log p_short = ratio · log p_long``."""
    low, high = -50.0, -1e-9
    for _ in range(100):  # bisection on log p_long
        middle = (low + high) / 2
        low, high = (
            (middle, high)
            if math.exp(ratio * middle) + math.exp(middle) < 1
            else (low, middle)
        )
    return ratio * low, low


def _script() -> dict[tuple[int, int], dict[int, float]]:
    """The next-token logits of each state (last token, source) the tests of decoding rely on.

    Sources 1-3 are for greedy decoding: 1 → "3 4 EOS", 2 → "5 EOS", 3 → "6 7 8 6 7 8 …" (never
    ends). Sources 4-7 are for beam search: after BOS, EOS (a hypothesis of length 1) or "3 4 EOS"
    (length 3), whose log-probabilities have the ratio of ``_BEAM_RATIOS``. Which one wins depends
    on how the length penalty counts: with α = 2 and these ratios, counting |y| right, counting BOS,
    not counting EOS, no penalty and |y|^α pick five different patterns of winners over the four
    sources. After EOS, every script continues with 9, so a decoder that does not stop there shows it.
    """
    script: dict[tuple[int, int], dict[int, float]] = {}
    chains = {1: [_BOS, 3, 4, _EOS], 2: [_BOS, 5, _EOS], 3: [_BOS, 6, 7, 8, 6]}
    for source, chain in chains.items():
        for current, following in zip(chain, chain[1:]):
            script[current, source] = {following: 4.0}
    for source, ratio in _BEAM_RATIOS.items():
        short, long = _beam_log_probs(ratio)
        script[_BOS, source] = {_EOS: short, 3: long}
        script[3, source] = {4: 0.0}
        script[4, source] = {_EOS: 0.0}
    for source in range(1, _SOURCES + 1):
        script[_EOS, source] = {9: 4.0}
    return script


def _build_scripted_model() -> Transformer:
    """A one-layer Transformer whose next-token logits, given the last token c and the source s,
    are ``_script()[c, s]`` (9 when the state is not scripted), whatever came before.

    Every sublayer but the decoder's cross-attention and feed-forward network adds nothing. The
    embeddings are large one-hot vectors, so the positional encoding barely moves them. Cross-attention
    averages the memory (its queries are 0), which adds the source's one-hot vector; the feed-forward
    network has one unit per (c, s) pair that fires only when both are there and writes a one-hot
    vector of its own; the generator maps that to the pair's logits. LayerNorm gives every pair the
    same numbers, so the generator's weights can be solved for exactly.
    """
    v, sources = _TGT_VOCAB, _SOURCES
    source_at, source_pad_at, pair_at = (
        v - 1,
        v + sources,
        v + sources + 1,
    )  # source s sits at v - 1 + s
    pairs = [(c, s) for s in range(1, sources + 1) for c in range(v)]
    d_model = pair_at + len(pairs)
    config = ModelConfig(
        sources + 1,
        v,
        d_model=d_model,
        num_heads=1,
        d_ff=len(pairs),
        num_layers=1,
        dropout=0.0,
        max_len=64,
    )
    model = Transformer(config).eval()
    big = 1e5  # the positional encoding (entries in [-1, 1]) moves these rows by 1 part in 1e6
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
        model.src_embed.weight[0, source_pad_at] = big
        for s in range(1, sources + 1):
            model.src_embed.weight[s, source_at + s] = big
        for c in range(v):
            model.tgt_embed.weight[c, c] = big
        cross = model.decoder.layers[0].cross_attn
        cross.v_proj.weight.copy_(torch.eye(d_model))
        cross.out_proj.weight.copy_(torch.eye(d_model))

        # What LayerNorm makes of the vectors at each stage, for any pair (all pairs look alike).
        def norm(x: Tensor) -> Tensor:
            return F.layer_norm(x, (d_model,))

        def one_hot(i: int) -> Tensor:
            return F.one_hot(torch.tensor(i), d_model).double()

        scale = big * math.sqrt(d_model)
        x2 = norm(norm(scale * one_hot(0)) + norm(norm(scale * one_hot(source_at + 1))))
        peak, base = x2[0].item(), x2[pair_at].item()
        # A unit sees 2·peak when both its token and its source are there, far less otherwise (one of
        # them, or a source averaged with padding); it fires only within `margin` of the full sum.
        margin = 0.1 * (peak - base)
        threshold = 2 * peak - margin
        spike = 20.0
        x3 = norm(x2 + spike * one_hot(pair_at))
        at_pair, elsewhere = x3[pair_at].item(), x3[-1].item()

        ff = model.decoder.layers[0].feed_forward
        script = _script()
        logits = torch.zeros(len(pairs), v, dtype=torch.float64)
        for unit, (c, s) in enumerate(pairs):
            ff.linear1.weight[unit, c] = 1.0
            ff.linear1.weight[unit, source_at + s] = 1.0
            ff.linear1.bias[unit] = -threshold
            ff.linear2.weight[pair_at + unit, unit] = spike / margin
            row = torch.tensor(
                [-14.0 - 0.1 * t for t in range(v)], dtype=torch.float64
            )  # distinct: no ties
            for token, value in script.get((c, s), {9: 4.0}).items():
                row[token] = value
            logits[unit] = row
        columns = logits.T / (at_pair - elsewhere)  # (v, pairs)
        model.generator.weight[:, pair_at:] = columns.float()
        model.generator.bias.copy_((-elsewhere * columns.sum(dim=1)).float())
    return model


_SCRIPTED: list[Transformer] = []


def _scripted_model(shared: bool = False) -> Transformer:
    """The scripted model (built once, with the global generator saved and restored): the one
    shared copy for the package's functions and the catalogue's, which change nothing, or a
    fresh copy for a reader's function."""
    if not _SCRIPTED:
        with torch.random.fork_rng(devices=[]):
            _SCRIPTED.append(_build_scripted_model())
    return _SCRIPTED[0] if shared else copy.deepcopy(_SCRIPTED[0])


class _Runaway(RuntimeError):
    pass


def _watch(model: Transformer, max_len: int, hypotheses: int) -> None:
    """Stop a decoding loop that does not end: it has called the generator far more often than
    ``max_len`` steps of ``hypotheses`` rows (one call per row each step at most) need, or for too long."""
    start, calls, limit = time.perf_counter(), [0], 4 * max_len * (hypotheses + 1) + 10

    def hook(module: nn.Module, args: tuple) -> None:
        calls[0] += 1
        if calls[0] > limit or time.perf_counter() - start > 10.0:
            raise _Runaway(
                f"stopped after {calls[0]} calls of model.generator for max_len={max_len}: the loop did not end "
                f"(the package's runs at most max_len − 1 steps)"
            )

    model.generator.register_forward_pre_hook(hook)


def _decoding_cases(beam: bool) -> list[_Case]:
    def make(rows: list[list[int]], max_len: int, **kwargs: Any) -> Callable[[], dict]:
        return lambda: dict(src=torch.tensor(rows), max_len=max_len, kwargs=kwargs)

    if beam:
        return [
            _Case(
                "4 sources, beam_size 2, alpha 2.0, max_len 6: outputs of length 1 and 3 compete",
                make(
                    [[4, 0, 0], [5, 5, 0], [6, 6, 6], [7, 0, 0]],
                    6,
                    beam_size=2,
                    alpha=2.0,
                ),
                needs=("beam_size", "alpha"),
            ),
            _Case(
                "3 sources, beam_size 3, alpha 0.6, max_len 6, one never emits EOS",
                make([[1, 1, 0], [2, 0, 0], [3, 0, 0]], 6, beam_size=3, alpha=0.6),
                needs=("beam_size", "alpha"),
            ),
            _Case(
                "batch 1, source length 1, beam_size 1",
                make([[2]], 5, beam_size=1),
                needs=("beam_size",),
            ),
        ]
    return [
        _Case(
            "2 sources with padding, max_len 8, both end early",
            make([[1, 0, 0], [2, 2, 0]], 8),
        ),
        _Case(
            "3 sources, max_len 6, one never emits EOS",
            make([[1, 1, 0], [3, 0, 0], [2, 0, 0]], 6),
        ),
        _Case("batch 1, source length 1, max_len 5", make([[2]], 5)),
        _Case("max_len 2: BOS and one token", make([[3]], 2)),
    ]


def _run_decoding(fn: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    trusted = fn in (greedy_decode, beam_search) or getattr(
        fn, "_catalogue_variant", False
    )
    model = _scripted_model(shared=trusted)
    if not trusted:  # the reader's loop gets a copy of its own, watched
        _watch(
            model,
            inputs["max_len"],
            len(inputs["src"]) * inputs["kwargs"].get("beam_size", 1),
        )
    args = (model, inputs["src"], inputs["max_len"], _BOS, _EOS)
    try:
        tokens = _call(f"Your {_display(fn)}", fn, *args, **inputs["kwargs"])
    except _ReaderError as problem:
        if isinstance(problem.error, _Runaway):
            raise _ReaderProblem(f"Your {_display(fn)} {problem.error}") from None
        raise
    return {"tokens": tokens}


def _greedy_variant(
    pad_after_eos: bool = True,
    stop_when_done: bool = True,
    keep_bos: bool = True,
    extra_steps: int = 0,
    stop_at_first: bool = False,
    hide_source_padding: bool = True,
    position: int = -1,
) -> Callable[..., Tensor]:
    """Greedy decoding (without a cache) with one thing changed."""

    def decode(
        model: Transformer,
        src: Tensor,
        max_len: int,
        bos_id: int,
        eos_id: int | None,
        **_: Any,
    ) -> Tensor:
        pad = model.config.pad_id
        src_mask = padding_mask(src, pad)
        memory = model.encode(src, src_mask)
        ys = torch.full((len(src), 1), bos_id)
        done = torch.zeros(len(src), dtype=torch.bool)
        for _step in range(max_len - 1 + extra_steps):
            hidden = model.decode(
                memory,
                ys,
                src_mask=src_mask if hide_source_padding else None,
                tgt_mask=causal_mask(ys.shape[1]),
            )
            token = model.generator(hidden[:, position]).argmax(-1)
            token = token.masked_fill(done, pad) if pad_after_eos else token
            ys = torch.cat([ys, token[:, None]], dim=1)
            done |= token == eos_id
            if (stop_at_first and done.any()) or (stop_when_done and done.all()):
                break
        return ys if keep_bos else ys[:, 1:]

    decode._catalogue_variant = True
    return torch.inference_mode()(decode)


_GREEDY_MISTAKES = (
    Mistake(
        "no_padding_after_eos",
        "a row that has produced EOS goes on producing tokens; the package writes pad_id after a row's EOS "
        "while the other rows go on",
        (_greedy_variant(pad_after_eos=False),),
        section=_CH9_STOP,
    ),
    Mistake(
        "no_early_stop",
        "the loop always runs to max_len, even when every row has produced EOS; the package stops as soon "
        "as all rows have ended",
        (_greedy_variant(stop_when_done=False),),
        section=_CH9_STOP,
    ),
    Mistake(
        "bos_missing",
        "the result leaves out the BOS column; the package returns every row starting with bos_id",
        (_greedy_variant(keep_bos=False),),
        section=_CH9_LOOP,
    ),
    Mistake(
        "max_len_off_by_one",
        "rows can reach another length than max_len: the package's count includes BOS, so it makes at most "
        "max_len − 1 steps",
        (_greedy_variant(extra_steps=1), _greedy_variant(extra_steps=-1)),
        section=_CH9_STOP,
    ),
    Mistake(
        "stops_at_first_eos",
        "the loop stops as soon as any row produces EOS; the package goes on until every row has ended",
        (_greedy_variant(stop_at_first=True),),
        section=_CH9_STOP,
    ),
    Mistake(
        "source_padding_visible",
        "the decoder's cross-attention reads the source's padding: no src_mask is given to decode",
        (_greedy_variant(hide_source_padding=False),),
        section=_CH5_PADDING,
    ),
    Mistake(
        "reads_first_position",
        "the next token is read from the first position's output (hidden[:, 0]); it comes from the last "
        "position, hidden[:, -1]",
        (_greedy_variant(position=0),),
        section=_CH9_LOOP,
    ),
)


def _beam_variant(
    first_length: float = 0.0,
    count_eos: bool = True,
    penalty: str = "gnmt",
    freeze: bool = True,
) -> Callable[..., Tensor]:
    """Beam search (without a cache) with one thing changed: where |y| starts, whether EOS counts
    in it, the length penalty, or finished hypotheses not frozen."""

    def search(
        model: Transformer,
        src: Tensor,
        max_len: int,
        bos_id: int,
        eos_id: int | None,
        beam_size: int = 4,
        src_mask: Tensor | None = None,
        alpha: float = 0.6,
    ) -> Tensor:
        pad, vocab, batch, k = (
            model.config.pad_id,
            model.config.tgt_vocab_size,
            len(src),
            beam_size,
        )
        src_mask = padding_mask(src, pad) if src_mask is None else src_mask
        memory = model.encode(src, src_mask).repeat_interleave(k, dim=0)
        memory_mask = src_mask.repeat_interleave(k, dim=0)
        ys = torch.full((batch * k, 1), bos_id)
        scores = torch.full((batch, k), float("-inf"))
        scores[:, 0] = 0.0
        lengths = torch.full((batch, k), first_length)
        finished = torch.zeros(batch, k, dtype=torch.bool)

        def normalise(length: Tensor) -> Tensor:
            if penalty == "none":
                return torch.ones_like(length)
            return (
                length**alpha if penalty == "power" else ((5.0 + length) / 6.0) ** alpha
            )

        for _step in range(max_len - 1):
            hidden = model.decode(
                memory, ys, src_mask=memory_mask, tgt_mask=causal_mask(ys.shape[1])
            )
            log_probs = (
                model.generator(hidden[:, -1]).log_softmax(-1).view(batch, k, vocab)
            )
            if freeze:
                pad_only = torch.full((vocab,), float("-inf"))
                pad_only[pad] = 0.0
                log_probs = torch.where(finished[..., None], pad_only, log_probs)
            candidates = (scores[..., None] + log_probs).view(batch, k * vocab)
            grows = (~finished)[..., None].expand(batch, k, vocab)
            if not count_eos:
                grows = grows & (torch.arange(vocab) != eos_id)
            candidate_lengths = (lengths[..., None] + grows.float()).reshape(
                batch, k * vocab
            )
            best = (candidates / normalise(candidate_lengths)).topk(k, dim=-1).indices
            beam, token = best // vocab, best % vocab
            rows = (beam + torch.arange(batch)[:, None] * k).view(-1)
            scores, lengths = (
                candidates.gather(1, best),
                candidate_lengths.gather(1, best),
            )
            if freeze:
                finished = finished.gather(1, beam) | (token == eos_id)
            ys = torch.cat([ys[rows], token.view(-1, 1)], dim=1)
            if finished.all():
                break
        best_beam = (scores / normalise(lengths)).argmax(-1)
        best_ys = ys[best_beam + torch.arange(batch) * k]
        keep = int((best_ys != pad).any(dim=0).nonzero().max()) + 1
        return best_ys[:, :keep]

    search._catalogue_variant = True
    return torch.inference_mode()(search)


_BEAM_MISTAKES = (
    Mistake(
        "length_counts_bos",
        "|y| in the length penalty counts BOS, so a hypothesis is one token longer than it is; |y| counts "
        "the tokens after BOS, EOS included (the first generated token has length 1)",
        (_beam_variant(first_length=1.0),),
    ),
    Mistake(
        "length_without_eos",
        "|y| in the length penalty leaves out EOS; |y| counts the tokens after BOS, EOS included",
        (_beam_variant(count_eos=False),),
    ),
    Mistake(
        "no_length_penalty",
        "hypotheses are ranked by log-probability alone (alpha has no effect); the package divides by "
        "((5 + |y|)/6)^alpha, so that longer outputs are not penalised for their length",
        (_beam_variant(penalty="none"),),
    ),
    Mistake(
        "length_power_penalty",
        "scores are divided by |y|^alpha; the package uses GNMT's penalty ((5 + |y|)/6)^alpha",
        (_beam_variant(penalty="power"),),
    ),
    Mistake(
        "finished_not_frozen",
        "a hypothesis that has produced EOS is extended further; the package freezes it: its score stays, "
        "and only padding follows",
        (_beam_variant(freeze=False),),
    ),
)


# ---------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------

_REGISTRY: dict[str, _Spec] = {
    spec.name: spec
    for spec in (
        _Spec(
            "TokenEmbedding",
            "class",
            TokenEmbedding,
            "class (vocab_size, d_model, padding_idx=None); forward(tokens) → (batch, seq, d_model)",
            _CH1,
            _embedding_cases,
            _run_embedding,
            _EMBEDDING_MISTAKES,
            axes={
                "output": ("batch", "position", "feature"),
                "gradient of the table": ("row", "feature"),
            },
            grad=True,
        ),
        _Spec(
            "sinusoidal_positional_encoding",
            "function",
            sinusoidal_positional_encoding,
            "(max_len, d_model) → the table (max_len, d_model)",
            _CH2_FORMULA,
            _pe_cases,
            _run_function(("output",)),
            _PE_MISTAKES,
            axes={"output": ("position", "column")},
            tolerance={torch.float32: (1e-4, 3e-5)},
        ),
        _Spec(
            "scaled_dot_product_attention",
            "function",
            scaled_dot_product_attention,
            "(query, key, value, mask=None) → output (and, if you like, weights)",
            _CH3_MATRIX,
            _attention_cases,
            _run_function(("output", "weights")),
            _ATTENTION_MISTAKES,
            axes={
                "output": ("batch", "head", "query", "feature"),
                "weights": ("batch", "head", "query", "key"),
            },
        ),
        _Spec(
            "split_heads",
            "function",
            _split_reference,
            "(x (B, len, d_model), num_heads) → (B, heads, len, d_head)",
            _CH4_SPLIT,
            lambda: _heads_cases(merge=False),
            _run_heads(("output",)),
            _SPLIT_MISTAKES,
            axes={"output": ("batch", "head", "position", "feature")},
        ),
        _Spec(
            "merge_heads",
            "function",
            _merge_reference,
            "(x (B, heads, len, d_head)[, num_heads]) → (B, len, d_model)",
            _CH4_SPLIT,
            lambda: _heads_cases(merge=True),
            _run_heads(("output",)),
            _MERGE_MISTAKES,
            axes={"output": ("batch", "position", "feature")},
        ),
        _Spec(
            "MultiHeadAttention",
            "class",
            MultiHeadAttention,
            "class (d_model, num_heads) with q_proj, k_proj, v_proj, out_proj; forward(query, key, value, mask=None)",
            _CH4_SPLIT,
            _mha_cases,
            _run_mha,
            _MHA_MISTAKES,
            axes={"output": ("batch", "query", "feature")},
        ),
        _Spec(
            "padding_mask",
            "function",
            padding_mask,
            "(tokens (batch, seq), pad_id=0) → (batch, 1, seq), True where a token is real",
            _CH5_PADDING,
            _padding_cases,
            _run_function(("output",)),
            _PADDING_MISTAKES,
            axes={"output": ("batch", "query", "key")},
        ),
        _Spec(
            "causal_mask",
            "function",
            causal_mask,
            "(size) → (1, size, size), True on and below the diagonal",
            _CH5_CAUSAL,
            _causal_cases,
            _run_function(("output",)),
            _CAUSAL_MISTAKES,
            axes={"output": ("batch", "query", "key")},
            broadcast_equivalent=True,
        ),
        _Spec(
            "sublayer_connection",
            "function",
            sublayer_connection,
            "(x, sublayer, norm, dropout, norm_first) → the residual connection around sublayer",
            _CH6_SUBLAYER,
            _sublayer_cases,
            _run_function(("output",)),
            _SUBLAYER_MISTAKES,
            axes={"output": ("batch", "position", "feature")},
        ),
        _Spec(
            "EncoderLayer",
            "class",
            EncoderLayer,
            "class (d_model, num_heads, d_ff, dropout=0.1, norm_first=False) with self_attn, feed_forward, "
            "norm1, norm2; forward(x, mask=None)",
            _CH6_LAYER,
            _encoder_cases,
            _run_encoder,
            _ENCODER_MISTAKES,
            axes={"output": ("batch", "position", "feature")},
        ),
        _Spec(
            "DecoderLayer",
            "class",
            DecoderLayer,
            "class (d_model, num_heads, d_ff, dropout=0.1, norm_first=False) with self_attn, cross_attn, "
            "feed_forward, norm1, norm2, norm3; forward(x, memory, *, src_mask=None, tgt_mask=None)",
            _CH7_LAYER,
            _decoder_cases,
            _run_decoder,
            _DECODER_MISTAKES,
            axes={"output": ("batch", "position", "feature")},
        ),
        _Spec(
            "LabelSmoothingLoss",
            "class",
            LabelSmoothingLoss,
            "class (vocab_size, smoothing=0.1, pad_id=0); forward(logits, target) → the mean loss",
            _CH8_LOSS,
            _smoothing_cases,
            _run_smoothing,
            _SMOOTHING_MISTAKES,
            strict_dtype=False,
        ),
        _Spec(
            "noam_rate",
            "function",
            noam_rate,
            "(step, d_model, warmup, factor=1.0, total_steps=None) → the learning rate",
            _CH8_RATE,
            _noam_cases,
            _run_noam,
            _NOAM_MISTAKES,
            axes={"rate": ("step",)},
            tolerance={torch.float64: (1e-6, 1e-12)},
        ),
        _Spec(
            "greedy_decode",
            "function",
            greedy_decode,
            "(model, src, max_len, bos_id, eos_id) → ids (batch, ≤ max_len), BOS first, padding after EOS",
            _CH9_LOOP,
            lambda: _decoding_cases(beam=False),
            _run_decoding,
            _GREEDY_MISTAKES,
            axes={"tokens": ("row", "position")},
            strict_dtype=False,
        ),
        _Spec(
            "beam_search",
            "function",
            beam_search,
            "(model, src, max_len, bos_id, eos_id, beam_size=4, src_mask=None, alpha=0.6) → ids (batch, ≤ max_len)",
            _CH9_BEAM,
            lambda: _decoding_cases(beam=True),
            _run_decoding,
            _BEAM_MISTAKES,
            axes={"tokens": ("row", "position")},
            strict_dtype=False,
        ),
    )
}


def names() -> list[str]:
    """The components :func:`check` can grade, in the order of the book."""
    return list(_REGISTRY)


def catalogue(name: str | None = None) -> dict[str, dict[str, str]]:
    """The recognised mistakes: ``{component: {mistake: what a version with it computes}}``
    (only ``name``'s when given)."""
    chosen = [_spec(name)] if name is not None else list(_REGISTRY.values())
    return {spec.name: {m.name: m.does for m in spec.mistakes} for spec in chosen}


def _spec(name: str) -> _Spec:
    if name not in _REGISTRY:
        raise ValueError(
            f"check() knows no component named {name!r}; it knows: {', '.join(_REGISTRY)}"
        )
    return _REGISTRY[name]


def check(name: str, fn: Any) -> CheckResult:
    """Grade ``fn``, your own version of the package's ``name``, and name the mistake if it is a known one.

    ``fn`` has the package's signature: a function for a function's name, a class for a class's
    name (it is built with the package's arguments, and the package's weights are copied into it
    by parameter name). Both versions run on the same small inputs; the result is a
    :class:`CheckResult` whose ``passed``, ``mistake`` and ``message`` say how yours compares.
    A function may return only the output where the package's returns (output, weights).

    The names (see also :func:`names` and :func:`catalogue`):

    - ``"TokenEmbedding"`` (chapter 1): class ``(vocab_size, d_model, padding_idx=None)``
    - ``"sinusoidal_positional_encoding"`` (chapter 2): ``(max_len, d_model)`` → ``(max_len, d_model)``
    - ``"scaled_dot_product_attention"`` (chapter 3): ``(query, key, value, mask=None)``
    - ``"split_heads"``, ``"merge_heads"`` (chapter 4): ``(x, num_heads)``
    - ``"MultiHeadAttention"`` (chapter 4): class ``(d_model, num_heads)`` with ``q_proj``, ``k_proj``,
      ``v_proj``, ``out_proj``
    - ``"padding_mask"``, ``"causal_mask"`` (chapter 5): ``(tokens, pad_id=0)``, ``(size)``
    - ``"sublayer_connection"`` (chapter 6): ``(x, sublayer, norm, dropout, norm_first)``
    - ``"EncoderLayer"`` (chapter 6): class ``(d_model, num_heads, d_ff, dropout=0.1, norm_first=False)``
    - ``"DecoderLayer"`` (chapter 7): class ``(d_model, num_heads, d_ff, dropout=0.1, norm_first=False)``
      with ``forward(x, memory, *, src_mask=None, tgt_mask=None)``, the masks by keyword only
    - ``"LabelSmoothingLoss"`` (chapter 8): class ``(vocab_size, smoothing=0.1, pad_id=0)``
    - ``"noam_rate"`` (chapter 8): ``(step, d_model, warmup, factor=1.0, total_steps=None)``
    - ``"greedy_decode"``, ``"beam_search"`` (chapter 9): ``(model, src, max_len, bos_id, eos_id, ...)``

    An unknown ``name`` raises ``ValueError``. Checking uses its own seeded generators and leaves
    PyTorch's global random state as it was; whatever ``fn`` raises ends up in the message.
    """
    spec = _spec(name)
    problem = _kind_problem(spec, fn)
    if problem is not None:
        return CheckResult(
            name=name, passed=False, mistake=None, message=problem, section=spec.section
        )
    try:
        with _isolated(spec.grad):
            return _grade(spec, fn)
    except (
        Exception
    ) as error:  # the checker's own failure must not take the reader's session down
        return CheckResult(
            name=name,
            passed=False,
            mistake=None,
            message=(
                f"The check itself failed ({type(error).__name__}: {error}), so your {name} could not be graded. "
                f"Re-read {spec.section} ({spec.section.link})."
            ),
            section=spec.section,
        )
