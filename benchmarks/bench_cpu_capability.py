"""Short rows and ATen's CPU kernel sets: softmax per value by row length, and the recipes'
training steps, under each kernel set this CPU can run.

PyTorch compiles each CPU kernel once per instruction set, its *CPU capability* (``AVX512``,
``AVX2``, ``DEFAULT``, ...), and runs the widest the CPU offers, unless the environment variable
``ATEN_CPU_CAPABILITY``, read once when torch starts, names a narrower one
(``torch.backends.cpu.get_cpu_capability()`` says which runs). ATen's softmax over the last
dimension works one vector register at a time along a row: 16 float32 numbers with AVX-512, 8
with AVX2. This script measures what a row shorter than one register costs, and what that does
to chapter 8's training steps, whose attention rows hold at most a dozen keys:

- ``softmax``: nanoseconds per value of ``torch.softmax`` and ``torch.log_softmax`` (forward)
  over rows of 2 to 64 numbers, 64K values in all;
- ``recipes``: milliseconds per training step of each recipe in ``tb.RECIPES`` (its model, its
  dropout, its batches: ``tb.train_step`` as ``tb.fit`` calls it, clipping included), and the
  step's self time in each operator, from ``torch.profiler``; ``row_ms`` adds up the operators
  that work along rows of attention scores or logits (``ROW_OPS``: softmax, log-softmax and the
  fused attention of ``F.scaled_dot_product_attention``, forward and backward).

Each kernel set runs in a process of its own, with one thread; the processes take turns, round
after round, in the order A B B A, and each ratio (a kernel set's time over the CPU's own
default's) is the median over rounds, with the lowest and highest beside it. A CPU whose widest
set is AVX-512 runs it and AVX2; any other runs its default alone.

    python benchmarks/bench_cpu_capability.py             # about four minutes on a 2-core CPU
    python benchmarks/bench_cpu_capability.py --rounds 1

A run with the default options writes ``benchmarks/results/cpu_capability.json``, which appendix C
renders (a CPU without AVX-512, which runs one kernel set, writes ``cpu_capability_<set>.json``,
which no page reads); ``--results NAME`` writes ``results/NAME.json`` instead, as for a second
machine's run; a shorter run only prints its tables.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch
from common import print_table, spread, write_results
from torch.profiler import profile
from torch.utils.benchmark import Timer

import transformer_book as tb

LENGTHS = (2, 4, 6, 8, 11, 12, 15, 16, 20, 24, 32, 48, 64)
VALUES = 65536  # values per softmax call
COSTS = ("softmax_ns", "log_softmax_ns")
#: The float32 numbers one vector register holds, per kernel set.
LANES = {"AVX512": 16, "AVX2": 8}
#: The operators that work along rows of attention scores or logits (forward and backward): the
#: softmax and log-softmax, and the CPU's fused attention, which runs a softmax inside.
ROW_OPS = ("aten::_softmax", "aten::_log_softmax", "aten::_scaled_dot_product_flash_attention")


def softmax_costs(lengths: tuple[int, ...], values: int, min_run_time: float) -> list[dict]:
    """Nanoseconds per value of softmax and log-softmax over rows of each length."""
    rows = []
    for length in lengths:
        x = torch.randn(max(values // length, 1), length)
        row = {"length": length}
        for name, fn in zip(COSTS, (torch.softmax, torch.log_softmax), strict=True):
            timer = Timer("fn(x, -1)", globals={"fn": fn, "x": x})
            row[name] = timer.blocked_autorange(min_run_time=min_run_time).median / x.numel() * 1e9
        rows.append(row)
    return rows


def recipe_steps(name: str, steps: int, warmup: int) -> dict:
    """Milliseconds per training step of recipe ``name`` (seed 0), and each operator's self
    time per step (those of 0.1 ms or more), with the row lengths the step worked on."""
    r = tb.recipe(name)
    tb.seed_everything(0)
    task = r.make_task(0)
    config = r.model_config(task)
    model = tb.make_model(config).train()
    optimizer, schedule = r.optimizer(model)
    loss_fn = r.loss_fn(config)
    rng = random.Random(1)
    batches = [task.train_batch(r.batch_size, rng) for _ in range(warmup + 2 * steps)]

    def step(batch: tb.Batch) -> None:
        with tb.trusted_ids():
            tb.train_step(model, batch, loss_fn, optimizer, schedule, clip_norm=r.clip_norm)

    for batch in batches[:warmup]:
        step(batch)
    start = time.perf_counter()
    for batch in batches[warmup : warmup + steps]:
        step(batch)
    ms = (time.perf_counter() - start) / steps * 1e3
    with profile() as prof:  # other batches: the timed steps ran without the profiler
        for batch in batches[warmup + steps :]:
            step(batch)
    total = {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages()}
    return {
        "ms_per_step": ms,
        "ops_ms": {op: ms for op, ms in total.items() if ms >= 0.1},
        "row_ms": sum(ms for op, ms in total.items() if op.startswith(ROW_OPS)),
        "profiled_ms": sum(total.values()),
        "keys": max(max(b.src.shape[1], b.tgt_in.shape[1]) for b in batches),  # an attention row, at most
        "vocab": config.tgt_vocab_size,  # the loss's log-softmax row
        "dropout": r.dropout,
        "batch": r.batch_size,
    }


def measure(lengths: tuple[int, ...], values: int, min_run_time: float, recipes: list[str], steps: int,
            warmup: int) -> dict:  # fmt: skip
    """All of one kernel set's measurements, in this process (a run's has one thread)."""
    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "softmax": softmax_costs(lengths, values, min_run_time),
        "recipes": {name: recipe_steps(name, steps, warmup) for name in recipes},
    }


def run_child(capability: str | None, argv: list[str]) -> dict:
    """:func:`measure` in a new process, under ``capability`` (None: the CPU's default)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability.lower()
    done = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True, env=env,
                          check=False)  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"the {capability or 'default'} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarise(runs: dict[str, list[dict]]) -> dict:
    """The results file's body from each kernel set's runs (the CPU's default first), one per
    round: medians over rounds, and each step's ratio to the default's in the same round."""
    sets = list(runs)
    default = runs[sets[0]]
    result: dict = {"default": sets[0], "sets": sets, "lanes": {s: LANES.get(s) for s in sets},
                    "rounds": len(default), "threads": 1, "softmax": {}, "recipes": {}}  # fmt: skip
    for name, mine in runs.items():
        result["softmax"][name] = [
            {"length": rows[0]["length"]} | {k: statistics.median(r[k] for r in rows) for k in COSTS}
            for rows in zip(*(run["softmax"] for run in mine), strict=True)
        ]
    for recipe, first in default[0]["recipes"].items():
        entry = {key: first[key] for key in ("keys", "vocab", "dropout", "batch")}
        for name, mine in runs.items():
            steps = [run["recipes"][recipe] for run in mine]
            ratios = [
                m["ms_per_step"] / d["recipes"][recipe]["ms_per_step"] for m, d in zip(steps, default, strict=True)
            ]
            ops = {op for m in steps for op in m["ops_ms"]}
            entry[name] = {
                "ms_per_step": statistics.median(m["ms_per_step"] for m in steps),
                **spread(ratios),
                "row_ms": statistics.median(m["row_ms"] for m in steps),
                "profiled_ms": statistics.median(m["profiled_ms"] for m in steps),
                "ops_ms": {op: statistics.median(m["ops_ms"].get(op, 0.0) for m in steps) for op in sorted(ops)},
            }  # fmt: skip
        result["recipes"][recipe] = entry
    return result


def report(result: dict) -> None:
    """Print the two tables."""
    sets = result["sets"]
    columns = [(s, kind) for s in sets for kind in ("softmax", "log_softmax")]
    rows = [[row["length"], *(f"{result['softmax'][s][i][f'{kind}_ns']:.2f}" for s, kind in columns)]
            for i, row in enumerate(result["softmax"][sets[0]])]  # fmt: skip
    print_table("ns per value (median over rounds)", ["row length", *(f"{s} {k}" for s, k in columns)], rows)
    rows = []
    for recipe, entry in result["recipes"].items():
        for s in sets:
            e = entry[s]
            ratio = f"{e['ratio']:.3f} ({e['ratio_min']:.3f}-{e['ratio_max']:.3f})"
            rows.append([recipe, s, f"{e['ms_per_step']:.1f}", ratio, f"{e['row_ms']:.1f}"])
    headers = ["recipe", "kernel set", "ms per step", f"/ {sets[0]} (min-max)", "row operators, ms per step"]
    print_table("training steps, one thread", headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of A B B A")
    parser.add_argument("--steps", type=int, default=20, help="timed training steps per recipe, per run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--recipes", nargs="+", default=sorted(tb.RECIPES), choices=sorted(tb.RECIPES))
    parser.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS))
    parser.add_argument("--values", type=int, default=VALUES)
    parser.add_argument("--min-run-time", type=float, default=0.1, help="seconds per softmax timing")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--results", help="write results/<RESULTS>.json (a default run writes cpu_capability.json)")
    args = parser.parse_args()
    if args.child:
        torch.set_num_threads(1)
        return print(json.dumps(measure(tuple(args.lengths), args.values, args.min_run_time, args.recipes,
                                        args.steps, args.warmup)))  # fmt: skip

    argv = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--recipes", *args.recipes,
            "--lengths", *map(str, args.lengths), "--values", str(args.values),
            "--min-run-time", str(args.min_run_time)]  # fmt: skip
    default = torch.backends.cpu.get_cpu_capability()
    sets = [default] + (["AVX2"] if default == "AVX512" else [])
    runs: dict[str, list[dict]] = {name: [] for name in sets}
    for _ in range(args.rounds):
        for name in [*sets, *reversed(sets)]:
            run = run_child(None if name == default else name, argv)
            if run["capability"] != name:
                sys.exit(f"asked for {name}, ran {run['capability']}")
            runs[name].append(run)
    result = summarise(runs) | {"values": args.values}
    torch.set_num_threads(1)  # as in the runs: the results file's machine line names one thread
    report(result)
    if vars(args) | {"results": None} != vars(parser.parse_args([])):
        return print("\nnot written: only a run with the default options writes the results file")
    # The appendix compares two kernel sets: a CPU with one writes a file of its own.
    default_name = "cpu_capability" if len(sets) > 1 else f"cpu_capability_{default.lower()}"
    write_results(args.results or default_name, result)


if __name__ == "__main__":
    main()
