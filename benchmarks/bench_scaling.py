"""The runs the scaling-out appendix shows: the trainer CLI alone and under torchrun.

Runs ``python -m transformer_book.tools.train`` (the ``transformer-book-train`` command) once as a
single process and several times under ``torchrun --standalone --nproc_per_node=2`` (gloo
on a CPU, NCCL on GPUs), and keeps every JSON line each run printed:

* ``copy_1``: the copy task, 500 steps, one process;
* ``copy_2``: the same command on two processes;
* ``dates_2``: the dates task, 1000 steps, two processes;
* ``tiny_1`` and ``tiny_2``: a 10-step run of a tiny model, one and two processes;
* ``resume_first`` and ``resume_second``: ``copy_2`` stopped at step 300, then resumed to 500.

    python benchmarks/bench_scaling.py            # about six minutes on a 2-core CPU

Writes ``benchmarks/results/scaling.json``, which ``chapters/appendix/scaling_out.md``
renders (the page reads the file; it does not train).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import write_results

# --no-taper: these copy runs are stopped at step 300 and resumed to 500, which a schedule that
# ends at --steps (the recipe's taper) would not allow.
COPY = ["--task", "copy", "--max-steps", "500", "--batch-size", "64", "--dropout", "0", "--eval-every", "100",
        "--no-taper"]  # fmt: skip
DATES = ["--task", "dates", "--max-steps", "1000", "--batch-size", "64", "--dropout", "0", "--eval-every", "250"]
TINY = ["--task", "copy", "--max-steps", "10", "--d-model", "32", "--num-heads", "2", "--d-ff", "64",
        "--num-layers", "1", "--dropout", "0", "--batch-size", "16", "--eval-every", "2"]  # fmt: skip
SINGLE = [sys.executable, "-m", "transformer_book.tools.train"]
TWO = ["torchrun", "--standalone", "--nproc_per_node=2", "-m", "transformer_book.tools.train"]


def run(launcher: list[str], args: list[str], out: Path, resume: Path | None = None) -> dict:
    """Run the trainer; return the command as a reader would type it and its JSON lines."""
    extra = ["--out", str(out)] + (["--resume", str(resume)] if resume else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(launcher + args + extra, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        sys.exit(f"{' '.join(launcher + args)} failed:\n{done.stderr[-3000:]}")
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    shown = ["python -m transformer_book.tools.train" if launcher is SINGLE else " ".join(TWO)]
    shown += args + ["--out", out.name] + (["--resume", resume.name] if resume else [])
    print(" ".join(shown), f"-> {len(lines)} lines, last {lines[-1] if lines else None}")
    return {"command": " ".join(shown), "lines": lines}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        runs = {
            "copy_1": run(SINGLE, COPY, folder / "copy.pt"),
            "copy_2": run(TWO, COPY, folder / "copy.pt"),
            "dates_2": run(TWO, DATES, folder / "dates.pt"),
            "tiny_1": run(SINGLE, TINY, folder / "tiny.pt"),
            "tiny_2": run(TWO, TINY, folder / "tiny.pt"),
        }
        first = [*COPY[:3], "300", *COPY[4:]]
        runs["resume_first"] = run(TWO, first, folder / "part.pt")
        runs["resume_second"] = run(TWO, COPY, folder / "part.pt", resume=folder / "part.pt")
    write_results("scaling", {"processes": 2, "runs": runs})


if __name__ == "__main__":
    main()
