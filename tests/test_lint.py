"""ruff keeps the code clean: lint and format, over the package, tests, benchmarks, scripts and chapters.

The configuration is pyproject.toml's `[tool.ruff]` (lines up to 120 characters) and
chapters/ruff.toml (code formatted to 77 in the chapters, no line over 88, the width of
the book's code column at 1280 px); ruff
reads the notebooks' code cells itself.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from book_helpers import REPO_ROOT

PATHS = ["src", "tests", "benchmarks", "scripts", "docs", "chapters"]


def _ruff() -> str:
    candidate = Path(sys.executable).with_name("ruff")
    exe = str(candidate) if candidate.exists() else shutil.which("ruff")
    assert exe, "ruff is not installed (bash scripts/setup.sh installs requirements.txt)"
    return exe


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(command: list[str]):
    proc = subprocess.run([_ruff(), *command, *PATHS], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == 0, f"ruff {' '.join(command)}:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"


def test_ruff_would_catch_a_long_chapter_line(tmp_path: Path):
    """The chapters' narrower code width is in force (the format check above is not vacuous)."""
    probe = tmp_path / "probe.py"
    probe.write_text("x = " + " + ".join(["1"] * 25) + "\n")  # 99 characters of code: fine at 120, not at 77
    config = REPO_ROOT / "chapters" / "ruff.toml"
    for extra, reformats in (([], False), (["--config", str(config)], True)):
        proc = subprocess.run([_ruff(), "format", "--check", *extra, str(probe)], capture_output=True,
                              text=True, cwd=REPO_ROOT, timeout=60)  # fmt: skip
        assert (proc.returncode != 0) == reformats, proc.stdout


# A comment the formatter pushed off its statement: after a closing bracket, or alone inside
# brackets that wrap a single value ("x = (\n    1  # why\n)").
AFTER_CLOSE = re.compile(r"^\s*[\)\]\}][^#]*#(?! fmt: skip)")
WRAPPED = re.compile(r"[:=] \($")


def split_comments(text: str) -> list[str]:
    lines = text.splitlines()
    found = [line for line in lines if AFTER_CLOSE.match(line)]
    for i, line in enumerate(lines[:-2]):
        if WRAPPED.search(line) and "#" in lines[i + 1] and lines[i + 2].strip().startswith(")"):
            found.append(lines[i + 1])
    return found


def test_no_comment_in_the_package_is_split_by_the_formatter():
    """The package's files are the book's listings: each comment stays on its line."""
    assert split_comments("x = f(\n    a\n)  # why\ny = (\n    1  # why\n)\n") == [")  # why", "    1  # why"]
    found = {
        str(path.relative_to(REPO_ROOT)): hits
        for path in sorted((REPO_ROOT / "src").rglob("*.py"))
        if (hits := split_comments(path.read_text()))
    }
    assert not found, f"comments split from their statements (move each above it): {found}"
