"""Building and loading the wing's C kernels (appendix C), so that they never harm the process.

Each C file is compiled on first use by the machine's C compiler (``$CC``, else ``cc``)
with OpenMP threads, and kept in ``$TRANSFORMER_BOOK_CACHE`` (default
``~/.cache/transformer_book``) under a name that changes with the source, the compiler,
the flags and the CPU. Loading a shared library runs its code, and a damaged one can kill
the process (a truncated file mapped into memory raises SIGBUS), so a library is loaded
only when all of these hold:

- the folder and the file belong to this user and no one else can write to them;
- the file's size and SHA-256 are those recorded when this package built it (a record
  written beside it, under the same rules); a file that fails is built again;
- it was built for this CPU: on Linux the key holds the CPU's instruction-set flags and the
  build uses ``-march=native``; where the flags cannot be read, the build targets the
  architecture's baseline instead, so it runs on any CPU of that architecture.

A failed build is remembered beside the library (``.failed``, with the compiler's first
error line), so later processes do not try again until the source, compiler or CPU change.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

BASE_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
LIBRARIES = (
    "-lm",
)  # after the source, so that linkers that drop unused libraries keep it


def load(source: Path, switch: str) -> tuple[ctypes.CDLL | None, str | None]:
    """``(library, None)``: the library built from ``source`` for this CPU, checked and loaded;
    or ``(None, why not)`` when the environment variable ``switch`` is ``0``, there is no
    compiler, the build failed (now or remembered), or the cache cannot be trusted."""
    if os.environ.get(switch, "1") == "0":
        return None, f"switched off by {switch}=0"
    try:
        return ctypes.CDLL(str(compiled(source))), None
    except (OSError, subprocess.SubprocessError, ValueError) as error:
        return None, f"{source.name}: {error}"


def self_test_failure(test: Callable[[], bool], wrong: str) -> str | None:
    """``None`` when a loaded kernel's ``test()`` passes; else why not: ``wrong``, or the error
    the test raised (a kernel is never left loaded without a passed self-test)."""
    try:
        return None if test() else wrong
    except (RuntimeError, ValueError) as error:
        return f"failed its self-test: {error}"


def flags() -> tuple[str, ...]:
    """The compiler flags: ``-march=native`` only where the CPU's flags are part of the cache key."""
    return (*BASE_FLAGS, "-march=native") if _cpu_flags() else BASE_FLAGS


def cache_folder() -> Path:
    """Where built libraries live: ``$TRANSFORMER_BOOK_CACHE`` or ``~/.cache/transformer_book``."""
    return Path(
        os.environ.get("TRANSFORMER_BOOK_CACHE")
        or Path.home() / ".cache" / "transformer_book"
    )


def compiled(source: Path) -> Path:
    """The shared library built from ``source`` for this CPU, compiler and flags, verified: from
    the cache, or compiled now. Raises ``OSError`` (with the reason) where none can be had."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise OSError(f"no C compiler {compiler!r} on PATH")
    key_text = repr(
        (
            compiler,
            flags(),
            LIBRARIES,
            platform.system(),
            platform.machine(),
            _cpu_flags(),
        )
    )
    key = hashlib.sha256(source.read_bytes() + key_text.encode()).hexdigest()[:16]
    folder = cache_folder()
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        _require_private(folder)
    except OSError:  # unusable or shared with others: build for this process only, in a folder of its own
        folder = Path(tempfile.mkdtemp(prefix="transformer_book-"))
    target = folder / f"{source.stem}-{key}.so"
    record, failure = target.with_suffix(".json"), target.with_suffix(".failed")
    if _private_file(failure):
        raise OSError(
            f"an earlier build failed (remembered in {failure}): {failure.read_text().strip()}"
        )
    if _verified(target, record):
        return target
    _build(compiler, source, target, record, failure)
    if not _verified(target, record):
        raise OSError(f"{target} changed while it was being built")
    return target


def _build(
    compiler: str, source: Path, target: Path, record: Path, failure: Path
) -> None:
    """Compile into a temporary name, record size and SHA-256, then rename (processes can race)."""
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, *flags(), str(source), *LIBRARIES, "-o", str(built)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            lines = [
                line for line in result.stderr.splitlines() if "error" in line.lower()
            ] or ["(no message)"]
            reason = f"{compiler} failed: {lines[0].strip()}"
            _write_private(failure, reason + "\n")
            raise OSError(reason)
        data = built.read_bytes()
        entry = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        _write_private(record, json.dumps(entry))
        os.chmod(built, 0o700)
        os.replace(built, target)


def _verified(target: Path, record: Path) -> bool:
    """Whether ``target`` is this user's, private, and exactly the file the record describes."""
    if not (_private_file(target) and _private_file(record)):
        return False
    try:
        entry = json.loads(record.read_text())
        data = target.read_bytes()
    except (OSError, ValueError):
        return False
    return (
        isinstance(entry, dict)
        and entry.get("size") == len(data)
        and entry.get("sha256") == hashlib.sha256(data).hexdigest()
    )


def _require_private(folder: Path) -> None:
    """``folder`` must be a real folder of this user that no one else can write to."""
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode):
        raise OSError(f"{folder} is not a folder")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise OSError(f"{folder} belongs to another user")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise OSError(f"others can write to {folder}")


def _private_file(path: Path) -> bool:
    """Whether ``path`` is a regular file (not a link) of this user that no one else can write to."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    mine = not hasattr(os, "getuid") or info.st_uid == os.getuid()
    return (
        stat.S_ISREG(info.st_mode)
        and mine
        and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, readable and writable by this user alone."""
    descriptor, temporary = tempfile.mkstemp(dir=path.parent)
    with os.fdopen(descriptor, "w") as file:
        file.write(text)
    os.replace(temporary, path)


def _cpu_flags() -> str:
    """This CPU's instruction-set flags, from ``/proc/cpuinfo`` (Linux); empty where unreadable."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    wanted = ("flags", "Features")  # x86 names its extensions "flags", Arm "Features"
    return "\n".join(
        dict.fromkeys(line for line in lines if line.startswith(wanted))
    )  # once, not per core
