"""Chapter notebooks: listed in the toc, stored stripped, install from the book's URL, and run.

Each chapter is executed in a fresh kernel (nbclient), from its own folder, with the
caller's environment (so TRANSFORMER_BOOK_DEVICE=cuda reaches the kernel on a GPU job).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from book_helpers import (
    BOOK_ROOT,
    NOTEBOOK_TIMES,
    chapter_notebooks_on_disk,
    load_config,
    notebooks_in_git,
    toc_notebooks,
)

CELL_TIMEOUT_S = 300
TOC_NOTEBOOKS = toc_notebooks()

# `%pip install ... "transformer-book @ git+<url>"`: the URL after git+.
PIP_GIT_URL = re.compile(r"""%pip\s+install\b.*?transformer-book\s*@\s*git\+(?P<url>[^\s"'@#]+)""")


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
    assert found, f"{notebook}: no `%pip install \"transformer-book @ git+URL\"` in the setup cell:\n{src}"
    assert {_normalise_url(u) for u in found} == {url}, (
        f"{notebook}: setup cell installs from {found}, but _config.yml repository.url is {url}"
    )


@pytest.mark.parametrize("notebook", TOC_NOTEBOOKS)
def test_notebook_executes(notebook, record_property):
    path = BOOK_ROOT / notebook
    assert path.exists(), f"{notebook} is listed in _toc.yml but does not exist"
    nb = nbformat.read(path, as_version=4)
    kernel = nb.metadata.get("kernelspec", {}).get("name", "python3")
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name=kernel,
        allow_errors=False,
        resources={"metadata": {"path": str(path.parent)}},
    )
    # The kernel inherits this process's environment; say so explicitly for the device switch.
    env = os.environ.copy()
    start = time.perf_counter()
    client.execute(env=env)
    seconds = time.perf_counter() - start
    NOTEBOOK_TIMES[notebook] = seconds
    record_property("wall_time_s", round(seconds, 2))
    print(f"{notebook}: {seconds:.1f}s (TRANSFORMER_BOOK_DEVICE={env.get('TRANSFORMER_BOOK_DEVICE', '')!r})")
