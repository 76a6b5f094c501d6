"""The grading machinery: the inputs of a check (:class:`Case`), one graded part (:class:`Part`),
running the reader's code, comparing it with the package's and naming the mistake.

The reader's code runs under guards, so that no version a reader writes can hang or flood the
notebook or change the session:

- **a time budget** (:data:`TIME_BUDGET_S` seconds per call of the reader's code): on platforms
  with ``signal.setitimer`` (Linux, macOS), and when checking runs on the main thread (as in a
  notebook), an alarm interrupts a call that runs longer, and the check says so. What cannot be
  interrupted: a single long operation in C (one huge matrix product, a ``time.sleep`` in
  a C extension) ends before Python sees the alarm, and a loop that catches every exception
  (a bare ``except:`` inside ``while True``) swallows each alarm; on Windows or off the main thread there is no
  alarm, and only the decoding checks' own step counting stops a runaway loop;
- **its printing is captured**, and the result says how much it printed and shows a few lines;
- **PyTorch's global state is put back**: the random state (CPU, and GPUs already in use), the
  default dtype, the number of threads and grad mode are what they were before the check.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import math
import os
import signal
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .compare import (
    _difference,
    _same,
    _shape,
)
from .results import CheckResult, Mistake, Section, _errata_link

_SEED = 20240917  # every input of every check comes from generators seeded from this


class _ReaderProblem(Exception):
    """Something about the reader's version that stops the comparison; its text is the message."""


class _ReaderError(_ReaderProblem):
    """The reader's code raised ``error`` while doing ``context``."""

    def __init__(self, context: str, error: BaseException) -> None:
        self.context, self.error = context, error
        super().__init__(f"{context} raised {type(error).__name__}")


@dataclass(frozen=True)
class Case:
    """One input of a check. ``make()`` returns fresh inputs each time (so that a version that
    changes its inputs in place cannot change what the next one sees); ``needs`` lists the
    parameters the reader's callable must accept for the case to apply."""

    label: str
    make: Callable[[], Any]
    needs: tuple[str, ...] = ()
    # Only to tell mistakes apart: a difference here alone does not fail the check.
    probe: bool = False
    # For recognising mistakes, this case counts only for these (for all when empty).
    only_for: tuple[str, ...] = ()
    # A fact worth adding when the reader's version raises on this case.
    on_error: str = ""
    # Labels of the indices of each output axis, by output name.
    ticks: dict[str, tuple[Sequence, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class Part:
    """Everything :func:`check` needs to know about one component."""

    name: str
    reference: Any  # the package's function or class
    summary: str
    section: Section
    cases: Callable[[], list[Case]]
    # (implementation, case inputs) → named outputs
    run: Callable[[Any, Any], dict[str, Any]]
    mistakes: tuple[Mistake, ...]
    axes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    strict_dtype: bool = True
    tolerance: dict[torch.dtype, tuple[float, float]] = field(default_factory=dict)
    # a result without the package's leading size-1 axes is the same
    broadcast_equivalent: bool = False
    grad: bool = False

    @property
    def kind(self) -> str:
        """``"class"`` or ``"function"``, as the package's reference is."""
        return "class" if isinstance(self.reference, type) else "function"


def _generator(offset: int) -> torch.Generator:
    return torch.Generator().manual_seed(_SEED + offset)


def _display(fn: Any) -> str:
    return (
        getattr(fn, "__qualname__", None)
        or getattr(fn, "__name__", None)
        or type(fn).__name__
    )


TIME_BUDGET_S = 3.0
"""Seconds one call of the reader's code may take (the inputs are tiny: a correct version takes
milliseconds)."""


class _OutOfTime(BaseException):
    """Raised by the alarm inside the reader's code; a BaseException, so that the reader's own
    ``except Exception`` does not swallow it."""


_ARMED = threading.local()


@contextlib.contextmanager
def _time_budget(seconds: float) -> Iterator[None]:
    """Interrupt the block with :class:`_OutOfTime` after ``seconds`` (again every 0.2 s, should the
    reader's code catch it), where an alarm is possible; put back whatever alarm was set before."""
    possible = hasattr(signal, "setitimer") and (
        threading.current_thread() is threading.main_thread()
    )
    if not possible or getattr(_ARMED, "on", False):
        yield
        return

    def alarm(signum: int, frame: Any) -> None:
        # after the block has ended, a late alarm does nothing
        if getattr(_ARMED, "on", False):
            raise _OutOfTime

    previous = signal.signal(signal.SIGALRM, alarm)
    _ARMED.on = True
    before, start = signal.setitimer(signal.ITIMER_REAL, seconds, 0.2), time.monotonic()
    try:
        yield
    finally:
        while True:  # disarm, even if the alarm goes off right here
            try:
                _ARMED.on = False
                signal.setitimer(signal.ITIMER_REAL, 0)
                break
            except _OutOfTime:
                continue
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)
        # someone else's alarm (pytest-timeout, say): its time, less ours
        if before[0] > 0:
            left = max(before[0] - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, before[1])


def _call(context: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` within the time budget; what it raises becomes a
    :class:`_ReaderError` saying ``context``, running out of time a :class:`_ReaderProblem`."""
    try:
        with _time_budget(TIME_BUDGET_S):
            return fn(*args, **kwargs)
    except _OutOfTime:
        raise _ReaderProblem(
            f"{context} was stopped after {TIME_BUDGET_S:g} seconds: on these tiny inputs the "
            "package's takes milliseconds, so it probably never ends (a loop whose condition "
            "stays true, or a decoding loop that never stops)"
        ) from None
    except _ReaderProblem:
        raise
    # a reader's sys.exit() must not end the session
    except (Exception, SystemExit) as error:
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


@contextlib.contextmanager
def _isolated(grad: bool) -> Iterator[None]:
    """Run the check seeded, on one thread (the inputs are tiny, and on a busy machine threads
    only wait for each other), in float32 by default and with grad mode ``grad``; afterwards put
    back the random state, the default dtype, the thread count and grad mode as they were,
    whatever the reader's code changed."""
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    # The GPUs' generators too, when a reader's code may already have drawn from them.
    gpus = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=gpus), torch.set_grad_enabled(grad):
            torch.set_num_threads(1)
            torch.set_default_dtype(torch.float32)
            # not torch.manual_seed: GPUs too
            torch.default_generator.manual_seed(_SEED)
            yield
    finally:
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)


@contextlib.contextmanager
def _captured() -> Iterator[io.StringIO]:
    """What the reader's code prints (stdout and stderr), kept instead of shown."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        yield buffer


def _printed_summary(text: str, shown: int = 3) -> str:
    """One line for the result about what the reader's code printed (nothing if it printed nothing)."""
    lines = text.splitlines()
    if not lines:
        return ""

    def short(line: str) -> str:
        return line if len(line) <= 100 else line[:99] + "…"

    head = " | ".join(short(line) for line in lines[:shown])
    more = (
        f" … {len(lines) - shown} more, the last: {short(lines[-1])}"
        if len(lines) > shown
        else ""
    )
    return (
        f"Your code printed {len(lines)} line(s) while it was checked (kept here, not shown in full): "
        f"{head}{more}"
    )


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


def _describe_error(problem: _ReaderError, case: Case) -> str:
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


def _kind_problem(spec: Part, fn: Any) -> str | None:
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


def _outputs_of(mistake: Mistake, outputs: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v for k, v in outputs.items() if not mistake.outputs or k in mistake.outputs
    }


def _recognise(
    spec: Part, fn: Any, cases: list[Case], got: list[dict[str, Any]]
) -> Mistake | None:
    """The first mistake of the catalogue one of whose variants gives the reader's outputs on every
    case (the probes included, where the reader's version runs on them)."""
    cases, got = list(cases), list(got)
    for probe in spec.cases():
        if probe.probe and all(_takes(fn, name) for name in probe.needs):
            try:
                got.append(spec.run(fn, probe.make()))
                cases.append(probe)
            except _ReaderProblem:
                pass
    for mistake in spec.mistakes:
        for variant in mistake.variants:
            try:
                if all(
                    _same(
                        spec,
                        case,
                        _outputs_of(mistake, g),
                        spec.run(variant, case.make()),
                    )
                    for case, g in zip(cases, got)
                    if _outputs_of(mistake, g)
                    and (not case.only_for or mistake.name in case.only_for)
                ):
                    return mistake
            # a variant that cannot run on some input is not the reader's version
            except Exception:
                continue
    return None


def _grade(spec: Part, fn: Any) -> CheckResult:
    cases, skipped = [], []
    for case in spec.cases():
        if case.probe:
            continue
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

    mistake = _recognise(spec, fn, cases, got)
    lines = []
    if mistake is not None:
        did = f" You {mistake.did}:" if mistake.did else ""
        lines.append(f"Recognised mistake “{mistake.name}”:{did} {mistake.does}.")
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


def _build_loaded(
    cls: Any, args: tuple, inputs: dict[str, Any], **wanted: Any
) -> tuple[nn.Module, tuple[str, ...]]:
    """``cls(*args, **wanted)`` in eval mode, in ``inputs["dtype"]``, holding the package's
    weights ``inputs["state"]``; and the names of the parameters it lacks."""
    module = _build(cls, args, wanted).to(inputs["dtype"])
    state = {k: v.to(inputs["dtype"]) for k, v in inputs["state"].items()}
    return module, _load_state(module, state)


def _forward(cls: Any, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Call the reader's ``module`` (built from their class ``cls``), guarded by :func:`_call`."""
    return _call(f"Your {_display(cls)}'s forward", module, *args, **kwargs)


def _key_padding(lengths: Sequence[int] | Tensor, size: int) -> Tensor:
    """A padding mask ``(batch, 1, size)``: row b may read its first ``lengths[b]`` keys."""
    return (torch.arange(size) < torch.as_tensor(lengths)[:, None])[:, None, :]


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


def _signature_of(reference: Callable) -> Callable[[Callable], Callable]:
    """Give a broken version of the catalogue the package's signature: it is called like
    ``reference``, and its body receives every parameter by name, the defaults filled in."""
    signature = inspect.signature(reference)

    def adopt(body: Callable) -> Callable:
        @functools.wraps(body)
        def version(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return body(**bound.arguments)

        version.__signature__ = signature
        return version

    return adopt


def run_function(names: tuple[str, ...]) -> Callable[[Any, Any], dict[str, Any]]:
    """A runner for a plain function: call it on the case's ``(args, kwargs)``."""

    def run(fn: Any, inputs: tuple[tuple, dict]) -> dict[str, Any]:
        args, kwargs = inputs
        # A keyword the reader's function does not take is left out: a case that needs it is
        # skipped beforehand (``Case.needs``), any other then shows what their default does.
        kwargs = _keywords(fn, **kwargs)
        return _named(_call(f"Your {_display(fn)}", fn, *args, **kwargs), names)

    return run


def run_check(spec: Part, fn: Any) -> CheckResult:
    """Grade ``fn`` against ``spec``, guarded (see the module's docstring)."""
    problem = _kind_problem(spec, fn)
    if problem is not None:
        return CheckResult(spec.name, False, None, problem, section=spec.section)
    with _captured() as printed:
        try:
            with _isolated(spec.grad):
                result = _grade(spec, fn)
        # the checker's own failure must not take the session down
        except Exception as error:
            result = CheckResult(
                spec.name,
                False,
                None,
                f"The check itself failed ({type(error).__name__}: {error}), so your {spec.name} could "
                f"not be graded. Re-read {spec.section} ({spec.section.link}).",
                section=spec.section,
            )
    result.printed = printed.getvalue()
    summary = _printed_summary(result.printed)
    if summary:
        result.message += "\n" + summary
    return result
