"""The Colab path: the package installed from its wheel into a fresh venv, not the checkout.

The venv is made once per session (tests/wheel_env.py, started in the background by
tests/conftest.py); tests/test_sections.py executes every section of every chapter with
it, and checks in each that `transformer_book` came from the venv. The weekly workflow
.github/workflows/colab.yml runs the chapters in Colab's own image.
"""

from __future__ import annotations

from pathlib import Path

from book_helpers import REPO_ROOT
from wheel_env import ColabEnv, _run, inside


def test_wheel_is_installed_not_the_checkout(wheel_env: ColabEnv, tmp_path: Path):
    """Outside any kernel: the venv imports the package from its site-packages, without pytest."""
    code = (
        "import transformer_book as tb, importlib.util as u; print(tb.__file__); print(u.find_spec('pytest') is None);"
        "print(len(tb.trained_model('dates', device=__import__('torch').device('cpu')).task.test_dates));"
        "import pathlib; print(sorted(p.suffix for p in pathlib.Path(tb.__file__).parent.rglob('*.[ch]')))"
    )
    out = _run([wheel_env.python, "-c", code], cwd=tmp_path, env=wheel_env.env).stdout.split("\n")
    assert inside(out[0], wheel_env.site_packages), (
        f"transformer_book came from {out[0]}, not {wheel_env.site_packages}"
    )
    assert not inside(out[0], REPO_ROOT), out[0]
    assert out[1] == "True", "the venv should hold only the package and what a notebook needs"
    assert out[2] == "1000", "the wheel must ship the dates checkpoint that trained_model() loads"
    assert out[3] == "[]", f"the wheel must ship no C source: {out[3]}"
