"""A command-line trainer for the copy and dates tasks that runs alone or under ``torchrun``.

One process::

    transformer-book-train --task copy --out copy.pt
    python -m transformer_book.tools.train --task copy --out copy.pt   # the same

Several processes (one per GPU, or several CPU processes talking over gloo)::

    torchrun --standalone --nproc_per_node=4 \\
        -m transformer_book.tools.train --task dates --out dates.pt

Every option left out takes its value from the task's recipe
(``transformer_book.RECIPES``), the one the book's chapters train with;
the training step itself is :func:`transformer_book.training.train_step`, the one
``fit`` runs.

The script is the same in both cases. Under ``torchrun`` the environment holds
``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; the script then joins the process group
(NCCL on CUDA, gloo otherwise) and wraps the model in PyTorch's
:class:`~torch.nn.parallel.DistributedDataParallel`, which averages the gradients
over the processes during ``backward``. Nothing else here is distributed logic.

Reproducibility is built from two rules:

- the data of step ``s`` depends only on ``(seed, step)``: every rank draws the
  whole global batch from a generator seeded by them and keeps its own slice, so
  the union of the slices is exactly the batch a single process would train on;
- the dropout randomness of step ``s`` on rank ``r`` comes from a generator reseeded
  with ``(seed, step, rank)``, so a resumed run needs no saved RNG state to repeat
  the run it continues.

Rank 0 alone shows a tqdm bar (stderr), prints one JSON line per evaluation
(stdout) and writes checkpoints, at every evaluation and at the end. As the recipes
say, the run keeps an average of the weights (``--average``), which is what it
evaluates and saves beside the weights, and the learning rate tapers to zero at
``--steps`` (``--taper``), so with the taper ``--steps`` is part of the run's definition.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from numpy import uint64
from numpy.random import SeedSequence
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import (
    tqdm,
)  # the text bar: tqdm.auto needs ipywidgets in a notebook and warns without it

from ..data import Batch
from ..model import ModelConfig, Transformer, make_model
from ..progress import ProgressBar
from ..recipes import RECIPES, Recipe, Task, held_out_accuracy
from ..runtime import get_device
from ..training import LabelSmoothingLoss, noam_optimizer, train_step, weight_average

TASKS = tuple(RECIPES)

# The arguments that define a run: a resumed run must be given the same values.
# (--eval-every, --out and the world size may change on resume, and --steps unless --taper is on.)
RUN_DEFINING = (
    "task",
    "batch_size",
    "d_model",
    "heads",
    "d_ff",
    "layers",
    "dropout",
    "warmup",
    "lr_factor",
    "clip_norm",
    "adam_eps",
    "taper",
    "average",
    "seed",
    "bf16",
)
# Options whose default is the recipe's value: option dest -> Recipe field.
FROM_RECIPE = {
    "steps": "max_steps",
    "batch_size": "batch_size",
    "d_model": "d_model",
    "heads": "num_heads",
    "d_ff": "d_ff",
    "layers": "num_layers",
    "dropout": "dropout",
    "warmup": "warmup",
    "lr_factor": "lr_factor",
    "clip_norm": "clip_norm",
    "adam_eps": "adam_eps",
    "taper": "taper",
    "average": "average",
    "eval_every": "eval_every",
}
# ModelConfig's field names as the command line spells them, for its error messages.
CONFIG_OPTIONS = {
    "d_model": "--d-model",
    "num_heads": "--heads",
    "d_ff": "--d-ff",
    "num_layers": "--layers",
    "dropout": "--dropout",
}


# --- arguments -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring for examples)."""
    parser = argparse.ArgumentParser(
        prog="transformer-book-train",
        description="Train the book's Transformer on the copy or dates task, alone or under torchrun. "
        "Options not given take the task's recipe value (transformer_book.recipes.RECIPES).",
    )
    recipe_value = "default: the recipe's"
    parser.add_argument(
        "--task",
        choices=TASKS,
        required=True,
        help="copy: repeat the input; dates: French words to ISO",
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="checkpoint file written by rank 0"
    )
    parser.add_argument(
        "--steps",
        type=int,
        help=f"train up to this step (a resumed run continues to it); {recipe_value} cap",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        help=f"the global batch, split evenly over the processes; {recipe_value}",
    )
    parser.add_argument(
        "--d-model", type=int, help=f"width of every layer; {recipe_value}"
    )
    parser.add_argument(
        "--heads",
        type=int,
        help=f"attention heads (must divide --d-model); {recipe_value}",
    )
    parser.add_argument(
        "--d-ff",
        type=int,
        help=f"inner width of the feed-forward blocks; {recipe_value}",
    )
    parser.add_argument(
        "--layers",
        type=int,
        help=f"encoder layers, and as many decoder layers; {recipe_value}",
    )
    parser.add_argument("--dropout", type=float, help=f"dropout rate; {recipe_value}")
    parser.add_argument(
        "--warmup",
        type=int,
        help=f"warm-up steps of the learning-rate schedule; {recipe_value}",
    )
    parser.add_argument(
        "--lr-factor",
        type=float,
        help=f"scale of the paper's learning-rate schedule; {recipe_value}",
    )
    parser.add_argument(
        "--clip-norm",
        type=float,
        help=f"largest gradient norm; 0 turns clipping off; {recipe_value}",
    )
    parser.add_argument(
        "--adam-eps",
        type=float,
        help=f"Adam's epsilon (the paper: 1e-9); {recipe_value}",
    )
    parser.add_argument(
        "--taper",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"let the learning rate fall linearly to zero at --steps; {recipe_value}",
    )
    parser.add_argument(
        "--average",
        type=float,
        help=f"decay of the weight average that is evaluated and saved, 0: none; {recipe_value}",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the weights, every batch and every dropout mask (default 0)",
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        help=f"evaluate (and checkpoint) every N steps, 0: at the end only; {recipe_value}",
    )
    parser.add_argument(
        "--eval-size",
        type=int,
        default=None,
        help="evaluate on the first N held-out examples (default: all)",
    )
    parser.add_argument(
        "--resume", type=Path, default=None, help="checkpoint to continue from"
    )
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="bfloat16 autocast (CUDA; also accepted on CPU, where it is slow)",
    )
    return parser


def fill_from_recipe(args: argparse.Namespace) -> Recipe:
    """Give every option that was left out its value from the task's recipe; returns the recipe."""
    recipe = RECIPES[args.task]
    for option, field_name in FROM_RECIPE.items():
        if getattr(args, option) is None:
            setattr(args, option, getattr(recipe, field_name))
    if args.clip_norm is not None and args.clip_norm <= 0:
        args.clip_norm = None  # 0 means: do not clip
    if args.average is not None and args.average == 0:
        args.average = None  # 0 means: no average
    return recipe


def model_config(
    args: argparse.Namespace, src_vocab_size: int, tgt_vocab_size: int
) -> ModelConfig:
    """The run's ModelConfig (its checks raise ValueError naming the fields)."""
    return ModelConfig.small(
        src_vocab_size,
        tgt_vocab_size,
        d_model=args.d_model,
        num_heads=args.heads,
        d_ff=args.d_ff,
        num_layers=args.layers,
        dropout=args.dropout,
    )


def validate_args(args: argparse.Namespace, world_size: int = 1) -> None:
    """Raise ``ValueError`` naming the option for a value the run cannot use.

    The model's sizes are checked by :class:`~transformer_book.model.ModelConfig` itself; its message is
    translated to the options' names (``num_heads`` → ``--heads``).
    """
    for name, value in {
        "--steps": args.steps,
        "--batch-size": args.batch_size,
        "--warmup": args.warmup,
    }.items():
        if value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    if not args.adam_eps > 0:
        raise ValueError(f"--adam-eps must be a positive number, got {args.adam_eps}")
    if args.average is not None and not 0 < args.average < 1:
        raise ValueError(
            f"--average must be 0 (none) or a decay in (0, 1), got {args.average}"
        )
    try:
        model_config(args, 3, 3)
    except ValueError as error:
        message = str(error)
        for field_name, option in CONFIG_OPTIONS.items():
            message = re.sub(rf"\b{field_name}\b", option, message)
        raise ValueError(message) from None
    if not (args.lr_factor > 0 and math.isfinite(args.lr_factor)):
        raise ValueError(f"--lr-factor must be a positive number, got {args.lr_factor}")
    if args.eval_every < 0:
        raise ValueError(
            f"--eval-every must be 0 (only at the end) or positive, got {args.eval_every}"
        )
    if args.eval_size is not None and args.eval_size <= 0:
        raise ValueError(f"--eval-size must be positive, got {args.eval_size}")
    if args.batch_size % world_size:
        raise ValueError(
            f"--batch-size={args.batch_size} must be divisible by the number of processes (world size {world_size}), "
            "so that every process trains on an equal share"
        )
    if args.out.exists() and args.out.is_dir():
        raise ValueError(
            f"--out={args.out} is a directory; give a file name such as {args.out / 'checkpoint.pt'}"
        )
    if args.resume is not None and not args.resume.is_file():
        raise ValueError(f"--resume={args.resume}: no such checkpoint file")


def parse_args(
    argv: Sequence[str] | None = None, world_size: int = 1
) -> argparse.Namespace:
    """Parse and validate the command line; ``ValueError`` for a value that parses but cannot be used."""
    args = build_parser().parse_args(argv)
    fill_from_recipe(args)
    validate_args(args, world_size)
    return args


# --- processes -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcessInfo:
    """Where this process stands: its rank among ``world_size`` processes and its device."""

    rank: int
    world_size: int
    device: torch.device
    distributed: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world_size_from_env() -> int:
    """``WORLD_SIZE`` as set by torchrun, or 1 for a plain ``python -m`` run."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def setup_processes(bf16: bool) -> ProcessInfo:
    """Join torchrun's process group when its variables are set; pick the device.

    On CUDA each process takes the GPU numbered by ``LOCAL_RANK`` (its index on
    this machine) and NCCL carries the gradients; on the CPU it is gloo.
    """
    device = get_device()
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if device.type == "mps" and (distributed or bf16):
        raise ValueError(
            "--bf16 and torchrun runs are not supported on Apple's MPS; set TRANSFORMER_BOOK_DEVICE=cpu"
        )
    if not distributed:
        return ProcessInfo(rank=0, world_size=1, device=device, distributed=False)
    if device.type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK={local_rank} but this machine has {torch.cuda.device_count()} CUDA device(s); "
                "give torchrun at most that many --nproc_per_node"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return ProcessInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        device=device,
        distributed=True,
    )


def derive_seed(*numbers: int) -> int:
    """A 63-bit seed mixed from several integers (NumPy's SeedSequence), e.g. ``(seed, step, rank)``."""
    return int(
        SeedSequence([int(n) for n in numbers]).generate_state(1, dtype=uint64)[0] >> 1
    )


# --- tasks ---------------------------------------------------------------------------------


def global_batch(task: Task, batch_size: int, seed: int, step: int) -> Batch:
    """The whole global batch of ``step``, drawn from a generator seeded by ``(seed, step)`` only,
    so every rank draws the same one and a resumed run draws what the first run would have."""
    return task.train_batch(batch_size, random.Random(derive_seed(seed, step)))


def shard(batch: Batch, rank: int, world_size: int, pad_id: int) -> Batch:
    """Rows ``[rank·b, (rank+1)·b)`` of the global batch, ``b = B / world_size``."""
    size = batch.src.shape[0]
    if size % world_size:
        raise ValueError(
            f"batch size {size} is not divisible by world_size={world_size}"
        )
    rows = slice(rank * size // world_size, (rank + 1) * size // world_size)
    tgt_out = batch.tgt_out[rows]
    return Batch(
        batch.src[rows],
        batch.tgt_in[rows],
        tgt_out,
        batch.src_mask[rows],
        batch.tgt_mask[rows],
        num_tokens=int((tgt_out != pad_id).sum()),
    )


# --- checkpoints ---------------------------------------------------------------------------


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run-defining arguments as plain Python values (stored in the checkpoint).

    With ``--taper`` the schedule ends at ``--steps``, so ``--steps`` defines the run too.
    """
    settings = {name: getattr(args, name) for name in RUN_DEFINING}
    settings["taper_steps"] = args.steps if args.taper else None
    return settings


def save_checkpoint(
    path: Path,
    model: nn.Module,
    averaged: nn.Module | None,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    step: int,
    elapsed: float,
    args: argparse.Namespace,
    config: ModelConfig,
    world_size: int,
) -> None:
    """Write the checkpoint atomically (a temporary file, then a rename).

    Only tensors, dicts, lists and numbers, so ``torch.load(path, weights_only=True)``
    reads it. No RNG state is needed: data and dropout are reseeded from
    ``(seed, step[, rank])`` at every step. ``average`` holds the weight average's
    state (``--average``), or an empty dict.
    """
    state = {
        "model": model.state_dict(),
        "average": averaged.state_dict() if averaged is not None else {},
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "step": step,
        "elapsed_s": elapsed,
        "args": run_settings(args),
        "model_config": dataclasses.asdict(config),
        "world_size": world_size,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    os.replace(partial, path)


CHECKPOINT_KEYS = {
    "model", "average", "optimizer", "schedule", "step", "elapsed_s", "args", "model_config", "world_size"
}  # fmt: skip


def load_checkpoint(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Read a checkpoint (``weights_only=True``) and check it belongs to the run described by ``args``.

    A file that is not this trainer's checkpoint (truncated, corrupt, written by another
    program, or by another run) is a ``ValueError`` naming the file and what is wrong.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - pickle, zip and torch each raise their own kinds
        # Not torch's message: its hint to load with weights_only=False is one this book never gives.
        raise ValueError(
            f"--resume={path} is not a checkpoint this trainer can read: torch.load failed with "
            f"{type(error).__name__} (a truncated or corrupt file, or not a PyTorch file)"
        ) from None
    missing = (
        CHECKPOINT_KEYS - set(state) if isinstance(state, dict) else CHECKPOINT_KEYS
    )
    if missing or not isinstance(state["args"], dict):
        raise ValueError(
            f"--resume={path} is not a checkpoint written by transformer-book-train "
            f"(it lacks {', '.join(sorted(missing or {'args'}))})"
        )
    for name, given in run_settings(args).items():
        saved = state["args"].get(name)
        if given != saved:
            option = (
                "--steps (with --taper)"
                if name == "taper_steps"
                else "--" + name.replace("_", "-")
            )
            raise ValueError(
                f"{option}={given} but the checkpoint {path} was trained with {option}={saved}; "
                "a resumed run must use the same settings"
            )
    if state["step"] >= args.steps:
        raise ValueError(
            f"--steps={args.steps} but the checkpoint {path} is already at step {state['step']}"
        )
    return state


# --- training ------------------------------------------------------------------------------


def rank_loss_scale(part: Batch, global_tokens: int, world_size: int) -> float:
    """The factor on this rank's mean loss that makes DDP's gradient *average* the 1-process gradient.

    The 1-process loss is (sum of per-token losses over the global batch) / global_tokens.
    Rank r holds the sum over its rows, ``mean_r · tokens_r``. DDP averages gradients,
    i.e. divides their sum over ranks by world_size, so each rank multiplies its
    contribution by world_size: ``mean_r · tokens_r / global_tokens · world_size``.
    The average over ranks of these is then exactly the 1-process loss, even when
    padding leaves the shards with different token counts.
    """
    return part.num_tokens / global_tokens * world_size


def evaluate(
    model: Transformer,
    task: Task,
    eval_size: int | None,
    device: torch.device,
    bf16: bool,
) -> float:
    """Exact-match accuracy of greedy decoding on the held-out set, or its first ``eval_size`` pairs
    (run by rank 0 on the bare model)."""
    with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
        return held_out_accuracy(model, task, eval_size)


def emit(record: dict[str, Any]) -> None:
    """One JSON line on stdout, written around the progress bar."""
    tqdm.write(json.dumps(record), file=sys.stdout)
    sys.stdout.flush()


def train_run(args: argparse.Namespace, rt: ProcessInfo) -> dict[str, Any]:
    """The training loop; returns the last metrics record (every rank computes the loss)."""
    task = RECIPES[args.task].make_task(args.seed)
    config = model_config(args, task.src_vocab_size, task.tgt_vocab_size)
    torch.manual_seed(
        args.seed
    )  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = make_model(config).to(rt.device)
    total_steps = args.steps if args.taper else None
    optimizer, schedule = noam_optimizer(
        model,
        args.d_model,
        args.warmup,
        args.lr_factor,
        eps=args.adam_eps,
        total_steps=total_steps,
    )
    averaged = weight_average(model, args.average) if args.average is not None else None
    start_step, elapsed_before = 0, 0.0
    if args.resume is not None:
        state = load_checkpoint(args.resume, args)
        model.load_state_dict(state["model"])
        if averaged is not None:
            averaged.load_state_dict(state["average"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        start_step, elapsed_before = state["step"], state["elapsed_s"]
    wrapped: nn.Module = (
        DistributedDataParallel(
            model, device_ids=[rt.device.index] if rt.device.type == "cuda" else None
        )
        if rt.distributed
        else model
    )
    loss_fn = LabelSmoothingLoss(
        config.tgt_vocab_size, RECIPES[args.task].smoothing, config.pad_id
    )

    record: dict[str, Any] = {}
    loss_sum, loss_steps = torch.zeros((), device=rt.device), 0
    started = time.perf_counter()
    bar = ProgressBar(
        args.steps,
        desc=f"{args.task} ×{rt.world_size}",
        unit="step",
        initial=start_step,
        enabled=rt.is_main,
    )
    for step in range(start_step + 1, args.steps + 1):
        full = global_batch(
            task, args.batch_size, args.seed, step
        )  # identical on every rank
        part = shard(full, rt.rank, rt.world_size, config.pad_id).to(rt.device)
        torch.manual_seed(
            derive_seed(args.seed, step, rt.rank)
        )  # this rank's dropout for this step
        # DDP all-reduces (averages) the gradients during backward; the scale makes that average
        # the one-process gradient.
        scale = rank_loss_scale(part, full.num_tokens, rt.world_size)
        loss, lr = train_step(wrapped, part, loss_fn, optimizer, schedule, clip_norm=args.clip_norm,
                              loss_scale=scale, bf16=args.bf16)  # fmt: skip
        loss_sum += (
            loss.detach() / rt.world_size
        )  # summed over ranks below: the global-batch loss
        loss_steps += 1
        if (
            averaged is not None
        ):  # every rank holds the same weights after DDP's update, so the same average
            averaged.update_parameters(model)

        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
            if rt.distributed:
                dist.all_reduce(loss_sum)
            record = {"step": step, "loss": loss_sum.item() / loss_steps, "lr": lr}
            loss_sum.zero_()
            loss_steps = 0
            if rt.is_main:
                elapsed = elapsed_before + time.perf_counter() - started
                scored = (
                    model if averaged is None else averaged.module
                )  # the recipe scores the average
                record["exact_match"] = evaluate(
                    scored, task, args.eval_size, rt.device, args.bf16
                )
                record.update(elapsed_s=round(elapsed, 3), world_size=rt.world_size)
                emit(record)
                bar.set_postfix(
                    loss=f"{record['loss']:.4f}", acc=f"{record['exact_match']:.3f}"
                )
                save_checkpoint(
                    args.out,
                    model,
                    averaged,
                    optimizer,
                    schedule,
                    step,
                    elapsed,
                    args,
                    config,
                    rt.world_size,
                )
        bar.update(1)
    bar.close()
    if rt.distributed:
        dist.barrier()  # nobody leaves before rank 0 has written the last checkpoint
    return record


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m transformer_book.tools.train``; returns the exit status."""
    try:
        args = parse_args(argv, world_size_from_env())
        rt = setup_processes(args.bf16)
    except ValueError as error:
        build_parser().error(
            str(error)
        )  # prints usage and the message, exits with status 2
    try:
        train_run(args, rt)
    except ValueError as error:  # e.g. a checkpoint that belongs to another run
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        if rt.distributed:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
