"""Chapter 2: positional encoding.

Attention by itself ignores order, so each position gets a fixed vector of
sines and cosines that is added to the token's embedding. With one frequency
per pair of columns, omega_i = 10000 ** (-2i / d_model), position p gets

    column 2i:     sin(p * omega_i)
    column 2i + 1: cos(p * omega_i)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .checks import check_features, check_positive, check_probability


def sinusoidal_positional_encoding(
    max_len: int,
    d_model: int,
    interleaved: bool = True,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The table of positional encodings, ``(max_len, d_model)``.

    ``interleaved=True`` is the paper's layout: sine in even columns, cosine in odd
    ones. ``interleaved=False`` is tensor2tensor's column layout (all sines in the first
    half, all cosines in the second) with the paper's frequencies: the same numbers in a
    different column order. (tensor2tensor also spaces its frequencies slightly differently.)
    """
    check_positive(max_len, "max_len")
    check_positive(d_model, "d_model")
    if d_model % 2:
        raise ValueError(f"d_model must be even (a sine and a cosine per frequency), got {d_model}")
    # Computed in float64 and cast once, so the table is as exact as the dtype allows.
    position = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)  # (max_len, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (d_model/2,)
    frequency = torch.exp(-math.log(10000.0) * two_i / d_model)  # 1 / 10000^(2i/d_model)
    angle = position * frequency  # (max_len, d_model/2)
    if interleaved:
        table = torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(1)  # sin, cos, sin, cos, ...
    else:
        table = torch.cat([angle.sin(), angle.cos()], dim=-1)  # sin ... sin, cos ... cos
    return table.to(dtype)


class PositionalEncoding(nn.Module):
    """Add the sinusoidal table to a batch of embeddings, then apply dropout.

    Shapes: ``x (batch, seq, d_model)`` → same shape. ``offset`` shifts the
    positions, so a decoder that feeds one new token at a time (the KV cache of
    chapter 9) gives it the position it really has.
    """

    def __init__(self, d_model: int, max_len: int = 5000, dropout: float = 0.1, interleaved: bool = True) -> None:
        super().__init__()
        check_probability(dropout, "dropout")
        self.d_model = d_model
        self.max_len = max_len
        self.dropout = nn.Dropout(dropout)
        # A buffer: it moves with .to(device) but is not a parameter and is not saved.
        self.register_buffer("pe", sinusoidal_positional_encoding(max_len, d_model, interleaved), persistent=False)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        check_features(x, "x", self.d_model)
        end = offset + x.shape[1]
        if offset < 0 or end > self.max_len:
            raise ValueError(
                f"positions {offset}..{end - 1} of x with shape ({', '.join(map(str, x.shape))}) "
                f"exceed max_len={self.max_len}"
            )
        return self.dropout(x + self.pe[offset:end].to(x.dtype))
