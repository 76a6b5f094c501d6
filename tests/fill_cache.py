"""Execute a book's notebooks several at a time into the jupyter-cache its build reads.

    python tests/fill_cache.py BOOK_ROOT CACHE_DIR [--workers N] [--timeout S] [--core-free FILE] NOTEBOOK...

`jupyter-book build` (myst-nb's ``execute_notebooks: cache``) executes each notebook that
has no cached outputs, one after another, as it reads the pages. Filled in advance, the
same cache lets the build find every notebook already executed: the executions are the
same (myst-nb's own call, ``single_nb_execution`` in the notebook's folder, and the same
cache record), only ``--workers`` of them run side by side. A notebook that fails is not
cached, so the build executes it again and reports the error as it always does.

The test suite runs this before its book build (tests/conftest.py), the longest chapters
first (``book_helpers.heaviest_first``), so two cores are busy where the build alone
would use one. The kernels are forked from one process that has imported the chapters'
libraries once (tests/forked_kernels.py): a fresh kernel would spend about four seconds
of CPU on those imports for every chapter. ``--core-free FILE`` is created once no
notebook is left to start and a worker has gone idle: the suite's sections run takes
that core while the last ones finish.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import forked_kernels
import nbformat


def execute(path: str, timeout: float) -> tuple[str, nbformat.NotebookNode | None, float, str]:
    """In a worker: (path, executed notebook or None, seconds, error text)."""
    from jupyter_cache.executors.utils import single_nb_execution

    notebook = nbformat.read(path, as_version=4)
    # What myst-nb's cache client does for a notebook the cache does not hold (in a forked kernel).
    result = single_nb_execution(
        notebook, cwd=str(Path(path).parent), allow_errors=False, timeout=timeout, meta_override=True,
        kernel_name=forked_kernels.KERNEL_NAME,
    )  # fmt: skip
    return path, (None if result.err else notebook), result.time, result.exc_string or ""


def fill(
    root: Path, cache_dir: Path, notebooks: list[str], workers: int, timeout: float, core_free: Path | None = None
) -> dict[str, float]:
    """Execute ``notebooks`` (relative to ``root``) into ``cache_dir``; returns seconds per notebook run.
    ``core_free`` is created when fewer than ``workers`` notebooks are left running."""
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    cache = get_cache(str(cache_dir))
    seconds: dict[str, float] = {}
    with forked_kernels.zygote(), ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(execute, str(root / name), timeout) for name in notebooks]
        for future in as_completed(futures):
            path, executed, elapsed, error = future.result()
            name = Path(path).relative_to(root).as_posix()
            seconds[name] = elapsed
            if core_free is not None and len(notebooks) - len(seconds) < workers:
                core_free.touch()  # every notebook has started, and a worker is idle
            if executed is None:  # the build will execute it again and report the error
                print(f"{name}: failed after {elapsed:.1f}s\n{error[-2000:]}", flush=True)
                continue
            record = cache.add_nb_to_project(path)
            cache.cache_notebook_bundle(
                CacheBundleIn(executed, record.uri, data={"execution_seconds": elapsed}),
                check_validity=False,
                overwrite=True,
            )
            print(f"{name}: {elapsed:.1f}s", flush=True)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("cache", type=Path)
    parser.add_argument("notebooks", nargs="+", help="paths relative to root, in the order to start them")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--core-free", type=Path, help="created when a worker has no notebook left to start")
    args = parser.parse_args()
    start = time.perf_counter()
    seconds = fill(args.root.resolve(), args.cache, args.notebooks, args.workers, args.timeout, args.core_free)
    print(f"{len(seconds)} notebooks in {time.perf_counter() - start:.1f}s with {args.workers} workers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
