"""Chapter 0: the recurrent encoder–decoder the Transformer replaced, with and without attention.

Both models read the source with PyTorch's own ``nn.GRU`` (bidirectional) and write the
target one token at a time with a ``nn.GRU`` decoder:

- ``attention=False`` — the whole source must pass through one fixed-size vector, the
  encoder's final states (Sutskever et al., 2014; Cho et al., 2014);
- ``attention=True`` — at every target step the decoder also reads a weighted average
  of all encoder states, weighted by a small additive score (Bahdanau et al., 2015).

The shipped checkpoints (``checkpoints/baselines/``, made by ``scripts/make_baselines.py``)
are read by :func:`trained_baseline`, checked against ``SHA256SUMS`` and against today's
:data:`BASELINES` recipe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.flop_counter import FlopCounterMode

try:
    from importlib.resources.abc import Traversable
except ImportError:  # Python 3.10
    from importlib.abc import Traversable

from ..checks import check_positive
from ..data import DateTask
from ..runtime import get_device, seed_everything
from ..training import strip_sequences


@dataclass(frozen=True)
class RecurrentConfig:
    """Sizes of a :class:`RecurrentSeq2Seq`."""

    src_vocab_size: int
    tgt_vocab_size: int
    # The width of the decoder's state; each encoder direction has hidden // 2.
    hidden: int = 64
    embed: int = 32
    attention: bool = False
    pad_id: int = 0


class RecurrentSeq2Seq(nn.Module):
    """A GRU encoder–decoder; with ``config.attention`` the decoder attends to every encoder state.

    ``forward(src (B, n), tgt_in (B, m)) -> logits (B, m, tgt_vocab_size)`` (teacher forcing);
    :meth:`greedy` decodes without the target.
    """

    def __init__(self, config: RecurrentConfig) -> None:
        super().__init__()
        check_positive(config.hidden, "hidden")
        if config.hidden % 2:
            raise ValueError(
                f"hidden must be even (two encoder directions), got {config.hidden}"
            )
        self.config = config
        h = config.hidden
        self.src_embed = nn.Embedding(
            config.src_vocab_size, config.embed, padding_idx=config.pad_id
        )
        self.tgt_embed = nn.Embedding(
            config.tgt_vocab_size, config.embed, padding_idx=config.pad_id
        )
        self.encoder = nn.GRU(
            config.embed, h // 2, batch_first=True, bidirectional=True
        )
        # final encoder states -> the decoder's first state
        self.bridge = nn.Linear(h, h)
        context = h if config.attention else 0
        self.decoder = nn.GRU(config.embed + context, h, batch_first=True)
        if config.attention:  # additive score v·tanh(W_s s + W_h h_j)
            self.score_query = nn.Linear(h, h, bias=False)
            self.score_key = nn.Linear(h, h)
            self.score_v = nn.Linear(h, 1, bias=False)
        self.generator = nn.Linear(h + context, config.tgt_vocab_size)

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """States ``(B, n, hidden)``, the decoder's first state ``(1, B, hidden)`` and the key mask ``(B, n)``."""
        mask = src != self.config.pad_id
        lengths = mask.sum(1).clamp(min=1).cpu()
        packed = pack_padded_sequence(
            self.src_embed(src), lengths, batch_first=True, enforce_sorted=False
        )
        out, last = self.encoder(packed)
        states, _ = pad_packed_sequence(
            out, batch_first=True, total_length=src.shape[1]
        )
        first = torch.tanh(
            self.bridge(torch.cat([last[0], last[1]], dim=-1))
        ).unsqueeze(0)
        return states, first, mask

    def attend(
        self, query: Tensor, states: Tensor, mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Context ``(B, hidden)`` and weights ``(B, n)`` for a decoder state ``query (B, hidden)``."""
        scores = self.score_v(
            torch.tanh(self.score_query(query).unsqueeze(1) + self.score_key(states))
        ).squeeze(-1)
        weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return (weights.unsqueeze(-1) * states).sum(1), weights

    def step(
        self, token: Tensor, state: Tensor, states: Tensor, mask: Tensor
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """One decoder step: logits ``(B, V)``, the new state and (with attention) the weights ``(B, n)``."""
        x = self.tgt_embed(token).unsqueeze(1)
        weights = None
        if self.config.attention:
            context, weights = self.attend(state[-1], states, mask)
            x = torch.cat([x, context.unsqueeze(1)], dim=-1)
        out, state = self.decoder(x, state)
        features = out[:, 0]
        if self.config.attention:
            features = torch.cat([features, context], dim=-1)
        return self.generator(features), state, weights

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        states, state, mask = self.encode(src)
        # No context to recompute: one call over the whole target.
        if not self.config.attention:
            out, _ = self.decoder(self.tgt_embed(tgt_in), state)
            return self.generator(out)
        logits = []
        for t in range(tgt_in.shape[1]):
            step_logits, state, _ = self.step(tgt_in[:, t], state, states, mask)
            logits.append(step_logits)
        return torch.stack(logits, dim=1)

    @torch.no_grad()
    def greedy(
        self, src: Tensor, max_tokens: int, bos_id: int
    ) -> tuple[Tensor, Tensor | None]:
        """Greedy decoding: ids ``(B, max_tokens)`` starting with BOS, and attention
        weights ``(B, max_tokens-1, n)``."""
        states, state, mask = self.encode(src)
        token = torch.full((src.shape[0],), bos_id, dtype=torch.long, device=src.device)
        out, weights = [token], []
        for _ in range(max_tokens - 1):
            logits, state, w = self.step(token, state, states, mask)
            token = logits.argmax(-1)
            out.append(token)
            weights.append(w)
        return torch.stack(out, 1), (
            torch.stack(weights, 1) if self.config.attention else None
        )


def row_matches(decoded: Tensor, tgt: Tensor, eos_id: int, pad_id: int = 0) -> Tensor:
    """A boolean per row: is ``decoded (N, m)`` (BOS first) the target ``tgt (N, m)`` up to EOS?"""
    predicted, expected = (
        strip_sequences(decoded.cpu(), eos_id, pad_id),
        strip_sequences(tgt.cpu(), eos_id, pad_id),
    )
    return torch.tensor([p == e for p, e in zip(predicted, expected)])


def match_per_row(
    model: RecurrentSeq2Seq, src: Tensor, tgt: Tensor, bos_id: int, eos_id: int
) -> Tensor:
    """Greedy decoding of every row of ``src (N, n)`` compared with ``tgt (N, m)``: a boolean per row."""
    model.eval()
    decoded, _ = model.greedy(
        src.to(next(model.parameters()).device), tgt.shape[1], bos_id
    )
    return row_matches(decoded, tgt, eos_id, model.config.pad_id)


# --- Table 1 of the paper, measured ----------------------------------------------------------------


def count_flops(fn: Callable[..., object], *args: object) -> int:
    """Floating-point operations of the matrix products ``fn(*args)`` runs (``torch.utils.flop_counter``)."""
    counter = FlopCounterMode(display=False)
    with counter:
        fn(*args)
    return counter.get_total_flops()


@contextlib.contextmanager
def rnn_gradients_in_eval() -> Iterator[None]:
    """A context in which autograd can differentiate through ``nn.GRU`` (``nn.LSTM``, ``nn.RNN``) in eval mode.

    On a GPU the recurrent layers run on cuDNN, whose backward pass refuses a layer in eval mode
    ("cudnn RNN backward can only be called in training mode"). Inside the context cuDNN is off,
    so PyTorch's own kernels run both passes; ``torch.backends.cudnn.enabled`` is restored on exit.
    Run the forward pass inside it too: the backward is chosen when the forward runs.

    cuDNN is switched off rather than the layer put into training mode: training mode is the same
    computation only without dropout, and the layer measured should be the one in eval mode. On a
    CPU cuDNN is never used and nothing changes.
    """
    # Only the ``enabled`` flag: ``torch.backends.cudnn.flags()`` would also reset cuDNN's other
    # settings (and, in newer PyTorch, CUDA's float32 precision) while the context lasts.
    enabled = torch.backends.cudnn.enabled
    torch.backends.cudnn.enabled = False
    try:
        yield
    finally:
        torch.backends.cudnn.enabled = enabled


def _inputs(node) -> list:
    return [child for child, _ in node.next_functions if child is not None]


def sequential_depth(output: Tensor) -> int:
    """The longest chain of dependent autograd operations from ``output`` back to the leaves.

    Operations on one chain must run one after the other; everything else could run in parallel.
    """
    if output.grad_fn is None:
        raise ValueError(
            "output must come from a computation with requires_grad inputs"
        )
    depth: dict = {}
    stack = [(output.grad_fn, False)]
    while stack:  # iterative post-order: a recurrent graph is thousands of nodes deep
        node, ready = stack.pop()
        if node in depth:
            continue
        children = _inputs(node)
        if ready:
            depth[node] = 1 + max((depth[c] for c in children), default=0)
        else:
            stack.append((node, True))
            stack.extend((c, False) for c in children if c not in depth)
    return depth[output.grad_fn]


def path_length(output: Tensor, leaf: Tensor) -> int:
    """The fewest autograd operations between ``output`` and the leaf tensor ``leaf`` (breadth-first search).

    Raises ``ValueError`` when ``output`` does not depend on ``leaf`` at all.
    """
    if output.grad_fn is None or not leaf.is_leaf or not leaf.requires_grad:
        raise ValueError(
            "output must have a grad_fn and leaf must be a leaf tensor that requires grad"
        )
    frontier, seen, steps = [output.grad_fn], {output.grad_fn}, 1
    while frontier:
        following = []
        for node in frontier:
            if getattr(node, "variable", None) is leaf:
                return steps
            for child in _inputs(node):
                if child not in seen:
                    seen.add(child)
                    following.append(child)
        frontier, steps = following, steps + 1
    raise ValueError("output does not depend on leaf")


# --- the recipe and the shipped checkpoints ------------------------------------------------------


@dataclass(frozen=True)
class BaselineRecipe:
    """How a baseline is trained on the dates task (the same for both, but for ``attention``)."""

    attention: bool
    hidden: int = 64
    embed: int = 32
    batch_size: int = 128
    lr: float = 3e-3
    clip_norm: float = 1.0
    steps: int = 1000
    # Steps between checks on the first ``eval_rows`` held-out dates.
    eval_every: int = 100
    eval_rows: int = 250


#: The two baselines, one recipe without and with attention.
BASELINES: dict[str, BaselineRecipe] = {
    "gru": BaselineRecipe(attention=False),
    "gru_attention": BaselineRecipe(attention=True),
}
BASELINE_PACKAGE = "transformer_book.checkpoints.baselines"


@dataclass
class TrainedBaseline:
    model: RecurrentSeq2Seq
    task: DateTask
    name: str
    seed: int
    accuracy: float  # exact match on the task's held-out set
    # (step, exact match on the first eval_rows held-out dates)
    curve: list[tuple[int, float]]


def train_baseline(
    name: str,
    seed: int = 0,
    steps: int | None = None,
    device: torch.device | None = None,
) -> TrainedBaseline:
    """Train ``BASELINES[name]`` on the dates task (held-out set and weights from ``seed``)."""
    if name not in BASELINES:
        raise ValueError(f"name must be one of {sorted(BASELINES)}, got {name!r}")
    r = BASELINES[name]
    device = device or get_device()
    seed_everything(seed)
    task = DateTask(seed=seed)
    config = RecurrentConfig(
        task.src_vocab_size,
        task.tgt_vocab_size,
        r.hidden,
        r.embed,
        r.attention,
        task.pad_id,
    )
    model = RecurrentSeq2Seq(config).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=r.lr)
    loss_fn = nn.CrossEntropyLoss(ignore_index=task.pad_id)
    rng = random.Random(seed + 1)
    src, tgt = task.test_set()
    curve = []
    for step in range(1, (r.steps if steps is None else steps) + 1):
        model.train()
        batch = task.train_batch(r.batch_size, rng).to(device)
        logits = model(batch.src, batch.tgt_in)
        loss = loss_fn(logits.reshape(-1, logits.shape[-1]), batch.tgt_out.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), r.clip_norm)
        optimizer.step()
        if step % r.eval_every == 0:
            rows = slice(0, r.eval_rows)
            curve.append(
                (
                    step,
                    match_per_row(model, src[rows], tgt[rows], task.bos_id, task.eos_id)
                    .float()
                    .mean()
                    .item(),
                )
            )
    accuracy = (
        match_per_row(model, src, tgt, task.bos_id, task.eos_id).float().mean().item()
    )
    return TrainedBaseline(model.eval(), task, name, seed, accuracy, curve)


def baseline_state(trained: TrainedBaseline) -> dict:
    """Weights, config, recipe, seed and accuracy: plain values only, for ``weights_only`` loading."""
    return {
        "model": trained.model.state_dict(),
        "model_config": dataclasses.asdict(trained.model.config),
        "recipe": dataclasses.asdict(BASELINES[trained.name]),
        "seed": trained.seed,
        "accuracy": trained.accuracy,
        "curve": [list(point) for point in trained.curve],
    }


def trained_baseline(
    name: str,
    device: torch.device | None = None,
    folder: Path | Traversable | None = None,
) -> TrainedBaseline:
    """The shipped checkpoint of ``BASELINES[name]``, verified against ``SHA256SUMS`` and the recipe.

    ``folder`` defaults to the package's ``checkpoints/baselines``.
    """
    if name not in BASELINES:
        raise ValueError(f"name must be one of {sorted(BASELINES)}, got {name!r}")
    folder = folder if folder is not None else resources.files(BASELINE_PACKAGE)
    data = (folder / f"{name}.pt").read_bytes()
    sums = (folder / "SHA256SUMS").read_text().split()
    if (
        dict(zip(sums[1::2], sums[0::2])).get(f"{name}.pt")
        != hashlib.sha256(data).hexdigest()
    ):
        raise ValueError(
            f"baseline checkpoint {name}.pt: its SHA-256 does not match SHA256SUMS"
        )
    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if state["recipe"] != dataclasses.asdict(BASELINES[name]):
        raise ValueError(
            f"{name}.pt was made by another recipe; run `python scripts/make_baselines.py`"
        )
    model = RecurrentSeq2Seq(RecurrentConfig(**state["model_config"]))
    model.load_state_dict(state["model"])
    model.to(device or get_device()).eval()
    curve = [(int(step), float(value)) for step, value in state["curve"]]
    return TrainedBaseline(
        model,
        DateTask(seed=state["seed"]),
        name,
        state["seed"],
        state["accuracy"],
        curve,
    )
