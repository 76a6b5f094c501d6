"""Every section of every chapter runs alone: a reader may copy any one into a fresh notebook.

Each section is executed after its chapter's setup cells only, in a process of its own,
against the package installed from its wheel, with a seed other than the book's and with
ATen's AVX2 kernels (tests/sections.py). So this one execution checks three promises at
once: sections stand alone, every claim holds for other seeds and another CPU's rounding,
and the chapters need nothing but the installed package.
"""

from __future__ import annotations

import pytest
from book_helpers import REPO_ROOT
from sections import FIRST_SEED, SectionRuns, book_sections
from wheel_env import inside

SETUPS, SECTIONS = book_sections()


def test_every_chapter_has_sections():
    """Every chapter notebook on disk is split into at least two sections (not only those that
    happen to have some: a chapter whose headings the splitter missed would vanish silently)."""
    chapters = sorted(p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
    counts = {name: sum(1 for s in SECTIONS if s.notebook == name) for name in chapters}
    assert len(chapters) >= 11, chapters
    assert all(count >= 2 for count in counts.values()), counts


@pytest.mark.parametrize("section", SECTIONS, ids=[s.id for s in SECTIONS])
def test_section_runs_alone(section, section_runs: SectionRuns):
    result = section_runs.results[section.id]
    seed = section_runs.seeds[section.id]
    if not result["ok"]:
        log = section_runs.logs / f"{section.id}.log"
        tail = log.read_text()[-3000:] if log.exists() else ""
        cell, setup = result.get("cell"), len(SETUPS[section.notebook])
        where = (
            "?" if cell is None else f"setup cell {cell + 1}" if cell < setup else f"its code cell {cell - setup + 1}"
        )
        pytest.fail(
            f"{section.notebook}, section {section.index} ({section.title!r}) failed alone in {where} "
            f"with TRANSFORMER_BOOK_SEED={seed} ATEN_CPU_CAPABILITY=avx2:\n{result['error']}\n--- output ---\n{tail}"
        )
    assert inside(result["module_file"], section_runs.env.site_packages), result["module_file"]
    assert inside(result["executable"], section_runs.env.venv), result["executable"]
    assert not [p for p in result["path"] if p and inside(p, REPO_ROOT)], "the repository is on sys.path"


def test_sections_ran_with_other_seeds(section_runs: SectionRuns):
    assert min(section_runs.seeds.values()) == FIRST_SEED != 0
    assert len(set(section_runs.seeds.values())) == len(SECTIONS)
