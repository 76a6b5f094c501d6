"""A progress bar that reads well wherever the code runs.

* In a terminal (the command-line trainer, a script) it is tqdm's bar on stderr.
* In a notebook kernel (Jupyter, Colab, VS Code) it is one output that is redrawn in place:
  each redraw replaces the output (``update_display_data``) instead of adding a line. When
  the bar closes, the output becomes a one-line summary of the run, such as
  ``training: 1000/1000 steps in 12.3 s, loss 0.412, metric 0.987``. A notebook executed
  without a front end (nbclient, as the book's build does) keeps only that last state, so
  the built page shows the summary, not every redraw.

Example::

    with ProgressBar(steps, desc="training", unit="step") as bar:
        for step in range(1, steps + 1):
            loss = ...
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
"""

from __future__ import annotations

import html
import sys
import time
from collections.abc import Callable
from typing import Any, Literal, TextIO

# The text bar: tqdm.auto needs ipywidgets in a notebook and warns without it.
from tqdm import tqdm

__all__ = ["ProgressBar", "in_notebook_kernel"]

Mode = Literal["auto", "notebook", "terminal"]

# Seconds between two redraws of the notebook bar; the terminal bar redraws as tqdm does.
NOTEBOOK_INTERVAL_S = 0.5
TERMINAL_INTERVAL_S = 0.1


def in_notebook_kernel() -> bool:
    """True when this code runs in a Jupyter kernel (a notebook, Colab, VS Code), not in a terminal.

    IPython's terminal shell has no kernel and gets the terminal bar."""
    if "ipykernel" not in sys.modules:  # cheap, and imports nothing outside a kernel
        return False
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - ipykernel always brings IPython
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def format_value(value: Any) -> str:
    """A postfix value as it is shown: strings as given, floats to 3 significant digits."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.3g}" if abs(value) < 1e4 else f"{value:,.0f}"


def format_seconds(seconds: float) -> str:
    """``12.3 s`` below 100 s, ``512 s`` below 10 minutes, else ``12 min 5 s``."""
    if seconds < 100:
        return f"{seconds:.1f} s"
    if seconds < 600:
        return f"{seconds:.0f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s"


class ProgressBar:
    """A progress bar over ``total`` units (``None``: unknown), starting at ``initial``.

    ``mode="auto"`` picks the notebook output inside a Jupyter kernel and tqdm (on ``file``,
    default stderr) elsewhere; ``"notebook"`` and ``"terminal"`` force one. ``interval`` is the
    least time between redraws (default 0.5 s in a notebook, 0.1 s in a terminal). With
    ``enabled=False`` it shows nothing (for example on every rank but the first).

    ``update(n)`` advances it, ``set_postfix(name=value, ...)`` sets the figures shown after
    the bar (a string is shown as given, a float to 3 significant digits), ``write(text)``
    prints a line without breaking the bar, and ``close()`` (or leaving the ``with`` block)
    ends it: in a notebook the output becomes :meth:`summary`.
    """

    def __init__(
        self,
        total: int | None,
        desc: str = "",
        unit: str = "it",
        *,
        enabled: bool = True,
        initial: int = 0,
        mode: Mode = "auto",
        file: TextIO | None = None,
        interval: float | None = None,
        display: Callable[..., Any] | None = None,
    ) -> None:
        if total is not None and total < 0:
            raise ValueError(f"total must be >= 0 or None, got {total}")
        if mode not in ("auto", "notebook", "terminal"):
            raise ValueError(
                f"mode must be 'auto', 'notebook' or 'terminal', got {mode!r}"
            )
        self.total = total
        self.desc = desc
        self.unit = unit
        self.enabled = enabled
        self.initial = initial
        self.n = initial
        self.postfix: dict[str, str] = {}
        self.notebook = enabled and (
            mode == "notebook" or (mode == "auto" and in_notebook_kernel())
        )
        self.closed = False
        self._start = time.perf_counter()
        self._elapsed: float | None = None  # fixed at close
        self._tqdm: tqdm | None = None
        self._handle: Any = None
        self._last_draw = float("-inf")
        if not enabled:
            return
        if self.notebook:
            self._interval = NOTEBOOK_INTERVAL_S if interval is None else interval
            self._display = display or _ipython_display
            self._handle = self._display(self._bundle(), raw=True, display_id=True)
            self._last_draw = time.perf_counter()
        else:
            self._tqdm = tqdm(
                total=total,
                desc=desc,
                unit=unit,
                initial=initial,
                file=file if file is not None else sys.stderr,
                mininterval=TERMINAL_INTERVAL_S if interval is None else interval,
            )

    # ------------------------------------------------------------------ what it shows

    @property
    def elapsed(self) -> float:
        """Seconds since the bar was made (frozen when it closes)."""
        return (
            self._elapsed
            if self._elapsed is not None
            else time.perf_counter() - self._start
        )

    def line(self) -> str:
        """The bar as one line of text, as tqdm draws it:
        ``training:  45%|████▌     | 450/1000 [00:05<00:06, 90.00step/s, loss=0.412]``."""
        elapsed = self.elapsed
        rate = (
            (self.n - self.initial) / elapsed
            if elapsed > 0 and self.n > self.initial
            else None
        )
        postfix = ", ".join(f"{k}={v}" for k, v in self.postfix.items()) or None
        return tqdm.format_meter(
            self.n,
            self.total,
            elapsed,
            prefix=self.desc,
            unit=self.unit,
            rate=rate,
            postfix=postfix,
        )

    def summary(self) -> str:
        """The run in one line: ``training: 1000/1000 steps in 12.3 s, loss 0.412, metric 0.987``."""
        units = (
            self.unit
            if self.unit.endswith("s") or self.unit == "it"
            else self.unit + "s"
        )
        count = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        text = f"{count} {units} in {format_seconds(self.elapsed)}"
        figures = ", ".join(f"{k} {v}" for k, v in self.postfix.items())
        return (
            (f"{self.desc}: " if self.desc else "")
            + text
            + (f", {figures}" if figures else "")
        )

    def _bundle(self) -> dict[str, str]:
        """The notebook output: while running, the text bar and an HTML one; closed, the summary."""
        if self.closed:
            return {"text/plain": self.summary()}
        text = self.line()
        if self.total:
            style = "width: 16em; vertical-align: middle"
            bar = f'<progress value="{self.n}" max="{self.total}" style="{style}"></progress>'
        else:
            bar = ""
        return {
            "text/plain": text,
            "text/html": f"<div>{bar} <code>{html.escape(text)}</code></div>",
        }

    def _draw(self, force: bool = False) -> None:
        # No front end took the output (IPython's display outside a kernel).
        if self._handle is None:
            return
        now = time.perf_counter()
        if force or now - self._last_draw >= self._interval:
            self._handle.update(self._bundle(), raw=True)
            self._last_draw = now

    # ------------------------------------------------------------------ what the loop calls

    def update(self, n: int = 1) -> None:
        """Advance by ``n`` units."""
        if not self.enabled or self.closed:
            return
        self.n += n
        if self._tqdm is not None:
            self._tqdm.update(n)
        else:
            self._draw(force=self.total is not None and self.n >= self.total)

    def set_postfix(self, **figures: Any) -> None:
        """Set the figures shown after the bar (they replace the previous ones; shown at the next redraw)."""
        self.postfix = {name: format_value(value) for name, value in figures.items()}
        if self._tqdm is not None:
            self._tqdm.set_postfix(self.postfix, refresh=False)

    def write(self, text: str, file: TextIO | None = None) -> None:
        """Print a line of text (to stdout unless ``file``) without breaking the bar."""
        if self._tqdm is not None:
            tqdm.write(text, file=file if file is not None else sys.stdout)
        else:
            print(text, file=file if file is not None else sys.stdout, flush=True)

    def close(self) -> None:
        """End the bar: the terminal bar stays at its last state; the notebook output becomes the summary."""
        if self.closed:
            return
        self._elapsed = time.perf_counter() - self._start
        self.closed = True
        if self._tqdm is not None:
            self._tqdm.close()
        elif self._handle is not None:
            self._draw(force=True)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ProgressBar({self.line()!r})"


def _ipython_display(bundle: dict[str, str], **kwargs: Any) -> Any:
    from IPython.display import display

    return display(bundle, **kwargs)
