"""Chapters cut into sections, and the run that executes each section alone.

A chapter's **setup** is every cell before its first `## ` heading (the install cell,
imports, device and seed). A **section** runs from a markdown cell holding a `## `
heading to the next one. `run_sections` executes, for every section of every chapter,
the setup cells and then that section's cells in a process of their own
(tests/section_runner.py), with the Python of the wheel's venv, another seed per section
and ATen's AVX2 kernels. It is the suite's second execution of every chapter.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from book_helpers import BOOK_ROOT, heaviest_first, toc_notebooks
from wheel_env import ColabEnv

RUNNER = Path(__file__).with_name("section_runner.py")
HEADING = re.compile(r"^## ", re.MULTILINE)
SECTION_TIMEOUT_S = 300
# Seeds other than the book's (0): section i of the run uses FIRST_SEED + i, so one run
# covers many seeds. TRANSFORMER_BOOK_TEST_SEED moves the whole range.
FIRST_SEED = int(os.environ.get("TRANSFORMER_BOOK_TEST_SEED", "1"))
CPU_KERNELS = "avx2"  # ATEN_CPU_CAPABILITY: what a CPU without AVX-512 runs


@dataclass(frozen=True)
class Section:
    notebook: str  # relative to the book root
    index: int  # 1, 2, ... in reading order
    title: str
    cells: tuple[str, ...]  # the section's code cells

    @property
    def id(self) -> str:
        return f"{Path(self.notebook).stem}-s{self.index:02d}"


def split_notebook(path: Path) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(setup code cells, [(section title, section code cells), ...]) of one notebook."""
    nb = nbformat.read(path, as_version=4)
    setup: list[str] = []
    sections: list[tuple[str, list[str]]] = []
    for cell in nb.cells:
        if cell.cell_type == "markdown" and HEADING.search(cell.source):
            title = HEADING.split(cell.source, maxsplit=1)[1].splitlines()[0].strip()
            sections.append((title, []))
        elif cell.cell_type == "code":
            (sections[-1][1] if sections else setup).append(cell.source)
    return setup, sections


def book_sections(
    root: Path = BOOK_ROOT, notebooks: list[str] | None = None
) -> tuple[dict[str, list[str]], list[Section]]:
    """Every notebook's setup cells, and every section of the book that has code."""
    setups, found = {}, []
    for notebook in notebooks or toc_notebooks(root):
        setup, sections = split_notebook(root / notebook)
        setups[notebook] = setup
        for index, (title, cells) in enumerate(sections, start=1):
            if cells:
                found.append(Section(notebook, index, title, tuple(cells)))
    return setups, found


@dataclass
class SectionRuns:
    """The outcome of every section's run: ``results[section.id]`` is the runner's report."""

    sections: list[Section]
    results: dict[str, dict]
    seeds: dict[str, int]
    seconds: float
    logs: Path
    env: ColabEnv | None
    stdout: str = field(repr=False, default="")


def run_sections(
    env: ColabEnv | None,
    work: Path,
    workers: int | None = None,
    notebooks: list[str] | None = None,
    start_when: Path | None = None,
    one_when: Path | None = None,
) -> SectionRuns:
    """Run every section alone (see the module docstring); returns every section's report.

    ``env`` is the wheel's venv; ``None`` runs with this Python (the checkout's package).
    ``workers`` sections run at a time (default: one per core), none before the file
    ``start_when`` exists, if one is given, but one alone once ``one_when`` exists.
    """
    setups, sections = book_sections(notebooks=notebooks)
    work.mkdir(parents=True, exist_ok=True)
    jobs, seeds = [], {}
    for i, section in enumerate(sections):
        # A reader's folder: nothing from the repository next to the notebook.
        folder = work / "reader" / Path(section.notebook).parent
        folder.mkdir(parents=True, exist_ok=True)
        seeds[section.id] = FIRST_SEED + i
        jobs.append({"id": section.id, "notebook": section.notebook, "folder": str(folder),
                     "seed": seeds[section.id], "cells": setups[section.notebook] + list(section.cells)})  # fmt: skip
    # Seeds follow reading order; the runs start with the last chapters, the longest.
    start_order = {notebook: rank for rank, notebook in enumerate(heaviest_first(list(setups)))}
    jobs.sort(key=lambda job: start_order[job["notebook"]])
    (work / "jobs.json").write_text(json.dumps(jobs))
    workers = workers or os.cpu_count() or 2  # each section uses one thread
    environment = {**(env.env if env else os.environ), "ATEN_CPU_CAPABILITY": CPU_KERNELS, "MPLBACKEND": "Agg"}
    start = time.perf_counter()
    wait = ["--start-when", str(start_when)] if start_when else []
    wait += ["--one-when", str(one_when)] if one_when else []
    proc = subprocess.run(
        [str(env.python if env else sys.executable), str(RUNNER), str(work / "jobs.json"), str(work / "results"),
         "--workers", str(workers), "--timeout", str(SECTION_TIMEOUT_S), *wait],
        capture_output=True, text=True, env=environment, cwd=work,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, (
        f"the section runner failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    results = {}
    for section in sections:
        report = work / "results" / f"{section.id}.json"
        results[section.id] = json.loads(report.read_text()) if report.exists() else {
            "ok": False, "error": "the section's process died without a report", "seconds": 0.0}  # fmt: skip
    return SectionRuns(sections, results, seeds, seconds, work / "results", env, proc.stdout)


def main() -> int:
    """Check chapters by hand: ``python tests/sections.py chapters/03_attention.ipynb ...``.

    Runs each section of the given notebooks alone with this Python (other seeds, AVX2
    kernels, as the test suite does) and prints what failed.
    """
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="paths relative to the book root (default: all)")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sections-"))
    runs = run_sections(None, work, args.workers, [str(Path(n)) for n in args.notebooks] or None)
    failed = 0
    for section in runs.sections:
        result = runs.results[section.id]
        status = "ok" if result["ok"] else "FAILED"
        print(f"{status:6} {result['seconds']:6.1f}s  {section.id}  seed {runs.seeds[section.id]}  {section.title}")
        if not result["ok"]:
            failed += 1
            print("    " + result["error"].strip().replace("\n", "\n    ")[-2500:])
    print(
        f"{len(runs.sections) - failed}/{len(runs.sections)} sections ran alone "
        f"in {runs.seconds:.0f}s (logs: {runs.logs})"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
