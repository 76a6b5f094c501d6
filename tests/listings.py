"""The package objects the chapters show with ``literalinclude :pyobject:``, read from the notebooks."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
# The module may sit in a subfolder: chapter 10 shows book/export.py.
PATTERN = re.compile(
    r"```\{literalinclude\}\s+\.\./(?:\.\./)?src/transformer_book/((?:\w+/)*\w+)\.py\s*\n:pyobject:\s*([\w.]+)"
)


@dataclass(frozen=True)
class Listing:
    notebook: str  # e.g. "03_attention.ipynb"
    module: str  # e.g. "attention", or "book.export" for src/transformer_book/book/export.py
    name: str  # e.g. "scaled_dot_product_attention" or "MultiHeadAttention.forward"

    @property
    def id(self) -> str:
        return f"{self.module}.{self.name}"

    def source(self) -> str:
        """The lines the page shows: decorators, signature, docstring and body, dedented."""
        text = (ROOT / "src" / "transformer_book" / f"{self.module.replace('.', '/')}.py").read_text()
        node: ast.AST = ast.parse(text)
        for part in self.name.split("."):
            node = next(
                n
                for n in ast.iter_child_nodes(node)
                if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and n.name == part
            )
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        lines = text.splitlines()[start - 1 : node.end_lineno]
        indent = len(lines[0]) - len(lines[0].lstrip())
        return "\n".join(line[indent:] for line in lines) + "\n"


def listings() -> list[Listing]:
    """Every listing of every chapter and appendix, in page order."""
    found = []
    for path in sorted((ROOT / "chapters").rglob("*.ipynb")):
        notebook = nbformat.read(path, as_version=4)
        for cell in notebook.cells:
            if cell.cell_type == "markdown":
                for module, name in PATTERN.findall(cell.source):
                    found.append(Listing(path.name, module.replace("/", "."), name))
    return found
