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

from .checks import check_encoding, check_features, check_offset, check_probability


def sinusoidal_positional_encoding(
    max_len: int,
    d_model: int,
    interleaved: bool = True,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The table of positional encodings, ``(max_len, d_model)``.

    ``interleaved=True`` is the paper's layout: sine in even columns, cosine in odd
    ones. ``interleaved=False`` puts all sines first, then all cosines (tensor2tensor's
    layout, with the paper's frequencies): the same numbers, columns in another order.
    """
    check_encoding(max_len, d_model)
    # In float64, cast once at the end: the table is as exact as the dtype allows.
    position = torch.arange(max_len, dtype=torch.float64)[:, None]  # (max_len, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (d_model/2,)
    frequency = torch.exp(-math.log(10000.0) * two_i / d_model)  # 10000^(-2i/d)
    angle = position * frequency  # (max_len, d_model/2)
    if interleaved:  # sin, cos, sin, cos, ...
        table = torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(1)
    else:  # sin ... sin, cos ... cos
        table = torch.cat([angle.sin(), angle.cos()], dim=-1)
    return table.to(dtype)


class PositionalEncoding(nn.Module):
    """Add the sinusoidal table to a batch of embeddings, then apply dropout.

    Shapes: ``x (batch, seq, d_model)`` → same shape. ``offset`` shifts the
    positions, so a decoder that feeds one new token at a time (the KV cache of
    chapter 9) gives it the position it really has; it may be a 0-d tensor on the
    device (the cache's position), which the host never reads.
    """

    def __init__(
        self,
        d_model: int,
        max_len: int = 5000,
        dropout: float = 0.1,
        interleaved: bool = True,
    ) -> None:
        super().__init__()
        check_probability(dropout, "dropout")
        self.d_model = d_model
        self.max_len = max_len
        self.drop = nn.Dropout(dropout)
        # A buffer: it moves with .to(device) but is not a parameter and is not saved.
        self.register_buffer(
            "pe",
            sinusoidal_positional_encoding(max_len, d_model, interleaved),
            persistent=False,
        )

    def forward(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        check_features(x, "x", self.d_model)
        check_offset(offset, x, self.max_len)
        positions = offset + torch.arange(x.shape[1], device=x.device)
        return self.drop(x + self.pe[positions].to(x.dtype))
