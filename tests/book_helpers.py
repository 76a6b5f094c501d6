"""Helpers shared by the book tests (tests/test_book.py, tests/test_notebooks.py).

The book root defaults to the repository root; set BOOK_ROOT to test another copy
of the book (for example a scratch copy with stub chapters).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
BOOK_ROOT = Path(os.environ.get("BOOK_ROOT", REPO_ROOT)).resolve()

# The command that builds the book: warnings are errors (-W), nitpicky (-n), and
# --keep-going reports every warning before failing.
BUILD_ARGS = ["build", "--all", "-W", "-n", "--keep-going"]

# Per-notebook wall times, filled by tests/test_notebooks.py, printed by conftest.py.
NOTEBOOK_TIMES: dict[str, float] = {}

# Altair's html renderer marks each chart's output div with this id prefix.
ALTAIR_DIV_SELECTOR = 'div[id^="altair-viz"]'

# Text Altair's mimetype renderer leaves behind when the chart was not rendered as HTML.
MIMETYPE_FALLBACK_MARKERS = (
    "&lt;VegaLite ",
    "<VegaLite ",
    "it means the renderer has not been properly enabled",
)


def jupyter_book_command() -> list[str]:
    """`jupyter-book` next to the running Python if present, else from PATH."""
    import shutil
    import sys

    candidate = Path(sys.executable).with_name("jupyter-book")
    exe = str(candidate) if candidate.exists() else shutil.which("jupyter-book")
    if exe is None:
        raise RuntimeError("jupyter-book is not installed (pip install -r requirements.txt)")
    return [exe]


def build_book(source: Path, output: Path, timeout: float = 3600) -> subprocess.CompletedProcess:
    """Build the book at `source` into `output/_build/html`; returns the finished process."""
    return subprocess.run(
        jupyter_book_command() + BUILD_ARGS + ["--path-output", str(output), str(source)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=os.environ.copy(),
    )


def heaviest_first(notebooks: list[str]) -> list[str]:
    """``notebooks`` (in reading order) in the order to start their executions: backwards.

    The later chapters train and decode and take a minute or more; the early ones take
    seconds. Started first, the long executions overlap each other, and the many short
    ones fill every core at the end instead of one long one running alone."""
    return notebooks[::-1]


def fill_build_cache(
    source: Path, output: Path, workers: int = 2, core_free: Path | None = None
) -> subprocess.CompletedProcess:
    """Execute the book's notebooks ``workers`` at a time into the jupyter-cache that
    ``build_book(source, output)`` reads (tests/fill_cache.py), so the build finds them executed.
    ``core_free``: a file to create once a worker has no notebook left to start."""
    timeout = load_config(source).get("execute", {}).get("timeout", 300)
    return subprocess.run(
        [sys.executable, str(Path(__file__).with_name("fill_cache.py")), str(source),
         str(output / "_build" / ".jupyter_cache"), *heaviest_first(toc_notebooks(source)),
         "--workers", str(workers), "--timeout", str(timeout), *(["--core-free", str(core_free)] if core_free else [])],
        capture_output=True, text=True, env=os.environ.copy(),
    )  # fmt: skip


def load_config(root: Path = BOOK_ROOT) -> dict:
    return yaml.safe_load((root / "_config.yml").read_text(encoding="utf-8"))


def load_toc(root: Path = BOOK_ROOT) -> dict:
    return yaml.safe_load((root / "_toc.yml").read_text(encoding="utf-8"))


def toc_files(root: Path = BOOK_ROOT) -> list[str]:
    """Every `file:` entry of _toc.yml, root first, in reading order (no extensions)."""
    toc = load_toc(root)
    out = [toc["root"]]

    def walk(entries):
        for entry in entries or []:
            if "file" in entry:
                out.append(entry["file"])
            walk(entry.get("sections"))

    for part in toc.get("parts", []):
        walk(part.get("chapters"))
    walk(toc.get("chapters"))
    return [re.sub(r"\.(ipynb|md)$", "", f) for f in out]


def toc_notebooks(root: Path = BOOK_ROOT) -> list[str]:
    """The notebook toc entries under chapters/, as paths relative to the book root, with .ipynb.

    Entries that are MyST markdown pages (``chapters/appendix/d_api.md``) are not notebooks."""
    return [f + ".ipynb" for f in toc_files(root) if f.startswith("chapters/") and not (root / f"{f}.md").exists()]


def chapter_notebooks_on_disk(root: Path = BOOK_ROOT) -> list[str]:
    return sorted(
        p.relative_to(root).as_posix()
        for p in (root / "chapters").rglob("*.ipynb")
        if ".ipynb_checkpoints" not in p.parts
    )


def notebooks_in_git(root: Path = BOOK_ROOT) -> list[Path]:
    """Notebooks git tracks or would add (tracked + untracked, not ignored)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "*.ipynb"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        # Not a git checkout (e.g. an unpacked archive): every notebook outside ignored folders.
        return sorted(p for p in root.rglob("*.ipynb") if not {".ipynb_checkpoints", "_build"} & set(p.parts))
    return sorted(root / line for line in out.splitlines() if line.strip())


def page_names(root: Path = BOOK_ROOT) -> list[str]:
    """Built pages to open in the browser: the root page and every toc entry."""
    return toc_files(root)


@dataclass
class PageWatch:
    """What a browser page did that the tests forbid: requests that tried to leave localhost
    (aborted), console errors, uncaught page errors, and local requests that failed."""

    outside: list[str] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    # Requests started and not yet finished or failed, and when the last one started or ended.
    in_flight: set = field(default_factory=set)
    last_change: float = field(default_factory=time.monotonic)

    def note(self, request, started: bool) -> None:
        (self.in_flight.add if started else self.in_flight.discard)(request)
        self.last_change = time.monotonic()

    def wait_quiet(self, page, quiet_s: float = 0.5, timeout_s: float = 60.0) -> None:
        """Wait until no request of the page has been in flight for ``quiet_s`` seconds.

        Playwright's own ``networkidle`` wait is unreliable (its documentation discourages it):
        on a long page it sometimes never resolves, though every request has finished and
        Chromium itself reports the network idle. This counts the page's own request events."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight or time.monotonic() - self.last_change < quiet_s:
            if time.monotonic() > deadline:
                urls = [r.url for r in self.in_flight]
                raise TimeoutError(f"requests still in flight after {timeout_s:.0f}s: {urls}")
            page.wait_for_timeout(100)


def watch_page(page) -> PageWatch:
    """Keep a Playwright ``page`` on localhost (anything else is aborted and noted) and record
    its errors; returns the record, which fills as the page runs."""
    watch = PageWatch()

    def route(r) -> None:
        if urlparse(r.request.url).hostname == "127.0.0.1":
            r.continue_()
        else:
            watch.outside.append(r.request.url)
            r.abort()

    def local_failure(r) -> None:
        if urlparse(r.url).hostname == "127.0.0.1":
            watch.failed.append(f"failed {r.url}")

    page.route("**/*", route)
    page.on("request", lambda r: watch.note(r, started=True))
    page.on("requestfinished", lambda r: watch.note(r, started=False))
    page.on("requestfailed", lambda r: watch.note(r, started=False))
    page.on("console", lambda m: watch.console_errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: watch.page_errors.append(str(e)))
    page.on("response", lambda r: watch.failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    page.on("requestfailed", local_failure)
    return watch


# --------------------------------------------------------------------------- code that fits, progress bars

# The window the book's code must fit: a laptop's 1280 x 900 (_static/page-fit.css lays the page out for it).
FIT_VIEWPORT = {"width": 1280, "height": 900}
# Pixels a code block may be wider than its column before it counts as cut off (rounding).
FIT_SLACK_PX = 2
# One drawing of a progress bar, as tqdm writes it: "training:  45%|████▌     | 450/1000 [...]",
# or a bar of block characters between pipes without a percentage. A JavaScript regular expression.
PROGRESS_LINE = r"\d{1,3}%\||\|[\u2588-\u258F#\s]*[\u2588-\u258F][\u2588-\u258F#\s]*\|"


def chapter_line_length(root: Path = BOOK_ROOT) -> int:
    """The widest line the chapters may hold, in characters: chapters/ruff.toml's
    ``max-line-length`` (code is formatted narrower, to its ``line-length``)."""
    text = (root / "chapters" / "ruff.toml").read_text(encoding="utf-8")
    match = re.search(r"^max-line-length\s*=\s*(\d+)", text, flags=re.MULTILINE)
    assert match, "chapters/ruff.toml sets no max-line-length"
    return int(match.group(1))


# Measures a loaded page's article in one call: every code block that is not a cell's output
# (code cell inputs, literalinclude listings, code fences), and every cell output. Folded code
# (hide-input cells, solutions) is unfolded first, as a reader would. Returns the window's
# width, how many code blocks and cell inputs there are, how many characters the first cell
# input's column holds, the blocks wider than their column (index among the page's code
# blocks, kind, widths, first line too long for the column) and the outputs that hold more
# than one drawing of a progress bar.
FIT_JS = """
({slack, progress}) => {
  const article = document.querySelector('article.bd-article') || document.body;
  article.querySelectorAll('details').forEach(d => { d.open = true; });
  article.querySelectorAll('.toggle-hidden').forEach(e => e.classList.remove('toggle-hidden'));
  const ctx = document.createElement('canvas').getContext('2d');
  const font = el => {
    const s = getComputedStyle(el);
    return `${s.fontStyle} ${s.fontWeight} ${s.fontSize} ${s.fontFamily}`;
  };
  const room = pre => {
    const s = getComputedStyle(pre);
    return pre.clientWidth - parseFloat(s.paddingLeft) - parseFloat(s.paddingRight);
  };
  const blocks = Array.from(article.querySelectorAll('pre')).filter(p => !p.closest('.cell_output'));
  const inputs = blocks.filter(p => p.closest('.cell_input'));
  let columns = null;
  if (inputs.length) {
    ctx.font = font(inputs[0]);
    columns = room(inputs[0]) / ctx.measureText('x'.repeat(100)).width * 100;
  }
  const overflowing = [];
  blocks.forEach((pre, index) => {
    if (pre.scrollWidth <= pre.clientWidth + slack) return;
    ctx.font = font(pre);
    const lines = pre.textContent.replace(/\\n$/, '').split('\\n');
    const widths = lines.map(line => ctx.measureText(line).width);
    let at = widths.findIndex(w => w > room(pre) + slack);
    if (at < 0) at = widths.indexOf(Math.max(...widths));
    overflowing.push({index, kind: pre.closest('.cell_input') ? 'input' : 'listing',
                      scrollWidth: pre.scrollWidth, clientWidth: pre.clientWidth,
                      line_no: at + 1, chars: lines[at].length, line: lines[at]});
  });
  const bar = new RegExp(progress);
  const outputs = Array.from(article.querySelectorAll('.cell_output > *'));
  const redraws = [];
  outputs.forEach((out, index) => {
    const lines = out.textContent.split(/[\\r\\n]+/).filter(line => bar.test(line));
    if (lines.length > 1) redraws.push({output: index, lines: lines.length,
                                        first: lines[0].trim(), last: lines[lines.length - 1].trim()});
  });
  return {width: window.innerWidth, blocks: blocks.length, inputs: inputs.length, outputs: outputs.length,
          columns, overflowing, redraws};
}
"""


def measure_fit(page) -> dict:
    """Run :data:`FIT_JS` on a loaded Playwright ``page`` (sized :data:`FIT_VIEWPORT`)."""
    return page.evaluate(FIT_JS, {"slack": FIT_SLACK_PX, "progress": PROGRESS_LINE})


def fit_problems(name: str, fit: dict) -> list[str]:
    """What :func:`measure_fit` found wrong on page ``name``, one line each (empty: all good)."""
    problems = [
        f"{name}: code block {o['index']} ({o['kind']}) is cut off at {FIT_VIEWPORT['width']} px "
        f"({o['scrollWidth']} px of code in {o['clientWidth']} px): line {o['line_no']}, "
        f"{o['chars']} characters: {o['line']!r}"
        for o in fit["overflowing"]
    ]
    problems += [
        f"{name}: cell output {r['output']} holds {r['lines']} drawings of a progress bar "
        f"(one line is enough): first {r['first']!r}, last {r['last']!r}"
        for r in fit["redraws"]
    ]
    return problems
