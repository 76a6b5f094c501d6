"""Graded parts: padding_mask, causal_mask."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ...masking import causal_mask, padding_mask, target_mask
from .engine import (
    Case,
    Part,
    run_function,
)
from .results import Mistake
from .sections import (
    _CH5_BOTH,
    _CH5_CAUSAL,
    _CH5_CONVENTIONS,
    _CH5_PADDING,
)


def _padding_cases() -> list[Case]:
    def make(rows: list[list[int]], **kwargs: Any) -> Callable[[], tuple]:
        return lambda: ((torch.tensor(rows),), kwargs)

    return [
        Case(
            "tokens (3, 5) with padding at the ends",
            make([[5, 3, 7, 0, 0], [4, 0, 0, 0, 0], [2, 6, 1, 8, 9]]),
        ),
        Case("a row that is all padding", make([[3, 2, 0, 0], [0, 0, 0, 0]])),
        Case("batch 1, length 1", make([[7]])),
        Case(
            "pad_id=1, where 0 is a real token",
            make([[0, 4, 1, 1], [5, 0, 2, 1]], pad_id=1),
        ),
    ]


def _padding_variant(
    *,
    invert: bool = False,
    layout: str = "keys",
    dtype: torch.dtype = torch.bool,
    fixed_pad: int | None = None,
) -> Callable[..., Tensor]:
    def mask(tokens: Tensor, pad_id: int = 0) -> Tensor:
        real = tokens == (pad_id if fixed_pad is None else fixed_pad)
        real = real if invert else ~real
        shaped = {
            "keys": real[:, None, :],
            "none": real,
            "queries": real[:, :, None],
            "heads": real[:, None, None, :],
        }[layout]
        return shaped.to(dtype)

    return mask


_PADDING_MISTAKES = (
    Mistake(
        "inverted",
        "the mask is True at the padding (nn.MultiheadAttention's key_padding_mask convention); the package's "
        "masks are True where a token may be attended to, so True marks the real tokens",
        (_padding_variant(invert=True),),
        section=_CH5_CONVENTIONS,
        did="marked the padding with True",
    ),
    Mistake(
        "missing_query_axis",
        "the mask has shape (batch, seq); the package's is (batch, 1, seq), whose axis of size 1 broadcasts "
        "over the queries (a (batch, seq) mask would broadcast its batch axis against the queries)",
        (_padding_variant(layout="none"),),
        section=_CH5_PADDING,
        did="returned (batch, seq) without the axis of size 1",
    ),
    Mistake(
        "hides_queries",
        "the mask has shape (batch, seq, 1): it hides the padding's queries (rows) instead of its keys "
        "(columns), so real tokens still read the padding",
        (_padding_variant(layout="queries"),),
        section=_CH5_PADDING,
        did="put the axis of size 1 last, (batch, seq, 1)",
    ),
    Mistake(
        "head_axis_added",
        "the mask has shape (batch, 1, 1, seq); the package's masks are (batch, 1, seq), and multi-head "
        "attention inserts the heads axis itself",
        (_padding_variant(layout="heads"),),
        section=_CH5_PADDING,
        did="returned (batch, 1, 1, seq)",
    ),
    Mistake(
        "not_boolean",
        "the mask holds numbers; the package's masks are boolean (True = may attend)",
        tuple(
            _padding_variant(dtype=dtype)
            for dtype in (torch.float32, torch.int64, torch.int32, torch.uint8)
        ),
        section=_CH5_PADDING,
        did="returned a float or integer mask",
    ),
    Mistake(
        "pad_id_ignored",
        "the padding id is taken to be 0 whatever pad_id is given, so with pad_id=1 the real "
        "token 0 is hidden and the padding is read",
        (_padding_variant(fixed_pad=0),),
        section=_CH5_PADDING,
        did="compared the tokens with 0 (or took no pad_id)",
    ),
)


def _causal_cases() -> list[Case]:
    return [
        Case("size 1", lambda: ((1,), {})),
        Case("size 2", lambda: ((2,), {})),
        Case("size 5", lambda: ((5,), {})),
    ]


def _causal_variant(
    diagonal: int = 0, upper: bool = False, form: str = "bool"
) -> Callable[..., Tensor]:
    def mask(size: int, device: Any = None) -> Tensor:
        ones = torch.ones(size, size, dtype=torch.bool)
        allowed = ones.triu(diagonal) if upper else ones.tril(diagonal)
        if form == "additive":  # 0 where allowed, −∞ where hidden, as nn.Transformer's
            return torch.zeros(size, size).masked_fill(~allowed, float("-inf"))[None]
        return allowed[None].to(
            {
                "bool": torch.bool,
                "float": torch.float32,
                "long": torch.int64,
                "int": torch.int32,
                "uint8": torch.uint8,
            }[form]
        )

    return mask


_CAUSAL_MISTAKES = (
    Mistake(
        "transposed",
        "the mask is True on and above the diagonal, so each query sees the future and not the past",
        (_causal_variant(upper=True),),
        section=_CH5_CAUSAL,
        did="used triu where the mask needs tril",
    ),
    Mistake(
        "diagonal_hidden",
        "the diagonal is hidden: each position may also attend to itself, and position 0 would have "
        "nothing to read at all",
        (_causal_variant(diagonal=-1),),
        section=_CH5_CAUSAL,
        errata=(17,),
        did="used tril(diagonal=-1)",
    ),
    Mistake(
        "blocked_convention",
        "the mask is True where attention is blocked (above the diagonal), the convention of nn.Transformer's "
        "boolean masks; the package's masks are True where a query may attend",
        (_causal_variant(diagonal=1, upper=True),),
        section=_CH5_CONVENTIONS,
        did="marked the future with True (triu(diagonal=1))",
    ),
    Mistake(
        "additive_float_mask",
        "the mask is a float tensor of 0 and −∞ to be added to the scores (what "
        "nn.Transformer.generate_square_subsequent_mask returns); the package's masks are boolean, True = may attend",
        (_causal_variant(form="additive"),),
        section=_CH5_CONVENTIONS,
        did="returned a float mask of 0 and −inf",
    ),
    Mistake(
        "one_future_token_visible",
        "each position may also see the next one (tril with diagonal=1)",
        (_causal_variant(diagonal=1),),
        section=_CH5_CAUSAL,
        did="used tril(diagonal=1)",
    ),
    Mistake(
        "not_boolean",
        "the mask holds 1 and 0 as numbers; the package's masks are boolean (True = may attend)",
        tuple(_causal_variant(form=form) for form in ("float", "long", "int", "uint8")),
        section=_CH5_CAUSAL,
        did="returned a float or integer mask (uint8 included)",
    ),
)


def _target_cases() -> list[Case]:
    def make(rows: list[list[int]], **kwargs: Any) -> Callable[[], tuple]:
        return lambda: ((torch.tensor(rows),), kwargs)

    return [
        Case(
            "tokens (2, 5), padding at the ends",
            make([[5, 3, 7, 0, 0], [4, 6, 8, 9, 0]]),
        ),
        Case("a row that is all padding", make([[3, 2, 0], [0, 0, 0]])),
        Case(
            "left padding: the padding comes first", make([[0, 0, 5, 3], [0, 4, 6, 8]])
        ),
        Case("batch 1, length 1", make([[7]])),
        Case(
            "pad_id=1, where 0 is a real token",
            make([[0, 4, 1, 1], [5, 0, 2, 1]], pad_id=1),
        ),
    ]


def _target_variant(
    *,
    padding: str = "keys",
    causal: bool = True,
    combine: str = "and",
    blocked: bool = False,
    fixed_pad: int | None = None,
    dtype: torch.dtype = torch.bool,
) -> Callable[..., Tensor]:
    def mask(tokens: Tensor, pad_id: int = 0) -> Tensor:
        size = tokens.shape[1]
        real = tokens != (pad_id if fixed_pad is None else fixed_pad)
        future = torch.ones(size, size, dtype=torch.bool).tril()[None]
        if not causal:
            future = torch.ones_like(future)
        pad = {
            "keys": real[:, None, :],
            "queries": real[:, :, None],
            "none": torch.ones_like(real[:, None, :]),
            "both": real[:, :, None] & real[:, None, :],
        }[padding]
        allowed = pad | future if combine == "or" else pad & future
        return (~allowed if blocked else allowed).to(dtype)

    return mask


_TARGET_MISTAKES = (
    Mistake(
        "causal_only",
        "the mask hides the future but not the padding: each query also reads the padding "
        "keys before it",
        (_target_variant(padding="none"),),
        section=_CH5_BOTH,
        did="returned the causal mask alone",
    ),
    Mistake(
        "padding_only",
        "the mask hides the padding but not the future: each query also reads the tokens after it",
        (_target_variant(causal=False),),
        section=_CH5_BOTH,
        did="returned the padding mask alone, broadcast to (batch, seq, seq)",
    ),
    Mistake(
        "padding_on_queries",
        "the padding hides the rows of the padding's queries instead of the columns of its keys, so "
        "a real token still reads the padding; padding_mask's (batch, 1, seq) hides keys",
        (_target_variant(padding="queries"),),
        section=_CH5_PADDING,
        did="put the padding on the query axis, (batch, seq, 1)",
    ),
    Mistake(
        "padding_queries_hidden_too",
        "the padding's query rows are hidden as well as its keys: a padding query then has no key "
        "to read at all; only the keys need hiding, what a padding query computes is never used",
        (_target_variant(padding="both"),),
        section=_CH5_PADDING,
        did="hid the padding on both axes, queries and keys",
    ),
    Mistake(
        "combined_with_or",
        "the two masks are combined with | (or): a key is readable when either mask allows it, so "
        "both the future and the padding leak; a key must be allowed by both, &",
        (_target_variant(combine="or"),),
        section=_CH5_BOTH,
        did="combined the two masks with |",
    ),
    Mistake(
        "blocked_convention",
        "the mask is True where attention is blocked (nn.Transformer's convention); the package's "
        "masks are True where a query may attend",
        (_target_variant(blocked=True), _target_variant(blocked=True, combine="or")),
        section=_CH5_CONVENTIONS,
        did="marked the hidden keys with True",
    ),
    Mistake(
        "pad_id_ignored",
        "the padding id is taken to be 0 whatever pad_id is given, so with pad_id=1 the real "
        "token 0 is hidden and the padding is read",
        (_target_variant(fixed_pad=0),),
        section=_CH5_PADDING,
        did="compared the tokens with 0 (or took no pad_id)",
    ),
    Mistake(
        "not_boolean",
        "the mask holds numbers; the package's masks are boolean (True = may attend)",
        tuple(
            _target_variant(dtype=dtype)
            for dtype in (torch.float32, torch.int64, torch.int32, torch.uint8)
        ),
        section=_CH5_CONVENTIONS,
        did="returned a float or integer mask",
    ),
)


PARTS = (
    Part(
        "padding_mask",
        "function",
        padding_mask,
        "(tokens (batch, seq), pad_id=0) → (batch, 1, seq), True where a token is real",
        _CH5_PADDING,
        _padding_cases,
        run_function(("output",)),
        _PADDING_MISTAKES,
        axes={"output": ("batch", "query", "key")},
    ),
    Part(
        "causal_mask",
        "function",
        causal_mask,
        "(size) → (1, size, size), True on and below the diagonal",
        _CH5_CAUSAL,
        _causal_cases,
        run_function(("output",)),
        _CAUSAL_MISTAKES,
        axes={"output": ("batch", "query", "key")},
        broadcast_equivalent=True,
    ),
    Part(
        "target_mask",
        "function",
        target_mask,
        "(tokens (batch, seq), pad_id=0) → (batch, seq, seq), True where query i may read key j: "
        "j ≤ i and token j is real",
        _CH5_BOTH,
        _target_cases,
        run_function(("output",)),
        _TARGET_MISTAKES,
        axes={"output": ("batch", "query", "key")},
    ),
)
