"""Graded parts: TokenEmbedding."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ...embedding import TokenEmbedding
from .compare import _shape
from .engine import Case, Part, _build, _forward, _generator, _ReaderProblem
from .results import mistake_maker
from .sections import EMBEDDING


def _embedding_cases() -> list[Case]:
    def make(
        offset: int,
        vocab: int,
        d_model: int,
        shape: tuple[int, ...],
        padding_idx=None,
        dtype=torch.float32,
    ):
        def inputs() -> dict[str, Any]:
            g = _generator(offset)
            tokens = torch.randint(0, vocab, shape, generator=g)
            # the last id is where a table one row short fails
            tokens.view(-1)[0] = vocab - 1
            table = torch.randn(vocab, d_model, generator=g, dtype=torch.float64).to(
                dtype
            )
            if padding_idx is not None:
                table[padding_idx] = 0.0
                tokens.view(-1)[-1] = padding_idx
            return dict(
                vocab=vocab,
                d_model=d_model,
                tokens=tokens,
                table=table,
                padding_idx=padding_idx,
                dtype=dtype,
                upstream=torch.randn(
                    *shape, d_model, generator=g, dtype=torch.float64
                ).to(dtype),
            )

        return inputs

    return [
        Case("vocabulary 11, d_model 8, tokens (2, 5)", make(1, 11, 8, (2, 5))),
        Case("vocabulary 5, d_model 64, tokens (3, 2)", make(2, 5, 64, (3, 2))),
        Case("batch 1, length 1: the last id", make(3, 11, 8, (1, 1))),
        Case(
            "float64 table, vocabulary 7, d_model 6",
            make(4, 7, 6, (2, 3), dtype=torch.float64),
        ),
        Case(
            "padding_idx=0, and the gradient of the table",
            make(5, 11, 8, (2, 6), padding_idx=0),
            needs=("padding_idx",),
        ),
    ]


def _run_embedding(cls: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    vocab, d_model, padding_idx = (
        inputs["vocab"],
        inputs["d_model"],
        inputs["padding_idx"],
    )
    wanted = {} if padding_idx is None else {"padding_idx": padding_idx}
    module = _build(cls, (vocab, d_model), wanted).to(inputs["dtype"])
    named = list(module.named_parameters())
    tables = [p for _, p in named if tuple(p.shape) == (vocab, d_model)]
    if len(tables) != 1:
        matrices = [tuple(p.shape) for _, p in named if p.dim() == 2]
        if len(matrices) == 1:  # one table, of the wrong size: that is the answer
            return {"table shape": matrices[0]}
        found = ", ".join(f"{name} {_shape(p.shape)}" for name, p in named) or "none"
        raise _ReaderProblem(
            f"The check looks for one table of shape (vocab_size, d_model) = {_shape((vocab, d_model))} in your "
            f"module, to copy the package's numbers into it; your module's parameters: {found}"
        )
    table = tables[0]
    with torch.no_grad():
        table.copy_(inputs["table"])
    tokens = inputs["tokens"]
    output = _forward(cls, module, tokens)
    outputs = {"table shape": (vocab, d_model), "output": output}
    if (
        padding_idx is not None
        and isinstance(output, Tensor)
        and output.shape == inputs["upstream"].shape
    ):
        # The padding row must get no gradient: train a little and it would stop being zero.
        if output.requires_grad:
            (gradient,) = torch.autograd.grad(
                (output * inputs["upstream"]).sum(), table
            )
        else:
            gradient = torch.zeros_like(table)
        outputs["gradient of the table"] = gradient
    return outputs


def _embedding_variant(
    scale: Callable[[int, int], float] = lambda d, v: math.sqrt(d),
    padding: bool = True,
    rows: int = 0,
) -> type:
    """A TokenEmbedding that multiplies by ``scale(d_model, vocab_size)``, with ``rows`` rows more
    (or fewer) than the vocabulary, and with or without the padding row."""

    class Variant(nn.Module):
        def __init__(
            self, vocab_size: int, d_model: int, padding_idx: int | None = None
        ) -> None:
            super().__init__()
            self.factor = scale(d_model, vocab_size)
            self.lookup = nn.Embedding(
                vocab_size + rows, d_model, padding_idx=padding_idx if padding else None
            )

        def forward(self, tokens: Tensor) -> Tensor:
            return self.lookup(tokens) * self.factor

    return Variant


_mistake = mistake_maker(_embedding_variant)

_EMBEDDING_MISTAKES = (
    _mistake(
        "missing_scale",
        "returned the lookup without multiplying by √d_model",
        "the vectors are not multiplied by √d_model; the package, like the paper, returns lookup(tokens) · √d_model",
        scale=lambda d, v: 1.0,
        errata=(63,),
    ),
    _mistake(
        "scaled_by_d_model",
        "multiplied by d_model",
        "the vectors are multiplied by d_model itself, not by its square root",
        scale=lambda d, v: float(d),
    ),
    _mistake(
        "divided_by_sqrt_d_model",
        "divided by √d_model",
        "the vectors are divided by √d_model, where the package multiplies by it",
        scale=lambda d, v: 1.0 / math.sqrt(d),
    ),
    _mistake(
        "scaled_by_sqrt_vocab_size",
        "multiplied by √vocab_size",
        "the vectors are multiplied by √vocab_size; the factor is √d_model, the width of the vectors",
        scale=lambda d, v: math.sqrt(v),
    ),
    _mistake(
        "padding_idx_ignored",
        "built nn.Embedding without padding_idx",
        "the padding row receives a gradient: the table is built without padding_idx, so training "
        "would move the padding vector away from zero",
        padding=False,
        section=EMBEDDING["The padding id"],
    ),
    _mistake(
        "table_one_row_short",
        "made the table vocab_size − 1 rows long",
        "the table has vocab_size − 1 rows; ids count from 0, so the last id, vocab_size − 1, needs a row "
        "of its own (padding included)",
        rows=-1,
        section=EMBEDDING["The copy-task batch, embedded"],
        errata=(33,),
    ),
)


PARTS = (
    Part(
        "TokenEmbedding",
        TokenEmbedding,
        "class (vocab_size, d_model, padding_idx=None); forward(tokens) → (batch, seq, d_model)",
        EMBEDDING["Why multiply by √d_model?"],
        _embedding_cases,
        _run_embedding,
        _EMBEDDING_MISTAKES,
        axes={
            "output": ("batch", "position", "feature"),
            "gradient of the table": ("row", "feature"),
        },
        grad=True,
    ),
)
