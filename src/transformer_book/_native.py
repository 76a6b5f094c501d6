"""Compiling the package's C kernels (appendix C): on first use, for the CPU it runs on.

Each C file is compiled by the machine's C compiler (``$CC``, else ``cc``) with OpenMP
threads (the OpenMP runtime PyTorch has loaded) and kept in ``$TRANSFORMER_BOOK_CACHE``
(default ``~/.cache/transformer_book``), under a name that changes with the source, the
compiler, the flags and the CPU. The modules that use a kernel check its results once per
process and fall back to PyTorch's operators where it cannot be built or computes wrongly.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
LIBRARIES = ("-lm",)  # after the source, so that linkers that drop unused libraries keep it


def load(source: Path, switch: str) -> tuple[ctypes.CDLL | None, str | None]:
    """``(library, None)``: the library built from ``source`` for this CPU, loaded; or
    ``(None, why not)`` when the environment variable ``switch`` is ``0``, there is no
    compiler, or compiling or loading fails."""
    if os.environ.get(switch, "1") == "0":
        return None, f"switched off by {switch}=0"
    try:
        return ctypes.CDLL(str(compiled(source))), None
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"could not compile or load {source.name}: {error}"


def compiled(source: Path) -> Path:
    """The shared library built from ``source`` for this CPU, compiler and flags: from the
    cache, or compiled now (into a temporary name, then renamed: processes can race)."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise OSError(f"no C compiler {compiler!r} on PATH")
    text = source.read_bytes()
    key = hashlib.sha256(text + repr((compiler, FLAGS, LIBRARIES, platform.machine(), _cpu())).encode()).hexdigest()
    key = key[:16]
    cache = Path(os.environ.get("TRANSFORMER_BOOK_CACHE") or Path.home() / ".cache" / "transformer_book")
    target = cache / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: compile for this process only
        cache = Path(tempfile.mkdtemp(prefix="transformer_book-"))
        target = cache / target.name
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, *FLAGS, str(source), *LIBRARIES, "-o", str(built)]
        subprocess.run(command, check=True, capture_output=True, timeout=120)
        os.replace(built, target)
    return target


def _cpu() -> str:
    """What identifies this CPU's instruction set (-march=native compiles for it)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags", "Features")  # x86 names its extensions "flags", Arm "Features"
    return "\n".join(dict.fromkeys(line for line in lines if line.startswith(wanted)))  # once, not per core
