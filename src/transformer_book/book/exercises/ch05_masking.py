"""Graded parts: padding_mask, causal_mask, target_mask."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ...masking import causal_mask, padding_mask, target_mask
from .engine import Case, Part, run_function
from .results import Mistake, Section, mistake_maker
from .sections import MASKING

_NUMBERS = (torch.float32, torch.int64, torch.int32, torch.uint8)
"""The dtypes a mask that is not boolean comes in."""

_MASK_AXES = {"output": ("batch", "query", "key")}


def _tokens(rows: list[list[int]], **kwargs: Any) -> Callable[[], tuple]:
    return lambda: ((torch.tensor(rows),), kwargs)


def _padding_cases() -> list[Case]:
    return [
        Case(
            "tokens (3, 5) with padding at the ends",
            _tokens([[5, 3, 7, 0, 0], [4, 0, 0, 0, 0], [2, 6, 1, 8, 9]]),
        ),
        Case("a row that is all padding", _tokens([[3, 2, 0, 0], [0, 0, 0, 0]])),
        Case("batch 1, length 1", _tokens([[7]])),
        Case(
            "pad_id=1, where 0 is a real token",
            _tokens([[0, 4, 1, 1], [5, 0, 2, 1]], pad_id=1),
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


def _shared_mistakes(
    mistake: Callable[..., Mistake], section: Section
) -> tuple[Mistake, ...]:
    """The mistakes padding_mask and target_mask share, made with the part's ``mistake``;
    ``section`` explains masks that are not boolean."""
    return (
        mistake(
            "not_boolean",
            "returned a float or integer mask",
            "the mask holds numbers; the package's masks are boolean (True = may attend)",
            *({"dtype": dtype} for dtype in _NUMBERS),
            section=section,
        ),
        mistake(
            "pad_id_ignored",
            "compared the tokens with 0 (or took no pad_id)",
            "the padding id is taken to be 0 whatever pad_id is given, so with pad_id=1 the real "
            "token 0 is hidden and the padding is read",
            fixed_pad=0,
            section=MASKING["The padding mask"],
        ),
    )


_padding_mistake = mistake_maker(_padding_variant)

_PADDING_MISTAKES = (
    _padding_mistake(
        "inverted",
        "marked the padding with True",
        "the mask is True at the padding (nn.MultiheadAttention's key_padding_mask convention); the package's "
        "masks are True where a token may be attended to, so True marks the real tokens",
        invert=True,
        section=MASKING["Two conventions: ours and `nn.MultiheadAttention`'s"],
    ),
    _padding_mistake(
        "missing_query_axis",
        "returned (batch, seq) without the axis of size 1",
        "the mask has shape (batch, seq); the package's is (batch, 1, seq), whose axis of size 1 broadcasts "
        "over the queries (a (batch, seq) mask would broadcast its batch axis against the queries)",
        layout="none",
    ),
    _padding_mistake(
        "hides_queries",
        "put the axis of size 1 last, (batch, seq, 1)",
        "the mask has shape (batch, seq, 1): it hides the padding's queries (rows) instead of its keys "
        "(columns), so real tokens still read the padding",
        layout="queries",
    ),
    _padding_mistake(
        "head_axis_added",
        "returned (batch, 1, 1, seq)",
        "the mask has shape (batch, 1, 1, seq); the package's masks are (batch, 1, seq), and multi-head "
        "attention inserts the heads axis itself",
        layout="heads",
    ),
    *_shared_mistakes(_padding_mistake, MASKING["The padding mask"]),
)


def _causal_cases() -> list[Case]:
    return [Case(f"size {n}", lambda n=n: ((n,), {})) for n in (1, 2, 5)]


def _causal_variant(
    diagonal: int = 0,
    upper: bool = False,
    additive: bool = False,
    dtype: torch.dtype = torch.bool,
) -> Callable[..., Tensor]:
    def mask(size: int, device: Any = None) -> Tensor:
        ones = torch.ones(size, size, dtype=torch.bool)
        allowed = ones.triu(diagonal) if upper else ones.tril(diagonal)
        if additive:  # 0 where allowed, −∞ where hidden, as nn.Transformer's
            return torch.zeros(size, size).masked_fill(~allowed, float("-inf"))[None]
        return allowed[None].to(dtype)

    return mask


_causal_mistake = mistake_maker(_causal_variant)

_CAUSAL_MISTAKES = (
    _causal_mistake(
        "transposed",
        "used triu where the mask needs tril",
        "the mask is True on and above the diagonal, so each query sees the future and not the past",
        upper=True,
    ),
    _causal_mistake(
        "diagonal_hidden",
        "used tril(diagonal=-1)",
        "the diagonal is hidden: each position may also attend to itself, and position 0 would have "
        "nothing to read at all",
        diagonal=-1,
        errata=(17,),
    ),
    _causal_mistake(
        "blocked_convention",
        "marked the future with True (triu(diagonal=1))",
        "the mask is True where attention is blocked (above the diagonal), the convention of nn.Transformer's "
        "boolean masks; the package's masks are True where a query may attend",
        diagonal=1,
        upper=True,
        section=MASKING["Two conventions: ours and `nn.MultiheadAttention`'s"],
    ),
    _causal_mistake(
        "additive_float_mask",
        "returned a float mask of 0 and −inf",
        "the mask is a float tensor of 0 and −∞ to be added to the scores (what "
        "nn.Transformer.generate_square_subsequent_mask returns); the package's masks are boolean, True = may attend",
        additive=True,
        section=MASKING["Two conventions: ours and `nn.MultiheadAttention`'s"],
    ),
    _causal_mistake(
        "one_future_token_visible",
        "used tril(diagonal=1)",
        "each position may also see the next one (tril with diagonal=1)",
        diagonal=1,
    ),
    _causal_mistake(
        "not_boolean",
        "returned a float or integer mask (uint8 included)",
        "the mask holds 1 and 0 as numbers; the package's masks are boolean (True = may attend)",
        *({"dtype": dtype} for dtype in _NUMBERS),
    ),
)


def _target_cases() -> list[Case]:
    return [
        Case(
            "tokens (2, 5), padding at the ends",
            _tokens([[5, 3, 7, 0, 0], [4, 6, 8, 9, 0]]),
        ),
        Case("a row that is all padding", _tokens([[3, 2, 0], [0, 0, 0]])),
        Case(
            "left padding: the padding comes first",
            _tokens([[0, 0, 5, 3], [0, 4, 6, 8]]),
        ),
        Case("batch 1, length 1", _tokens([[7]])),
        Case(
            "pad_id=1, where 0 is a real token",
            _tokens([[0, 4, 1, 1], [5, 0, 2, 1]], pad_id=1),
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


_target_mistake = mistake_maker(_target_variant)

_TARGET_MISTAKES = (
    _target_mistake(
        "causal_only",
        "returned the causal mask alone",
        "the mask hides the future but not the padding: each query also reads the padding "
        "keys before it",
        padding="none",
    ),
    _target_mistake(
        "padding_only",
        "returned the padding mask alone, broadcast to (batch, seq, seq)",
        "the mask hides the padding but not the future: each query also reads the tokens after it",
        causal=False,
    ),
    _target_mistake(
        "padding_on_queries",
        "put the padding on the query axis, (batch, seq, 1)",
        "the padding hides the rows of the padding's queries instead of the columns of its keys, so "
        "a real token still reads the padding; padding_mask's (batch, 1, seq) hides keys",
        padding="queries",
        section=MASKING["The padding mask"],
    ),
    _target_mistake(
        "padding_queries_hidden_too",
        "hid the padding on both axes, queries and keys",
        "the padding's query rows are hidden as well as its keys: a padding query then has no key "
        "to read at all; only the keys need hiding, what a padding query computes is never used",
        padding="both",
        section=MASKING["The padding mask"],
    ),
    _target_mistake(
        "combined_with_or",
        "combined the two masks with |",
        "the two masks are combined with | (or): a key is readable when either mask allows it, so "
        "both the future and the padding leak; a key must be allowed by both, &",
        combine="or",
    ),
    _target_mistake(
        "blocked_convention",
        "marked the hidden keys with True",
        "the mask is True where attention is blocked (nn.Transformer's convention); the package's "
        "masks are True where a query may attend",
        {"blocked": True},
        {"blocked": True, "combine": "or"},
        section=MASKING["Two conventions: ours and `nn.MultiheadAttention`'s"],
    ),
    *_shared_mistakes(
        _target_mistake, MASKING["Two conventions: ours and `nn.MultiheadAttention`'s"]
    ),
)


PARTS = (
    Part(
        "padding_mask",
        padding_mask,
        "(tokens (batch, seq), pad_id=0) → (batch, 1, seq), True where a token is real",
        MASKING["The padding mask"],
        _padding_cases,
        run_function(("output",)),
        _PADDING_MISTAKES,
        axes=_MASK_AXES,
    ),
    Part(
        "causal_mask",
        causal_mask,
        "(size) → (1, size, size), True on and below the diagonal",
        MASKING["The causal (subsequent) mask"],
        _causal_cases,
        run_function(("output",)),
        _CAUSAL_MISTAKES,
        axes=_MASK_AXES,
        broadcast_equivalent=True,
    ),
    Part(
        "target_mask",
        target_mask,
        "(tokens (batch, seq), pad_id=0) → (batch, seq, seq), True where query i may read key j: "
        "j ≤ i and token j is real",
        MASKING["Both at once: the decoder's mask"],
        _target_cases,
        run_function(("output",)),
        _TARGET_MISTAKES,
        axes=_MASK_AXES,
    ),
)
