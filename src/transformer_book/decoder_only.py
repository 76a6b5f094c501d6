"""Chapter 11.7: a decoder-only model, built from the package's parts.

It reads the source and the target as one sequence under a causal mask: a stack of
:class:`~transformer_book.encoder.EncoderLayer` (self-attention and a feed-forward
network each), no encoder, no cross-attention. It takes the encoder–decoder's call
(``forward(src, tgt)``, ``encode``, ``decode``), so ``fit``, ``greedy_decode`` and
``beam_search`` run it as they are, with its own KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .attention import KVCache
from .checks import (
    check_cache_layers,
    check_cache_room,
    check_positive,
    check_tokens,
    require_instance,
)
from .embedding import TokenEmbedding
from .encoder import EncoderLayer
from .layers import sublayer_connection
from .masking import padding_mask, target_mask
from .model import ModelConfig
from .positional import PositionalEncoding


@dataclass(eq=False)
class DecoderOnlyCache:
    """:class:`DecoderOnly`'s KV cache: one self-attention
    :class:`~transformer_book.attention.KVCache` per layer, of ``capacity`` =
    source length + target positions; ``position``, a 0-d integer tensor,
    counts the positions written; ``visible (batch, 1, capacity)`` is False on
    every slot that holds padding, as the whole sequence's mask hides it. The
    source is written with the first step (``filled`` says whether it has been:
    a fact of the host, so no step asks the device)."""

    layers: list[KVCache]
    position: Tensor
    visible: Tensor
    filled: bool = False

    @property
    def capacity(self) -> int:
        """How many positions fit, the source's included."""
        return self.visible.shape[-1]

    def step_mask(self, tokens: Tensor, pad_id: int) -> Tensor:
        """Mark the slots of this step's ``tokens (batch, new)``, from ``position``
        on, visible where :func:`~transformer_book.masking.padding_mask` shows
        them, as the whole sequence's mask does (a model may pick the padding id
        as a word); then return the step's mask ``(batch, new, capacity)``: each
        new position sees the slots up to its own, the padding excepted."""
        queries = self.position + torch.arange(tokens.shape[1], device=tokens.device)
        self.visible.index_copy_(2, queries, padding_mask(tokens, pad_id))
        slots = torch.arange(self.capacity, device=tokens.device)
        return (slots <= queries[:, None])[None] & self.visible

    def reorder(self, index: Tensor) -> None:
        """Keep the batch rows ``index`` (beam search)."""
        for kv in self.layers:
            kv.reorder(index)
        self.visible = self.visible.index_select(0, index)


class DecoderOnlyLayers(nn.Module):
    """:class:`DecoderOnly`'s stack of encoder layers under a causal mask
    (self-attention and a feed-forward network each), and its KV cache."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.pad_id, self.max_len = c.pad_id, c.max_len
        self.layers = nn.ModuleList(
            EncoderLayer(c.d_model, c.num_heads, c.d_ff, c.dropout, c.norm_first)
            for _ in range(c.num_layers)
        )

    def new_cache(self, memory: Tensor, capacity: int) -> DecoderOnlyCache:
        """A cache for the source ``memory (batch, S)`` (token ids) and up to
        ``capacity`` target positions (the decoding loops' call)."""
        check_tokens(memory, "memory")
        check_positive(capacity, "capacity")
        batch, length = memory.shape
        if length + capacity > self.max_len:  # the positional table's length
            raise ValueError(
                f"memory {tuple(memory.shape)} and capacity={capacity}: "
                f"{length + capacity} positions, beyond max_len={self.max_len}"
            )
        attention = self.layers[0].self_attn
        like = attention.q_proj.weight  # the buffers' device and dtype
        shape = (batch, attention.num_heads, length + capacity, attention.d_head)
        position = torch.zeros((), dtype=torch.long, device=memory.device)
        layers = [KVCache.allocate(shape, like, position) for _ in self.layers]
        # Each step marks its own slots (the first, the source's too): step_mask.
        visible = torch.ones(
            batch, 1, length + capacity, dtype=torch.bool, device=memory.device
        )
        return DecoderOnlyCache(layers, position, visible)

    def forward(
        self, x: Tensor, mask: Tensor, cache: DecoderOnlyCache | None = None
    ) -> Tensor:
        """``x (batch, new, d_model)`` → the same shape. With ``cache``, the
        keys and values of ``x`` are written from ``cache.position`` on, and
        each layer's self-attention reads every slot written."""
        for index, layer in enumerate(self.layers):
            if cache is None:
                x = layer(x, mask)
                continue
            kv = cache.layers[index]  # EncoderLayer, cached
            attend = lambda h: layer.self_attn(h, h, h, mask, cache=kv)[0]  # noqa: B023,E731
            x = sublayer_connection(
                x, attend, layer.norm1, layer.drop1, layer.norm_first
            )
            x = sublayer_connection(
                x, layer.feed_forward, layer.norm2, layer.drop2, layer.norm_first
            )
        return x


class DecoderOnly(nn.Module):
    """Encoder layers under a causal mask: no encoder, no cross-attention.
    ``src (batch, S)`` and ``tgt (batch, T)`` are read as one sequence →
    logits of ``tgt``'s positions ``(batch, T, tgt_vocab_size)``: the
    encoder–decoder's call, so the decoding loops run it as they are."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        require_instance(config, "config", ModelConfig)
        c = self.config = config
        # It reads both languages (src_vocab_size) and writes German only.
        self.embed = TokenEmbedding(c.src_vocab_size, c.d_model, c.pad_id)
        self.positional = PositionalEncoding(c.d_model, c.max_len, c.dropout)
        self.decoder = DecoderOnlyLayers(c)
        self.generator = nn.Linear(c.d_model, c.tgt_vocab_size)

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """No encoder: the "memory" the decoding loops hand back is ``src``."""
        return src

    def decode(
        self, memory: Tensor, tgt: Tensor, *, cache: DecoderOnlyCache | None = None,
        **masks: Tensor | None,
    ) -> Tensor:  # fmt: skip
        """Hidden states of ``tgt``'s positions ``(batch, T, d_model)``; the mask
        is made here (causal, padding hidden). With ``cache``, ``tgt`` holds the
        new positions only, and the first call writes the source too."""
        first = cache is None or not cache.filled  # the source goes in too
        tokens = torch.cat([memory, tgt], dim=1) if first else tgt
        start = memory.shape[1] if first else 0  # where tgt's positions begin
        check_tokens(tokens, "src and tgt", self.config.src_vocab_size)
        if cache is None:
            x = self.positional(self.embed(tokens))
            return self.decoder(x, target_mask(tokens, self.config.pad_id))[:, start:]
        require_instance(cache, "cache", DecoderOnlyCache)
        check_cache_layers(cache, len(self.decoder.layers))
        check_cache_room(cache.position, tokens, cache.capacity, "src and tgt")
        x = self.positional(self.embed(tokens), offset=cache.position)
        mask = cache.step_mask(tokens, self.config.pad_id)
        hidden = self.decoder(x, mask, cache)
        cache.position += tokens.shape[1]  # on the device: the host never reads it
        cache.filled = True
        return hidden[:, start:]

    def forward(self, src: Tensor, tgt: Tensor, *masks: Tensor | None) -> Tensor:
        """Logits ``(batch, T, tgt_vocab_size)``; ``fit``'s masks are not needed."""
        return self.generator(self.decode(self.encode(src), tgt))
