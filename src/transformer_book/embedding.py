"""Chapter 1: token ids become vectors.

An embedding is a lookup table with one learned row per token id. The paper
multiplies the row by sqrt(d_model) and does not say why. One reading is that the
factor brings the rows to the scale of the positional encoding added next (whose
entries lie in [-1, 1]); chapter 1 measures how far that holds, and at the base
model's size it does not.
"""

from __future__ import annotations

import math

from torch import Tensor, nn

from .checks import check_embedding, check_tokens


class TokenEmbedding(nn.Module):
    """Look up a ``d_model``-wide vector per token id and scale it by ``sqrt(d_model)``.

    ``vocab_size`` ids; ``padding_idx``, if given, names an id whose row stays zero.
    Shapes: ``tokens (batch, seq)`` integer → ``(batch, seq, d_model)`` float.
    """

    def __init__(
        self, vocab_size: int, d_model: int, padding_idx: int | None = None
    ) -> None:
        super().__init__()
        check_embedding(vocab_size, d_model, padding_idx)
        self.vocab_size, self.d_model = vocab_size, d_model
        self.lookup = nn.Embedding(vocab_size, d_model, padding_idx=padding_idx)

    @property
    def weight(self) -> Tensor:
        """The table ``(vocab_size, d_model)``, before scaling."""
        return self.lookup.weight

    def forward(self, tokens: Tensor) -> Tensor:
        check_tokens(tokens, "tokens", self.vocab_size, device=self.weight.device)
        return self.lookup(tokens) * math.sqrt(self.d_model)
