"""Chapter 7: the decoder, which attends to its own past and to the encoder's output."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch.nn.functional as F
from torch import Tensor, nn

from ._checks import check_features, check_positive
from .attention import KVCache, MultiHeadAttention, one_query_attention
from .kernels import Dropout, frozen_block
from .layers import FeedForward, final_norm, sublayer_connection


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One decoder layer's work in a decoding step, bound once per
    :func:`~transformer_book.kernels.frozen_weights` block (see :meth:`DecoderLayer.step`):
    each product a function of its input, on the kernel the layer's forward would use."""

    block: int  # the frozen_weights() block it was made in, and is valid for
    self_qkv: Callable[[Tensor], Tensor]  # packed q/k/v projection: (..., d_model) → (..., 3 * d_model)
    self_out: Callable[[Tensor], Tensor]
    cross_q: Callable[[Tensor], Tensor]
    cross_out: Callable[[Tensor], Tensor]
    ff_in: Callable[[Tensor], Tensor]
    ff_out: Callable[[Tensor], Tensor]
    norms: tuple[Callable[[Tensor], Tensor], ...]  # norm1, norm2, norm3


@dataclass
class LayerCache:
    """What one decoder layer remembers between decoding steps (chapter 9's KV cache), and the
    plan of its fast step (appendix C)."""

    self_attn: KVCache = field(default_factory=KVCache)
    cross_attn: KVCache = field(default_factory=lambda: KVCache(static=True))
    step_plan: StepPlan | None = field(default=None, repr=False)


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention over the encoder's memory, then feed-forward.

    Shapes: ``x (batch, tgt_len, d_model)``, ``memory (batch, src_len, d_model)``,
    ``tgt_mask`` broadcastable to ``(batch, tgt_len, tgt_len)``, ``src_mask`` to
    ``(batch, tgt_len, src_len)`` (usually ``(batch, 1, src_len)``) → ``(batch, tgt_len, d_model)``.
    Equal to ``nn.TransformerDecoderLayer(..., batch_first=True)`` with the same weights.
    """

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1, norm_first: bool = False) -> None:
        super().__init__()
        self.d_model = d_model
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, num_heads, dropout)
        self.cross_attn = MultiHeadAttention(d_model, num_heads, dropout)
        self.feed_forward = FeedForward(d_model, d_ff, dropout)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.norm3 = nn.LayerNorm(d_model)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.dropout3 = Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        *,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> Tensor:
        """Masks by keyword only: ``nn.TransformerDecoderLayer`` takes them in the other order
        (``tgt_mask`` first), and two masks of the same shape would swap silently."""
        check_features(x, "x", self.d_model)
        check_features(memory, "memory", self.d_model)
        self_cache = cache.self_attn if cache is not None else None
        cross_cache = cache.cross_attn if cache is not None else None

        def self_attention(h: Tensor) -> Tensor:
            return self.self_attn(h, h, h, tgt_mask, cache=self_cache)[0]

        def cross_attention(h: Tensor) -> Tensor:  # queries from the decoder, keys and values from the encoder
            return self.cross_attn(h, memory, memory, src_mask, cache=cross_cache)[0]

        x = sublayer_connection(x, self_attention, self.norm1, self.dropout1, self.norm_first)
        x = sublayer_connection(x, cross_attention, self.norm2, self.dropout2, self.norm_first)
        return sublayer_connection(x, self.feed_forward, self.norm3, self.dropout3, self.norm_first)

    def step(self, x: Tensor, *, src_mask: Tensor | None, cache: LayerCache) -> Tensor:
        """One decoding step, ``x (batch, 1, d_model)`` → ``(batch, 1, d_model)``: what ``forward``
        computes for one new position with a ``cache`` that an earlier step has filled, in eval
        mode, inside a :func:`~transformer_book.kernels.frozen_weights` block.

        The same kernels on the same numbers, called from a plan made once per block (the
        layer's products bound to their packed weights, its norms to their parameters), without
        the checks, submodule calls and branches of ``forward``: a decoding loop runs this once
        per layer per token, and with a few rows per product that Python work is a large share
        of a step.
        ``src_mask`` is ``None`` or broadcastable to ``(batch, 1, 1, src_len)`` (head axis included).
        """
        plan = cache.step_plan
        if plan is None or plan.block != frozen_block():
            plan = cache.step_plan = self._step_plan(x.numel())
        batch, heads, d_head = x.shape[0], self.self_attn.num_heads, self.self_attn.d_head

        def split(t: Tensor) -> Tensor:  # split_heads for one position: (batch, 1, d) → (batch, heads, 1, d_head)
            return t.view(batch, heads, 1, d_head)

        def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:  # heads merged
            return one_query_attention(split(q), k, v, mask)

        def self_attention(h: Tensor) -> Tensor:
            q, k, v = plan.self_qkv(h).chunk(3, dim=-1)
            k, v = cache.self_attn.append(split(k), split(v))
            return plan.self_out(attend(q, k, v, None))

        def cross_attention(h: Tensor) -> Tensor:
            return plan.cross_out(attend(plan.cross_q(h), cache.cross_attn.key, cache.cross_attn.value, src_mask))

        def feed_forward(h: Tensor) -> Tensor:
            return plan.ff_out(plan.ff_in(h).relu())

        x = sublayer_connection(x, self_attention, plan.norms[0], _identity, self.norm_first)
        x = sublayer_connection(x, cross_attention, plan.norms[1], _identity, self.norm_first)
        return sublayer_connection(x, feed_forward, plan.norms[2], _identity, self.norm_first)

    def _step_plan(self, numel: int) -> StepPlan:
        """Bind this layer's products and norms for steps whose input has ``numel`` elements."""
        self_attn, cross_attn, ff = self.self_attn, self.cross_attn, self.feed_forward
        rows = numel // self.d_model
        norms = tuple(
            partial(F.layer_norm, normalized_shape=n.normalized_shape, weight=n.weight, bias=n.bias, eps=n.eps)
            for n in (self.norm1, self.norm2, self.norm3)
        )
        return StepPlan(
            block=frozen_block(),
            self_qkv=self_attn.bind_packed("qkv", numel),
            self_out=self_attn.out_proj.bind(numel),
            cross_q=cross_attn.q_proj.bind(numel),
            cross_out=cross_attn.out_proj.bind(numel),
            ff_in=ff.linear1.bind(numel),
            ff_out=ff.linear2.bind(rows * ff.linear2.in_features),
            norms=norms,
        )


def _identity(x: Tensor) -> Tensor:  # dropout in eval mode
    return x


class Decoder(nn.Module):
    """``num_layers`` copies of ``layer``, then ``norm`` (LayerNorm for pre-norm, Identity for post-norm)."""

    def __init__(self, layer: DecoderLayer, num_layers: int) -> None:
        super().__init__()
        check_positive(num_layers, "num_layers")
        self.layers = nn.ModuleList(copy.deepcopy(layer) for _ in range(num_layers))
        self.norm = final_norm(layer.d_model, layer.norm_first)

    def new_cache(self) -> list[LayerCache]:
        """An empty KV cache, one entry per layer."""
        return [LayerCache() for _ in self.layers]

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        *,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        cache: list[LayerCache] | None = None,
    ) -> Tensor:
        """``x (batch, tgt_len, d_model)``, ``memory (batch, src_len, d_model)`` → ``(batch, tgt_len, d_model)``.

        Masks by keyword only (see :class:`DecoderLayer`).

        With ``cache``, ``x`` holds only the new positions; keys and values of the
        earlier ones are read from the cache and the new ones appended to it.
        """
        if cache is not None and len(cache) != len(self.layers):
            raise ValueError(f"cache has {len(cache)} entries but the decoder has {len(self.layers)} layers")
        for index, layer in enumerate(self.layers):
            layer_cache = cache[index] if cache is not None else None
            x = layer(x, memory, src_mask=src_mask, tgt_mask=tgt_mask, cache=layer_cache)
        return self.norm(x)

    def step(self, x: Tensor, *, src_mask: Tensor | None, cache: list[LayerCache]) -> Tensor:
        """One decoding step through every layer (see :meth:`DecoderLayer.step`):
        ``x (batch, 1, d_model)`` → ``(batch, 1, d_model)``."""
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            x = layer.step(x, src_mask=src_mask, cache=layer_cache)
        return self.norm(x)
