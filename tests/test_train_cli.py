"""The command-line trainer: one process and two (torchrun, gloo) agree, resume repeats the run, bad input is refused.

Single-process runs call ``main`` in this process (no second torch import);
the two-process run goes through ``torchrun`` exactly as a reader would type it.
Everything runs on the CPU, with a tiny model, in well under a minute.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import transformer_book
from transformer_book.data import Batch, DateTask, copy_task_batch
from transformer_book.training import LabelSmoothingLoss

cli = importlib.import_module("transformer_book.tools.train")

TINY = ["--d-model", "32", "--num-heads", "2", "--d-ff", "64", "--num-layers", "1", "--eval-size", "8"]
METRIC_KEYS = {"step", "loss", "lr", "exact_match", "elapsed_s", "world_size"}


@pytest.fixture(autouse=True)
def cpu_one_thread_and_restored_rng(monkeypatch: pytest.MonkeyPatch):
    """Force the CPU (a GPU job must not hand two ranks one GPU) and one thread (as torchrun gives
    each rank: on a busy 2-core machine a tiny model runs ~10x slower with two); restore both and the RNG."""
    monkeypatch.setenv("TRANSFORMER_BOOK_DEVICE", "cpu")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    state, threads = torch.get_rng_state(), torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.set_rng_state(state)


def run_here(argv: list[str], capsys: pytest.CaptureFixture) -> list[dict]:
    """``python -m transformer_book.tools.train ARGV`` in this process; the JSON lines it printed."""
    assert cli.main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["model"]


def test_two_processes_under_torchrun_match_one_process(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    common = ["--task", "copy", "--max-steps", "12", "--batch-size", "16", "--dropout", "0", "--eval-every", "1", *TINY]
    one = run_here([*common, "--out", str(tmp_path / "one.pt")], capsys)

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "transformer_book.tools.train",
            *common,
            "--out",
            str(tmp_path / "two.pt"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    two = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]

    # rank 0 alone prints: exactly one line per evaluation, with every field
    assert [r["step"] for r in two] == list(range(1, 13)) == [r["step"] for r in one]
    assert all(set(r) == METRIC_KEYS for r in one + two)
    assert {r["world_size"] for r in one} == {1} and {r["world_size"] for r in two} == {2}
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in two]), torch.tensor([r["loss"] for r in one]), rtol=1e-5, atol=0
    )
    assert [r["lr"] for r in two] == pytest.approx([r["lr"] for r in one], rel=1e-12)

    # The weights agree too, except the key biases: their true gradient is zero (softmax ignores a
    # shift shared by all keys), so Adam turns rounding noise of either sign into steps of size ~lr.
    w1, w2 = weights(tmp_path / "one.pt"), weights(tmp_path / "two.pt")
    for name in w1:
        if not name.endswith("k_proj.bias"):
            torch.testing.assert_close(w2[name], w1[name], rtol=1e-4, atol=1e-5, msg=name)


def test_resume_gives_the_uninterrupted_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # A run of 10 steps stands in for one interrupted at step 10, so the schedule must not end
    # at --max-steps (--no-taper); the average is kept and saved, and must resume exactly too.
    common = ["--task", "copy", "--batch-size", "8", "--dropout", "0.1", "--eval-every", "5", "--no-taper",
              "--average", "0.9", *TINY]  # fmt: skip
    whole = run_here([*common, "--max-steps", "20", "--out", str(tmp_path / "whole.pt")], capsys)
    first = run_here([*common, "--max-steps", "10", "--out", str(tmp_path / "half.pt")], capsys)
    half = torch.load(tmp_path / "half.pt", weights_only=True)
    assert half["step"] == 10
    rest = run_here(
        [*common, "--max-steps", "20", "--resume", str(tmp_path / "half.pt"), "--out", str(tmp_path / "resumed.pt")],
        capsys,
    )

    assert [r["step"] for r in first + rest] == [5, 10, 15, 20]
    # dropout is on, yet the losses repeat exactly: data and dropout are reseeded from (seed, step, rank)
    assert [r["loss"] for r in first + rest] == [r["loss"] for r in whole]
    assert rest[-1]["elapsed_s"] >= first[-1]["elapsed_s"]  # the clock continues across the resume

    a = torch.load(tmp_path / "whole.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed.pt", weights_only=True)
    torch.testing.assert_close(b["model"], a["model"], rtol=0, atol=0)
    torch.testing.assert_close(b["optimizer"]["state"], a["optimizer"]["state"], rtol=0, atol=0)
    torch.testing.assert_close(b["average"], a["average"], rtol=0, atol=0)
    assert int(a["average"]["n_averaged"]) == 20  # one update of the average per step
    assert b["schedule"] == a["schedule"] and b["step"] == a["step"] == 20


def test_checkpoint_is_plain_data_that_loads_with_weights_only(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["--task", "copy", "--max-steps", "2", "--batch-size", "4", *TINY, "--out", str(tmp_path / "c.pt")]
    run_here(argv, capsys)
    state = torch.load(tmp_path / "c.pt", weights_only=True)
    assert set(state) == cli.CHECKPOINT_KEYS == {
        "model", "average", "optimizer", "schedule", "step", "elapsed_s", "args", "model_config", "world_size"
    }  # fmt: skip
    assert state["step"] == 2 and state["world_size"] == 1
    # the recipe keeps an average of the weights: saved beside them, as plain tensors
    assert state["args"]["average"] == transformer_book.recipe("copy").average
    assert {f"module.{name}" for name in state["model"]} <= set(state["average"])
    assert state["args"]["d_model"] == state["model_config"]["d_model"] == 32
    copy = transformer_book.recipe("copy")  # options not given come from the task's recipe
    assert (state["args"]["warmup"], state["args"]["lr_factor"], state["args"]["clip_norm"]) == (
        copy.warmup,
        copy.lr_factor,
        copy.clip_norm,
    )
    assert state["schedule"]["last_epoch"] == 2
    assert all(isinstance(t, torch.Tensor) for t in state["model"].values())
    assert not (tmp_path / "c.pt.partial").exists()


def test_shards_make_up_the_global_batch() -> None:
    full = copy_task_batch(12, generator=torch.Generator().manual_seed(3))
    parts = [cli.shard(full, rank, 3, pad_id=0) for rank in range(3)]
    for field in ("src", "tgt_in", "tgt_out", "src_mask", "tgt_mask"):
        torch.testing.assert_close(torch.cat([getattr(p, field) for p in parts]), getattr(full, field))
    assert sum(p.num_tokens for p in parts) == full.num_tokens
    with pytest.raises(ValueError, match="world_size=5"):
        cli.shard(full, 0, 5, pad_id=0)


def test_rank_losses_average_to_the_global_loss_with_uneven_padding() -> None:
    """With padding the shards hold different token counts; the scaled per-rank losses still average exactly."""
    src = torch.tensor([[1, 3, 4, 0], [1, 5, 0, 0], [1, 3, 3, 3], [1, 6, 7, 0]])
    tgt = torch.tensor([[1, 3, 4, 2, 0], [1, 5, 2, 0, 0], [1, 3, 3, 3, 2], [1, 6, 7, 2, 0]])
    full = Batch.from_pairs(src, tgt)
    logits = torch.randn(4, 4, 8, generator=torch.Generator().manual_seed(0))
    loss_fn = LabelSmoothingLoss(8, 0.1)
    shards = [cli.shard(full, r, 2, pad_id=0) for r in range(2)]
    per_rank = [
        loss_fn(logits[r * 2 : (r + 1) * 2], shards[r].tgt_out) * cli.rank_loss_scale(shards[r], full.num_tokens, 2)
        for r in range(2)
    ]
    assert shards[0].num_tokens != shards[1].num_tokens
    torch.testing.assert_close(sum(per_rank) / 2, loss_fn(logits, full.tgt_out))


def test_dates_task_and_bf16_autocast_run_on_the_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # two years of dates instead of a hundred keeps the vocabulary build quick
    monkeypatch.setattr(
        transformer_book.recipes, "DateTask", lambda seed=0: DateTask(range(2000, 2002), held_out=50, seed=seed)
    )
    records = run_here(
        ["--task", "dates", "--max-steps", "3", "--batch-size", "4", "--bf16", *TINY, "--out", str(tmp_path / "d.pt")],
        capsys,
    )
    assert [r["step"] for r in records] == [3]
    assert 0.0 < records[0]["loss"] < 10.0 and 0.0 <= records[0]["exact_match"] <= 1.0


def test_options_are_the_recipe_fields_and_zero_turns_clipping_and_the_average_off(tmp_path: Path) -> None:
    base = ["--task", "copy", "--out", str(tmp_path / "x.pt")]
    args, r, _ = cli.parse_args([*base, "--num-layers", "3", "--no-taper", "--clip-norm", "0", "--average", "0"])
    assert r == dataclasses.replace(
        transformer_book.recipe("copy"), num_layers=3, taper=False, clip_norm=None, average=None
    )
    assert cli.parse_args(base)[1] == transformer_book.recipe("copy")  # every option left out: the recipe's value
    assert args.seed == 0 and args.resume is None and not args.bf16


@pytest.mark.parametrize(
    ("extra", "world_size", "message"),
    [
        (["--batch-size", "15"], 2, "--batch-size=15 must be divisible"),
        (["--max-steps", "0"], 1, "--max-steps must be a positive"),
        (["--d-model", "30", "--num-heads", "4"], 1, "--d-model=30 is not divisible by --num-heads=4"),
        (["--d-model", "0"], 1, "--d-model must be a positive"),
        (["--dropout", "1.0"], 1, "--dropout must be in"),
        (["--lr-factor", "-1"], 1, "--lr-factor must be a positive number, got -1.0"),
        (["--eval-every", "-5"], 1, "--eval-every must be 0 or positive, got -5"),
        (["--average", "1.5"], 1, "--average must be in \\[0, 1\\), got 1.5"),  # 0: no average
        (["--warmup", "0"], 1, "--warmup must be a positive integer, got 0"),
        (["--adam-eps", "0"], 1, "--adam-eps must be a positive number, got 0.0"),
        (["--eval-size", "0"], 1, "--eval-size must be a positive integer, got 0"),
        (["--resume", "no/such/file.pt"], 1, "--resume=no/such/file.pt: no such file"),
        (["--out", "."], 1, "--out=. is a directory"),
    ],
)
def test_bad_arguments_raise_value_errors_naming_the_option(
    extra: list[str], world_size: int, message: str, tmp_path: Path
) -> None:
    argv = ["--task", "copy", "--max-steps", "4", "--batch-size", "8", "--out", str(tmp_path / "x.pt"), *extra]
    with pytest.raises(ValueError, match=message):
        cli.parse_args(argv, world_size=world_size)


def test_command_line_reports_errors_and_refuses_a_foreign_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    base = ["--task", "copy", "--batch-size", "4", *TINY, "--out", str(tmp_path / "c.pt")]
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*base, "--max-steps", "-1"])
    assert exit_info.value.code == 2 and "--max-steps must be a positive integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([*base[:-2], "--max-steps", "2"])  # no --out
    assert "--out" in capsys.readouterr().err

    run_here([*base, "--max-steps", "2"], capsys)
    resume = ["--resume", str(tmp_path / "c.pt")]
    assert cli.main([*base, "--max-steps", "4", "--d-model", "64", *resume]) == 2
    assert "--d-model=64 but the checkpoint" in capsys.readouterr().err
    assert cli.main([*base, "--max-steps", "2", *resume]) == 2
    assert "already at step 2" in capsys.readouterr().err
    assert cli.main([*base, "--max-steps", "4", *resume]) == 2  # the taper ends the schedule at --max-steps=2
    assert "--max-steps (with --taper)=4 but the checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["truncated", "garbage", "foreign", "not a dict"])
def test_resume_refuses_a_file_that_is_not_this_trainers_checkpoint(
    damage: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    base = ["--task", "copy", "--batch-size", "4", *TINY, "--out", str(tmp_path / "c.pt")]
    run_here([*base, "--max-steps", "2"], capsys)
    bad = tmp_path / "bad.pt"
    if damage == "truncated":
        bad.write_bytes((tmp_path / "c.pt").read_bytes()[:5000])
    elif damage == "garbage":
        bad.write_bytes(b"this is not a checkpoint\n" * 100)
    elif damage == "foreign":
        torch.save({"weights": torch.zeros(3), "epoch": 7}, bad)  # another program's checkpoint
    else:
        torch.save([1, 2, 3], bad)
    assert cli.main([*base, "--max-steps", "4", "--resume", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--resume={bad}" in err, err  # one line, naming the file
    assert "Traceback" not in err and "weights_only=False" not in err, err
    assert ("can read" in err) if damage in ("truncated", "garbage") else ("not a checkpoint written by" in err)
