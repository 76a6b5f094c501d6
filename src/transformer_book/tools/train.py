"""A command-line trainer for the copy and dates tasks that runs alone or under ``torchrun``.

One process, then several (one per GPU, or several CPU processes talking over gloo)::

    transformer-book-train --task copy --out copy.pt
    python -m transformer_book.tools.train --task copy --out copy.pt  # the same
    torchrun --standalone --nproc_per_node=4 -m transformer_book.tools.train \\
        --task dates --out dates.pt

Every option is a field of the task's recipe (``transformer_book.RECIPES``), spelt with dashes
(``--num-heads`` for ``num_heads``), and every option left out takes the recipe's value: the run is
``dataclasses.replace(recipe, ...)``, trained by :func:`~transformer_book.training.fit`, the loop the chapters run.

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
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm  # the text bar: tqdm.auto needs ipywidgets in a notebook and warns without it

from ..checks import check_positive, check_probability
from ..data import Batch
from ..model import make_model
from ..recipes import RECIPES, Recipe, Task, validation_accuracy
from ..runtime import get_device
from ..training import History, fit, weight_average

#: The recipe fields the command line sets (each option is its field's name), with their help.
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
# What a resumed run may change besides --out and the number of processes; the rest must be the checkpoint's,
# "taper_steps" too: with --taper the schedule ends at --max-steps, which then may not change.
MAY_CHANGE = ("max_steps", "eval_every", "target")  # target: this trainer never stops early
CHECKPOINT_KEYS = {
    "model", "average", "optimizer", "schedule", "step", "elapsed_s", "args", "model_config", "world_size"
}  # fmt: skip


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
    kinds = {"int": {"type": int}, "float": {"type": float}, "bool": {"action": argparse.BooleanOptionalAction}}
    for field in dataclasses.fields(Recipe):
        if field.name in HELP:  # the annotation is text: "int", "float | None", "bool"
            parser.add_argument(option(field.name), help=HELP[field.name], **kinds[field.type.split(" ")[0]])
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights, the batches and dropout")
    parser.add_argument("--eval-size", type=int, help="evaluate on the first N validation examples")
    parser.add_argument("--resume", type=Path, help="checkpoint to continue from")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast (CUDA; slow on a CPU)")
    return parser


def require(condition: bool, message: str) -> None:
    """A ``ValueError`` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise ValueError(message)


def parse_args(argv: Sequence[str] | None = None, world_size: int = 1) -> tuple[argparse.Namespace, Recipe, Task]:
    """The arguments, the run's recipe (the task's, with every option given in place of its value) and
    its task. A value the run cannot use is a ``ValueError`` naming the option: the package's checks get
    the options' names, and ``ModelConfig``'s messages, which name its fields, are read as options."""
    args = build_parser().parse_args(argv)
    given = {name: getattr(args, name) for name in HELP if getattr(args, name) is not None}
    if given.get("clip_norm", 1) <= 0:
        given["clip_norm"] = None  # 0 means: do not clip
    if given.get("average") == 0:
        given["average"] = None  # 0 means: no average
    r = dataclasses.replace(RECIPES[args.task], **given)
    for name in ("max_steps", "batch_size", "warmup"):
        check_positive(getattr(r, name), option(name))
    if args.eval_size is not None:
        check_positive(args.eval_size, "--eval-size")
    check_probability(args.average or 0.0, "--average")  # 0 (and left out: the recipe's) is fine
    require(r.adam_eps > 0, f"--adam-eps must be a positive number, got {r.adam_eps}")
    require(0 < r.lr_factor < float("inf"), f"--lr-factor must be a positive number, got {r.lr_factor}")
    require(r.eval_every >= 0, f"--eval-every must be 0 or positive, got {r.eval_every}")
    require(r.batch_size % world_size == 0,
            f"--batch-size={r.batch_size} must be divisible by the number of processes ({world_size})")  # fmt: skip
    require(not args.out.is_dir(), f"--out={args.out} is a directory; give a file name")
    require(args.resume is None or args.resume.is_file(), f"--resume={args.resume}: no such file")
    try:
        task = r.make_task(args.seed)
        r.model_config(task)
    except ValueError as error:
        message = str(error)
        for name in HELP:
            message = message.replace(name, option(name))
        raise ValueError(message) from None
    return args, r, task


# --- processes and data --------------------------------------------------------------------
def setup_processes(bf16: bool) -> tuple[int, int, torch.device]:
    """This process's rank, the number of processes and its device. Under torchrun (its variables
    are set) it joins the process group: on CUDA each process takes the GPU numbered by
    ``LOCAL_RANK`` (its index on this machine) and NCCL carries the gradients; on the CPU, gloo."""
    device = get_device()
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    require(device.type != "mps" or not (distributed or bf16),
            "--bf16 and torchrun runs are not supported on Apple's MPS; set TRANSFORMER_BOOK_DEVICE=cpu")  # fmt: skip
    if not distributed:
        return 0, 1, device
    if device.type == "cuda":
        local_rank, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        require(local_rank < count, f"LOCAL_RANK={local_rank} but this machine has {count} CUDA device(s); "
                "give torchrun at most that many --nproc_per_node")  # fmt: skip
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def derive_seed(*numbers: int) -> int:
    """A 63-bit seed mixed from several integers (NumPy's SeedSequence), e.g. ``(seed, step, rank)``."""
    return int(np.random.SeedSequence([int(n) for n in numbers]).generate_state(1, dtype=np.uint64)[0] >> 1)


def shard(batch: Batch, rank: int, world_size: int, pad_id: int) -> Batch:
    """Rows ``[rank·b, (rank+1)·b)`` of the global batch, ``b = B / world_size``."""
    size = batch.src.shape[0]
    require(size % world_size == 0, f"batch size {size} is not divisible by world_size={world_size}")
    rows = slice(rank * size // world_size, (rank + 1) * size // world_size)
    part = [batch.src[rows], batch.tgt_in[rows], batch.tgt_out[rows], batch.src_mask[rows], batch.tgt_mask[rows]]
    return Batch(*part, num_tokens=int((part[2] != pad_id).sum()))


def rank_loss_scale(part: Batch, global_tokens: int, world_size: int) -> float:
    """The factor on this rank's mean loss that makes DDP's gradient *average* the 1-process gradient.

    The 1-process loss is (sum of per-token losses over the global batch) / global_tokens; rank r
    holds ``mean_r · tokens_r`` of that sum. DDP divides the sum of the ranks' gradients by world_size,
    so rank r scales its mean by ``tokens_r / global_tokens · world_size``; the average over ranks is
    then exactly the 1-process loss, even when padding leaves the shards with different token counts.
    """
    return part.num_tokens / global_tokens * world_size


# --- checkpoints ---------------------------------------------------------------------------
def load_checkpoint(path: Path, settings: dict, max_steps: int) -> dict:
    """Read a checkpoint (``weights_only=True``) of the run ``settings`` describe. A file that is not
    one (truncated, corrupt, written by another program or run) is a ``ValueError`` naming it."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - pickle, zip and torch each raise their own kinds
        # Not torch's message: its hint to load with weights_only=False is one this book never gives.
        raise ValueError(
            f"--resume={path} is not a checkpoint this trainer can read: torch.load failed with "
            f"{type(error).__name__} (a truncated or corrupt file, or not a PyTorch file)"
        ) from None
    missing = CHECKPOINT_KEYS - set(state) if isinstance(state, dict) else CHECKPOINT_KEYS
    require(not missing, f"--resume={path} is not a checkpoint written by transformer-book-train "
            f"(it lacks {', '.join(sorted(missing))})")  # fmt: skip
    for name, given in settings.items():
        saved = state["args"].get(name)
        flag = "--max-steps (with --taper)" if name == "taper_steps" else option(name)
        require(name in MAY_CHANGE or given == saved, f"{flag}={given} but the checkpoint {path} was trained "
                f"with {flag}={saved}; a resumed run must use the same settings")  # fmt: skip
    require(state["step"] < max_steps, f"--max-steps={max_steps} but the checkpoint {path} is "
            f"already at step {state['step']}")  # fmt: skip
    return state


# --- training ------------------------------------------------------------------------------
def train_run(args: argparse.Namespace, r: Recipe, task: Task) -> None:
    """Set the processes and the run up, and hand it to :func:`~transformer_book.training.fit`."""
    rank, world_size, device = setup_processes(args.bf16)
    config = r.model_config(task)
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's too)
    model = make_model(config).to(device)
    optimizer, schedule = r.optimizer(model)
    averaged = weight_average(model, r.average) if r.average is not None else None
    # what the checkpoint keeps the state of (the average's is empty where there is none) ...
    stateful = {"model": model, "average": averaged, "optimizer": optimizer, "schedule": schedule}
    # ... and the run's settings as plain values: the recipe, the seed, bf16 and where the schedule ends
    settings = {**dataclasses.asdict(r), "seed": args.seed, "bf16": args.bf16, "taper_steps": r.taper_steps}
    start_step, elapsed_before = 0, 0.0
    if args.resume is not None:
        state = load_checkpoint(args.resume, settings, r.max_steps)
        for name, thing in stateful.items():
            if thing is not None:
                thing.load_state_dict(state[name])
        start_step, elapsed_before = state["step"], state["elapsed_s"]
    ids = [device.index] if device.type == "cuda" else None  # DDP averages the gradients during backward
    trained = DistributedDataParallel(model, device_ids=ids) if dist.is_initialized() else model
    global_tokens = 0  # the real target tokens of the step's global batch
    last_eval, started = start_step, time.perf_counter()

    def next_batch(step: int) -> Batch:
        nonlocal global_tokens
        # the whole global batch, from (seed, step) only: the same on every rank, and after a resume
        full = task.train_batch(r.batch_size, random.Random(derive_seed(args.seed, step)))
        global_tokens = full.num_tokens
        torch.manual_seed(derive_seed(args.seed, step, rank))  # this rank's dropout, this step
        return shard(full, rank, world_size, config.pad_id)

    def validation(module: torch.nn.Module) -> float:  # rank 0 only
        with torch.autocast(device.type, torch.bfloat16, enabled=args.bf16):
            return validation_accuracy(module, task, args.eval_size)

    def after_eval(step: int, history: History) -> None:
        """Every rank: the global batch's mean loss since the last evaluation; rank 0: a JSON line and a checkpoint."""
        nonlocal last_eval
        losses = torch.tensor(history.loss[last_eval - start_step :], dtype=torch.float64)
        loss = losses.mean() / world_size  # each rank's share: their sum is the global loss
        if dist.is_initialized():
            dist.all_reduce(loss)
        last_eval = step
        if rank != 0:
            return
        elapsed = round(elapsed_before + time.perf_counter() - started, 3)
        shared = {"step": step, "elapsed_s": elapsed, "world_size": world_size}  # the JSON line's and the checkpoint's
        line = {"step": step, "loss": loss.item(), "lr": history.lr[-1], "exact_match": history.eval_metric[-1]}
        tqdm.write(json.dumps({**line, **shared}), file=sys.stdout)  # one JSON line, written around the progress bar
        sys.stdout.flush()
        # The checkpoint holds only tensors, dicts, lists and numbers, so torch.load(weights_only=True)
        # reads it, and no random state: data and dropout are reseeded from (seed, step[, rank]).
        states = {name: thing.state_dict() if thing is not None else {} for name, thing in stateful.items()}
        partial = args.out.with_name(args.out.name + ".partial")  # written whole, then renamed: atomic
        args.out.parent.mkdir(parents=True, exist_ok=True)
        torch.save({**states, **shared, "args": settings, "model_config": dataclasses.asdict(config)}, partial)
        os.replace(partial, args.out)

    fit(
        trained, next_batch, r.max_steps, optimizer, schedule, loss_fn=r.loss_fn(config),
        evaluate=validation if rank == 0 else None, eval_every=r.eval_every, progress=rank == 0,
        clip_norm=r.clip_norm, bf16=args.bf16, start_step=start_step, averaged=averaged,
        loss_scale=lambda part: rank_loss_scale(part, global_tokens, world_size), after_eval=after_eval,
    )  # fmt: skip
    if dist.is_initialized():
        dist.barrier()  # nobody leaves before rank 0 has written the last checkpoint


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m transformer_book.tools.train``; returns the exit status."""
    try:
        args, r, task = parse_args(argv, int(os.environ.get("WORLD_SIZE", "1")))  # torchrun's, or 1 process
    except ValueError as error:
        build_parser().error(str(error))  # prints usage and the message, exits with status 2
    try:
        train_run(args, r, task)
    except ValueError as error:  # e.g. a checkpoint that belongs to another run
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
