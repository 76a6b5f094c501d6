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

# The URL the setup cell names once (`BOOK = "<url>"`) and installs from (`git+{BOOK}`).
BOOK_URL = re.compile(r"""^BOOK = "(?P<url>[^"]+)"$""", re.MULTILINE)


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
    """The second cell is the one install cell (scripts/install_cell.py): it installs the package
    with its `book` extra from _config.yml's repository URL unless the package and every module of
    the extra can be found (a reader with the package but not the extra gets the extra)."""
    import sys

    sys.path.insert(0, str(BOOK_ROOT / "scripts"))
    from install_cell import INSTALL_CELL

    nb = nbformat.read(BOOK_ROOT / notebook, as_version=4)
    assert len(nb.cells) >= 2 and nb.cells[1].cell_type == "code", f"{notebook}: the second cell must be setup code"
    assert nb.cells[1].source == INSTALL_CELL, f"{notebook}: run scripts/install_cell.py"
    url = _normalise_url(load_config()["repository"]["url"])
    assert [_normalise_url(u) for u in BOOK_URL.findall(INSTALL_CELL)] == [url]
    assert '%pip install --quiet "transformer-book[book] @ git+{BOOK}"' in INSTALL_CELL
    import tomllib

    extra = tomllib.loads((BOOK_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["book"]
    modules = {re.split(r"[<>=!~ ;\[]", requirement)[0].replace("-", "_") for requirement in extra}
    checked = set(re.findall(r'"(\w+)"', INSTALL_CELL))
    assert modules | {"transformer_book"} <= checked, f"the install cell does not check {modules - checked}"


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


HIDDEN = {"hide-input", "remove-input", "remove-cell"}
# What a chart, a table or an image hands the page: anything richer than plain text.
RICH = {"text/html", "image/png", "image/svg+xml", "application/vnd.vegalite.v5+json", "text/markdown"}


def executed_notebook(notebook: str, executions, built_book_output: Path):
    """``notebook`` as the book build executed it, outputs and all."""
    project, cached = executions[notebook]
    assert cached is not None, f"{notebook} failed in the book build"
    from jupyter_cache import get_cache

    return get_cache(built_book_output / "_build" / ".jupyter_cache").get_cache_bundle(cached.pk).nb


@pytest.mark.parametrize("notebook", TOC_NOTEBOOKS)
def test_no_hidden_cell_prints_a_bare_value(notebook, executions, built_book_output):
    """A cell whose input is hidden or removed shows its output on the page without the code that
    made it: a bare number or repr there ("0.1949317738791423") means nothing to a reader. Charts,
    tables and deliberate printed lines (a stream) are fine; a plain-text result is not."""
    executed = executed_notebook(notebook, executions, built_book_output)
    stray = []
    for index, cell in enumerate(executed.cells):
        tags = set(cell.get("metadata", {}).get("tags", []))
        if cell.cell_type != "code" or not tags & HIDDEN:
            continue
        for output in cell.get("outputs", []):
            if output.get("output_type") == "execute_result" and not set(output.get("data", {})) & RICH:
                stray.append(f"cell {index}: {str(output['data'].get('text/plain'))[:60]!r}")
    assert not stray, f"{notebook}: hidden cells print bare values: {stray}"


@pytest.mark.parametrize("notebook", TOC_NOTEBOOKS)
def test_every_matplotlib_figure_reaches_the_page_as_an_image(notebook, executions, built_book_output):
    """A kernel with ipykernel's inline backend sends each figure as a PNG; one that lost it (the test
    suite forks its kernels from a process that imported matplotlib, tests/forked_kernels.py) would
    send only the text "<Figure size ...>", and the page would show that instead of the chart."""
    executed = executed_notebook(notebook, executions, built_book_output)
    outputs = [output for cell in executed.cells if cell.cell_type == "code" for output in cell.get("outputs", [])]
    figures = [o for o in outputs if str(o.get("data", {}).get("text/plain", "")).startswith("<Figure size")]
    assert all("image/png" in figure["data"] for figure in figures), f"{notebook}: a figure without its image"
    draws = any(re.search(r"\b(plt|sns)\.", cell.source) for cell in executed.cells if cell.cell_type == "code")
    assert figures or not draws, f"{notebook} draws with matplotlib, but no figure reached its outputs"


#: A graded part, and the names under which the package's version of it can be shown.
PACKAGE_VERSIONS = {
    "sinusoidal_positional_encoding": ("sinusoidal_positional_encoding", "pe_vectorised"),
    "MultiHeadAttention": ("MultiHeadAttention", "MultiHeadAttention.forward"),
    "EncoderLayer": ("EncoderLayer", "EncoderLayer.forward"),
    "DecoderLayer": ("DecoderLayer", "DecoderLayer.forward"),
}
FOLDED = re.compile(r"(?ms)^(`{3,}|:{3,})\{(admonition|dropdown|toggle)\}[^\n]*\n(.*?)^\1\s*$")
BUILD_IT = re.compile(r"exercise-start\}\s*Build it")
CHECKED = re.compile(r"""check\(\s*["'](\w+)["']""")


def shown_above(cells: list, names: tuple[str, ...]) -> list[str]:
    """Where ``cells`` show one of ``names`` on the page: a literalinclude of it outside a folded
    block, or a visible code cell that prints its source."""
    found = []
    for index, cell in enumerate(cells):
        text = cell.source
        tags = set(cell.get("metadata", {}).get("tags", []))
        if cell.cell_type == "markdown":
            # Folded blocks: a dropdown, or an admonition of class dropdown, whose fence may hold
            # the listing's own shorter fence.
            folded = "".join(
                body
                for _, kind, body in FOLDED.findall(text)
                if kind != "admonition" or re.search(r"^:class:.*\bdropdown\b", body, re.M)
            )
            for name in names:
                listing = rf":pyobject: {re.escape(name)}\s*$"
                if len(re.findall(listing, text, re.M)) > len(re.findall(listing, folded, re.M)):
                    found.append(f"cell {index}: literalinclude {name}")
        elif cell.cell_type == "code" and not tags & HIDDEN:
            for name in names:
                short = re.escape(name.split(".")[-1])
                if re.search(rf"getsource\([\w.]*\b{short}\b|^def {short}\(", text, re.M):
                    found.append(f"cell {index}: shows {name}")
    return found


@pytest.mark.parametrize("notebook", [n for n in TOC_NOTEBOOKS if re.match(r"chapters/\d\d_", n)])
def test_every_build_it_is_built_before_it_is_seen(notebook):
    """Above each Build it, no listing outside a folded block and no visible cell shows the
    package's version of the part it asks for (issue 42: the reader writes it first)."""
    cells = nbformat.read(BOOK_ROOT / notebook, as_version=4).cells
    problems = []
    for index, cell in enumerate(cells):
        if cell.cell_type != "markdown" or not BUILD_IT.search(cell.source):
            continue
        after = "\n".join(c.source for c in cells[index : index + 4])
        for part in CHECKED.findall(after)[:1]:
            names = PACKAGE_VERSIONS.get(part, (part,))
            problems += [f"{part}: {where}" for where in shown_above(cells[:index], names)]
    assert not problems, f"{notebook}: a Build it's part is shown above it: {problems}"
