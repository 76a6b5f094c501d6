"""Graded parts: split_heads, merge_heads, MultiHeadAttention."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from ...attention import MultiHeadAttention
from ...masking import causal_mask
from .engine import (
    Case,
    Part,
    _build_loaded,
    _call,
    _display,
    _forward,
    _generator,
    _key_padding,
    _named,
    _random_state,
)
from .results import mistake_maker
from .sections import _HEADS_COUNT, ATTENTION, HEADS


def _mha_cases() -> list[Case]:
    def make(
        offset: int,
        d_model: int,
        heads: int,
        q_shape: tuple,
        k_len: int | None,
        mask=None,
        dtype=torch.float32,
    ):
        def inputs() -> dict[str, Any]:
            g = _generator(200 + offset)
            state = _random_state(MultiHeadAttention(d_model, heads), g)

            def draw(*shape: int) -> Tensor:
                x = torch.randn(*shape, d_model, generator=g, dtype=torch.float64)
                return x.to(dtype)

            query = draw(*q_shape)
            if k_len is None:  # self-attention: one tensor for query, key and value
                key = value = query
            else:
                key, value = draw(q_shape[0], k_len), draw(q_shape[0], k_len)
            args = (query, key, value) + ((mask(),) if mask else ())
            return dict(sizes=(d_model, heads), state=state, args=args, dtype=dtype)

        return inputs

    return [
        Case(
            "self-attention, d_model 12, 3 heads, x (2, 4, 12)",
            make(1, 12, 3, (2, 4), None),
        ),
        Case(
            "cross-attention, 4 heads, 3 queries, 5 keys, a padding mask",
            make(2, 12, 4, (2, 3), 5, partial(_key_padding, [3, 5], 5)),
        ),
        Case(
            "self-attention, 2 heads, a causal mask (1, 4, 4)",
            make(3, 12, 2, (1, 4), None, partial(causal_mask, 4)),
        ),
        Case("batch 1, length 1, 6 heads", make(4, 12, 6, (1, 1), None)),
        Case(
            "float64, 4 heads, 3 queries, 5 keys, a padding mask",
            make(5, 12, 4, (2, 3), 5, partial(_key_padding, [3, 5], 5), torch.float64),
        ),
    ]


def _run_mha(cls: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    module, missing = _build_loaded(cls, inputs["sizes"], inputs)
    outputs = _named(_forward(cls, module, *inputs["args"]), ("output", "weights"))
    return {"missing parameters": missing, **outputs}


def _mha_variant(
    split: str = "transpose",
    merge: str = "transpose",
    heads: int | None = None,
    scale: str = "d_head",
    project_values: bool = True,
    out_proj: bool = True,
) -> type:
    """Multi-head attention with one thing changed: how heads are split or merged, how many there
    are, the scale, or a projection left out."""

    class Variant(nn.Module):
        def __init__(
            self, d_model: int, num_heads: int, dropout: float = 0.0, bias: bool = True
        ) -> None:
            super().__init__()
            self.d_model, self.num_heads = d_model, heads or num_heads
            self.d_head = d_model // self.num_heads
            self.q_proj = nn.Linear(d_model, d_model)
            self.k_proj = nn.Linear(d_model, d_model)
            if project_values:
                self.v_proj = nn.Linear(d_model, d_model)
            if out_proj:
                self.out_proj = nn.Linear(d_model, d_model)

        def split(self, x: Tensor) -> Tensor:
            b, n, h, w = x.shape[0], x.shape[1], self.num_heads, self.d_head
            # (B, heads, len, d_head) read straight from (B, len, d_model)
            if split == "view":
                return x.reshape(b, h, n, w)
            if split == "swapped":  # d_head "heads" of num_heads features each
                return x.reshape(b, n, w, h).transpose(1, 2)
            return x.reshape(b, n, h, w).transpose(1, 2)

        def merge(self, x: Tensor) -> Tensor:
            b, n = x.shape[0], x.shape[2]
            if merge == "view":
                return x.reshape(b, n, self.d_model)
            return x.transpose(1, 2).reshape(b, n, self.d_model)

        def forward(
            self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None
        ) -> Tensor:
            q, k = self.split(self.q_proj(query)), self.split(self.k_proj(key))
            v = self.split(self.v_proj(value) if project_values else value)
            if mask is not None:
                mask = mask.unsqueeze(1)
            width = {
                "d_head": self.d_head,
                "d_model": self.d_model,
                "actual": q.shape[-1],
            }[scale]
            scores = q @ k.transpose(-2, -1) / math.sqrt(width)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            weights = scores.softmax(-1)
            if mask is not None:
                weights = weights.masked_fill(~mask.any(-1, keepdim=True), 0.0)
            merged = self.merge(weights @ v)
            return self.out_proj(merged) if out_proj else merged

    return Variant


_mha_mistake = mistake_maker(_mha_variant)

_MHA_MISTAKES = (
    _mha_mistake(
        "merge_without_transpose",
        "reshaped (B, heads, len, d_head) straight to (B, len, d_model)",
        "the heads are merged by reshaping (B, heads, len, d_head) straight to (B, len, d_model); without "
        "transposing heads and positions back first, each output row mixes pieces of several positions",
        merge="view",
        section=HEADS["Why `view` needs the `transpose`"],
    ),
    _mha_mistake(
        "split_without_transpose",
        "viewed (B, len, d_model) straight as (B, heads, len, d_head)",
        "the heads are split by viewing (B, len, d_model) straight as (B, heads, len, d_head); that reads "
        "consecutive numbers as one position, so each head sees pieces of several positions",
        {"split": "view"},
        {"split": "view", "merge": "view"},
        section=HEADS["Why `view` needs the `transpose`"],
    ),
    _mha_mistake(
        "heads_and_width_swapped",
        "viewed the features as (…, d_head, num_heads)",
        "the split uses (…, d_head, num_heads) where it needs (…, num_heads, d_head), which makes d_head "
        "heads of num_heads features each",
        {"split": "swapped"},
        {"split": "swapped", "scale": "actual"},
    ),
    _mha_mistake(
        "split_by_layers",
        "split into 6 parts",
        "the vectors are split into 6 parts, the number of layers, instead of into num_heads heads",
        heads=6,
        section=_HEADS_COUNT,
        errata=(27,),
    ),
    _mha_mistake(
        "missing_out_proj",
        "returned the concatenated heads without out_proj",
        "the block ends with the concatenation of the heads; the package then applies W^O (out_proj), "
        "which mixes the heads' columns",
        out_proj=False,
        section=HEADS["Concatenation, then $W^O$"],
        errata=(31,),
    ),
    _mha_mistake(
        "values_not_projected",
        "weighted the values without v_proj",
        "the values are the inputs themselves; each head weights v_proj(value), the values projected by W^V",
        project_values=False,
        section=ATTENTION["3.3 Every query at once: the matrix form"],
        errata=(26,),
    ),
    _mha_mistake(
        "scaled_by_d_model",
        "divided the scores by √d_model",
        "the scores are divided by √d_model; each head divides by √d_head, the width of its own queries and keys",
        scale="d_model",
        section=ATTENTION["3.4 Why divide by √d_k?"],
    ),
)


def _split_reference(x: Tensor, num_heads: int) -> Tensor:
    return MultiHeadAttention(x.shape[-1], num_heads).split_heads(x)


def _merge_reference(x: Tensor, num_heads: int | None = None) -> Tensor:
    return MultiHeadAttention(x.shape[1] * x.shape[-1], x.shape[1]).merge_heads(x)


def _heads_cases(merge: bool) -> list[Case]:
    def make(
        offset: int, batch: int, length: int, heads: int, d_model: int
    ) -> Callable[[], tuple]:
        def inputs() -> tuple[tuple, dict]:
            g = _generator(300 + offset)
            if merge:
                return (
                    torch.randn(batch, heads, length, d_model // heads, generator=g),
                    heads,
                ), {}
            return (torch.randn(batch, length, d_model, generator=g), heads), {}

        return inputs

    what = "heads (B, heads, len, d_head)" if merge else "x (B, len, d_model)"
    return [
        Case(f"{what}, batch 2, length 4, 3 heads, d_model 12", make(1, 2, 4, 3, 12)),
        Case(f"{what}, batch 2, length 5, 4 heads, d_model 12", make(2, 2, 5, 4, 12)),
        Case(f"{what}, batch 1, length 1, 2 heads, d_model 12", make(3, 1, 1, 2, 12)),
    ]


def _run_heads(fn: Any, inputs: tuple[tuple, dict]) -> dict[str, Any]:
    """Call ``fn(x, num_heads)``, or ``fn(x)`` for a merge that takes only the tensor."""
    (x, heads), _ = inputs
    try:
        inspect.signature(fn).bind(x, heads)
        args = (x, heads)
    except TypeError:
        args = (x,)
    except ValueError:
        args = (x, heads)
    return {"output": _call(f"Your {_display(fn)}", fn, *args)}


def _split(
    layout: str = "transpose", fixed_heads: int | None = None
) -> Callable[..., Tensor]:
    def split_heads(x: Tensor, num_heads: int) -> Tensor:
        b, n, d = x.shape
        h = fixed_heads or num_heads
        if layout == "view":
            return x.reshape(b, h, n, d // h)
        if layout == "swapped":
            return x.reshape(b, n, d // h, h).transpose(1, 2)
        if layout == "strided":  # head i takes columns i, i + h, i + 2h, ...
            return x.reshape(b, n, d // h, h).permute(0, 3, 1, 2)
        if layout == "keys_transposed":
            return x.reshape(b, n, h, d // h).permute(0, 2, 3, 1)
        return x.reshape(b, n, h, d // h).transpose(1, 2)

    return split_heads


def _merge(layout: str = "transpose") -> Callable[..., Tensor]:
    def merge_heads(x: Tensor, num_heads: int | None = None) -> Tensor:
        b, h, n, w = x.shape
        if layout == "view":
            return x.reshape(b, n, h * w)
        if layout == "strided":
            return x.permute(0, 2, 3, 1).reshape(b, n, h * w)
        if layout == "sum":
            return x.sum(dim=1)
        if layout == "mean":
            return x.mean(dim=1)
        # heads concatenated one after another along the positions
        if layout == "sequence":
            return x.reshape(b, h * n, w)
        return x.transpose(1, 2).reshape(b, n, h * w)

    return merge_heads


_split_mistake = mistake_maker(_split)

_SPLIT_MISTAKES = (
    _split_mistake(
        "split_without_transpose",
        "viewed x straight as (B, heads, len, d_head)",
        "x is viewed straight as (B, heads, len, d_head); that reads consecutive numbers as one position, so "
        "each head's rows are pieces of several positions. The heads axis has to come from the features",
        layout="view",
        section=HEADS["Why `view` needs the `transpose`"],
    ),
    _split_mistake(
        "heads_and_width_swapped",
        "viewed the features as (…, d_head, num_heads)",
        "the features are viewed as (…, d_head, num_heads), which makes d_head heads of num_heads features each",
        layout="swapped",
    ),
    _split_mistake(
        "strided_heads",
        "gave head i every h-th column",
        "head i takes the columns i, i + h, i + 2h, …; each head is one contiguous block of d_head columns "
        "(the columns of its own W_i^Q)",
        layout="strided",
    ),
    _split_mistake(
        "keys_transposed",
        "put the positions last, (B, heads, d_head, len)",
        "the result is (B, heads, d_head, len), positions last; split_heads gives (B, heads, len, d_head), "
        "and attention transposes the keys itself",
        layout="keys_transposed",
    ),
    _split_mistake(
        "split_by_layers",
        "split into 6 parts",
        "the vectors are split into 6 parts, the number of layers, instead of into num_heads heads",
        fixed_heads=6,
        section=_HEADS_COUNT,
        errata=(27,),
    ),
)


_merge_mistake = mistake_maker(_merge)

_MERGE_MISTAKES = (
    _merge_mistake(
        "merge_without_transpose",
        "reshaped (B, heads, len, d_head) straight to (B, len, d_model)",
        "(B, heads, len, d_head) is reshaped straight to (B, len, d_model); without first moving the heads "
        "axis next to d_head, each output row mixes pieces of several positions",
        layout="view",
        section=HEADS["Why `view` needs the `transpose`"],
    ),
    _merge_mistake(
        "strided_merge",
        "interleaved the heads' columns",
        "the heads' columns are interleaved (head 0's first feature, head 1's first feature, …); the "
        "concatenation puts each head's d_head columns side by side as one block",
        layout="strided",
    ),
    _merge_mistake(
        "heads_summed",
        "added the heads up",
        "the heads are added up, giving d_head features per position; they are concatenated, giving "
        "heads × d_head = d_model",
        layout="sum",
        section=HEADS["Concatenation, then $W^O$"],
    ),
    _merge_mistake(
        "heads_averaged",
        "averaged the heads",
        "the heads are averaged, giving d_head features per position; they are concatenated, giving "
        "heads × d_head = d_model",
        layout="mean",
        section=HEADS["Concatenation, then $W^O$"],
    ),
    _merge_mistake(
        "concatenated_along_positions",
        "concatenated the heads along the positions",
        "the heads are concatenated along the positions, (B, heads · len, d_head); the concatenation is "
        "along the features, (B, len, heads · d_head)",
        layout="sequence",
        section=HEADS["Concatenation, then $W^O$"],
    ),
)


PARTS = (
    Part(
        "split_heads",
        _split_reference,
        "(x (B, len, d_model), num_heads) → (B, heads, len, d_head)",
        HEADS["The split, one shape at a time"],
        lambda: _heads_cases(merge=False),
        _run_heads,
        _SPLIT_MISTAKES,
        axes={"output": ("batch", "head", "position", "feature")},
    ),
    Part(
        "merge_heads",
        _merge_reference,
        "(x (B, heads, len, d_head)[, num_heads]) → (B, len, d_model)",
        HEADS["The split, one shape at a time"],
        lambda: _heads_cases(merge=True),
        _run_heads,
        _MERGE_MISTAKES,
        axes={"output": ("batch", "position", "feature")},
    ),
    Part(
        "MultiHeadAttention",
        MultiHeadAttention,
        "class (d_model, num_heads) with q_proj, k_proj, v_proj, out_proj; forward(query, key, value, mask=None)",
        HEADS["The split, one shape at a time"],
        _mha_cases,
        _run_mha,
        _MHA_MISTAKES,
        axes={"output": ("batch", "query", "feature")},
    ),
)
