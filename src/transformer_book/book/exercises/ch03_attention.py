"""Graded parts: scaled_dot_product_attention."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor

from ...attention import scaled_dot_product_attention
from ...masking import causal_mask
from .engine import Case, Part, _generator, _key_padding, run_function
from .results import mistake_maker
from .sections import ATTENTION, MASKING


def _attention_cases() -> list[Case]:
    def make(
        offset: int,
        q: tuple,
        k: tuple,
        d_v: int,
        mask: Callable | None = None,
        dtype=torch.float32,
    ):
        def inputs() -> tuple[tuple, dict]:
            g = _generator(100 + offset)
            query = 2.0 * torch.randn(q, generator=g, dtype=torch.float64)
            key = 2.0 * torch.randn(k, generator=g, dtype=torch.float64)
            value = torch.randn((*k[:-1], d_v), generator=g, dtype=torch.float64)
            args = tuple(t.to(dtype) for t in (query, key, value))
            return (*args, mask()) if mask else args, {}

        return inputs

    def one_empty_row() -> Tensor:
        mask = torch.tensor(
            [
                [
                    [True, False, True, True],
                    [True, True, False, True],
                    [False, True, True, False],
                ]
            ]
            * 2
        )
        mask[1, 1] = False  # query 1 of batch 1 may look at nothing
        return mask

    def float64_mask() -> Tensor:
        return torch.tensor(
            [
                [[True, True, False, True, True, False]],
                [[True, True, True, True, True, False]],
            ]
        )

    return [
        Case(
            "batch 2, 3 queries, 5 keys, d_k 4, d_v 6, no mask",
            make(1, (2, 3, 4), (2, 5, 4), 6),
        ),
        Case(
            "a padding mask of shape (2, 1, 5)",
            make(2, (2, 3, 4), (2, 5, 4), 6, partial(_key_padding, [3, 4], 5)),
        ),
        Case(
            "2 heads, (1, 2, 4, 8), a causal mask (1, 4, 4)",
            make(3, (1, 2, 4, 8), (1, 2, 4, 8), 8, partial(causal_mask, 4)),
        ),
        Case("batch 1, one query, one key", make(4, (1, 1, 8), (1, 1, 8), 3)),
        Case(
            "query 1 of batch 1 has every key masked",
            make(5, (2, 3, 4), (2, 4, 4), 5, one_empty_row),
        ),
        Case(
            "float64, d_k 16, a padding mask",
            make(6, (2, 3, 16), (2, 6, 16), 16, float64_mask, torch.float64),
        ),
    ]


def _attention_variant(
    *,
    scale: Callable[[Tensor, Tensor, Tensor], float] = lambda q, k, v: math.sqrt(
        q.shape[-1]
    ),
    axis: int = -1,
    fill: float = float("-inf"),
    invert: bool = False,
    empty_rows_zero: bool = True,
) -> Callable[..., tuple[Tensor, Tensor]]:
    """Attention with one thing changed: the scale, the softmax's axis, the mask's fill value or
    convention, or a query with no key left to read not given zero weights."""

    def attention(
        query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        scores = query @ key.transpose(-2, -1) / scale(query, key, value)
        hidden = None
        if mask is not None:
            hidden = mask if invert else ~mask
            scores = scores.masked_fill(hidden, fill)
        weights = scores.softmax(dim=axis)
        if hidden is not None and empty_rows_zero:
            weights = weights.masked_fill(hidden.all(dim=-1, keepdim=True), 0.0)
        return weights @ value, weights

    return attention


def _both_empty_row_handlings(**changes: Any) -> tuple[Callable, ...]:
    return (
        _attention_variant(**changes),
        _attention_variant(empty_rows_zero=False, **changes),
    )


_mistake = mistake_maker(
    _both_empty_row_handlings, ATTENTION["3.4 Why divide by √d_k?"]
)

_ATTENTION_MISTAKES = (
    _mistake(
        "no_scale",
        "left out the division by √d_k",
        "the scores Q Kᵀ are not divided by √d_k, so with wide vectors the softmax saturates",
        scale=lambda q, k, v: 1.0,
    ),
    _mistake(
        "divided_by_d_k",
        "divided the scores by d_k",
        "the scores are divided by d_k instead of by its square root √d_k",
        scale=lambda q, k, v: float(q.shape[-1]),
    ),
    _mistake(
        "scale_uses_d_v",
        "took the scale from value.shape[-1]",
        "the scores are divided by the square root of the values' width d_v; the scale is √d_k, the width "
        "of the queries and keys (query.shape[-1])",
        scale=lambda q, k, v: math.sqrt(v.shape[-1]),
    ),
    _mistake(
        "scale_uses_length",
        "took the scale from key.shape[-2]",
        "the scores are divided by the square root of the number of keys (shape[-2]); the scale is √d_k, "
        "the width of the queries and keys (shape[-1])",
        scale=lambda q, k, v: math.sqrt(k.shape[-2]),
    ),
    _mistake(
        "softmax_over_queries",
        "took the softmax over dim=-2",
        "the softmax runs over the queries (dim=-2), so each key's column sums to 1 instead of each query's row",
        axis=-2,
        section=ATTENTION["Step 4: softmax"],
    ),
    _mistake(
        "mask_inverted",
        "hid the keys where the mask is True",
        "the mask is read as True = hidden (nn.MultiheadAttention's convention); in the package True means "
        "may attend, so the keys the mask allows are the ones hidden",
        invert=True,
        section=MASKING["Two conventions: ours and `nn.MultiheadAttention`'s"],
    ),
    _mistake(
        "masked_scores_zero",
        "set the hidden scores to 0",
        "hidden scores are set to 0 before the softmax, and e⁰ = 1 still gives them weight; a hidden key "
        "needs the score −∞ to get the weight 0",
        fill=0.0,
        section=MASKING["How a mask enters attention"],
        errata=(10,),
    ),
    _mistake(
        "empty_row_nan",
        "filled with −inf and left rows with nothing to read as they came out",
        "a query whose every key is masked gets NaN (a softmax over nothing but −∞ is 0/0); the package "
        "gives such a query zero weights and a zero output, as PyTorch's fused kernel does",
        _attention_variant(empty_rows_zero=False),
        section=MASKING["`-inf` or `-1e9`? The row with nothing to read"],
    ),
    _mistake(
        "empty_row_average",
        "filled the hidden scores with −1e9",
        "hidden scores are filled with a large negative number such as −1e9 and nothing more, so a query whose "
        "every key is masked gets the plain average of all the values instead of zero weights",
        _attention_variant(fill=-1e9, empty_rows_zero=False),
        section=MASKING["`-inf` or `-1e9`? The row with nothing to read"],
        errata=(43,),
    ),
)


PARTS = (
    Part(
        "scaled_dot_product_attention",
        scaled_dot_product_attention,
        "(query, key, value, mask=None) → output (and, if you like, weights)",
        ATTENTION["3.3 Every query at once: the matrix form"],
        _attention_cases,
        run_function(("output", "weights")),
        _ATTENTION_MISTAKES,
        axes={
            "output": ("batch", "head", "query", "feature"),
            "weights": ("batch", "head", "query", "key"),
        },
    ),
)
