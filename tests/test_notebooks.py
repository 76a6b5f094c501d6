"""Chapter notebooks: listed in the toc, stored stripped, install from the book's URL, and run.

The book build executes each chapter once, in a fresh kernel from its own folder, with the
caller's environment (so TRANSFORMER_BOOK_DEVICE=cuda reaches the kernel on a GPU job);
the tests here read that execution from the build's jupyter-cache.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat
import pytest
from book_helpers import (
    BOOK_ROOT,
    NOTEBOOK_TIMES,
    chapter_notebooks_on_disk,
    load_config,
    notebooks_in_git,
    toc_notebooks,
)

TOC_NOTEBOOKS = toc_notebooks()

# `%pip install ... "transformer-book[book] @ git+<url>"`: the URL after git+ (the book extra
# brings the chart libraries the chapters draw with).
PIP_GIT_URL = re.compile(r"""%pip\s+install\b.*?transformer-book\[book\]\s*@\s*git\+(?P<url>[^\s"'@#]+)""")


def _normalise_url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url[:-4] if url.endswith(".git") else url


def test_toc_and_chapters_folder_agree():
    on_disk = set(chapter_notebooks_on_disk())
    in_toc = set(TOC_NOTEBOOKS)
    assert in_toc, "_toc.yml lists no chapters/ notebooks"
    missing = sorted(in_toc - on_disk)
    unlisted = sorted(on_disk - in_toc)
    assert not missing, f"_toc.yml lists notebooks that do not exist: {missing}"
    assert not unlisted, f"notebooks in chapters/ missing from _toc.yml: {unlisted}"


def test_notebooks_are_stored_without_outputs():
    notebooks = notebooks_in_git()
    assert notebooks, "found no notebooks to check"
    dirty = []
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            if cell.get("outputs") or cell.get("execution_count") is not None:
                dirty.append(f"{path.relative_to(BOOK_ROOT)} cell {i}")
    assert not dirty, (
        "notebooks must be committed with outputs stripped (e.g. `jupyter nbconvert "
        "--clear-output --inplace` or `nbstripout`); these cells keep outputs or "
        f"execution counts: {dirty}"
    )


@pytest.mark.parametrize("notebook", TOC_NOTEBOOKS)
def test_setup_cell_installs_from_the_book_repository(notebook):
    url = _normalise_url(load_config()["repository"]["url"])
    nb = nbformat.read(BOOK_ROOT / notebook, as_version=4)
    assert len(nb.cells) >= 2, f"{notebook}: expected a title cell and a setup cell"
    setup = nb.cells[1]
    assert setup.cell_type == "code", f"{notebook}: the second cell must be the setup (code) cell"
    src = setup.source
    assert "import transformer_book" in src and "except ImportError" in src, (
        f"{notebook}: the setup cell must try `import transformer_book` and install on ImportError:\n{src}"
    )
    found = PIP_GIT_URL.findall(src)
    assert found, f'{notebook}: no `%pip install "transformer-book[book] @ git+URL"` in the setup cell:\n{src}'
    assert {_normalise_url(u) for u in found} == {url}, (
        f"{notebook}: setup cell installs from {found}, but _config.yml repository.url is {url}"
    )


@pytest.fixture(scope="module")
def executions(built_book_output: Path) -> dict[str, tuple[object, object]]:
    """The book build's jupyter-cache: notebook path -> (project record, cache record or None)."""
    from jupyter_cache import get_cache

    cache = get_cache(built_book_output / "_build" / ".jupyter_cache")
    return {
        Path(record.uri).resolve().relative_to(BOOK_ROOT).as_posix(): (record, cache.get_cached_project_nb(record.uri))
        for record in cache.list_project_records()
    }


def test_the_build_found_every_chapter_executed(built_book_log: str):
    """tests/fill_cache.py executes the chapters into the build's cache, the build reads them.

    A chapter the build executed again (its cache key no longer matching the notebook
    myst-nb reads) would still be correct, but would cost the suite its time twice.
    """
    again = re.findall(r"(\S+\.ipynb): Executing notebook", built_book_log)
    assert not again, f"the book build executed again: {again}"
    assert len(re.findall(r"Using cached notebook", built_book_log)) >= len(TOC_NOTEBOOKS), built_book_log[-3000:]


@pytest.mark.parametrize("notebook", TOC_NOTEBOOKS)
def test_notebook_executes(notebook, executions, record_property):
    """Each chapter executed without error in the book build (its outputs are in the cache).

    The build executes every chapter once, with the book's seeds, through jupyter-cache;
    a chapter that raised has no cached outputs, only a traceback. The second execution,
    section by section with other seeds, is tests/test_sections.py.
    """
    assert notebook in executions, f"{notebook} was not executed by the book build: {sorted(executions)}"
    project, cached = executions[notebook]
    assert cached is not None, f"{notebook} failed in the book build:\n{project.traceback}"
    seconds = cached.data.get("execution_seconds")
    NOTEBOOK_TIMES[notebook] = seconds
    record_property("wall_time_s", round(seconds, 2))
    print(f"{notebook}: {seconds:.1f}s (TRANSFORMER_BOOK_DEVICE={os.environ.get('TRANSFORMER_BOOK_DEVICE', '')!r})")
