"""The Colab path's environment: the package's wheel in a fresh virtual environment.

A reader on Colab (or in any fresh notebook) has no checkout: the chapter's setup cell
imports `transformer_book` from site-packages. `make_wheel_env` reproduces that:

1. build the package's wheel from a copy of only what the wheel needs (pyproject.toml,
   README.md, src/), so the build leaves nothing in the repository;
2. create a plain virtual environment (no system site-packages, so the repository's
   editable install is invisible; no pip of its own: the test run's pip installs into it)
   and install the wheel with its `book` extra (the chart libraries a chapter needs) plus
   ipykernel, with the versions pinned in requirements.txt as constraints. The
   distributions the wheel's requirements reach are linked from the test run's own
   environment rather than unpacked again (`link_requirements`), so pip adds just the wheel.

tests/conftest.py makes it once per session, in the background, and tests/test_sections.py
runs every section of every chapter with its Python.
"""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from book_helpers import REPO_ROOT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

INSTALL_TIMEOUT_S = 1200
# Cleared from every environment below: they would put the repository (or another
# environment) on the venv's path.
LEAKY_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "VIRTUAL_ENV", "CONDA_PREFIX")


@dataclass(frozen=True)
class ColabEnv:
    venv: Path
    python: Path
    site_packages: Path
    env: dict[str, str]
    setup_seconds: float


def _run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}"
    )
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
    lines = [
        line
        for line in (REPO_ROOT / "requirements.txt").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.lstrip().startswith(("#", "-e", "--editable", "."))
    ]
    dest.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return dest


def make_wheel_env(root: Path) -> ColabEnv:
    """Build the wheel and a venv holding it under ``root`` (see the module docstring)."""
    start = time.perf_counter()
    env = _clean_env()
    # 1. The wheel, built from a copy so that no build/ or egg-info lands in the checkout.
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO_ROOT / name).exists():
            shutil.copy2(REPO_ROOT / name, source / name)
    shutil.copytree(
        REPO_ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    )
    dist = root / "dist"
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", dist, source],
        cwd=root,
        env=env,
        timeout=INSTALL_TIMEOUT_S,
    )
    wheels = sorted(dist.glob("transformer_book-*.whl"))
    assert len(wheels) == 1, f"expected one transformer_book wheel in {dist}: {list(dist.iterdir())}"

    # 2. A plain venv (no --system-site-packages): the repository's editable install is not in it.
    # Without a pip of its own (installing one costs seconds): this pip installs into it (--python).
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=root, env=env, timeout=INSTALL_TIMEOUT_S)
    python = venv / "bin" / "python"
    venv_env = _clean_env(venv)
    site = Path(
        _run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root, env=venv_env
        ).stdout.strip()
    )
    link_requirements([*wheel_requirements(wheels[0], ("book",)), Requirement("ipykernel")], site)
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            python,
            "install",
            "--quiet",
            "-c",
            _constraints(root / "constraints.txt"),
            f"{wheels[0]}[book]",
            "ipykernel",
        ],
        cwd=root,
        env=venv_env,
        timeout=INSTALL_TIMEOUT_S,
    )

    return ColabEnv(venv, python, site, venv_env, time.perf_counter() - start)


def wheel_requirements(wheel: Path, extras: tuple[str, ...]) -> list[Requirement]:
    """The ``Requires-Dist`` entries of ``wheel``'s metadata that apply with ``extras``."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        fields = email.parser.Parser().parsestr(archive.read(name).decode())
    return [r for r in map(Requirement, fields.get_all("Requires-Dist") or []) if _applies(r, extras)]


def _applies(requirement: Requirement, extras: Iterable[str]) -> bool:
    marker = requirement.marker
    return marker is None or any(marker.evaluate({"extra": extra}) for extra in ("", *extras))


def link_requirements(requirements: list[Requirement], site: Path) -> list[str]:
    """Link into the venv ``site`` every distribution ``requirements`` need, transitively, from
    this test run's own environment; returns their names.

    Unpacking the same ~1 GB of wheels (torch alone is ~700 MB) into every test run's venv
    took over a minute. A link to the installed files of the versions requirements.txt pins
    is instant, and the venv still holds exactly what the wheel declares: only the
    distributions its requirements reach are linked, so a chapter that imports anything
    else fails there. pip then finds them installed and adds just the wheel (and installs
    anything that could not be linked, such as a version other than the one installed here).
    """
    linked: dict[str, metadata.Distribution] = {}
    todo = list(requirements)
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in linked:
            continue
        try:
            dist = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            continue
        if not dist.files or not requirement.specifier.contains(dist.version, prereleases=True):
            continue
        origin = Path(dist.locate_file(""))
        # ".." holds its scripts. __pycache__ is shared by every single-file module (six.py,
        # typing_extensions.py): linked once, it would hide all the others' modules from the
        # check below. The venv's modules get a __pycache__ of their own when Python writes one.
        tops = sorted({file.parts[0] for file in dist.files} - {"..", "__pycache__"})
        if any((site / top).exists() for top in tops):  # e.g. the venv's own setuptools: pip's to handle
            continue
        for top in tops:
            (site / top).symlink_to(origin / top, target_is_directory=(origin / top).is_dir())
        linked[name] = dist
        todo += [r for r in map(Requirement, dist.requires or []) if _applies(r, requirement.extras)]
    return sorted(linked)


def inside(path: str | Path, folder: Path) -> bool:
    """True if `path` lies in `folder`, as written or with symlinks resolved (a venv's
    bin/python is a link to the base interpreter, so compare as written too)."""
    for p, f in ((os.path.abspath(path), os.path.abspath(folder)), (Path(path).resolve(), folder.resolve())):
        if Path(p) == Path(f) or Path(f) in Path(p).parents:
            return True
    return False
