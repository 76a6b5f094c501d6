"""Run notebook sections, each alone in a fresh IPython namespace of its own process.

Usage (by tests/test_sections.py, with the Python of the wheel's virtual environment)::

    python section_runner.py JOBS.json RESULTS_DIR [--workers N] [--timeout S] [--start-when FILE] [--one-when FILE]

JOBS.json is a list of ``{"id", "notebook", "folder", "seed", "cells"}``, in the order
to start them: ``cells`` are the code cells to run in order (a chapter's setup cells,
then one section's). For each job this process forks a child that starts from an empty
user namespace, sets ``TRANSFORMER_BOOK_SEED`` to the job's seed, runs the cells with
IPython (magics and ``display`` work as in a notebook) from ``folder``, and writes
``RESULTS_DIR/<id>.json``.
It runs ``--workers`` children at a time, none before the file ``--start-when`` exists
(the test suite creates it when the book build has executed its chapters, so that
the two do not share the cores), and one alone once ``--one-when`` exists (created when
the build has one chapter left running, and a core to spare).

Why fork rather than start a Jupyter kernel per section: a kernel costs about four seconds
to start and import torch, pandas and Altair, and the book has over fifty sections. The
parent imports those libraries once and runs no chapter code; every child is a copy of
that pristine process, so a section sees exactly what a fresh kernel would (the libraries,
nothing any other section made) at a fraction of the cost. A section that leans on a name
from an earlier section fails here with the same NameError a reader would get.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from preload import import_libraries  # noqa: E402 - before this folder leaves sys.path

# Python put this script's folder (the repository's tests/) first on sys.path: a reader's
# kernel has nothing of the repository there, so neither do the sections.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

# Imported once here, before any fork: the children inherit them already loaded.
import_libraries("IPython.core.interactiveshell", "traitlets.config", plots="Agg")
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402
from traitlets.config import Config  # noqa: E402


def run_job(job: dict, results: Path) -> None:
    """In the child: run the cells, write the result file. Never returns."""
    result = {"id": job["id"], "ok": False, "cell": None, "error": "", "seconds": 0.0}
    log = open(results / f"{job['id']}.log", "w")
    os.dup2(log.fileno(), 1)  # the cells' prints go to the job's log, not the parent's stdout
    os.dup2(log.fileno(), 2)
    start = time.perf_counter()
    try:
        os.chdir(job["folder"])
        os.environ["TRANSFORMER_BOOK_SEED"] = str(job["seed"])  # what seed_everything() will use
        config = Config()
        config.HistoryManager.enabled = False  # no sqlite history shared between processes
        shell = InteractiveShell.instance(config=config)
        for index, source in enumerate(job["cells"]):
            outcome = shell.run_cell(source, store_history=False)
            if not outcome.success:
                error = outcome.error_in_exec or outcome.error_before_exec
                result["cell"] = index
                result["error"] = "".join(traceback.format_exception(type(error), error, error.__traceback__))[-4000:]
                break
        else:
            result["ok"] = True
        module = sys.modules["transformer_book"]
        result["module_file"] = module.__file__
        result["executable"] = sys.executable
        result["path"] = sys.path
    except BaseException as error:  # noqa: BLE001 - report anything, the parent decides
        result["error"] = repr(error)
    result["seconds"] = time.perf_counter() - start
    (results / f"{job['id']}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jobs", type=Path)
    parser.add_argument("results", type=Path)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--start-when", type=Path, help="run --workers sections at a time once this file exists")
    parser.add_argument("--one-when", type=Path, help="before --start-when, run one at a time once this file exists")
    args = parser.parse_args()
    jobs = json.loads(args.jobs.read_text())
    args.results.mkdir(parents=True, exist_ok=True)
    pending, running = list(jobs), {}

    def allowed() -> int:
        """How many sections may run now."""
        if args.start_when is None or args.start_when.exists():
            return args.workers
        return 1 if args.one_when is not None and args.one_when.exists() else 0

    while not allowed():
        time.sleep(0.2)
    while pending or running:
        while pending and len(running) < allowed():
            job = pending.pop(0)
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                run_job(job, args.results)
            running[pid] = (job, time.perf_counter())
        time.sleep(0.02)
        for pid, (job, started) in list(running.items()):
            done, _ = os.waitpid(pid, os.WNOHANG)
            if not done and time.perf_counter() - started > args.timeout:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                result = {"id": job["id"], "ok": False, "cell": None, "seconds": args.timeout,
                          "error": f"timed out after {args.timeout:.0f} s"}  # fmt: skip
                (args.results / f"{job['id']}.json").write_text(json.dumps(result))
                done = pid
            if done:
                del running[pid]
                print(f"{job['id']}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
