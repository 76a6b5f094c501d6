"""Chapter 1: token ids become vectors.

An embedding is a lookup table with one learned row per token id. The paper
multiplies the row by sqrt(d_model) so that its scale matches the positional
encoding added next (whose entries lie in [-1, 1]).
"""

from __future__ import annotations

import math

from torch import Tensor, nn

from .checks import check_positive, check_tokens


class TokenEmbedding(nn.Module):
    """Look up ``d_model``-wide vectors for token ids and scale them by ``sqrt(d_model)``.

    Args:
        vocab_size: number of token ids, ``V``.
        d_model: width of each vector.
        padding_idx: optional id whose row is kept at zero and gets no gradient.

    Shapes: ``tokens (batch, seq)`` integer → ``(batch, seq, d_model)`` float.
    """

    def __init__(self, vocab_size: int, d_model: int, padding_idx: int | None = None) -> None:
        super().__init__()
        check_positive(vocab_size, "vocab_size")
        check_positive(d_model, "d_model")
        if padding_idx is not None and not 0 <= padding_idx < vocab_size:
            raise ValueError(f"padding_idx must be in [0, {vocab_size}), got {padding_idx}")
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.lookup = nn.Embedding(vocab_size, d_model, padding_idx=padding_idx)

    @property
    def weight(self) -> Tensor:
        """The table ``(vocab_size, d_model)``; row ``i`` is token ``i``'s vector before scaling."""
        return self.lookup.weight

    def forward(self, tokens: Tensor, *, name: str = "tokens") -> Tensor:
        """``name``: what an error message calls ``tokens`` (the caller's argument)."""
        check_tokens(tokens, name, self.vocab_size)
        return self.lookup(tokens) * math.sqrt(self.d_model)
