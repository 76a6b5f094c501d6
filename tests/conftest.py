"""Shared fixtures for the book tests.

`built_book` builds the whole book once per test session, exactly as CI and the
README do (`jupyter-book build --all -W -n --keep-going`), into a temporary folder,
and returns the folder holding the HTML. Set BOOK_ROOT to build another copy of the
book (default: the repository root).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from book_helpers import BOOK_ROOT, NOTEBOOK_TIMES, build_book


# The package tests use small models, for which one thread is as fast as two; with two, a
# busy shared machine (the kernels of the notebook tests run beside them) makes PyTorch's
# threads wait on each other and a 10-second training test takes minutes.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def book_root() -> Path:
    return BOOK_ROOT


@pytest.fixture(scope="session")
def built_book(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the book once; fail with the build log if the build fails. Returns the html dir."""
    out = tmp_path_factory.mktemp("book")
    start = time.perf_counter()
    proc = build_book(BOOK_ROOT, out)
    seconds = time.perf_counter() - start
    log = proc.stdout + "\n" + proc.stderr
    assert proc.returncode == 0, (
        f"jupyter-book build failed (exit {proc.returncode}) after {seconds:.0f}s "
        f"for {BOOK_ROOT}:\n{log[-20000:]}"
    )
    html = out / "_build" / "html"
    assert (html / "index.html").exists(), f"no index.html in {html}:\n{log[-5000:]}"
    print(f"\nbook built in {seconds:.1f}s -> {html}")
    return html


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if NOTEBOOK_TIMES:
        terminalreporter.section("notebook execution times")
        for name, seconds in sorted(NOTEBOOK_TIMES.items()):
            terminalreporter.write_line(f"{seconds:7.1f}s  {name}")
