"""The built site: every page loads offline in headless Chromium and every chart draws; in a
laptop's 1280 x 900 window no code is cut off and no output shows a progress bar line by line.

Uses the session fixture `built_book` (tests/conftest.py). The HTML is served by a
local http.server on 127.0.0.1; every request to any other host is aborted and
recorded, so a page that reaches for a CDN (Vega, MathJax, fonts) fails the test.
"""

from __future__ import annotations

import functools
import html.parser
import http.server
import os
import queue
import re
import shutil
import threading
from concurrent.futures import Future
from pathlib import Path
from urllib.parse import unquote, urlparse

import altair as alt
import nbformat
import pytest
from book_helpers import (
    ALTAIR_DIV_SELECTOR,
    BOOK_ROOT,
    FIT_VIEWPORT,
    MIMETYPE_FALLBACK_MARKERS,
    build_book,
    chapter_line_length,
    fit_problems,
    measure_fit,
    page_names,
    toc_notebooks,
    watch_page,
)

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--no-first-run",
]
MAX_PAGE_BYTES = int(1.5 * 1024 * 1024)
PAGES = page_names()
# The pages made from notebooks: each has code cells, so the fit check must find code on them.
NOTEBOOK_PAGES = {name[: -len(".ipynb")] for name in toc_notebooks()}
CHART_TIMEOUT_MS = 20_000


# --------------------------------------------------------------------------- static checks


def _vega_debug() -> dict[str, str]:
    text = (BOOK_ROOT / "_static" / "vega-offline.js").read_text(encoding="utf-8")
    match = re.search(r"var\s+VEGA_DEBUG\s*=\s*(\{[^}]*\})", text)
    assert match, "_static/vega-offline.js must set `var VEGA_DEBUG = {...}`"
    return dict(re.findall(r'(\w+)\s*:\s*"([^"]*)"', match.group(1)))


def test_vega_offline_versions_match_altair():
    assert _vega_debug() == {
        "vega_version": alt.VEGA_VERSION,
        "vegalite_version": alt.VEGALITE_VERSION,
        "vegaembed_version": alt.VEGAEMBED_VERSION,
    }


def test_vendored_vega_files_exist_and_are_loaded_first():
    import yaml

    vendor = BOOK_ROOT / "_static" / "vendor"
    for name in ("vega.min.js", "vega-lite.min.js", "vega-embed.min.js"):
        assert (vendor / name).stat().st_size > 10_000, f"_static/vendor/{name} missing or truncated"
    js = yaml.safe_load((BOOK_ROOT / "_config.yml").read_text())["sphinx"]["config"]["html_js_files"]
    assert js[:4] == ["vega-offline.js", "vendor/vega.min.js", "vendor/vega-lite.min.js", "vendor/vega-embed.min.js"], (
        js
    )


def test_page_html_size(built_book: Path):
    too_big = {}
    for name in PAGES:
        size = (built_book / f"{name}.html").stat().st_size
        if size > MAX_PAGE_BYTES:
            too_big[name] = f"{size / 1e6:.2f} MB"
    assert not too_big, f"pages over {MAX_PAGE_BYTES / 1e6:.2f} MB (shrink chart data): {too_big}"


def test_no_mimetype_chart_fallbacks(built_book: Path):
    """A chart shown with Altair's mimetype renderer builds as plain text, not a chart."""
    bad = [
        name
        for name in PAGES
        if any(m in (built_book / f"{name}.html").read_text(encoding="utf-8") for m in MIMETYPE_FALLBACK_MARKERS)
    ]
    assert not bad, f"charts rendered as text (use Altair's default html renderer): {bad}"


class _LinkParser(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("name"):
            self.ids.add(attrs["name"])
        for key in ("href", "src"):
            if attrs.get(key):
                self.links.append(attrs[key])


@functools.cache
def _parse(path: Path) -> _LinkParser:
    parser = _LinkParser()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def test_no_broken_internal_links(built_book: Path):
    broken = []
    for page in sorted(built_book.rglob("*.html")):
        if "_static" in page.relative_to(built_book).parts:
            continue
        for link in _parse(page).links:
            url = urlparse(link)
            if url.scheme or url.netloc or link.startswith(("mailto:", "javascript:", "data:")):
                continue
            target = page if not url.path else (page.parent / unquote(url.path)).resolve()
            where = f"{page.relative_to(built_book)} -> {link}"
            if not target.exists():
                broken.append(where)
            elif url.fragment and target.suffix == ".html" and url.fragment not in _parse(target).ids:
                broken.append(where + " (no such anchor)")
    assert not broken, "broken internal links:\n" + "\n".join(broken)


def test_cell_error_fails_the_build(tmp_path: Path):
    """The book's configuration turns a raising cell into a failed build."""
    src = tmp_path / "book"
    src.mkdir()
    shutil.copy(BOOK_ROOT / "_config.yml", src)
    shutil.copytree(BOOK_ROOT / "_static", src / "_static")
    shutil.copytree(BOOK_ROOT / "docs" / "_ext", src / "docs" / "_ext")
    (src / "intro.md").write_text("# Intro\n\nA page.\n")
    (src / "_toc.yml").write_text("format: jb-book\nroot: intro\nchapters:\n  - file: broken\n")
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# Broken"),
        nbformat.v4.new_code_cell("raise ZeroDivisionError('cell error must fail the build')"),
    ]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, src / "broken.ipynb")
    proc = build_book(src, tmp_path / "out", timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, "a notebook cell raised but the build succeeded:\n" + log[-5000:]
    assert "cell error must fail the build" in log, log[-5000:]


# --------------------------------------------------------------------------- browser checks


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def site(built_book: Path):
    handler = functools.partial(_QuietHandler, directory=str(built_book))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def launch_chromium(pw):
    """Headless Chromium from a Playwright instance, with the test's offline arguments."""
    return pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = launch_chromium(pw)
        yield b
        b.close()


CHARTS_DRAWN_JS = """
(selector) => {
  const divs = Array.from(document.querySelectorAll(selector));
  return divs.map(div => {
    const el = div.querySelector('canvas, svg.marks');
    const r = el ? el.getBoundingClientRect() : null;
    return {id: div.id, drawn: !!(r && r.width > 0 && r.height > 0),
            error: (div.querySelector('.error') || {}).textContent || null};
  });
}
"""


def check_page(browser, site: str, name: str) -> dict:
    """Open one built page offline and wait for its charts and its math; returns what the
    page tests check: the page's watch record, each chart's state, the math, the chart
    libraries' versions (on the first page and pages with charts, else None), and the
    code blocks and outputs measured at a laptop's width (``fit``, last: it unfolds code)."""
    context = browser.new_context(viewport=FIT_VIEWPORT, service_workers="block")
    page = context.new_page()
    watch = watch_page(page)
    try:
        page.goto(f"{site}/{name}.html", wait_until="load")
        # MathJax typesets asynchronously; wait for it when the page has math.
        page.evaluate(
            "() => (window.MathJax && MathJax.startup && MathJax.startup.promise) "
            "? MathJax.startup.promise.then(() => true) : true"
        )
        n_charts = page.locator(ALTAIR_DIV_SELECTOR).count()
        if n_charts:
            try:
                page.wait_for_function(
                    "(s) => Array.from(document.querySelectorAll(s)).every(d => "
                    "d.querySelector('canvas, svg.marks') || d.querySelector('.error'))",
                    arg=ALTAIR_DIV_SELECTOR,
                    timeout=CHART_TIMEOUT_MS,
                )
            except Exception:
                pass  # reported by the test, chart by chart
        watch.wait_quiet(page)
        report = {
            "watch": watch,
            "charts": page.evaluate(CHARTS_DRAWN_JS, ALTAIR_DIV_SELECTOR),
            "math": page.evaluate(
                "() => ({tex: document.querySelectorAll('.math').length, "
                "typeset: document.querySelectorAll('mjx-container').length})"
            ),
            "libs": None,
        }
        if name == PAGES[0] or n_charts:
            report["libs"] = page.evaluate(
                "() => ({vega: window.vega && vega.version, "
                "vegalite: window.vegaLite && vegaLite.version, "
                "embed: window.vegaEmbed && vegaEmbed.version})"
            )
        shots = os.environ.get("BOOK_SCREENSHOTS")  # a folder: save a full-page PNG per page
        if shots:
            Path(shots).mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(Path(shots) / (name.replace("/", "__") + ".png")), full_page=True)
        report["fit"] = measure_fit(page)
    finally:
        context.close()
    return report


class PageChecks:
    """:func:`check_page` for every page, ``workers`` pages at a time, from the moment it is made.

    Each worker thread launches its own Chromium: Playwright's synchronous API belongs to the
    thread that started it. Rendering charts and math keeps a browser busy on about one core;
    one browser alone, at the end of the test run, would leave the other cores idle once the
    chapter executions finish."""

    def __init__(self, site: str, names: list[str], workers: int) -> None:
        self._results: dict[str, Future] = {name: Future() for name in names}
        self._todo: queue.SimpleQueue[str] = queue.SimpleQueue()
        for name in names:
            self._todo.put(name)
        self._threads = [threading.Thread(target=self._work, args=(site,), daemon=True) for _ in range(workers)]
        for thread in self._threads:
            thread.start()

    def _next(self) -> str | None:
        try:
            return self._todo.get_nowait()
        except queue.Empty:
            return None

    def _work(self, site: str) -> None:
        from playwright.sync_api import sync_playwright

        try:
            with sync_playwright() as pw:
                chromium = launch_chromium(pw)
                while (name := self._next()) is not None:
                    try:
                        self._results[name].set_result(check_page(chromium, site, name))
                    except Exception as error:  # the page's test reports it
                        self._results[name].set_exception(error)
                chromium.close()
        except Exception as error:  # no browser in this thread: the pages it would have checked fail
            while (name := self._next()) is not None:
                self._results[name].set_exception(error)

    def result(self, name: str) -> dict:
        return self._results[name].result(timeout=600)

    def close(self) -> None:
        for thread in self._threads:
            thread.join(timeout=600)


@pytest.fixture(scope="module")
def page_checks(site: str):
    checks = PageChecks(site, PAGES, workers=min(4, max(2, os.cpu_count() or 2)))
    yield checks
    checks.close()


@pytest.mark.parametrize("name", PAGES)
def test_page_loads_offline_and_charts_draw(name, page_checks, request):
    report = page_checks.result(name)
    watch, charts, math, libs = report["watch"], report["charts"], report["math"], report["libs"]
    if request.config.getoption("verbose") > 0:
        print(f"{name}: {len(charts)} charts, {math}, libs={libs}")
    assert not watch.outside, f"{name}: requests left localhost: {watch.outside}"
    assert not watch.page_errors, f"{name}: page errors: {watch.page_errors}"
    assert not watch.console_errors, f"{name}: console errors: {watch.console_errors}"
    assert not watch.failed, f"{name}: failed local requests: {watch.failed}"
    not_drawn = [c for c in charts if not c["drawn"]]
    assert not not_drawn, f"{name}: charts that did not draw: {not_drawn}"
    if math["tex"]:
        assert math["typeset"] >= 1, f"{name}: page has math but MathJax typeset nothing: {math}"
    if libs is not None:
        assert libs["vega"] and libs["vega"].split(".")[0] == alt.VEGA_VERSION.split(".")[0], libs
        assert libs["vegalite"] == alt.VEGALITE_VERSION, libs
        assert libs["embed"] and libs["embed"].split(".")[0] == alt.VEGAEMBED_VERSION.split(".")[0], libs


@pytest.mark.parametrize("name", PAGES)
def test_code_fits_a_laptop_and_progress_bars_are_one_line(name, page_checks, request):
    """At 1280 x 900 no code cell input or listing hides behind a scroll bar (outputs, such as
    tables and tracebacks, may scroll), and no cell output shows a progress bar redrawn line
    after line. Measured on the page load of the test above."""
    fit = page_checks.result(name)["fit"]
    if request.config.getoption("verbose") > 0:
        print(f"{name}: {fit['blocks']} code blocks, {fit['columns']} characters wide, {fit['outputs']} outputs")
    assert fit["width"] == FIT_VIEWPORT["width"], fit
    if name in NOTEBOOK_PAGES:
        assert fit["inputs"] > 0, f"{name}: no code cell inputs found; the fit check would pass without looking"
        assert fit["columns"] >= chapter_line_length(), (
            f"{name}: the code column holds {fit['columns']:.1f} characters at {FIT_VIEWPORT['width']} px, "
            f"fewer than chapters/ruff.toml's line-length {chapter_line_length()}"
        )
    problems = fit_problems(name, fit)
    assert not problems, "\n".join(problems)


FIT_PROBE_HTML = """<!doctype html><html><body style="width: 400px"><article class="bd-article">
<div class="cell_input"><pre style="font: 14px monospace">short = 1
long_enough_to_be_cut_off = "{long}"</pre></div>
<details><summary>hidden</summary><div class="cell_input"><pre style="font: 14px monospace">{long}</pre></div></details>
<div class="highlight"><pre style="font: 14px monospace">fits()</pre></div>
<div class="cell_output"><div class="output stderr"><pre>{bars}</pre></div>
<div class="output text_plain"><pre>training: 200/200 steps in 1.0 s, loss 0.100</pre></div>
<div class="output text_plain"><pre>{wide}</pre></div></div>
</article></body></html>"""


def test_fit_check_sees_cut_off_code_and_redrawn_bars(browser):
    """The measurement itself, on a made-up page: it finds the cut-off input and the folded one,
    names the first long line, leaves the fitting listing and a wide output alone, and counts
    the redraws of a bar in one output (but not a one-line summary)."""
    bars = "\n".join(f"training: {p:3d}%|{'█' * (p // 10):10s}| {p * 2}/200" for p in range(0, 101, 20))
    html_text = FIT_PROBE_HTML.format(long="x" * 120, bars=bars, wide="y" * 300)
    context = browser.new_context(viewport=FIT_VIEWPORT)
    try:
        page = context.new_page()
        page.set_content(html_text)
        fit = measure_fit(page)
    finally:
        context.close()
    assert fit["blocks"] == 3 and fit["inputs"] == 2 and fit["outputs"] == 3, fit
    assert [o["index"] for o in fit["overflowing"]] == [0, 1], fit
    assert fit["overflowing"][0]["line_no"] == 2 and fit["overflowing"][0]["line"].startswith("long_enough"), fit
    assert [(r["output"], r["lines"]) for r in fit["redraws"]] == [(0, 6)], fit
    problems = fit_problems("probe", fit)
    assert len(problems) == 3 and "line 2" in problems[0] and "6 drawings" in problems[2], problems
