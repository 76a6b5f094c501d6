"""The retired C speed wing's size and last measurements, read from git history, for appendix C.

Until the commit that removed ``src/transformer_book/fast``, the package carried a speed wing
of its own (C kernels loaded through ctypes, faster module classes, a decoding plan). Its
measurements were never kept in a results file of their own: ``bench_model.py`` and
``bench_decoding.py`` recorded them beside the plain model's. This script finds that commit
(the last one to touch the folder), reads ``benchmarks/results/model.json`` and
``decoding.json`` as they stood just before it, counts the wing's lines there (its C, its
Python, and the tests the commit removed with it), and writes ``benchmarks/results/wing.json``.
The measurements' own date and machine are under ``model`` and ``decoding``; the top-level
date and machine are this script's run, which only reads git.

    python benchmarks/wing_history.py
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from common import write_results

REPO_ROOT = Path(__file__).resolve().parent.parent
WING = "src/transformer_book/fast"


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=True).stdout


def lines(commit: str, path: str) -> int:
    return len(git("show", f"{commit}:{path}").splitlines())


def old_json(commit: str, path: str) -> dict:
    return json.loads(git("show", f"{commit}:{path}"))


def main() -> int:
    removal = git("log", "-1", "--format=%H", "--", WING).strip()
    if not removal:
        print(f"no commit in this clone's history touches {WING} (a shallow clone?)", file=sys.stderr)
        return 1
    if git("ls-tree", "-r", "--name-only", removal, "--", WING).strip():
        print(f"{WING} is still there: nothing retired to record", file=sys.stderr)
        return 1
    before = f"{removal}^"
    files = git("ls-tree", "-r", "--name-only", before, "--", WING).split()
    tests = git("diff", "--name-only", "--diff-filter=D", before, removal, "--", "tests").split()
    kinds = {
        "c": [f for f in files if f.endswith((".c", ".h"))],
        "python": [f for f in files if f.endswith(".py")],
        "tests": [f for f in tests if f.endswith(".py")],
    }
    model = old_json(before, "benchmarks/results/model.json")
    decoding = old_json(before, "benchmarks/results/decoding.json")
    train = next(r for r in model["rows"] if r["what"].startswith("train"))
    evaluate = next(r for r in model["rows"] if r["what"].startswith("eval"))
    batch = re.search(r"batch (\d+)", decoding["title"])
    data = {
        "note": "the wing's size and its last measurements, as git holds them just before the commit "
        "that removed it (benchmarks/wing_history.py)",
        "commit": removal,
        "short": git("rev-parse", "--short=7", removal).strip(),
        "subject": git("log", "-1", "--format=%s", removal).strip(),
        "commit_date": git("log", "-1", "--format=%cs", removal).strip(),
        "lines": {kind: sum(lines(before, f) for f in paths) for kind, paths in kinds.items()},
        "files": kinds,
        "model": {
            "date": model["date"],
            "machine": model["machine"],
            "title": model["title"],
            # ratio: the accelerated model over nn.Transformer; plain_ratio: the plain model over it
            "train": {k: train[k] for k in ("ratio", "ratio_min", "ratio_max", "plain_ratio")},
            "eval": {k: evaluate[k] for k in ("ratio", "ratio_min", "ratio_max", "plain_ratio")},
        },
        "decoding": {
            "date": decoding["date"],
            "machine": decoding["machine"],
            "title": decoding["title"],
            "batch": int(batch.group(1)) if batch else None,
            # accelerate_speedup: the plain model's cached greedy decoding over the accelerated one's
            "greedy": [{k: r[k] for k in ("new_tokens", "accelerate_speedup")} for r in decoding["greedy"]],
        },
    }
    write_results("wing", data)
    print(json.dumps(data["lines"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
