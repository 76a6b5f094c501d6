"""Shared fixtures for the book tests, and the two executions that cost the suite most.

Every chapter is executed twice per test run, and both executions start in the
background as soon as the tests are collected, so they overlap with the package tests:

1. **The book build** (`built_book`): `jupyter-book build --all -W -n --keep-going`, exactly
   as CI and the README run it, into a temporary folder. Every chapter is executed once,
   with the book's seeds, into the build's jupyter-cache: two at a time by tests/fill_cache.py
   (in kernels forked from one that has imported the libraries, tests/forked_kernels.py)
   just before the build, which then finds them executed. tests/test_notebooks.py reads
   that cache instead of executing the chapters again, and tests/test_book.py checks the HTML.
2. **The sections run** (`section_runs`): the package's wheel in a fresh venv (the Colab
   path), and every section of every chapter executed alone, after the chapter's setup
   cells, with other seeds (`TRANSFORMER_BOOK_SEED`) and ATen's AVX2 kernels
   (`ATEN_CPU_CAPABILITY=avx2`, the float rounding of another CPU kind): one per core,
   from the moment the build has executed its chapters, and one alone from the moment
   the build has a core to spare (its last chapter running alone): fewer executions at
   a time than starting beside the build, for the same total time.

Tests that need either are moved to the end of the run. Set BOOK_ROOT to build another
copy of the book (default: the repository root).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from book_helpers import BOOK_ROOT, NOTEBOOK_TIMES, build_book, fill_build_cache
from sections import SectionRuns, run_sections
from wheel_env import ColabEnv, make_wheel_env

from transformer_book.book.export import EXPORT_CACHE

# The package tests use small models, for which one thread is as fast as two; with two, a
# busy shared machine (the executions above run beside them) makes PyTorch's threads wait
# on each other and a 10-second training test takes minutes.
torch.set_num_threads(1)
# The same for the two background executions: three streams of work share the cores, and
# PyTorch's threads waiting on each other would cost more than they give.
os.environ.setdefault("OMP_NUM_THREADS", "1")

_scratch = Path(tempfile.mkdtemp(prefix="transformer-book-tests-"))
# The book build, chapter 10, its sections and tests/test_export.py export the same model to
# ONNX, a few seconds each: the first traces it, the others copy its files (export_onnx's
# cache, keyed by the weights, the code and the library versions; see book/export.py).
os.environ[EXPORT_CACHE] = str(_scratch / "onnx-exports")
_pool = ThreadPoolExecutor(
    max_workers=len(("built_book", "wheel_env", "section_runs")), thread_name_prefix="background"
)
_jobs: dict[str, Future] = {}
_jobs_lock = threading.Lock()


# Created when the book build has executed every chapter: the sections run starts then,
# and its first section as soon as one chapter alone is left running (a core is idle).
_CHAPTERS_DONE = _scratch / "chapters-done"
_CORE_FREE = _scratch / "core-free"


def _build() -> tuple[Path, float, str]:
    out = _scratch / "book"
    start = time.perf_counter()
    try:
        # The chapters, two at a time, into the cache the build reads; one that fails there is
        # executed again by the build, which reports it.
        filled = fill_build_cache(BOOK_ROOT, out, core_free=_CORE_FREE)
    finally:
        _CHAPTERS_DONE.touch()
    proc = build_book(BOOK_ROOT, out)
    seconds = time.perf_counter() - start
    log = filled.stdout + filled.stderr[-5000:] + "\n" + proc.stdout + "\n" + proc.stderr
    assert proc.returncode == 0, (
        f"jupyter-book build failed (exit {proc.returncode}) after {seconds:.0f}s for {BOOK_ROOT}:\n{log[-20000:]}"
    )
    return out, seconds, log


def _wheel_env() -> ColabEnv:
    root = _scratch / "wheel"
    root.mkdir()
    return make_wheel_env(root)


def _sections() -> SectionRuns:
    env = _job("wheel_env", _wheel_env)
    # Without the book build (tests that need the sections alone), start at once.
    start_when, one_when = (_CHAPTERS_DONE, _CORE_FREE) if "built_book" in _jobs else (None, None)
    return run_sections(env.result(), _scratch / "sections", start_when=start_when, one_when=one_when)


JOBS: dict[str, Callable] = {"built_book": _build, "wheel_env": _wheel_env, "section_runs": _sections}


def _job(name: str, function: Callable | None = None) -> Future:
    """The background job `name`, started now if it has not been."""
    with _jobs_lock:
        if name not in _jobs:
            _jobs[name] = _pool.submit(function or JOBS[name])
        return _jobs[name]


def _needs(item: pytest.Item) -> set[str]:
    """The background jobs a test waits for (through any fixture it uses, directly or not)."""
    names = set(getattr(item, "fixturenames", ()))
    if names & {"built_book_output", "built_book_log"}:
        names.add("built_book")
    return names & set(JOBS)


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and "not book" not in (config.option.markexpr or ""):
        # Under pytest-xdist each worker would build the book and run every section again.
        raise pytest.UsageError("the book's tests run in one process: drop -n, or add -m 'not book'")
    config.addinivalue_line(
        "markers", "book: needs the book build or the sections run (`pytest -m 'not book'`: the package alone)"
    )


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _needs(item):
            item.add_marker(pytest.mark.book)
    # Tests that wait for a background execution run last, so the others overlap with it.
    items.sort(key=lambda item: bool(_needs(item)))


def pytest_collection_finish(session: pytest.Session) -> None:
    needed = set().union(*(_needs(item) for item in session.items)) if session.items else set()
    if "built_book" in needed:
        _job("built_book")
    if needed & {"section_runs", "wheel_env"}:
        _job("section_runs" if "section_runs" in needed else "wheel_env")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _pool.shutdown(wait=True, cancel_futures=True)
    # The venv holds about 1 GB (torch); pytest would not clean a folder it did not make.
    if not os.environ.get("KEEP_TEST_SCRATCH"):
        shutil.rmtree(_scratch, ignore_errors=True)


@pytest.fixture(scope="session")
def book_root() -> Path:
    return BOOK_ROOT


@pytest.fixture(scope="session")
def built_book_output() -> Path:
    """The folder the book was built into (its `_build/` holds `html/` and the jupyter-cache)."""
    out, seconds, _ = _job("built_book").result()
    NOTEBOOK_TIMES["book build (every chapter executed once)"] = seconds
    return out


@pytest.fixture(scope="session")
def built_book_log(built_book_output: Path) -> str:
    """What tests/fill_cache.py and `jupyter-book build` printed."""
    return _job("built_book").result()[2]


@pytest.fixture(scope="session")
def built_book(built_book_output: Path) -> Path:
    """The built HTML folder."""
    html = built_book_output / "_build" / "html"
    assert (html / "index.html").exists(), f"no index.html in {html}"
    return html


@pytest.fixture(scope="session")
def wheel_env() -> ColabEnv:
    env = _job("wheel_env").result()
    NOTEBOOK_TIMES["colab path: wheel + venv setup"] = env.setup_seconds
    return env


@pytest.fixture(scope="session")
def section_runs() -> SectionRuns:
    runs = _job("section_runs").result()
    NOTEBOOK_TIMES["sections alone (other seeds, AVX2), wall time with its wait"] = runs.seconds
    slowest = sorted(runs.results.items(), key=lambda item: -item[1]["seconds"])[:8]
    for section_id, result in slowest:  # where the suite's time goes
        NOTEBOOK_TIMES[f"  section {section_id}"] = result["seconds"]
    return runs


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if NOTEBOOK_TIMES:
        terminalreporter.section("execution times")
        for name, seconds in sorted(NOTEBOOK_TIMES.items()):
            terminalreporter.write_line(f"{seconds:7.1f}s  {name}")
