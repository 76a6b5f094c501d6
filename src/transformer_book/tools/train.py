"""A command-line trainer for the copy and dates tasks that runs alone or under ``torchrun``.

One process::

    transformer-book-train --task copy --out copy.pt
    python -m transformer_book.tools.train --task copy --out copy.pt   # the same

Several processes (one per GPU, or several CPU processes talking over gloo)::

    torchrun --standalone --nproc_per_node=4 \\
        -m transformer_book.tools.train --task dates --out dates.pt

Every option is a field of the task's recipe (``transformer_book.RECIPES``), spelt with
dashes (``--num-heads`` for ``num_heads``), and every option left out takes the recipe's
value: the run is ``dataclasses.replace(recipe, ...)``, trained by :func:`~transformer_book.training.fit`,
the loop the chapters run.

Under ``torchrun`` (its ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) the script joins the process
group (NCCL on CUDA, gloo otherwise) and wraps the model in ``DistributedDataParallel``, which
averages the gradients during ``backward``; nothing else here is distributed logic. Two rules
make runs repeatable: the data of step ``s`` depends only on ``(seed, step)`` (every rank draws
the whole global batch and keeps its slice), and rank ``r``'s dropout at step ``s`` on
``(seed, step, rank)``, so a resumed run needs no saved random state. Rank 0 alone shows the
bar, prints one JSON line per evaluation and writes the checkpoint (at each evaluation).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
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

# the text bar: tqdm.auto needs ipywidgets in a notebook and warns without it
from tqdm import tqdm

from ..data import Batch
from ..model import make_model
from ..recipes import RECIPES, Recipe, Task, validation_accuracy
from ..runtime import get_device
from ..training import History, fit, weight_average

#: What each recipe field means on the command line (the options are the fields' names).
HELP = {
    "max_steps": "train up to this step (a resumed run continues to it)",
    "batch_size": "the global batch, split evenly over the processes",
    "d_model": "width of every layer",
    "num_heads": "attention heads (must divide --d-model)",
    "d_ff": "inner width of the feed-forward blocks",
    "num_layers": "encoder layers, and as many decoder layers",
    "dropout": "dropout rate",
    "warmup": "warm-up steps of the learning-rate schedule",
    "lr_factor": "scale of the paper's learning-rate schedule",
    "clip_norm": "largest gradient norm; 0 turns clipping off",
    "adam_eps": "Adam's epsilon (the paper: 1e-9)",
    "taper": "let the learning rate fall linearly to zero at --max-steps",
    "average": "decay of the weight average that is evaluated and saved; 0: none",
    "eval_every": "evaluate (and checkpoint) every N steps; 0: at the end only",
}
# A resumed run must be given the same values of these (it may change --eval-every,
# --out, the number of processes, and --max-steps unless --taper is on).
RUN_DEFINING = (
    "task",
    *(name for name in HELP if name not in ("max_steps", "eval_every")),
    "seed",
    "bf16",
)


# --- arguments -----------------------------------------------------------------------------


def option(name: str) -> str:
    """``--num-heads`` for the field ``num_heads``."""
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    """The command line: the recipe's fields, and what a run needs beside them."""
    parser = argparse.ArgumentParser(
        prog="transformer-book-train",
        description="Train the book's Transformer on a task, alone or under torchrun. Options "
        "not given take the task's recipe value (transformer_book.RECIPES).",
    )
    parser.add_argument("--task", choices=tuple(RECIPES), required=True)
    parser.add_argument("--out", type=Path, required=True, help="checkpoint written by rank 0")
    fields = {field.name: field for field in dataclasses.fields(Recipe)}
    for name, text in HELP.items():
        kind = fields[name].type.split(" ")[0]  # "int", "float", "bool" (with "| None")
        if kind == "bool":
            parser.add_argument(option(name), action=argparse.BooleanOptionalAction, help=text)
        else:
            parser.add_argument(option(name), type=float if kind == "float" else int, help=text)
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights, the batches and dropout")
    parser.add_argument("--eval-size", type=int, help="evaluate on the first N validation examples")
    parser.add_argument("--resume", type=Path, help="checkpoint to continue from")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast (CUDA; slow on a CPU)")
    return parser


def run_recipe(args: argparse.Namespace) -> Recipe:
    """The task's recipe with every option that was given in place of its value."""
    given = {name: getattr(args, name) for name in HELP if getattr(args, name) is not None}
    if given.get("clip_norm", 1) <= 0:
        given["clip_norm"] = None  # 0 means: do not clip
    if given.get("average") == 0:
        given["average"] = None  # 0 means: no average
    return dataclasses.replace(RECIPES[args.task], **given)


def require(condition: bool, message: str) -> None:
    """A ``ValueError`` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise ValueError(message)


def validate_args(args: argparse.Namespace, world_size: int = 1) -> tuple[Recipe, Task]:
    """The run's recipe and its task; a ``ValueError`` naming the option for a value the run cannot use.
    The model's sizes are checked by ``ModelConfig`` itself, its field names read as options."""
    r = run_recipe(args)
    problems = {  # message: whether it applies
        f"--max-steps must be a positive integer, got {r.max_steps}": r.max_steps <= 0,
        f"--batch-size must be a positive integer, got {r.batch_size}": r.batch_size <= 0,
        f"--warmup must be a positive integer, got {r.warmup}": r.warmup <= 0,
        f"--adam-eps must be a positive number, got {r.adam_eps}": not r.adam_eps > 0,
        f"--lr-factor must be a positive number, got {r.lr_factor}": not 0 < r.lr_factor < float("inf"),
        f"--average must be 0 or in (0, 1), got {r.average}": r.average is not None and not 0 < r.average < 1,
        f"--eval-every must be 0 or positive, got {r.eval_every}": r.eval_every < 0,
        f"--eval-size must be positive, got {args.eval_size}": args.eval_size is not None and args.eval_size <= 0,
        f"--batch-size={r.batch_size} must be divisible by the number of processes ({world_size})": (
            r.batch_size % world_size != 0
        ),
        f"--out={args.out} is a directory; give a file name": args.out.is_dir(),
        f"--resume={args.resume}: no such file": args.resume is not None and not args.resume.is_file(),
    }
    for message, wrong in problems.items():
        require(not wrong, message)
    try:
        task = r.make_task(args.seed)
        r.model_config(task)
    except ValueError as error:
        message = str(error)
        for name in HELP:
            message = message.replace(name, option(name))
        raise ValueError(message) from None
    return r, task


def parse_args(argv: Sequence[str] | None = None, world_size: int = 1) -> tuple[argparse.Namespace, Recipe, Task]:
    """Parse and validate the command line: the arguments, the run's recipe and its task."""
    args = build_parser().parse_args(argv)
    return (args, *validate_args(args, world_size))


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
    require(device.type != "mps" or not (distributed or bf16),
            "--bf16 and torchrun runs are not supported on Apple's MPS; set TRANSFORMER_BOOK_DEVICE=cpu")  # fmt: skip
    if not distributed:
        return ProcessInfo(rank=0, world_size=1, device=device, distributed=False)
    if device.type == "cuda":
        local_rank, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        require(local_rank < count, f"LOCAL_RANK={local_rank} but this machine has {count} CUDA device(s); "
                "give torchrun at most that many --nproc_per_node")  # fmt: skip
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return ProcessInfo(dist.get_rank(), dist.get_world_size(), device, distributed=True)


def derive_seed(*numbers: int) -> int:
    """A 63-bit seed mixed from several integers (NumPy's SeedSequence), e.g. ``(seed, step, rank)``."""
    return int(SeedSequence([int(n) for n in numbers]).generate_state(1, dtype=uint64)[0] >> 1)


# --- tasks ---------------------------------------------------------------------------------


def global_batch(task: Task, batch_size: int, seed: int, step: int) -> Batch:
    """The whole global batch of ``step``, drawn from a generator seeded by ``(seed, step)`` only,
    so every rank draws the same one and a resumed run draws what the first run would have."""
    return task.train_batch(batch_size, random.Random(derive_seed(seed, step)))


def shard(batch: Batch, rank: int, world_size: int, pad_id: int) -> Batch:
    """Rows ``[rank·b, (rank+1)·b)`` of the global batch, ``b = B / world_size``."""
    size = batch.src.shape[0]
    require(size % world_size == 0, f"batch size {size} is not divisible by world_size={world_size}")
    rows = slice(rank * size // world_size, (rank + 1) * size // world_size)
    part = [batch.src[rows], batch.tgt_in[rows], batch.tgt_out[rows], batch.src_mask[rows], batch.tgt_mask[rows]]
    return Batch(*part, num_tokens=int((part[2] != pad_id).sum()))


# --- checkpoints ---------------------------------------------------------------------------


def run_settings(args: argparse.Namespace, r: Recipe) -> dict[str, Any]:
    """The run-defining settings as plain Python values (stored in the checkpoint).

    With ``--taper`` the schedule ends at ``--max-steps``, so that defines the run too.
    """
    values = {**dataclasses.asdict(r), "seed": args.seed, "bf16": args.bf16}
    settings = {name: values[name] for name in RUN_DEFINING}
    settings["taper_steps"] = r.taper_steps
    return settings


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` atomically (a temporary file, then a rename). It holds only tensors, dicts,
    lists and numbers, so ``torch.load(path, weights_only=True)`` reads it; no random state is
    needed, since data and dropout are reseeded from ``(seed, step[, rank])`` at every step."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    os.replace(partial, path)


CHECKPOINT_KEYS = {
    "model", "average", "optimizer", "schedule", "step", "elapsed_s", "args", "model_config", "world_size"
}  # fmt: skip


def load_checkpoint(path: Path, settings: dict[str, Any], max_steps: int) -> dict[str, Any]:
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
    missing = CHECKPOINT_KEYS - set(state) if isinstance(state, dict) else CHECKPOINT_KEYS
    if missing or not isinstance(state["args"], dict):
        raise ValueError(
            f"--resume={path} is not a checkpoint written by transformer-book-train "
            f"(it lacks {', '.join(sorted(missing or {'args'}))})"
        )
    for name, given in settings.items():
        saved = state["args"].get(name)
        flag = "--max-steps (with --taper)" if name == "taper_steps" else option(name)
        require(given == saved, f"{flag}={given} but the checkpoint {path} was trained with "
                f"{flag}={saved}; a resumed run must use the same settings")  # fmt: skip
    require(state["step"] < max_steps, f"--max-steps={max_steps} but the checkpoint {path} is "
            f"already at step {state['step']}")  # fmt: skip
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


def emit(record: dict[str, Any]) -> None:
    """One JSON line on stdout, written around the progress bar."""
    tqdm.write(json.dumps(record), file=sys.stdout)
    sys.stdout.flush()


def train_run(args: argparse.Namespace, r: Recipe, task: Task, rt: ProcessInfo) -> History:
    """Set the run up and hand it to :func:`~transformer_book.training.fit`."""
    config = r.model_config(task)
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's too)
    model = make_model(config).to(rt.device)
    optimizer, schedule = r.optimizer(model)
    averaged = weight_average(model, r.average) if r.average is not None else None
    settings, start_step, elapsed_before = run_settings(args, r), 0, 0.0
    if args.resume is not None:
        state = load_checkpoint(args.resume, settings, r.max_steps)
        model.load_state_dict(state["model"])
        if averaged is not None:
            averaged.load_state_dict(state["average"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        start_step, elapsed_before = state["step"], state["elapsed_s"]
    trained: nn.Module = model
    if rt.distributed:  # averages the gradients over the processes during backward
        trained = DistributedDataParallel(model, device_ids=[rt.device.index] if rt.device.type == "cuda" else None)
    global_tokens = [0]  # the real target tokens of the step's global batch

    def next_batch(step: int) -> Batch:
        full = global_batch(task, r.batch_size, args.seed, step)  # identical on every rank
        global_tokens[0] = full.num_tokens
        torch.manual_seed(derive_seed(args.seed, step, rt.rank))  # this rank's dropout, this step
        return shard(full, rt.rank, rt.world_size, config.pad_id)

    def validation(module: nn.Module) -> float:  # rank 0 only
        with torch.autocast(rt.device.type, torch.bfloat16, enabled=args.bf16):
            return validation_accuracy(module, task, args.eval_size)

    started, last = time.perf_counter(), [start_step]

    def after_eval(step: int, history: History) -> None:
        """Every rank: the global batch's mean loss since the last evaluation; rank 0: a JSON line and a checkpoint."""
        losses = torch.tensor(history.loss[last[0] - start_step :], dtype=torch.float64)
        loss = losses.sum() / rt.world_size  # each rank's share: their sum is the global loss
        if rt.distributed:
            dist.all_reduce(loss)
        record = {"step": step, "loss": loss.item() / len(losses), "lr": history.lr[-1]}
        last[0] = step
        if rt.is_main:
            elapsed = elapsed_before + time.perf_counter() - started
            record.update(
                exact_match=history.eval_metric[-1],
                elapsed_s=round(elapsed, 3),
                world_size=rt.world_size,
            )
            emit(record)
            save_checkpoint(args.out, {
                "model": model.state_dict(), "average": averaged.state_dict() if averaged is not None else {},
                "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(), "step": step,
                "elapsed_s": elapsed, "args": settings, "model_config": dataclasses.asdict(config),
                "world_size": rt.world_size,
            })  # fmt: skip

    history = fit(
        trained, next_batch, r.max_steps, optimizer, schedule, loss_fn=r.loss_fn(config),
        evaluate=validation if rt.is_main else None, eval_every=r.eval_every, progress=rt.is_main,
        clip_norm=r.clip_norm, bf16=args.bf16, start_step=start_step, averaged=averaged,
        loss_scale=lambda part: rank_loss_scale(part, global_tokens[0], rt.world_size),
        after_eval=after_eval,
    )  # fmt: skip
    if rt.distributed:
        dist.barrier()  # nobody leaves before rank 0 has written the last checkpoint
    return history


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m transformer_book.tools.train``; returns the exit status."""
    try:
        args, r, task = parse_args(argv, world_size_from_env())
        rt = setup_processes(args.bf16)
    except ValueError as error:
        build_parser().error(str(error))  # prints usage and the message, exits with status 2
    try:
        train_run(args, r, task, rt)
    except ValueError as error:  # e.g. a checkpoint that belongs to another run
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        if rt.distributed:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
