"""Chapter 8: how the model learns — label smoothing, the warm-up schedule, the loop, evaluation."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.checkpoint import checkpoint

from .checks import (
    check_aligned,
    check_logits,
    check_pairs,
    check_positive,
    check_positive_number,
    check_probability,
    check_schedule,
    check_smoothing,
    check_start,
    check_tokens,
    require_instance,
    trusted_ids,
)
from .data import Batch
from .inference import greedy_decode
from .model import ModelConfig, Transformer
from .progress import ProgressBar


class LabelSmoothingLoss(nn.Module):
    """Cross-entropy against a softened target: ``1 - smoothing`` on the right token,
    ``smoothing`` shared evenly by the other real tokens (padding gets nothing).
    ``logits (..., vocab_size)``, ``target (...)`` ids → the mean loss over the targets
    that are not padding. With ``smoothing=0`` it is plain cross-entropy."""

    def __init__(
        self, vocab_size: int, smoothing: float = 0.1, pad_id: int = 0
    ) -> None:
        super().__init__()
        check_smoothing(vocab_size, smoothing, pad_id)
        self.vocab_size, self.smoothing, self.pad_id = vocab_size, smoothing, pad_id

    def target_distribution(self, target: Tensor) -> Tensor:
        """What each position is trained towards: ``target.shape + (vocab_size,)``."""
        # Spread over the wrong tokens: not the right one, not padding.
        share = self.smoothing / (self.vocab_size - 2)
        dist = torch.full((*target.shape, self.vocab_size), share, device=target.device)
        dist.scatter_(-1, target.unsqueeze(-1), 1.0 - self.smoothing)
        dist[..., self.pad_id] = 0.0
        # A padding position is trained towards nothing: its row is all zeros.
        return dist.masked_fill((target == self.pad_id).unsqueeze(-1), 0.0)

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        check_logits(logits, target, self.vocab_size)
        log_probs = logits.float().log_softmax(dim=-1)
        per_position = -(self.target_distribution(target) * log_probs).sum(dim=-1)
        return per_position.sum() / (target != self.pad_id).sum().clamp(min=1)


def chunked_loss(
    hidden: Tensor,
    generator: nn.Module,
    target: Tensor,
    loss_fn: LabelSmoothingLoss,
    chunk: int,
) -> Tensor:
    """``loss_fn(generator(hidden), target)``, computed ``chunk`` positions at a time.

    ``hidden (..., d_model)`` (the decoder's output), ``target (...)`` ids. The mean
    over the targets that are not padding is a sum of per-chunk sums over their count.
    Each chunk's logits are made, reduced and dropped, and the backward pass makes them
    again (``torch.utils.checkpoint``): the float32 logits of the whole batch,
    ``positions × vocabulary`` (3.8 GB for the paper's batch and 37,000 words), never
    exist at once. The same loss and gradients as the whole, up to float rounding.
    """
    check_positive(chunk, "chunk")
    require_instance(loss_fn, "loss_fn", LabelSmoothingLoss)
    check_aligned(hidden, target)
    h, t = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    counted = t != loss_fn.pad_id

    def chunk_sum(h_part: Tensor, t_part: Tensor, counted_part: Tensor) -> Tensor:
        return loss_fn(generator(h_part), t_part) * counted_part.sum()

    parts = [
        checkpoint(chunk_sum, h[i : i + chunk], t[i : i + chunk],
                   counted[i : i + chunk], use_reentrant=False)
        for i in range(0, t.shape[0], chunk)
    ]  # fmt: skip
    return torch.stack(parts).sum() / counted.sum().clamp(min=1)


def noam_rate(
    step: int,
    d_model: int,
    warmup: int,
    factor: float = 1.0,
    total_steps: int | None = None,
) -> float:
    """The paper's rate, ``factor · d_model^-0.5 · min(step^-0.5, step · warmup^-1.5)``.

    It rises linearly for ``warmup`` steps, then decays as ``1/sqrt(step)``; step 0
    counts as step 1. With ``total_steps`` (not in the paper) it is also multiplied by
    ``1 - step / total_steps``, a taper that brings it to zero at the last step.
    """
    check_positive(d_model, "d_model")
    check_schedule(warmup, total_steps)
    check_positive_number(factor, "factor")
    step = max(step, 1)
    rate = factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
    return rate if total_steps is None else rate * max(0.0, 1.0 - step / total_steps)


def noam_optimizer(
    model: nn.Module,
    d_model: int,
    warmup: int,
    factor: float = 1.0,
    eps: float = 1e-9,
    total_steps: int | None = None,
) -> tuple[torch.optim.Adam, torch.optim.lr_scheduler.LambdaLR]:
    """Adam with the paper's betas (0.9, 0.98) and eps (1e-9 unless given), and
    :func:`noam_rate` as its schedule (tapered to zero at ``total_steps`` if given).

    Adam divides each update by ``sqrt(v) + eps``, ``v`` the recent mean squared
    gradient: with a tiny ``eps`` a parameter whose gradient is only rounding noise
    still moves by about the learning rate at every step; a larger ``eps`` damps it.
    """
    require_instance(model, "model", nn.Module)
    check_schedule(warmup, total_steps, eps)
    check_positive_number(factor, "factor")
    parameters = list(model.parameters())
    # Fused Adam: one kernel for all the parameters, not a loop of small operations.
    fused = all(p.device.type in ("cpu", "cuda") for p in parameters) or None
    optimizer = torch.optim.Adam(parameters, 1.0, (0.9, 0.98), eps, fused=fused)

    # LambdaLR passes the number of updates done; the paper counts the next one from 1.
    def rate(done: int) -> float:
        return noam_rate(done + 1, d_model, warmup, factor, total_steps)

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, rate)


@dataclass
class History:
    """What the training loop recorded, one entry per step (and per evaluation)."""

    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    eval_step: list[int] = field(default_factory=list)
    eval_metric: list[float] = field(default_factory=list)
    seconds: float = 0.0
    # With fit(..., average=...): the running average of the weights, which evaluate() scored.
    averaged: Transformer | None = None


def weight_average(model: Transformer, decay: float) -> AveragedModel:
    """An exponential moving average of ``model``'s weights,
    ``avg ← decay · avg + (1 − decay) · weights`` after every update (PyTorch's
    ``AveragedModel``; its ``.module`` is a :class:`~transformer_book.model.Transformer`).

    The paper evaluated the average of its last checkpoints; an average over the last
    ``~1 / (1 − decay)`` updates smooths out the jolts a single update can give the weights.
    """
    check_probability(decay, "decay")
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))


def train_step(
    model: nn.Module,
    batch: Batch,
    loss_fn: nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler | None = None,
    *,
    clip_norm: float | None = None,
    loss_scale: float = 1.0,
    bf16: bool = False,
) -> tuple[Tensor, float]:
    """One teacher-forced step on ``batch`` (on the model's device): forward, the loss
    times ``loss_scale`` (torchrun's share per process), backward, the gradient norm
    clipped to ``clip_norm`` if given, the update. Returns ``(loss, lr it used)``."""
    require_instance(batch, "batch", Batch)
    if clip_norm is not None:
        check_positive_number(clip_norm, "clip_norm")
    model.train()
    with torch.autocast(batch.src.device.type, torch.bfloat16, enabled=bf16):
        logits = model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
    loss = loss_fn(logits, batch.tgt_out) * loss_scale
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if clip_norm is not None:
        nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
    optimizer.step()
    lr = optimizer.param_groups[0]["lr"]
    if schedule is not None:
        schedule.step()
    return loss.detach(), lr


def check_batch(batch: Batch, config: ModelConfig) -> None:
    """``batch`` must be a :class:`~transformer_book.data.Batch` whose ids are ids of the
    model's vocabularies (read where they are)."""
    require_instance(batch, "next_batch(step)'s result", Batch)
    check_tokens(batch.src, "batch.src", config.src_vocab_size, config.max_len)
    check_tokens(batch.tgt_in, "batch.tgt_in", config.tgt_vocab_size, config.max_len)
    check_tokens(batch.tgt_out, "batch.tgt_out", config.tgt_vocab_size, config.max_len)


def fit(
    model: nn.Module,
    next_batch: Callable[[int], Batch],
    steps: int,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler | None = None,
    loss_fn: nn.Module | None = None,
    evaluate: Callable[[Transformer], float] | None = None,
    eval_every: int = 0,
    stop_at: float | None = None,
    progress: bool = True,
    clip_norm: float | None = None,
    bf16: bool = False,
    average: float | None = None,
    *,
    start_step: int = 0,
    averaged: AveragedModel | None = None,
    loss_scale: Callable[[Batch], float] | None = None,
    after_eval: Callable[[int, History], None] | None = None,
) -> History:
    """Train from step ``start_step + 1`` to ``steps`` with :func:`train_step`; return the
    :class:`History`. This is the one loop that trains the Transformer: the chapters, the
    recipes and the command-line trainer (alone or under torchrun) all run it.

    ``next_batch(step)`` gives each step's :class:`~transformer_book.data.Batch`; its ids are
    checked where they are, then it is moved to the model's device. ``model`` may be wrapped
    (``DistributedDataParallel``): the wrapper trains, the module inside is averaged and
    scored. ``evaluate(model)`` returns a metric such as exact match on a *validation* set;
    it runs on the model in evaluation mode, every ``eval_every`` steps and at the last, and
    training stops once it reaches ``stop_at``. ``clip_norm`` caps the gradient norm;
    ``bf16`` trains under bfloat16 autocast.
    With ``average`` (a decay, e.g. 0.99) a :func:`weight_average` is kept: ``evaluate``
    scores it and ``history.averaged`` holds it; ``averaged`` continues one (a resumed run).
    ``loss_scale(batch)`` multiplies each step's loss (a process's share under torchrun);
    ``after_eval(step, history)`` runs at every evaluation step, after the evaluation (a
    checkpoint). A progress bar shows the loss and the learning rate.
    """
    check_positive(steps, "steps")
    require_instance(optimizer, "optimizer", torch.optim.Optimizer)
    check_start(start_step, steps)
    if eval_every:  # 0: only at the last step
        check_positive(eval_every, "eval_every")
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    device = next(inner.parameters()).device
    loss_fn = loss_fn or LabelSmoothingLoss(
        inner.config.tgt_vocab_size, 0.1, inner.config.pad_id
    )
    history = History()
    if averaged is None and average is not None:
        averaged = weight_average(inner, average)
    start = time.perf_counter()
    # A terminal gets tqdm's bar on stderr; a notebook one output redrawn in place, which
    # ends as a one-line summary (the built page shows that line, not every redraw).
    figures: dict[str, str] = {}
    bar = ProgressBar(
        steps, desc="training", unit="step", initial=start_step, enabled=progress
    )
    with bar:
        for step in range(start_step + 1, steps + 1):
            batch = next_batch(step)
            check_batch(batch, inner.config)  # where the ids are (the CPU, usually)
            scale = loss_scale(batch) if loss_scale is not None else 1.0
            with trusted_ids():  # so the model need not read them back from the device
                loss, lr = train_step(
                    model, batch.to(device), loss_fn, optimizer, schedule,
                    clip_norm=clip_norm, loss_scale=scale, bf16=bf16,
                )  # fmt: skip
            history.step.append(step)
            history.loss.append(loss.item())  # times loss_scale, as it was trained
            history.lr.append(lr)
            if averaged is not None:
                averaged.update_parameters(inner)
            figures.update(loss=f"{history.loss[-1]:.3f}", lr=f"{lr:.2e}")
            stop = False
            if (eval_every and step % eval_every == 0) or step == steps:
                if evaluate is not None:
                    scored = inner if averaged is None else averaged.module
                    mode = scored.training
                    metric = evaluate(scored.eval())
                    scored.train(mode)  # as it was: fit returns the model in it
                    history.eval_step.append(step)
                    history.eval_metric.append(metric)
                    figures["metric"] = f"{metric:.3f}"
                    stop = stop_at is not None and metric >= stop_at
                if after_eval is not None:
                    after_eval(step, history)
            bar.set_postfix(**figures)
            bar.update(1)
            if stop:
                break
    history.seconds = time.perf_counter() - start
    if averaged is not None:
        history.averaged = averaged.module.eval()
    return history


def strip_sequences(
    ids: Tensor, eos_id: int | None, pad_id: int
) -> list[tuple[int, ...]]:
    """Rows of ``ids (n, len)`` (BOS first) as tuples of the tokens after BOS, up to and without EOS."""
    rows = []
    for row in ids[:, 1:].tolist():
        if eos_id is not None and eos_id in row:
            row = row[: row.index(eos_id)]
        rows.append(tuple(t for t in row if t != pad_id))
    return rows


@torch.no_grad()
def exact_match(
    model: Transformer,
    src: Tensor,
    tgt: Tensor,
    bos_id: int,
    eos_id: int | None,
    batch_size: int = 500,
) -> float:
    """The fraction of sources whose greedy translation equals the target exactly.

    ``src (n, S)``, ``tgt (n, T)`` with BOS first (and EOS, unless ``eos_id`` is None).
    """
    check_positive(batch_size, "batch_size")
    check_pairs(src, tgt)
    model.eval()
    device = next(model.parameters()).device
    pad_id = model.config.pad_id
    correct = 0
    for first in range(0, src.shape[0], batch_size):
        chunk_src = src[first : first + batch_size].to(device)
        chunk_tgt = tgt[first : first + batch_size]
        decoded = greedy_decode(model, chunk_src, tgt.shape[1], bos_id, eos_id).cpu()
        predicted = strip_sequences(decoded, eos_id, pad_id)
        expected = strip_sequences(chunk_tgt, eos_id, pad_id)
        correct += sum(p == e for p, e in zip(predicted, expected))
    return correct / src.shape[0]
