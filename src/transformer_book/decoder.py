"""Chapter 7: the decoder, which attends to its own past and to the encoder's output."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .attention import KVCache, MultiHeadAttention
from .checks import check_features, check_positive
from .layers import FeedForward, final_norm, sublayer_connection


@dataclass(eq=False)
class LayerCache:
    """What one decoder layer remembers between decoding steps (chapter 9's KV cache): the
    keys and values of its self-attention, and those of its cross-attention over the memory."""

    self_attn: KVCache
    cross_attn: KVCache


@dataclass(eq=False)
class DecoderCache:
    """A decoder's KV cache: one :class:`LayerCache` per layer, and ``position``, a 0-d
    integer tensor on the model's device that counts the positions written so far (the
    same tensor as each layer's ``self_attn.position``).

    Made by :meth:`Decoder.new_cache`; :meth:`~transformer_book.model.Transformer.decode`
    writes each step's positions and moves ``position`` on, on the device.
    """

    layers: list[LayerCache]
    position: Tensor

    @property
    def capacity(self) -> int:
        """How many target positions fit (each layer's self-attention buffer length)."""
        return self.layers[0].self_attn.capacity

    def slot_mask(self, new: int) -> Tensor:
        """``(1, new, capacity)``: the ``new`` positions from ``position`` on may see every
        slot up to their own, and no slot not written yet."""
        slots = torch.arange(self.capacity, device=self.position.device)
        queries = self.position + torch.arange(new, device=self.position.device)
        return (slots <= queries[:, None])[None]

    def reorder(self, index: Tensor) -> None:
        """Keep the batch rows ``index`` of every self-attention cache (beam search). The
        cross-attention caches stay: the beams of one source share its memory."""
        for layer in self.layers:
            layer.self_attn.reorder(index)


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention over the encoder's memory, then feed-forward.

    Shapes: ``x (batch, tgt_len, d_model)``, ``memory (batch, src_len, d_model)``,
    ``tgt_mask`` broadcastable to ``(batch, tgt_len, tgt_len)``, ``src_mask`` to
    ``(batch, tgt_len, src_len)`` (usually ``(batch, 1, src_len)``) → ``(batch, tgt_len, d_model)``.
    Equal to ``nn.TransformerDecoderLayer(..., batch_first=True)`` with the same weights.
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
        self.d_model = d_model
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, num_heads, dropout)
        self.cross_attn = MultiHeadAttention(d_model, num_heads, dropout)
        self.feed_forward = FeedForward(d_model, d_ff, dropout)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.norm3 = nn.LayerNorm(d_model)
        self.drop1 = nn.Dropout(dropout)
        self.drop2 = nn.Dropout(dropout)
        self.drop3 = nn.Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        *,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> Tensor:
        """Masks by keyword only (``nn.TransformerDecoderLayer`` takes ``tgt_mask`` first:
        masks of one shape would swap silently). With ``cache``, ``x`` holds the new
        positions, written into the cache from its ``position`` on."""
        check_features(x, "x", self.d_model)
        check_features(memory, "memory", self.d_model)
        self_cache = cache.self_attn if cache is not None else None
        cross_cache = cache.cross_attn if cache is not None else None

        def self_attention(h: Tensor) -> Tensor:  # the decoder's own past, masked
            return self.self_attn(h, h, h, tgt_mask, cache=self_cache)[0]

        def cross_attention(h: Tensor) -> Tensor:  # keys and values: the encoder's
            return self.cross_attn(h, memory, memory, src_mask, cache=cross_cache)[0]

        pre = self.norm_first  # pre-norm, or the paper's post-norm
        x = sublayer_connection(x, self_attention, self.norm1, self.drop1, pre)
        x = sublayer_connection(x, cross_attention, self.norm2, self.drop2, pre)
        return sublayer_connection(x, self.feed_forward, self.norm3, self.drop3, pre)


class Decoder(nn.Module):
    """``num_layers`` copies of ``layer``, then ``norm`` (LayerNorm for pre-norm, Identity for post-norm)."""

    def __init__(self, layer: DecoderLayer, num_layers: int) -> None:
        super().__init__()
        check_positive(num_layers, "num_layers")
        self.layers = nn.ModuleList(copy.deepcopy(layer) for _ in range(num_layers))
        self.norm = final_norm(layer.d_model, layer.norm_first)

    def new_cache(self, memory: Tensor, capacity: int) -> DecoderCache:
        """A KV cache for decoding up to ``capacity`` target positions against ``memory
        (batch, src_len, d_model)``: empty self-attention buffers, and the memory's keys
        and values for each cross-attention, projected once, here."""
        attention = self.layers[0].self_attn
        check_features(memory, "memory", attention.d_model)
        check_positive(capacity, "capacity")
        shape = (memory.shape[0], attention.num_heads, capacity, attention.d_head)
        # One counter for all layers: decode() moves it on once per step, for them all.
        position = torch.zeros((), dtype=torch.long, device=memory.device)
        layers = [
            LayerCache(
                KVCache.allocate(shape, memory, position),
                KVCache(*layer.cross_attn.keys_values(memory, memory)),
            )
            for layer in self.layers
        ]
        return DecoderCache(layers, position)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        *,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        cache: DecoderCache | None = None,
    ) -> Tensor:
        """``x (batch, tgt_len, d_model)``, ``memory (batch, src_len, d_model)`` → ``(batch, tgt_len, d_model)``.

        Masks by keyword only (see :class:`DecoderLayer`). With ``cache``, ``x`` holds only the
        new positions; they are written into the cache at ``cache.position``, and the keys and
        values of the earlier ones are read from it (``tgt_mask`` defaults to the cache's
        :meth:`~DecoderCache.slot_mask`, which hides the slots not written yet).
        """
        if cache is not None and tgt_mask is None:  # never the slots not written yet
            tgt_mask = cache.slot_mask(x.shape[1])
        for index, layer in enumerate(self.layers):
            layer_cache = cache.layers[index] if cache is not None else None
            x = layer(
                x, memory, src_mask=src_mask, tgt_mask=tgt_mask, cache=layer_cache
            )
        return self.norm(x)
