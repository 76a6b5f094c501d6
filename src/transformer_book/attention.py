"""Chapters 3 and 4: scaled dot-product attention and multi-head attention.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V

Masks are boolean with True = "may attend", the convention of
``torch.nn.functional.scaled_dot_product_attention``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .checks import (
    check_attention,
    check_heads_input,
    check_sizes,
    require_instance,
)


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """softmax(Q K^T / sqrt(d_k)) V, returning the weights too.

    ``query (..., q_len, d_k)``, ``key (..., k_len, d_k)``, ``value (..., k_len, d_v)``,
    ``mask`` boolean (True = may attend), broadcastable to ``(..., q_len, k_len)``
    → ``output (..., q_len, d_v)``, ``weights (..., q_len, k_len)``.
    """
    check_attention(query, key, value, mask, dropout_p)
    d_k = query.shape[-1]
    scores = query @ key.transpose(-1, -2) / math.sqrt(d_k)  # (..., q_len, k_len)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim=-1)
    if mask is not None:
        # A query with no key to look at: softmax over nothing but -inf is 0/0 = NaN.
        # Give it zero weights instead, as PyTorch's fused kernel does.
        weights = weights.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
    weights = F.dropout(weights, dropout_p)
    return weights @ value, weights


class KVCache:
    """One attention's keys and values, kept between decoding steps (chapter 9):
    ``key`` and ``value`` ``(batch, heads, capacity, d_head)``, allocated once.

    A *static* cache, as PyTorch and Hugging Face call it: its buffers never grow, so
    every decoding step has the same shapes (and can be compiled, or replayed as a CUDA
    graph). Self-attention's cache writes each step's new keys and values at
    ``position``, a 0-d integer tensor (so the host never reads it) that every layer's
    cache shares, and reads the whole buffer, its mask hiding the slots not written yet.
    Cross-attention's cache has no ``position``: it holds the memory's keys and values,
    projected once before the first step, and is only read.
    """

    def __init__(
        self, key: Tensor, value: Tensor, position: Tensor | None = None
    ) -> None:
        self.key, self.value, self.position = key, value, position

    @classmethod
    def allocate(
        cls, shape: tuple[int, int, int, int], like: Tensor, position: Tensor
    ) -> KVCache:
        """Empty buffers of ``shape`` ``(batch, heads, capacity, d_head)``, on ``like``'s
        device and dtype, to be written from ``position`` on."""
        key = like.new_zeros(shape)
        return cls(key, torch.zeros_like(key), position)

    @property
    def capacity(self) -> int:
        """How many positions the buffers hold."""
        return self.key.shape[2]

    def write(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Store ``key``, ``value`` ``(batch, heads, new, d_head)`` at ``position,
        position + 1, ...`` (the step's shapes never change); return the whole buffers.
        The decoder moves ``position`` on once all its layers have written."""
        index = self.position + torch.arange(key.shape[2], device=key.device)
        # In the buffers' dtype: under autocast the projections may come in bfloat16.
        self.key.index_copy_(2, index, key.to(self.key.dtype))
        self.value.index_copy_(2, index, value.to(self.value.dtype))
        return self.key, self.value

    def reorder(self, index: Tensor) -> None:
        """Keep the batch rows ``index``, in place (beam search reorders its hypotheses)."""
        self.key.copy_(self.key.index_select(0, index))
        self.value.copy_(self.value.index_select(0, index))

    def __repr__(self) -> str:
        return f"KVCache(key shape={tuple(self.key.shape)})"


class MultiHeadAttention(nn.Module):
    """``num_heads`` attentions side by side, each on a ``d_model / num_heads`` slice.

    The paper's per-head matrices ``W_i^Q`` (d_model × d_k) are column blocks of
    one ``q_proj`` (and likewise for K and V); ``out_proj`` is ``W^O``. Parameter
    names match ``nn.MultiheadAttention``'s split form, so weights copy across.

    ``forward(query (B, q_len, d_model), key (B, k_len, d_model), value (B, k_len, d_model),
    mask)`` → ``(output (B, q_len, d_model), weights (B, heads, q_len, k_len) or None)``.
    ``mask`` is boolean, True = may attend, broadcastable to ``(B, q_len, k_len)``
    (or ``(B, heads, q_len, k_len)``); a 3-D mask gets the head axis inserted, so every
    head sees the same mask.
    """

    def __init__(
        self, d_model: int, num_heads: int, dropout: float = 0.0, bias: bool = True
    ) -> None:
        super().__init__()
        check_sizes(d_model, num_heads, dropout)
        self.d_model, self.num_heads = d_model, num_heads
        self.d_head = d_model // num_heads
        self.dropout = dropout
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, d_model, bias=bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        # Set by record_attention(): keep the weights of the last call for charts.
        self.record_weights = False
        self.last_weights: Tensor | None = None

    def split_heads(self, x: Tensor) -> Tensor:
        """``(B, len, d_model)`` → ``(B, heads, len, d_head)``."""
        batch, length, _ = x.shape
        return x.view(batch, length, self.num_heads, self.d_head).transpose(1, 2)

    def merge_heads(self, x: Tensor) -> Tensor:
        """``(B, heads, len, d_head)`` → ``(B, len, d_model)``: the heads side by side."""
        batch, _, length, _ = x.shape
        return x.transpose(1, 2).reshape(batch, length, self.d_model)

    def keys_values(
        self, key: Tensor, value: Tensor, cache: KVCache | None = None
    ) -> tuple[Tensor, Tensor]:
        """The heads' keys and values ``(B, heads, k_len, d_head)``, ``key`` and ``value``
        projected and split. In decoding, with a ``cache``: cross-attention reads the
        memory's, projected once (its cache has no ``position``); self-attention writes
        this step's at the cache's ``position`` and reads every slot."""
        if cache is not None and cache.position is None:
            return cache.key, cache.value
        k = self.split_heads(self.k_proj(key))
        v = self.split_heads(self.v_proj(value))
        return (k, v) if cache is None else cache.write(k, v)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: Tensor | None = None,
        need_weights: bool = False,
        cache: KVCache | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        check_heads_input(query, key, value, mask, self.d_model, self.num_heads, cache)
        q = self.split_heads(self.q_proj(query))  # (B, heads, q_len, d_head)
        k, v = self.keys_values(key, value, cache)  # (B, heads, keys, d_head)
        mask = mask.unsqueeze(1) if mask is not None and mask.dim() == 3 else mask
        p = self.dropout if self.training else 0.0
        if need_weights or self.record_weights:
            heads, weights = scaled_dot_product_attention(q, k, v, mask, p)
            self.last_weights = weights.detach() if self.record_weights else None
        else:  # the same formula, fused by PyTorch (chapter 3 checks that they agree)
            heads, weights = F.scaled_dot_product_attention(q, k, v, mask, p), None
        output = self.out_proj(self.merge_heads(heads))
        return output, weights if need_weights else None


@contextmanager
def record_attention(model: nn.Module) -> Iterator[dict[str, Tensor]]:
    """Collect the attention weights of every :class:`MultiHeadAttention` inside ``model``.

    Within the block each attention computes its weights explicitly; on leaving it the
    returned dict maps module names (``"encoder.layers.0.self_attn"``, ...) to the
    weights of their last call, ``(batch, heads, q_len, k_len)``::

        with record_attention(model) as maps:
            model(src, tgt)
        maps["decoder.layers.1.cross_attn"]
    """
    require_instance(model, "model", nn.Module)
    modules = {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, MultiHeadAttention)
    }
    maps: dict[str, Tensor] = {}
    for module in modules.values():
        module.record_weights, module.last_weights = True, None
    try:
        yield maps
    finally:
        for name, module in modules.items():
            if module.last_weights is not None:
                maps[name] = module.last_weights
            module.record_weights, module.last_weights = False, None
