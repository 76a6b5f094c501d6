"""Do the training recipes work on every seed? Each recipe, ten seeds, run to the step cap.

For every seed the run continues to the recipe's cap even after it reaches its target,
so the table shows both how fast it gets there and whether it stays. Every evaluation
scores the validation set: "min after" is the lowest validation exact match at any
evaluation after the first one at the target. A seed fails if it never reaches the target
or later drops below ``--stay`` (99%). "test" is the test set's exact match, scored once,
at the cap (the weights a run stopped at the target would keep are not scored).

    python benchmarks/bench_recipes.py                   # both recipes, seeds 0-9, 2 processes
    python benchmarks/bench_recipes.py --recipes dates --seeds 3 --workers 1

Prints a table per recipe and one JSON line per recipe, and writes everything to
``benchmarks/results/recipes.json``, which the training chapter renders.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from datetime import date

import torch
from common import RESULTS_DIR, machine, print_table, write_results

import transformer_book as tb


def run_seed(name: str, seed: int, stay: float) -> dict:
    """One seed of one recipe, to the cap (in a worker process of its own)."""
    torch.set_num_threads(1)
    run = tb.train_recipe(name, seed, until_target=False, device=torch.device("cpu"))
    history, target = run.history, run.recipe.target
    reached = next((i for i, metric in enumerate(history.eval_metric) if metric >= target), None)
    after = history.eval_metric[reached:] if reached is not None else []
    # Seconds to the target: the share of the run's time spent up to that evaluation.
    step = history.eval_step[reached] if reached is not None else None
    seconds = history.seconds * step / history.step[-1] if step else None
    return {
        "seed": seed,
        "steps_to_target": step,
        "seconds_to_target": seconds,
        "final": history.eval_metric[-1],  # validation, at the cap
        "test": run.accuracy,  # scored once, at the cap
        "min_after_target": min(after) if after else None,
        "failed": reached is None or min(after) < stay,
        "seconds_total": history.seconds,
    }


def summary(name: str, rows: list[dict]) -> dict:
    reached = [r for r in rows if r["steps_to_target"] is not None]
    steps = [r["steps_to_target"] for r in reached]
    seconds = [r["seconds_to_target"] for r in reached]
    r = tb.recipe(name)
    return {
        "recipe": name,
        "seeds": len(rows),
        "failures": sum(row["failed"] for row in rows),
        "steps_median": statistics.median(steps) if steps else None,
        "steps_max": max(steps) if steps else None,
        "step_cap": r.max_steps,
        "target": r.target,
        "seconds_median": round(statistics.median(seconds), 2) if seconds else None,
        "test_min": min(row["test"] for row in rows),
        "machine": machine(),
    }


def kept_results(rerun: list[str]) -> dict:
    """The previous results of the recipes not run now, if they were made by today's recipe."""
    path = RESULTS_DIR / "recipes.json"
    if not path.exists():
        return {}
    previous = json.loads(path.read_text())["recipes"]
    current = {name: dataclasses.asdict(r) for name, r in tb.RECIPES.items()}
    return {
        name: entry for name, entry in previous.items() if name not in rerun and entry["recipe"] == current.get(name)
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=sorted(tb.RECIPES), choices=sorted(tb.RECIPES))
    parser.add_argument("--seeds", type=int, default=10, help="seeds 0 .. N-1")
    parser.add_argument("--stay", type=float, default=0.99, help="the accuracy a run must keep after its target")
    parser.add_argument("--workers", type=int, default=2, help="processes, each with one thread")
    args = parser.parse_args()

    report = {"note": "each seed in a process of its own, one thread", "recipes": kept_results(args.recipes)}
    with ProcessPoolExecutor(args.workers) as pool:
        futures = {
            name: [pool.submit(run_seed, name, seed, args.stay) for seed in range(args.seeds)] for name in args.recipes
        }
        for name, jobs in futures.items():
            rows = [job.result() for job in jobs]
            print_table(
                f"{name}: {tb.recipe(name)}",
                ["seed", "steps to target", "seconds to target", "final", "min after target", "test", "ok"],
                [[r["seed"], r["steps_to_target"] or "never",
                  f"{r['seconds_to_target']:.1f}" if r["seconds_to_target"] else "-",
                  f"{r['final']:.4f}", f"{r['min_after_target']:.4f}" if r["min_after_target"] is not None else "-",
                  f"{r['test']:.4f}",
                  "no" if r["failed"] else "yes"] for r in rows],
            )  # fmt: skip
            line = summary(name, rows)
            print(json.dumps(line))
            report["recipes"][name] = {"summary": line, "seeds": rows, "recipe": dataclasses.asdict(tb.recipe(name)),
                                       "stay": args.stay, "date": date.today().isoformat()}  # fmt: skip
    write_results("recipes", report)
    return 0 if all(r["summary"]["failures"] == 0 for r in report["recipes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
