"""Graded parts: sinusoidal_positional_encoding."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ...positional import sinusoidal_positional_encoding
from .engine import Case, Part, _signature_of, run_function
from .results import mistake_maker
from .sections import POSITIONAL


def _pe_cases() -> list[Case]:
    def make(*args: Any, **kwargs: Any) -> Callable[[], tuple]:
        return lambda: (args, kwargs)

    return [
        Case("max_len 1, d_model 2", make(1, 2)),
        Case("max_len 6, d_model 4", make(6, 4)),
        Case("max_len 50, d_model 16", make(50, 16)),
        Case("max_len 9, d_model 10 (five pairs)", make(9, 10)),
        Case(
            "interleaved=False, max_len 5, d_model 8",
            make(5, 8, interleaved=False),
            needs=("interleaved",),
        ),
        Case(
            "dtype=torch.float64, max_len 12, d_model 8",
            make(12, 8, dtype=torch.float64),
            needs=("dtype",),
        ),
    ]


def _pe_variant(
    *,
    first_position: int = 0,
    cos_first: bool = False,
    layout: str = "asked",
    index: str = "pair",
    exponent: Callable[[Tensor, int], Tensor] = lambda i, d: 2 * i / d,
    sign: float = -1.0,
    sine_only: bool = False,
) -> Callable[..., Tensor]:
    """A positional encoding with one thing changed: where positions start, which of sine and cosine
    comes first, the layout ("asked" by ``interleaved``, else always "concatenated" or
    "interleaved"), what the exponent's ``i`` counts, the exponent, or cosines left out."""

    @_signature_of(sinusoidal_positional_encoding)
    def encoding(max_len: int, d_model: int, interleaved: bool, dtype: torch.dtype):
        position = torch.arange(
            first_position, first_position + max_len, dtype=torch.float64
        )[:, None]
        column = torch.arange(d_model)
        half = d_model // 2
        concatenated = layout == "concatenated" or (
            layout == "asked" and not interleaved
        )
        pair = column % half if concatenated else column // 2
        is_sine = column < half if concatenated else column % 2 == 0
        i = pair if index == "pair" else column
        angle = position * 10000.0 ** (sign * exponent(i.double(), d_model))
        table = torch.where(is_sine != cos_first, angle.sin(), angle.cos())
        return (angle.sin() if sine_only else table).to(dtype)

    return encoding


_mistake = mistake_maker(_pe_variant)

_PE_MISTAKES = (
    _mistake(
        "sine_cosine_swapped",
        "put cos in the even columns and sin in the odd ones",
        "the even columns hold cosines and the odd columns sines; the paper puts the sine in column 2i",
        cos_first=True,
    ),
    _mistake(
        "positions_from_one",
        "counted positions from 1",
        "positions are counted from 1, so each row holds what the package's table has one row further down. "
        "The package counts from 0, as tensor2tensor and the Annotated Transformer do (its row 0 is sin 0 = 0, "
        "cos 0 = 1); either convention works on its own, but mixing the two shifts every position by one",
        first_position=1,
        section=POSITIONAL["2.3 Worked examples: a single entry and a whole row"],
        errata=(1, 22),
    ),
    _mistake(
        "halves_concatenated",
        "put all the sines first and the cosines after them",
        "all sines come first and all cosines after them (tensor2tensor's column order): the same numbers, "
        "but the package and the paper interleave them, sine in column 2i and cosine in column 2i + 1",
        layout="concatenated",
        section=POSITIONAL[
            "2.6 Interleaved or concatenated: the same table, columns reordered"
        ],
    ),
    _mistake(
        "exponent_uses_column",
        "used the column j as the i of 10000^(2i/d_model)",
        "the i of 10000^(2i/d_model) is taken to be the column; it numbers the sine/cosine pair, so "
        "columns 2i and 2i + 1 share one frequency",
        index="column",
        section=POSITIONAL["2.3 Worked examples: a single entry and a whole row"],
        errata=(23,),
    ),
    _mistake(
        "columns_counted_from_one",
        "counted the columns from 1 in the entry formula",
        "the entry formula is read with columns counted from 1: column 0 is a cosine, and each sine is paired "
        "with the cosine of the next frequency; the paper's columns 2i and 2i + 1 count from 0",
        # Entry (p, j), j counted from 1: sin(p / 10000^(j/d)) for even j, cos(p / 10000^((j-1)/d))
        # for odd j; whatever interleaved asks.
        layout="interleaved",
        cos_first=True,
        index="column",
        exponent=lambda c, d: (c + c % 2) / d,
        errata=(64,),
    ),
    _mistake(
        "exponent_without_two",
        "wrote 10000^(i/d_model)",
        "the exponent is i/d_model instead of 2i/d_model, so the wavelengths grow only to about "
        "10000^(1/2) instead of reaching 10000 · 2π",
        exponent=lambda i, d: i / d,
    ),
    _mistake(
        "frequency_inverted",
        "multiplied the positions by 10000^(2i/d_model)",
        "positions are multiplied by 10000^(2i/d_model) instead of divided by it, so the later pairs "
        "turn faster instead of slower",
        sign=1.0,
    ),
    _mistake(
        "sine_only",
        "filled every column with a sine",
        "every column holds a sine, so each odd column repeats the even column before it and row 0 is all zeros",
        sine_only=True,
        section=POSITIONAL[
            "2.4 The picture, and a bug in the tutorial's plotting code"
        ],
        errata=(24,),
    ),
)


PARTS = (
    Part(
        "sinusoidal_positional_encoding",
        sinusoidal_positional_encoding,
        "(max_len, d_model) → the table (max_len, d_model)",
        POSITIONAL["2.2 The formula"],
        _pe_cases,
        run_function(("output",)),
        _PE_MISTAKES,
        axes={"output": ("position", "column")},
        tolerance={torch.float32: (1e-4, 3e-5)},
    ),
)
