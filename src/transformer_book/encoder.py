"""Chapter 6: the encoder, a stack of identical layers of self-attention and feed-forward."""

from __future__ import annotations

import copy

from torch import Tensor, nn

from .attention import MultiHeadAttention
from .checks import check_features, check_positive
from .layers import FeedForward, final_norm, sublayer_connection


class EncoderLayer(nn.Module):
    """Self-attention, then a feed-forward network, each in a residual + LayerNorm.

    ``x (batch, seq, d_model)``, ``mask`` broadcastable to ``(batch, seq, seq)`` →
    ``(batch, seq, d_model)``: ``nn.TransformerEncoderLayer``'s, with the same weights.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        dropout: float = 0.1,
        norm_first: bool = False,
    ) -> None:
        super().__init__()
        self.d_model, self.norm_first = d_model, norm_first
        self.self_attn = MultiHeadAttention(d_model, num_heads, dropout)
        self.feed_forward = FeedForward(d_model, d_ff, dropout)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.drop1, self.drop2 = nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        check_features(x, "x", self.d_model)
        attend = lambda h: self.self_attn(h, h, h, mask)[0]  # noqa: E731
        pre = self.norm_first  # pre-norm, or the paper's post-norm
        x = sublayer_connection(x, attend, self.norm1, self.drop1, pre)
        return sublayer_connection(x, self.feed_forward, self.norm2, self.drop2, pre)


class Encoder(nn.Module):
    """``num_layers`` copies of ``layer`` (each with its own weights), then ``norm``.

    ``norm`` is a final LayerNorm for pre-norm layers and ``nn.Identity`` for post-norm.
    Shapes: ``x (batch, seq, d_model)`` → memory ``(batch, seq, d_model)``.
    """

    def __init__(self, layer: EncoderLayer, num_layers: int) -> None:
        super().__init__()
        check_positive(num_layers, "num_layers")
        self.layers = nn.ModuleList(copy.deepcopy(layer) for _ in range(num_layers))
        self.norm = final_norm(layer.d_model, layer.norm_first)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x)
