"""The Colab path, tested here: every chapter runs against the *installed* package.

A reader on Colab (or in any fresh notebook) has no checkout: the chapter's setup cell
imports `transformer_book` from site-packages. This test reproduces that once per session:

1. build the package's wheel from a copy of only what the wheel needs (pyproject.toml,
   README.md, src/), so the build leaves nothing in the repository;
2. create a plain virtual environment (no system site-packages, so the repository's
   editable install is invisible) and install the wheel plus ipykernel, with the versions
   pinned in requirements.txt as constraints (torch comes from the local pip cache/wheels);
3. copy each chapter into its own temporary folder and execute it with nbclient in a
   kernel running the venv's Python, with PYTHONPATH cleared and the repository nowhere on
   sys.path; the last (appended) cell reports where `transformer_book` was imported from.

The device switch (TRANSFORMER_BOOK_DEVICE) reaches the kernel, so on the GPU job this
path runs on cuda too. That every setup cell installs from _config.yml's repository URL
is checked by tests/test_notebooks.py::test_setup_cell_installs_from_the_book_repository.
The weekly workflow .github/workflows/colab.yml runs the same path in Colab's own image.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from book_helpers import BOOK_ROOT, NOTEBOOK_TIMES, REPO_ROOT, toc_notebooks

CELL_TIMEOUT_S = 300
INSTALL_TIMEOUT_S = 1200
KERNEL_NAME = "transformer-book-wheel"
TOC_NOTEBOOKS = toc_notebooks()
# Cleared from every environment below: they would put the repository (or another
# environment) on the venv's path.
LEAKY_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "VIRTUAL_ENV", "CONDA_PREFIX")
REPORT_MARKER = "COLAB-PATH-REPORT:"
REPORT_CELL = f"""\
import json as _json, sys as _sys
import transformer_book as _tb
print({REPORT_MARKER!r} + _json.dumps({{"file": _tb.__file__, "path": _sys.path, "executable": _sys.executable}}))
"""


@dataclass(frozen=True)
class ColabEnv:
    venv: Path
    python: Path
    site_packages: Path
    kernels: Path
    env: dict[str, str]
    setup_seconds: float


def _run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}"
    return proc


def _clean_env(venv: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LEAKY_ENV}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    if venv is not None:
        env["VIRTUAL_ENV"] = str(venv)
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def _constraints(dest: Path) -> Path:
    """requirements.txt's pins, minus the editable install of the repository."""
    lines = [line for line in (REPO_ROOT / "requirements.txt").read_text(encoding="utf-8").splitlines()
             if line.strip() and not line.lstrip().startswith(("#", "-e", "--editable", "."))]
    dest.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return dest


@pytest.fixture(scope="session")
def colab_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ColabEnv]:
    start = time.perf_counter()
    root = tmp_path_factory.mktemp("colab-path")
    env = _clean_env()

    # 1. The wheel, built from a copy so that no build/ or egg-info lands in the checkout.
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO_ROOT / name).exists():
            shutil.copy2(REPO_ROOT / name, source / name)
    shutil.copytree(REPO_ROOT / "src", source / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc"))
    dist = root / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", dist, source],
         cwd=root, env=env, timeout=INSTALL_TIMEOUT_S)
    wheels = sorted(dist.glob("transformer_book-*.whl"))
    assert len(wheels) == 1, f"expected one transformer_book wheel in {dist}: {list(dist.iterdir())}"

    # 2. A plain venv (no --system-site-packages): the repository's editable install is not in it.
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=root, env=env, timeout=INSTALL_TIMEOUT_S)
    python = venv / "bin" / "python"
    venv_env = _clean_env(venv)
    _run([python, "-m", "pip", "install", "--quiet", "-c", _constraints(root / "constraints.txt"),
          wheels[0], "ipykernel"], cwd=root, env=venv_env, timeout=INSTALL_TIMEOUT_S)
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=root, env=venv_env).stdout.strip())

    # 3. A kernelspec that runs the venv's Python, known only to this test's kernel manager.
    kernel_dir = root / "kernels" / KERNEL_NAME
    kernel_dir.mkdir(parents=True)
    (kernel_dir / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "transformer_book from its wheel",
        "language": "python",
    }), encoding="utf-8")
    seconds = time.perf_counter() - start
    print(f"\nColab path: wheel + venv ready in {seconds:.1f}s ({venv})")
    NOTEBOOK_TIMES["colab path: wheel + venv setup"] = seconds
    yield ColabEnv(venv, python, site, root / "kernels", venv_env, seconds)
    # The venv holds about 1 GB (torch); pytest keeps old temporary folders, so drop it now.
    shutil.rmtree(root, ignore_errors=True)


def _report(nb: nbformat.NotebookNode) -> dict:
    for output in nb.cells[-1].get("outputs", []):
        text = output.get("text", "")
        if output.get("name") == "stdout" and REPORT_MARKER in text:
            return json.loads(text.split(REPORT_MARKER, 1)[1].strip().splitlines()[0])
    raise AssertionError(f"the report cell printed nothing: {nb.cells[-1].get('outputs')}")


def _inside(path: str | Path, folder: Path) -> bool:
    """True if `path` lies in `folder`, as written or with symlinks resolved (a venv's
    bin/python is a link to the base interpreter, so compare as written too)."""
    for p, f in ((os.path.abspath(path), os.path.abspath(folder)), (Path(path).resolve(), folder.resolve())):
        if Path(p) == Path(f) or Path(f) in Path(p).parents:
            return True
    return False


def test_wheel_is_installed_not_the_checkout(colab_env: ColabEnv, tmp_path: Path):
    """Outside any kernel: the venv imports the package from its site-packages, without pytest."""
    code = "import transformer_book as tb, importlib.util as u; print(tb.__file__); print(u.find_spec('pytest') is None)"
    out = _run([colab_env.python, "-c", code], cwd=tmp_path, env=colab_env.env).stdout.split()
    assert _inside(out[0], colab_env.site_packages), f"transformer_book came from {out[0]}, not {colab_env.site_packages}"
    assert not _inside(out[0], REPO_ROOT), out[0]
    assert out[1] == "True", "the venv should hold only the package and what a notebook needs"


@pytest.mark.parametrize("notebook", TOC_NOTEBOOKS)
def test_chapter_runs_against_the_installed_wheel(notebook: str, colab_env: ColabEnv, tmp_path: Path):
    folder = tmp_path / "reader"
    folder.mkdir()
    copy = folder / Path(notebook).name
    shutil.copyfile(BOOK_ROOT / notebook, copy)
    nb = nbformat.read(copy, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(REPORT_CELL))

    ksm = KernelSpecManager(kernel_dirs=[str(colab_env.kernels)])
    km = KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=ksm)
    client = NotebookClient(nb, km=km, timeout=CELL_TIMEOUT_S, allow_errors=False,
                            resources={"metadata": {"path": str(folder)}})
    start = time.perf_counter()
    client.execute(env=colab_env.env)
    seconds = time.perf_counter() - start
    NOTEBOOK_TIMES[f"colab path: {notebook}"] = seconds
    print(f"{notebook} against the wheel: {seconds:.1f}s "
          f"(TRANSFORMER_BOOK_DEVICE={colab_env.env.get('TRANSFORMER_BOOK_DEVICE', '')!r})")

    report = _report(nb)
    assert _inside(report["executable"], colab_env.venv), f"the kernel ran {report['executable']}, not the venv's Python"
    assert _inside(report["file"], colab_env.site_packages), (
        f"{notebook}: transformer_book came from {report['file']}, not the venv's {colab_env.site_packages}")
    on_path = [p for p in report["path"] if p and _inside(p, REPO_ROOT)]
    assert not on_path, f"{notebook}: the repository is on the kernel's sys.path: {on_path}"
