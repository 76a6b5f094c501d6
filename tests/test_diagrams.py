"""The explanatory diagrams (transformer_book.book.diagrams) and their place in every chapter."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import nbformat
import pytest
from book_helpers import BOOK_ROOT

from transformer_book.book import diagrams

SVG = "{http://www.w3.org/2000/svg}"
EXAMPLES = {
    "architecture_map": lambda: diagrams.architecture_map("encoder"),
    "recurrent_vs_attention": lambda: diagrams.recurrent_vs_attention(5, 3),
    "embedding_lookup": lambda: diagrams.embedding_lookup([3, 7, 1], 11, 512),
    "sinusoid_stack": lambda: diagrams.sinusoid_stack(512),
    "qkv_scores": lambda: diagrams.qkv_scores(4, 512, 64),
    "split_heads": lambda: diagrams.split_heads(2, 5, 512, 8),
    "mask_grids": lambda: diagrams.mask_grids([5, 3], 6),
    "residual_sublayer": diagrams.residual_sublayer,
    "three_attentions": lambda: diagrams.three_attentions(4, 3),
    "shifted_target": lambda: diagrams.shifted_target(list("2026")),
    "kv_cache_steps": lambda: diagrams.kv_cache_steps(4),
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_diagram_is_an_accessible_svg_in_the_book_style(name):
    diagram = EXAMPLES[name]()
    root = ET.fromstring(diagram.svg)  # well-formed XML
    assert root.tag == SVG + "svg" and root.get("role") == "img"
    assert root.get("aria-label") == diagram.alt and len(diagram.alt) > 60
    assert root.find(SVG + "title").text and root.find(SVG + "desc").text == diagram.alt
    assert diagrams.STYLE in diagram.svg  # one style sheet, with its dark-mode fills
    assert "html[data-theme=dark]" in diagrams.STYLE
    # colours only through the style sheet's classes: no fill or stroke written on an element
    assert not re.search(r'\s(fill|stroke)="', diagram.svg)
    assert diagram._repr_html_().count("<svg") == 1


def test_the_numbers_in_a_diagram_come_from_its_arguments():
    assert "12 × 768" in diagrams.embedding_lookup([3], 12, 768).svg
    heads = diagrams.split_heads(3, 7, 96, 4)
    assert "(3, 4, 7, 24)" in heads.svg and "24" in heads.alt
    assert "9×9" in diagrams.qkv_scores(9, 32, 8).svg


def _table_rows(svg: str) -> list[tuple[float, float, bool, str]]:
    """The embedding table's boxes (x = 200): top, bottom, highlighted, label."""
    children = list(ET.fromstring(svg))
    return [
        (
            float(rect.get("y")),
            float(rect.get("y")) + float(rect.get("height")),
            "f-emb" in rect.get("class"),
            text.text,
        )
        for rect, text in zip(children, children[1:])
        if rect.tag == SVG + "rect" and rect.get("x") == "200" and text.tag == SVG + "text"
    ]


@pytest.mark.parametrize(
    "ids, vocab_size", [([1, 4, 7, 2], 11), ([10, 0, 5], 11), ([3, 7, 1], 9), ([3, 700, 36999, 699], 37000)]
)
def test_embedding_lookup_sends_every_id_to_the_box_of_its_own_row(ids, vocab_size):
    svg = diagrams.embedding_lookup(ids, vocab_size, 512).svg
    rows = _table_rows(svg)
    highlighted = sorted(label for _, _, on, label in rows if on)
    assert highlighted == sorted({f"row {token}" for token in ids})
    labels = [label for *_, label in rows]
    if vocab_size <= 12:  # a small table is drawn whole, in order
        assert labels == [f"row {r}" for r in range(vocab_size)]
    else:  # the first row, the ids' rows and the last row, with "…" for the rows left out
        assert labels[0] == "row 0" and labels[-1] == f"row {vocab_size - 1}" and "…" in labels
    # the arrow from each id box (x = 105) ends inside the box labelled with its row
    ends = re.findall(r'x1="105\.0" y1="[\d.]+" x2="200\.0" y2="([\d.]+)"', svg)
    assert len(ends) == len(ids)
    for token, end in zip(ids, ends):
        [label] = [label for top, bottom, _, label in rows if top < float(end) < bottom]
        assert label == f"row {token}"


def test_architecture_map_highlights_exactly_the_chapter_blocks():
    for part, (blocks, what) in diagrams.CHAPTER_PARTS.items():
        svg = diagrams.architecture_map(part).svg
        assert svg.count("box f-") == len(diagrams._MAP_BLOCKS)
        highlighted = re.findall(r'<rect class="box f-\w+ hl"', svg)
        assert len(highlighted) == len(blocks), part
        assert what in diagrams.architecture_map(part).alt
    with pytest.raises(ValueError, match="highlight must be one of"):
        diagrams.architecture_map("chapter 11")


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="divisible"):
        diagrams.split_heads(1, 4, 10, 3)
    with pytest.raises(ValueError, match="lengths"):
        diagrams.mask_grids([7], 6)
    with pytest.raises(ValueError, match="ids"):
        diagrams.embedding_lookup([], 11, 8)
    with pytest.raises(ValueError, match=r"ids must lie in 0\.\.10"):
        diagrams.embedding_lookup([3, 11], 11, 8)


# --- every chapter: the map, a diagram, the exercises -------------------------------------------------

CHAPTERS = sorted(p.relative_to(BOOK_ROOT).as_posix() for p in (BOOK_ROOT / "chapters").glob("0[0-9]_*.ipynb"))
EXERCISE = re.compile(r"^```\{exercise(?:-start)?\}.*?\n:label: (\S+)", re.MULTILINE | re.DOTALL)
SOLUTION = re.compile(r"^```\{solution-start\} (\S+)", re.MULTILINE)
DIAGRAM_CALL = re.compile(r"^\s*(?:diagrams\.)?(\w+)\(", re.MULTILINE)


def _cells(notebook: str):
    return nbformat.read(BOOK_ROOT / notebook, as_version=4).cells


@pytest.mark.parametrize("notebook", CHAPTERS)
def test_chapter_opens_with_its_architecture_map_and_has_a_diagram(notebook):
    cells = _cells(notebook)
    first_section = next(i for i, c in enumerate(cells) if c.cell_type == "markdown" and "\n## " in "\n" + c.source)
    maps = [c for c in cells[:first_section] if c.cell_type == "code" and "architecture_map(highlight=" in c.source]
    assert len(maps) == 1, f"{notebook}: one architecture_map(highlight=...) cell before the first section"
    names = {
        name
        for c in cells
        if c.cell_type == "code"
        for name in DIAGRAM_CALL.findall(c.source)
        if name in EXAMPLES and name != "architecture_map"
    }
    assert names, f"{notebook}: no explanatory diagram from transformer_book.book.diagrams"


@pytest.mark.parametrize("notebook", [c for c in CHAPTERS if not c.startswith("chapters/00_")])
def test_chapter_ends_with_three_exercises_and_a_solution_for_each(notebook):
    cells = _cells(notebook)
    text = "\n".join(c.source for c in cells if c.cell_type == "markdown")
    exercises = [label for label in EXERCISE.findall(text)]
    solutions = SOLUTION.findall(text)
    assert len(exercises) >= 3, f"{notebook}: {len(exercises)} exercises"
    assert len(set(exercises)) == len(exercises) and sorted(solutions) == sorted(exercises), (exercises, solutions)
    # every solution runs code and checks it: at least one assert between its start and end
    starts = [i for i, c in enumerate(cells) if c.cell_type == "markdown" and SOLUTION.search(c.source)]
    for start in starts:
        end = next(i for i in range(start, len(cells)) if "{solution-end}" in cells[i].source)
        code = [c.source for c in cells[start:end] if c.cell_type == "code"]
        assert code and any("assert" in src for src in code), f"{notebook}: solution at cell {start} asserts nothing"
    # the solutions come after every exercise, so a plain notebook view does not show one under its exercise
    last_exercise = max(i for i, c in enumerate(cells) if c.cell_type == "markdown" and EXERCISE.search(c.source))
    assert last_exercise < min(starts), f"{notebook}: a solution comes before the last exercise"


@pytest.mark.parametrize("notebook", [n for n in CHAPTERS if not n.startswith("chapters/00")])
def test_chapter_has_a_build_it_exercise_graded_by_check(notebook):
    """Chapters 1-9 end their exercises with a Build it: a starter the reader fills in and a call of
    ``exercises.check`` that grades it; its executed solution calls ``check`` again and asserts it passed."""
    cells = _cells(notebook)
    label = f"ex-{notebook.split('/')[-1][:2]}-build-it"
    text = "\n".join(c.source for c in cells if c.cell_type == "markdown")
    assert label in EXERCISE.findall(text), f"{notebook}: no exercise labelled {label}"
    code = "\n".join(c.source for c in cells if c.cell_type == "code")
    assert re.search(r"\bcheck\(\s*\"\w+\"", code), f"{notebook}: no call of exercises.check"
    start = next(i for i, c in enumerate(cells) if re.search(r"^```\{solution-start\} " + label, c.source, re.M))
    end = next(i for i in range(start, len(cells)) if "{solution-end}" in cells[i].source)
    solution = "\n".join(c.source for c in cells[start:end] if c.cell_type == "code")
    assert "check(" in solution and "passed" in solution, f"{notebook}: the Build it solution must assert check passes"


def test_the_introduction_lists_every_chapter():
    intro = (BOOK_ROOT / "intro.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\((chapters/\d\d_\w+)\.ipynb\)", intro))
    on_disk = {
        p.relative_to(BOOK_ROOT).with_suffix("").as_posix() for p in (BOOK_ROOT / "chapters").glob("[0-9][0-9]_*.ipynb")
    }
    assert on_disk <= linked, f"chapters missing from the introduction's table: {sorted(on_disk - linked)}"
