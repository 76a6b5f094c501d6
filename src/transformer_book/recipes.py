"""Chapter 8 (end): how each task is trained, written down once.

A :class:`Recipe` holds every choice that decides whether training works: model
size, dropout, batch, the schedule's warm-up, scale and taper, gradient clipping, the
weight average that is evaluated and kept, how often to evaluate, the step cap and
the target. The chapters, the tests, the benchmarks, the command-line trainer and
:func:`trained_model` all read the same two recipes (``RECIPES["copy"]``,
``RECIPES["dates"]``), so a change here changes them all.

Only the task's validation set chooses: the evaluations during training, the stop
at the target and the weights kept all look at it. The test set is scored once,
after training, and that score is ``TrainedModel.accuracy``.

``benchmarks/bench_recipes.py`` runs each recipe with ten seeds to the step cap and
checks that every seed reaches its target and stays there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from torch import nn

try:
    from importlib.resources.abc import Traversable
except ImportError:  # Python 3.10
    from importlib.abc import Traversable

from .checks import check_choice, check_positive
from .data import Batch, CopyTask, DateTask
from .model import ModelConfig, Transformer, make_model
from .runtime import get_device, seed_everything
from .training import (
    History,
    LabelSmoothingLoss,
    exact_match,
    fit,
    noam_optimizer,
    noam_rate,
)

Task = CopyTask | DateTask


@dataclass(frozen=True)
class Recipe:
    """Everything that decides how one task is trained (see the module docstring)."""

    task: str  # "copy", "dates" or "numbers" (chapter 11's, made by transformer_book.numbers)
    dropout: float
    batch_size: int
    warmup: int  # steps of linear warm-up of the paper's schedule
    lr_factor: float  # the schedule's scale c: peak rate c · d_model^-0.5 · warmup^-0.5
    clip_norm: float | None  # the largest gradient norm an update may use
    adam_eps: float  # Adam's epsilon (the paper: 1e-9)
    max_steps: int  # the cap: a run that has not reached the target by then has failed
    eval_every: int  # steps between evaluations on the validation set
    target: float  # exact match on the validation set at which training stops
    smoothing: float = 0.1
    d_model: int = 64
    num_heads: int = 4
    d_ff: int = 256
    num_layers: int = 2
    # LayerNorm before each sublayer (pre-norm) instead of after it
    norm_first: bool = False
    taper: bool = False  # the rate also falls linearly to zero at max_steps (noam_rate's total_steps)
    # Evaluate and keep an average of the weights with this decay (fit's average).
    average: float | None = None

    def __post_init__(self) -> None:
        # The task's name only: the numbers are checked where they are used.
        check_choice(self.task, "task", ("copy", "dates", "numbers"))

    def make_task(self, seed: int = 0) -> Task:
        """The task with its validation and test sets drawn from ``seed``."""
        check_choice(
            self.task, "task (numbers.NumberTask makes chapter 11's)", ("copy", "dates")
        )
        return CopyTask(seed=seed) if self.task == "copy" else DateTask(seed=seed)

    def model_config(self, task: Task) -> ModelConfig:
        """``ModelConfig.small`` with this recipe's sizes, for ``task``'s vocabularies."""
        return ModelConfig.small(
            task.src_vocab_size, task.tgt_vocab_size, d_model=self.d_model, num_heads=self.num_heads,
            d_ff=self.d_ff, num_layers=self.num_layers, dropout=self.dropout, norm_first=self.norm_first,
        )  # fmt: skip

    @property
    def taper_steps(self) -> int | None:
        """Where the schedule reaches zero (``noam_rate``'s ``total_steps``): the cap, or None without a taper."""
        return self.max_steps if self.taper else None

    def optimizer(
        self, model: nn.Module
    ) -> tuple[torch.optim.Adam, torch.optim.lr_scheduler.LambdaLR]:
        """Adam with the paper's warm-up schedule, scaled and tapered as this recipe says."""
        return noam_optimizer(
            model,
            self.d_model,
            self.warmup,
            self.lr_factor,
            eps=self.adam_eps,
            total_steps=self.taper_steps,
        )

    def rate(self, step: int) -> float:
        """The learning rate of update ``step`` (counted from 1) under this recipe's schedule."""
        return noam_rate(
            step, self.d_model, self.warmup, self.lr_factor, self.taper_steps
        )

    def loss_fn(self, config: ModelConfig) -> LabelSmoothingLoss:
        return LabelSmoothingLoss(config.tgt_vocab_size, self.smoothing, config.pad_id)


RECIPES: dict[str, Recipe] = {
    "copy": Recipe(
        task="copy", dropout=0.0, batch_size=64, warmup=100, lr_factor=1.0, clip_norm=1.0, adam_eps=1e-9,
        max_steps=1000, eval_every=50, target=1.0, taper=True, average=0.99,
    ),
    "dates": Recipe(
        task="dates", dropout=0.1, batch_size=64, warmup=100, lr_factor=1.0, clip_norm=1.0, adam_eps=1e-9,
        max_steps=800, eval_every=50, target=0.999, taper=True, average=0.99,
    ),
}  # fmt: skip


def recipe(name: str) -> Recipe:
    """``RECIPES[name]``, with a clear error for an unknown name."""
    check_choice(name, "name", RECIPES)
    return RECIPES[name]


def _accuracy(model: Transformer, pairs: tuple, task: Task, limit: int | None) -> float:
    src, tgt = pairs
    if limit is not None:
        check_positive(limit, "limit")
        src, tgt = src[:limit], tgt[:limit]
    return exact_match(model, src, tgt, bos_id=task.bos_id, eos_id=task.eos_id)


def validation_accuracy(
    model: Transformer, task: Task, limit: int | None = None
) -> float:
    """Exact match of greedy decoding on ``task``'s validation set (its first ``limit`` pairs
    if given): the score that may choose (stopping, the weights kept)."""
    return _accuracy(model, task.validation_set(), task, limit)


def test_accuracy(model: Transformer, task: Task, limit: int | None = None) -> float:
    """Exact match of greedy decoding on ``task``'s test set (its first ``limit`` pairs if
    given): scored once, after training, and never used to choose."""
    return _accuracy(model, task.test_set(), task, limit)


test_accuracy.__test__ = False  # not a test for pytest to collect


@dataclass
class TrainedModel:
    """A model trained by a recipe, with the task (and so the validation and test sets) it was trained on."""

    model: Transformer
    task: Task
    recipe: Recipe
    seed: int
    steps: int  # training steps taken
    accuracy: float  # exact match on task's test set, scored once after training
    history: History | None = None  # None for a model loaded from a checkpoint
    validation: float | None = None  # exact match on the validation set (it chose)


def train_recipe(
    name: str,
    seed: int = 0,
    *,
    until_target: bool = True,
    device: torch.device | None = None,
    progress: bool = False,
) -> TrainedModel:
    """Train a fresh model with ``RECIPES[name]`` and seed ``seed``.

    Every ``eval_every`` steps the weight average is scored on the task's validation
    set. With ``until_target`` training stops at the first evaluation that reaches the
    recipe's target; without it, it runs to the cap (the benchmark does, to see that
    the model stays there). Then the test set is scored, once: that is the returned
    ``accuracy``; the last validation score is ``validation``. The data, the two
    held-out sets and the initial weights all derive from ``seed``. This is the one
    code path that trains a recipe: the chapters,
    the benchmarks and ``scripts/make_checkpoints.py`` (the shipped checkpoints) all call it.
    """
    r = recipe(name)
    device = device or get_device()
    seed_everything(seed)  # initial weights and dropout
    task = r.make_task(seed)
    config = r.model_config(task)
    model = make_model(config).to(device)
    optimizer, schedule = r.optimizer(model)
    rng = random.Random(seed + 1)  # the training batches

    def next_batch(step: int) -> Batch:
        return task.train_batch(r.batch_size, rng)

    history = fit(
        model, next_batch, r.max_steps, optimizer, schedule, loss_fn=r.loss_fn(config),
        evaluate=lambda m: validation_accuracy(m, task), eval_every=r.eval_every,
        stop_at=r.target if until_target else None, progress=progress, clip_norm=r.clip_norm,
        average=r.average,
    )  # fmt: skip
    model = history.averaged if history.averaged is not None else model.eval()
    test = test_accuracy(model, task)  # once, after training
    return TrainedModel(
        model, task, r, seed, history.step[-1], test, history,
        validation=history.eval_metric[-1],
    )  # fmt: skip


# --- the shipped checkpoints -------------------------------------------------------------------

CHECKPOINT_PACKAGE = "transformer_book.checkpoints"


def checkpoint_state(trained: TrainedModel) -> dict:
    """What a checkpoint holds: weights, the model's config, the recipe that made it, its result.

    Only tensors, strings and numbers, so ``torch.load(..., weights_only=True)`` reads it.
    """
    return {
        "model": trained.model.state_dict(),
        "model_config": dataclasses.asdict(trained.model.config),
        "recipe": dataclasses.asdict(trained.recipe),
        "seed": trained.seed,
        "steps": trained.steps,
        "accuracy": trained.accuracy,  # the test set's
        "validation": trained.validation,
        # A plain string: weights_only loading refuses TorchVersion.
        "torch": str(torch.__version__),
    }


def checkpoint_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_checkpoint(folder: Path | Traversable, name: str) -> dict:
    """Load ``folder/<name>.pt`` (``weights_only=True``) after checking it against ``folder/SHA256SUMS``
    and the recipe it was made with against ``RECIPES[name]``."""
    r = recipe(name)
    file = folder / f"{name}.pt"
    if not file.is_file():
        raise ValueError(
            f"name={name!r}: no checkpoint {file} is shipped for this recipe; use retrain=True"
        )
    data = file.read_bytes()
    sums = (folder / "SHA256SUMS").read_text().split()
    # file name -> digest, as sha256sum writes them
    expected = dict(zip(sums[1::2], sums[0::2]))
    if expected.get(file.name) != checkpoint_digest(data):
        raise ValueError(
            f"checkpoint {file}: its SHA-256 does not match SHA256SUMS (corrupt or replaced)"
        )
    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if state.get("recipe") != dataclasses.asdict(r):
        raise ValueError(
            f"checkpoint {file} was made by another recipe than RECIPES[{name!r}]; "
            "run `python scripts/make_checkpoints.py` to make it again"
        )
    return state


def trained_model(
    name: str = "dates", *, retrain: bool = False, device: torch.device | None = None
) -> TrainedModel:
    """A model trained by ``RECIPES[name]``, in evaluation mode, and its task.

    By default the checkpoint shipped inside the package is loaded (a second, no
    training): its SHA-256 must match ``checkpoints/SHA256SUMS`` and the recipe stored in it
    must equal today's recipe, so a checkpoint can never silently drift from the code.
    ``retrain=True`` trains a new one with seed 0 instead (under a minute on a CPU),
    as ``scripts/make_checkpoints.py`` does to produce the shipped file.
    """
    device = device or get_device()
    if retrain:
        return train_recipe(name, seed=0, device=device)
    state = read_checkpoint(resources.files(CHECKPOINT_PACKAGE), name)
    model = make_model(ModelConfig(**state["model_config"]))
    model.load_state_dict(state["model"])
    model.to(device).eval()
    r = recipe(name)
    return TrainedModel(
        model,
        r.make_task(state["seed"]),
        r,
        state["seed"],
        state["steps"],
        state["accuracy"],
        validation=state.get("validation"),
    )
