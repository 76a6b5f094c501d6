"""Per-chapter execution time: every chapter in a fresh kernel, on CPU and on GPU when present.

Each chapter listed in _toc.yml is copied into a fresh temporary folder and executed
there with nbclient in a new kernel (as a reader who downloaded it would), with
TRANSFORMER_BOOK_DEVICE set in the kernel's environment. Times are wall-clock and
include starting the kernel and importing torch. A chapter that fails is reported in
the table and makes the script exit non-zero (the weekly Colab job relies on that).

    python benchmarks/bench_chapters.py                    # cpu, and cuda when available
    python benchmarks/bench_chapters.py --devices cuda     # what the weekly Colab job runs
    python benchmarks/bench_chapters.py --root PATH --kernel python3 --chapters 03 07
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import torch
from common import machine, print_table, write_results
from nbclient import NotebookClient

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tests"))
from book_helpers import toc_notebooks  # noqa: E402

CELL_TIMEOUT_S = 600


def execute(notebook: Path, device: str, kernel: str | None) -> float:
    """Run a copy of ``notebook`` in a fresh folder and kernel on ``device``; returns seconds."""
    nb = nbformat.read(notebook, as_version=4)
    kernel = kernel or nb.metadata.get("kernelspec", {}).get("name", "python3")
    env = os.environ.copy()
    env["TRANSFORMER_BOOK_DEVICE"] = device
    with tempfile.TemporaryDirectory(prefix="chapter-") as folder:
        copy = Path(folder) / notebook.name
        shutil.copyfile(notebook, copy)
        client = NotebookClient(
            nbformat.read(copy, as_version=4),
            timeout=CELL_TIMEOUT_S,
            kernel_name=kernel,
            allow_errors=False,
            resources={"metadata": {"path": folder}},
        )
        start = time.perf_counter()
        client.execute(env=env)
        return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="the book's root (holds _toc.yml)")
    parser.add_argument(
        "--devices", nargs="+", default=None, help="devices to run on (default: cpu, and cuda when available)"
    )
    parser.add_argument("--kernel", default=None, help="kernel name (default: each notebook's kernelspec)")
    parser.add_argument(
        "--chapters", nargs="+", default=None, help="only chapters whose path contains one of these strings"
    )
    args = parser.parse_args()

    devices = args.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    notebooks = toc_notebooks(args.root.resolve())
    if args.chapters:
        notebooks = [n for n in notebooks if any(c in n for c in args.chapters)]
    if not notebooks:
        print("no chapters to run", file=sys.stderr)
        return 1

    seconds: dict[tuple[str, str], float | None] = {}
    failures: list[str] = []
    for device in devices:
        for name in notebooks:
            try:
                seconds[name, device] = execute(args.root / name, device, args.kernel)
                print(f"{device:>5}  {seconds[name, device]:7.1f}s  {name}", file=sys.stderr, flush=True)
            except Exception as exc:  # a failing cell, a timeout, a dead kernel: report it, go on
                seconds[name, device] = None
                failures.append(f"{name} on {device}: {type(exc).__name__}: {str(exc)[-3000:]}")
                print(f"{device:>5}   FAILED  {name}", file=sys.stderr, flush=True)

    def cell(value: float | None) -> str:
        return "FAILED" if value is None else f"{value:.1f}"

    headers = ["chapter"] + [f"{d} (s)" for d in devices]
    both = {"cpu", "cuda"} <= set(devices)
    if both:
        headers.append("cpu / cuda")
    rows = []
    for name in notebooks:
        row = [Path(name).stem] + [cell(seconds[name, d]) for d in devices]
        if both:
            cpu, cuda = seconds[name, "cpu"], seconds[name, "cuda"]
            row.append(f"{cpu / cuda:.2f}" if cpu and cuda else "-")
        rows.append(row)
    totals = {d: [seconds[n, d] for n in notebooks] for d in devices}
    rows.append(
        ["**total**"] + [cell(None if None in t else sum(t)) for t in totals.values()] + (["-"] if both else [])
    )

    try:
        package = importlib.metadata.version("transformer-book")
    except importlib.metadata.PackageNotFoundError:
        package = "not installed"
    import nbclient

    print_table(
        "Chapter execution time (fresh kernel per chapter, wall-clock incl. kernel start)\n\n"
        f"{machine()}; transformer-book {package}; nbclient {nbclient.__version__}",
        headers,
        rows,
    )
    if failures:
        print("\nFailed:\n" + "\n\n".join(failures), file=sys.stderr)
        return 1
    if not args.chapters and args.root.resolve() == REPO_ROOT:
        write_results("chapters", {
            "note": "fresh kernel per chapter, wall-clock including kernel start and imports",
            "rows": [
                {"chapter": Path(n).stem, "device": d, "seconds": seconds[n, d]} for d in devices for n in notebooks
            ],
        })  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
