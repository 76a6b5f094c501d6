"""Write the one install cell (the second cell) of every chapter and appendix notebook.

Run after adding a notebook: ``python scripts/install_cell.py``. tests/test_notebooks.py
checks that every notebook's second cell is exactly this text.
"""

from __future__ import annotations

from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
INSTALL_CELL = """\
# Colab or a fresh environment: install the book's package and the
# libraries of its `book` extra (charts, ONNX) unless all are there.
import importlib.util

BOOK = "https://github.com/executable-transformer/executable-transformer"
NEEDS = ["transformer_book", "altair", "pandas", "matplotlib", "seaborn"]
NEEDS += ["onnx", "onnxscript", "onnxruntime", "tokenizers", "sacrebleu"]
if not all(importlib.util.find_spec(name) for name in NEEDS):
    %pip install --quiet "transformer-book[book] @ git+{BOOK}\""""


def main() -> None:
    for path in sorted((ROOT / "chapters").rglob("*.ipynb")):
        notebook = nbformat.read(path, as_version=4)
        cell = notebook.cells[1]
        if cell.cell_type == "code" and cell.source != INSTALL_CELL:
            cell.source = INSTALL_CELL
            nbformat.write(notebook, path)
            print("updated", path.relative_to(ROOT))


if __name__ == "__main__":
    main()
