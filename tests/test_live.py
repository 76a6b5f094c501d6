"""Chapter 10's live model, in headless Chromium, offline, against the package.

Uses the book that tests/conftest.py builds (the `built_book` fixture through `site`).
One page session: start the model once, type held-out dates, compare the page's tokens
with tb.greedy_decode and its heatmap with PyTorch's cross-attention, then type the
inputs the model cannot read and check the message. No request may leave 127.0.0.1
and nothing may reach the console as an error.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from book_helpers import REPO_ROOT, watch_page
from test_book import browser, site  # noqa: F401  (fixtures: the built site on 127.0.0.1, Chromium)

import transformer_book as tb
from transformer_book.data import date_to_french

PAGE = "chapters/10_try_it"
DATES = 24  # held-out dates typed into the page: the first ones of the task's held-out list
TIMEOUT_MS = 60_000
# What the page may add to the first load of any other page (the theme, Vega, fonts): its script and style.
EXTRA_FIRST_LOAD_MAX_BYTES = 50_000

# Read back after each translation: the tokens the page chose, and the heatmap's data as Vega holds it.
READ_RESULT_JS = """
() => ({
  ids: JSON.parse(document.querySelector('#live-iso').dataset.ids),
  source: JSON.parse(document.querySelector('#live-iso').dataset.source),
  weights: window.liveDates.view.data('weights').map(d => [d.head, d.step, d.position, d.weight]),
})
"""
# Bytes the page fetched so far, per file (decoded sizes, so caching does not hide any).
RESOURCES_JS = """
() => [[location.href, performance.getEntriesByType('navigation')[0].decodedBodySize]].concat(
  performance.getEntriesByType('resource').map(e => [e.name, e.decodedBodySize]))
"""


def _submit(page, text: str, count: int) -> None:
    """Type `text`, press Enter, wait until the page has handled translation number `count`."""
    page.fill("#live-input", text)
    page.press("#live-input", "Enter")
    page.wait_for_function(
        "(n) => Number(document.getElementById('live-dates').dataset.translations) >= n", arg=count, timeout=TIMEOUT_MS
    )


def _weights(rows: list, heads: int, outputs: int, words: int) -> np.ndarray:
    grid = np.full((heads, outputs, words), np.nan)
    for head, step, position, weight in rows:
        grid[head - 1, step - 1, position - 1] = weight
    return grid


def run_session(site_url: str, chromium, trained: tb.TrainedModel, dates: int = DATES) -> dict:
    """Drive the page; returns what it showed and what the browser reported."""
    task, model = trained.task, trained.model
    context = chromium.new_context(viewport={"width": 1280, "height": 1000}, service_workers="block")
    page = context.new_page()
    watch = watch_page(page)
    report: dict = {"mismatches": [], "worst_weight_gap": 0.0, "messages": {}}
    try:
        page.goto(f"{site_url}/intro.html", wait_until="load")  # any other page, for comparison
        watch.wait_quiet(page)
        report["other_page_load"] = dict(page.evaluate(RESOURCES_JS))
        page.goto(f"{site_url}/{PAGE}.html", wait_until="load")
        watch.wait_quiet(page)
        report["first_load"] = dict(page.evaluate(RESOURCES_JS))
        page.click("#live-start")
        page.wait_for_function(
            "() => window.liveDates.timings && window.liveDates.timings.startToFirstMs", timeout=TIMEOUT_MS
        )
        report["start_to_first_ms"] = page.evaluate("() => window.liveDates.timings.startToFirstMs")
        report["after_start"] = dict(page.evaluate(RESOURCES_JS))
        count = int(page.get_attribute("#live-dates", "data-translations"))
        count += 1  # known words in an order no date has: a guess, not a message
        _submit(page, "mai mai mai", count)
        report["nonsense"] = (page.get_attribute("#live-dates", "data-state"), page.evaluate(READ_RESULT_JS)["ids"])
        last = f"decoder.layers.{model.config.num_layers - 1}.cross_attn"
        for date in task.test_dates[:dates]:
            words = task.sources[date]
            count += 1
            _submit(page, date_to_french(date), count)  # as a reader writes it: "vingt-trois", hyphenated
            shown = page.evaluate(READ_RESULT_JS)
            src = torch.tensor([task.src_vocab.encode(words)])
            expected = tb.greedy_decode(model, src, task.tgt_len, task.bos_id, task.eos_id)
            with torch.no_grad(), tb.record_attention(model) as maps:
                model(src, expected[:, :-1])
            reference = maps[last][0].numpy()  # (heads, outputs, words)
            if shown["source"] != src[0].tolist() or shown["ids"] != expected[0].tolist():
                report["mismatches"].append((" ".join(words), shown["ids"], expected[0].tolist()))
                continue
            grid = _weights(shown["weights"], *reference.shape)
            report["worst_weight_gap"] = max(report["worst_weight_gap"], float(np.abs(grid - reference).max()))
        too_long = " ".join(["mille"] * (task.src_len + 1))
        for name, text in {
            "unknown": "vingt-trois novembre deux mille vingt-sixx",
            "capital": "Vingt-trois novembre deux mille vingt-six",
            "empty": "   ",
            "too long": too_long,
        }.items():
            count += 1
            _submit(page, text, count)
            report["messages"][name] = (
                page.get_attribute("#live-dates", "data-state"),
                page.is_visible("#live-message"),
                page.inner_text("#live-message"),
            )
        report["iso_after_rejections"] = page.evaluate("() => window.liveDates.last.iso")
        report["dimmed_after_rejections"] = page.evaluate(
            "() => document.getElementById('live-dates').classList.contains('live-stale')"
        )
    finally:
        context.close()
    report.update(dataclasses.asdict(watch))
    return report


@pytest.fixture(scope="module")
def trained() -> tb.TrainedModel:
    return tb.trained_model("dates", device=torch.device("cpu"))


def test_live_model_translates_like_the_package(site, browser, built_book: Path, trained):  # noqa: F811
    report = run_session(site, browser, trained)
    first, other = report["first_load"], report["other_page_load"]
    print(
        f"start to first translation {report['start_to_first_ms']:.0f} ms; first load {sum(first.values()):,} bytes "
        f"(another page: {sum(other.values()):,}); after start {sum(report['after_start'].values()):,} bytes; "
        f"worst heatmap weight gap {report['worst_weight_gap']:.1e} over {DATES} dates"
    )
    assert not report["outside"], f"requests left localhost: {report['outside']}"
    assert not report["page_errors"] and not report["console_errors"], (report["page_errors"], report["console_errors"])
    assert not report["failed"], report["failed"]

    # Nothing heavy before the reader asks: no runtime, no model in the first load.
    assert not [url for url in first if "/_static/live/ort/" in url or "/_static/live/model/" in url], first
    shared = {url.split("?")[0] for url in other}
    extra = {url: size for url, size in first.items() if url.split("?")[0] not in shared and not url.endswith(".html")}
    assert sum(extra.values()) <= EXTRA_FIRST_LOAD_MAX_BYTES, extra
    fetched = [url for url in report["after_start"] if "/_static/live/" in url]
    assert any(url.endswith(".wasm") for url in fetched) and any(url.endswith("decoder.onnx") for url in fetched)

    assert not report["mismatches"], report["mismatches"]
    assert report["worst_weight_gap"] <= 1e-4, report["worst_weight_gap"]

    state, ids = report["nonsense"]
    assert state == "done" and len(ids) > 1, report["nonsense"]

    messages = report["messages"]
    for name, (state, visible, text) in messages.items():
        assert state == "rejected" and visible, (name, state, visible, text)
    assert "“sixx”" in messages["unknown"][2] and "novembre" in messages["unknown"][2]
    assert "“Vingt”" in messages["capital"][2] and "“vingt”, in lower case" in messages["capital"][2]
    assert "Type a date" in messages["empty"][2]
    assert f"{trained.task.src_len + 1} words" in messages["too long"][2]
    # A rejected input leaves the last translation as it was, dimmed.
    assert report["iso_after_rejections"] == trained.task.test_dates[DATES - 1].isoformat()
    assert report["dimmed_after_rejections"]


def test_live_files_only_where_needed(built_book: Path, trained):
    """The page's script is on its page only; the model in the site is today's package's."""
    assert "live/live.js" in (built_book / f"{PAGE}.html").read_text(encoding="utf-8")
    others = [p for p in built_book.rglob("*.html") if "_static" not in p.parts and p.name != Path(PAGE).name + ".html"]
    assert others and not [p for p in others if "live/live.js" in p.read_text(encoding="utf-8")]
    live = built_book / "_static" / "live"
    spec = json.loads((live / "model" / "tokenizer.json").read_text(encoding="utf-8"))
    assert spec["source_tokens"] == trained.task.src_vocab.tokens
    assert (spec["steps"], spec["accuracy"]) == (trained.steps, trained.accuracy)  # made from the shipped checkpoint
    assert (live / "ort" / "ort-wasm-simd-threaded.wasm").stat().st_size > 1_000_000
    assert sum(info["bytes"] for info in spec["files"].values()) <= tb.book.export.MAX_MODEL_BYTES


def test_build_fails_without_onnxruntime_web(tmp_path: Path):
    """A book root without node_modules/ gets an error that says what to run, not a page that cannot start."""
    from sphinx.errors import ExtensionError

    sys.path.insert(0, str(REPO_ROOT / "docs" / "_ext"))
    try:
        import live_model
    finally:
        sys.path.remove(str(REPO_ROOT / "docs" / "_ext"))
    with pytest.raises(ExtensionError, match="npm ci"):
        live_model.ort_sources(tmp_path)
    assert [p.name for p in live_model.ort_sources(REPO_ROOT)] == list(live_model.ORT_FILES)
