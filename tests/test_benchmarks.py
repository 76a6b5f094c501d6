"""The benchmark scripts' options, on the CPU and uncompiled (no timing is asserted).

A benchmark that breaks only after minutes of compiling on a lent GPU costs that GPU's
time: here its bookkeeping runs in a second, with the contenders that need no compiler.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import transformer_book as tb

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_model  # noqa: E402


@pytest.mark.parametrize("evaluate", [True, False], ids=["with-eval", "train-only"])
def test_a_short_run_keeps_the_baseline_and_the_model_that_counts_the_work(evaluate):
    config = tb.ModelConfig.small(40)
    result = bench_model.run(torch.device("cpu"), config, batch=2, length=6, repeats=1, compiled=False,
                             profile_ops=False, matmul_size=64, only=["theirs"], evaluate=evaluate)  # fmt: skip
    rows = {(r["what"], r["contender"]): r for r in result["rows"]}
    kinds = ["train step (fwd+loss+bwd+Adam)"] + (["eval forward"] if evaluate else [])
    # --only theirs still times the eager plain model: its step is where the FLOPs are counted.
    assert sorted(rows) == sorted((kind, name) for kind in kinds for name in ("plain", "theirs"))
    for (kind, name), row in rows.items():
        assert row["gflop"] > 0 and row["ms"] > 0, (kind, name)
        if name == bench_model.BASELINE:
            assert row["ratio"] == row["ratio_min"] == row["ratio_max"] == 1.0
    assert result["tokens_per_step"] == 2 * 6 and "profile" not in result


def test_the_cpu_capability_bookkeeping_on_this_process_kernels():
    """bench_cpu_capability's measurements and summary, at a tiny size in this process: the row
    lengths asked for, the recipe's own row length and vocabulary, the operators that work along
    rows found in the profile (dates drops attention weights, so it runs the plain softmax), and
    a kernel set's ratio to itself of exactly 1. (The copy recipe's fused attention is asserted
    by appendix C from the results file.)"""
    import bench_cpu_capability as bench

    one = bench.measure((4, 16), 512, 0.01, ["dates"], steps=1, warmup=0)
    assert one["capability"] == torch.backends.cpu.get_cpu_capability()
    assert [row["length"] for row in one["softmax"]] == [4, 16]
    assert all(row[cost] > 0 for row in one["softmax"] for cost in bench.COSTS)
    result = bench.summarise({one["capability"]: [one, one]})
    assert result["sets"] == [one["capability"]] and result["rounds"] == 2
    dates, task = result["recipes"]["dates"], tb.recipe("dates").make_task(0)
    assert dates["vocab"] == task.tgt_vocab_size and dates["dropout"] == tb.recipe("dates").dropout > 0
    mine = dates[one["capability"]]
    assert mine["ratio"] == mine["ratio_min"] == mine["ratio_max"] == 1.0
    assert 0 < mine["ops_ms"]["aten::_softmax"] <= mine["row_ms"] < mine["profiled_ms"]


def test_the_decoding_step_products_are_the_weights_a_step_reads():
    """bench_decoding times a cached step's matrix products alone: the modules it times hold
    exactly the megabytes of weights step_weights_mb counts (no more, no fewer), and at the
    small sizes the pass takes some time and returns."""
    import bench_decoding

    config = tb.ModelConfig.small(40)
    model = bench_decoding.make_model(torch.device("cpu"), config)
    linears = bench_decoding.step_linears(model)
    assert len(linears) == 8 * config.num_layers + 1 and linears[-1] is model.generator
    megabytes = sum(4 * linear.weight.numel() for linear in linears) / 1e6
    assert megabytes == pytest.approx(bench_decoding.step_weights_mb(config))
    assert bench_decoding.products_ms(linears, batch=1, repeats=1) > 0
    threads = torch.get_num_threads()
    assert bench_decoding.products_one_thread_ms(linears, batch=1, repeats=1) > 0
    assert torch.get_num_threads() == threads  # restored


def test_the_decoding_steps_compile_options_are_recorded_as_json():
    """On a CPU both compiled steps ask for Inductor's decompose_mm_pass (the pass appendix C
    describes; whether it fires is the measured run's business) and call their kernels from
    C++; on a GPU the cached step is a CUDA graph. The results file keeps the options, so
    they must survive JSON."""
    import json

    import bench_decoding

    for dynamic in (False, True):
        cpu = bench_decoding.compile_options(torch.device("cpu"), dynamic)
        assert cpu["dynamic"] is dynamic and cpu["options"]["cpp_wrapper"] is True
        assert "decompose_mm_pass" in cpu["options"]["post_grad_fusion_options"]
        assert json.loads(json.dumps(cpu)) == cpu
    assert bench_decoding.compile_options(torch.device("cuda"), False) == {"dynamic": False, "mode": "reduce-overhead"}
    assert bench_decoding.compile_options(torch.device("cuda"), True) == {"dynamic": True}
