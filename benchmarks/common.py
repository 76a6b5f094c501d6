"""Shared by the benchmark scripts: the machine, a timer, and a plain-text table."""

from __future__ import annotations

import atexit
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import date
from pathlib import Path

import torch


def machine() -> str:
    """CPU model (or GPU name), core count and library versions, for the table's caption."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    threads = torch.get_num_threads()
    parts = [f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({threads} thread{'s' if threads > 1 else ''})"]
    if torch.cuda.is_available():
        driver = cuda_driver()
        parts.append(f"GPU {torch.cuda.get_device_name()} (CUDA {torch.version.cuda}, driver {driver or 'unknown'})")
    return "; ".join(parts) + f"; python {platform.python_version()}"


def cuda_driver() -> str | None:
    """The NVIDIA driver's version, as ``nvidia-smi`` reports it, or None where it cannot say."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def cold_compile_cache() -> str:
    """Point torch.compile's on-disk caches (Inductor's, Triton's inside it) at a new, empty folder,
    removed at exit, so that a compiled contender's first call is timed compiling rather than
    reading an earlier run's kernels back. A ``TORCHINDUCTOR_CACHE_DIR`` set by the caller wins.
    Call it before anything is compiled. Returns the folder."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        folder = tempfile.mkdtemp(prefix="bench-inductor-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn`` over ``repeats`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_medians(
    fns: dict[str, Callable[[], object]], device: torch.device, repeats: int, warmup: int = 2
) -> dict[str, float]:
    """Like :func:`median_seconds` for several functions, taking turns, so drift in the
    machine's load (these machines are shared) hits every contender alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def paired_ratios(
    fns: dict[str, Callable[[], object]], baseline: str, device: torch.device, repeats: int
) -> dict[str, dict[str, float]]:
    """Time ``fns`` in rounds, in order and then in reverse (A B C C B A), after one untimed
    call each, so a drift of the machine's load and the order itself hit all alike.

    Returns, per name, ``seconds`` (the median over rounds of its mean time in the round),
    ``ratio``, ``ratio_min``, ``ratio_max``: the median, lowest and highest over rounds of its
    time over ``baseline``'s in the same round (1 for the baseline itself), and ``rounds``: its
    time in each round, for ratios between two other names.
    """
    for fn in fns.values():
        fn()
    order = [*fns.items(), *reversed(fns.items())]
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        spent = dict.fromkeys(fns, 0.0)
        for name, fn in order:
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            spent[name] += (time.perf_counter() - start) / 2
        for name in fns:
            times[name].append(spent[name])
    result = {}
    for name, seconds in times.items():
        ratios = [mine / base for mine, base in zip(seconds, times[baseline], strict=True)]
        result[name] = {"seconds": statistics.median(seconds), **spread(ratios), "rounds": seconds}
    return result


def spread(ratios: Sequence[float], name: str = "ratio") -> dict[str, float]:
    """``name``, ``name_min`` and ``name_max``: the median, lowest and highest of ``ratios``, one
    per round, the way every results file reports a ratio."""
    return {name: statistics.median(ratios), f"{name}_min": min(ratios), f"{name}_max": max(ratios)}


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A Markdown table, so the output pastes straight into the performance appendix."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    print(f"\n{title}\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(cells[0], widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells[1:]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")


RESULTS_DIR = Path(__file__).resolve().parent / "results"


def write_results(name: str, data: dict) -> Path:
    """Write ``benchmarks/results/<name>.json`` with the date, the machine and the versions.

    The performance appendix renders its tables from these files, so the figures on the
    page are what a script printed, never retyped.
    """
    record = {"date": date.today().isoformat(), "machine": machine(), "torch": torch.__version__,
              "python": platform.python_version()}  # fmt: skip
    if torch.cuda.is_available():
        record |= {"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda, "driver": cuda_driver()}
    record |= data
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nwrote {path}")
    return path
