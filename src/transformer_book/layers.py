"""Chapter 6 (part): the pieces every layer is made of.

A layer is two or three *sublayers* (attention, feed-forward), each wrapped in a
residual connection and a LayerNorm. The paper normalises after adding
(post-norm); most later models normalise the sublayer's input (pre-norm).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from .checks import check_positive, check_probability


class FeedForward(nn.Module):
    """Position-wise feed-forward network: ``linear2(drop(relu(linear1(x))))``.

    The same two matrices are applied to every position independently.
    Shapes: ``(batch, seq, d_model)`` → ``(batch, seq, d_model)`` via ``d_ff`` hidden units.
    """

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.1) -> None:
        super().__init__()
        check_positive(d_model, "d_model")
        check_positive(d_ff, "d_ff")
        check_probability(dropout, "dropout")
        self.linear1 = nn.Linear(d_model, d_ff)
        self.linear2 = nn.Linear(d_ff, d_model)
        self.drop = nn.Dropout(dropout)  # a module; `dropout` is its rate

    def forward(self, x: Tensor) -> Tensor:
        return self.linear2(self.drop(self.linear1(x).relu()))


def sublayer_connection(
    x: Tensor,
    sublayer: Callable[[Tensor], Tensor],
    norm: Callable[[Tensor], Tensor],
    drop: Callable[[Tensor], Tensor],
    norm_first: bool,
) -> Tensor:
    """Residual + LayerNorm around one sublayer, both ways.

    post-norm (the paper): ``norm(x + drop(sublayer(x)))``
    pre-norm:              ``x + drop(sublayer(norm(x)))``

    ``drop`` is a dropout module (``nn.Dropout``); ``dropout`` always names a rate.
    """
    if norm_first:
        return x + drop(sublayer(norm(x)))
    return norm(x + drop(sublayer(x)))


def final_norm(d_model: int, norm_first: bool) -> nn.Module:
    """A stack of pre-norm layers ends with one more LayerNorm; a post-norm stack is already normalised."""
    return nn.LayerNorm(d_model) if norm_first else nn.Identity()
