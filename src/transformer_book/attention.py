"""Chapters 3 and 4: scaled dot-product attention and multi-head attention.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V

Masks are boolean with True = "may attend", the convention of
``torch.nn.functional.scaled_dot_product_attention``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import few_rows, kernels
from ._checks import check_features, check_mask, check_positive, check_probability, require_tensor, shape_of
from .kernels import Linear, PackedWeight, linear, weight_stamp


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Attention written out step by step, returning the weights too.

    Shapes: ``query (..., q_len, d_k)``, ``key (..., k_len, d_k)``,
    ``value (..., k_len, d_v)``, ``mask`` boolean, broadcastable to
    ``(..., q_len, k_len)``. Returns ``output (..., q_len, d_v)`` and
    ``weights (..., q_len, k_len)``.

    A query whose every key is masked gets all-zero weights (and output), not
    NaN, exactly as PyTorch's fused kernel does.
    """
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        require_tensor(tensor, name)
        if tensor.dim() < 2 or not tensor.is_floating_point():
            raise ValueError(
                f"{name} must be a floating tensor (..., len, features), got {tensor.dtype} {shape_of(tensor)}"
            )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key must share d_k, got query {shape_of(query)} and key {shape_of(key)}")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(
            f"key and value must have the same length, got key {shape_of(key)} and value {shape_of(value)}"
        )
    check_probability(dropout_p, "dropout_p")
    if mask is not None:
        scores_shape = (*torch.broadcast_shapes(query.shape[:-2], key.shape[:-2]), query.shape[-2], key.shape[-2])
        check_mask(mask, "mask", scores_shape)
    return _attention(query, key, value, mask, dropout_p)


def _attention(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, dropout_p: float
) -> tuple[Tensor, Tensor]:
    """:func:`scaled_dot_product_attention` on inputs already checked."""
    d_k = query.shape[-1]
    scores = (query @ key.mT) / math.sqrt(d_k)  # (..., q_len, k_len)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    if mask is not None:
        # softmax of a row that is all -inf is 0/0 = NaN; such a query attends to nothing.
        attends = mask.any(dim=-1, keepdim=True)
        if not (kernels.applies_to(weights) and bool(attends.all())):  # eager CPU: skip it if no row is empty
            weights = weights.masked_fill(~attends, 0.0)
    weights = kernels.dropout(weights, dropout_p)
    return weights @ value, weights


def one_query_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Attention of a decoding step's one new position, heads merged: ``q (B, heads, 1, d_head)``,
    ``k``, ``v (B, heads, len, d_head)``, ``mask`` broadcastable to ``(B, heads, 1, len)`` or
    ``None`` → ``(B, 1, heads * d_head)``, PyTorch's fused kernel's result to float rounding.

    On an eager float32 CPU tensor without autograd it runs :func:`few_rows.attention
    <transformer_book.few_rows.attention>` (appendix C), which reads the cache where it lies and
    writes the heads side by side; elsewhere PyTorch's fused kernel.
    """
    if not torch.is_grad_enabled() and kernels.applies_to(q, k, v) and few_rows.available():
        return few_rows.attention(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).reshape(q.shape[0], 1, -1)


class KVCache:
    """Keys and values already projected, ``key``/``value`` ``(batch, heads, length, d_head)``.

    Self-attention in the decoder appends one position per step. The entries live in a
    buffer that doubles when full, so a step writes only its own position instead of
    copying the whole past (``torch.cat`` would make decoding ``n`` tokens cost ``n²``
    copies). Cross-attention sets ``static=True``: its keys and values come from the
    encoder's memory, which does not change while decoding, so they are projected once,
    stored, and reused at every step.
    """

    def __init__(self, static: bool = False) -> None:
        self.static = static
        self.length = 0
        # key/value: views of the first `length` positions of the buffers _key/_value.
        self.key: Tensor | None = None
        self.value: Tensor | None = None
        self._key: Tensor | None = None
        self._value: Tensor | None = None

    def store(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Keep ``key`` and ``value`` as they are (a static cache's one write); returns them."""
        self._key, self._value, self.length = key, value, key.shape[2]
        return self._publish()

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Add the new positions ``(batch, heads, new, d_head)``; returns every position so far."""
        end = self.length + key.shape[2]
        if self._key is None or end > self._key.shape[2]:
            capacity = max(16, 2 * end)
            grown_key = key.new_empty(*key.shape[:2], capacity, key.shape[3])
            grown_value = value.new_empty(*value.shape[:2], capacity, value.shape[3])
            if self._key is not None:
                grown_key.narrow(2, 0, self.length).copy_(self.key)
                grown_value.narrow(2, 0, self.length).copy_(self.value)
            self._key, self._value = grown_key, grown_value
        # narrow + copy_ rather than slice assignment: the same copy with less Python, and
        # every layer of every decoding step runs it.
        self._key.narrow(2, self.length, end - self.length).copy_(key)
        self._value.narrow(2, self.length, end - self.length).copy_(value)
        self.length = end
        return self._publish()

    def reorder(self, index: Tensor) -> None:
        """Keep the batch rows ``index`` (beam search reorders its hypotheses)."""
        if self._key is not None:
            self._key = self._key.index_select(0, index)
            self._value = self._value.index_select(0, index)
            self._publish()

    def _publish(self) -> tuple[Tensor, Tensor]:
        """Point ``key``/``value`` at the buffers' first ``length`` positions (set once per write,
        so the many reads of a decoding step slice nothing)."""
        self.key, self.value = self._key.narrow(2, 0, self.length), self._value.narrow(2, 0, self.length)
        return self.key, self.value

    def __repr__(self) -> str:
        shape = None if self._key is None else tuple(self.key.shape)
        return f"KVCache(static={self.static}, length={self.length}, key shape={shape})"


class MultiHeadAttention(nn.Module):
    """``num_heads`` attentions side by side, each on a ``d_model / num_heads`` slice.

    The paper's per-head matrices ``W_i^Q`` (d_model × d_k) are column blocks of
    one ``q_proj`` (and likewise for K and V); ``out_proj`` is ``W^O``. Parameter
    names match ``nn.MultiheadAttention``'s split form, so weights copy across.

    ``forward(query (B, q_len, d_model), key (B, k_len, d_model), value (B, k_len, d_model),
    mask)`` → ``(output (B, q_len, d_model), weights (B, heads, q_len, k_len) or None)``.
    ``mask`` is boolean, True = may attend, broadcastable to ``(B, q_len, k_len)``
    (or ``(B, heads, q_len, k_len)``).
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        check_positive(d_model, "d_model")
        check_positive(num_heads, "num_heads")
        check_probability(dropout, "dropout")
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.d_model = d_model
        self.num_heads = num_heads
        self.d_head = d_model // num_heads
        self.dropout = dropout
        self.q_proj = Linear(d_model, d_model, bias=bias)
        self.k_proj = Linear(d_model, d_model, bias=bias)
        self.v_proj = Linear(d_model, d_model, bias=bias)
        self.out_proj = Linear(d_model, d_model, bias=bias)
        # Set by record_attention(): keep the weights of the last call for charts.
        self.record_weights = False
        self.last_weights: Tensor | None = None
        # The packed q/k/v (or k/v) weights for inference, with the parameters' stamp they match.
        self._packed_cache: dict[str, tuple] = {}

    def project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``q_proj(query)``, ``k_proj(key)``, ``v_proj(value)``, each ``(B, len, d_model)``.

        When inputs are the same tensor (self-attention: all three; cross-attention: key
        and value) their projections run as one wider matrix product, which is faster,
        as ``nn.MultiheadAttention``'s packed ``in_proj_weight`` is. Same numbers either way.
        """
        if query is key and key is value:
            return self._packed(query, "qkv")
        if key is value:
            return (self.q_proj(query), *self._packed(key, "kv"))
        return self.q_proj(query), self.k_proj(key), self.v_proj(value)

    def _projections(self, which: str) -> list[nn.Linear]:
        """The projections packed side by side as ``which``: ``"qkv"`` or ``"kv"``."""
        return [self.q_proj, self.k_proj, self.v_proj] if which == "qkv" else [self.k_proj, self.v_proj]

    def _packed(self, x: Tensor, which: str) -> tuple[Tensor, ...]:
        projections = self._projections(which)
        if torch.is_grad_enabled():  # training: the concatenation must be part of the autograd graph
            weight = torch.cat([p.weight for p in projections])
            bias = torch.cat([p.bias for p in projections]) if projections[0].bias is not None else None
            return linear(x, weight, bias).chunk(len(projections), dim=-1)
        # inference: concatenate once, again only when an optimiser has changed the weights
        stamp, weight, bias, packed = self._packed_weights(which, projections)
        return packed.linear(x, weight, bias, stamp).chunk(len(projections), dim=-1)

    def bind_packed(self, which: str, numel: int) -> Callable[[Tensor], Tensor]:
        """The packed ``"qkv"`` or ``"kv"`` projection as a function of inputs of ``numel``
        elements, for the rest of the :func:`~transformer_book.kernels.frozen_weights` block
        (see :meth:`~transformer_book.kernels.PackedWeight.bind`); its output is the
        projections side by side, ``(..., 3 * d_model)`` or ``(..., 2 * d_model)``."""
        stamp, weight, bias, packed = self._packed_weights(which, self._projections(which))
        return packed.bind(weight, bias, numel, stamp)

    def _packed_weights(self, which: str, projections: list[nn.Linear]) -> tuple:
        """``(stamp, weight, bias, PackedWeight)`` of the concatenated ``which`` projections."""
        cached = self._packed_cache.get(which)
        if cached is not None and cached[3].checked_in_this_block():  # see kernels.frozen_weights
            return cached
        stamp = weight_stamp(*[t for p in projections for t in (p.weight, p.bias)])
        if cached is None or cached[0] != stamp or stamp is None:  # None: not trackable, never reused
            weight = torch.cat([p.weight for p in projections]).detach()
            bias = torch.cat([p.bias for p in projections]).detach() if projections[0].bias is not None else None
            cached = self._packed_cache[which] = (stamp, weight, bias, PackedWeight())
        return cached

    def split_heads(self, x: Tensor) -> Tensor:
        """``(B, len, d_model)`` → ``(B, heads, len, d_head)``."""
        batch, length, _ = x.shape
        return x.view(batch, length, self.num_heads, self.d_head).transpose(1, 2)

    def merge_heads(self, x: Tensor) -> Tensor:
        """``(B, heads, len, d_head)`` → ``(B, len, d_model)``: the concatenation of the heads."""
        batch, _, length, _ = x.shape
        return x.transpose(1, 2).reshape(batch, length, self.d_model)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: Tensor | None = None,
        need_weights: bool = False,
        cache: KVCache | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        check_features(query, "query", self.d_model)
        reuse_static = cache is not None and cache.static and cache.length > 0
        if not reuse_static:
            check_features(key, "key", self.d_model)
            check_features(value, "value", self.d_model)
            if key.shape[:2] != value.shape[:2]:
                raise ValueError(
                    f"key and value must share (batch, len), got key {shape_of(key)} and value {shape_of(value)}"
                )
            if key.shape[0] != query.shape[0]:
                raise ValueError(
                    f"query and key must share the batch size, got query {shape_of(query)} and key {shape_of(key)}"
                )

        if reuse_static:
            q = self.split_heads(self.q_proj(query))
            k, v = cache.key, cache.value
        else:
            q, k, v = self.project(query, key, value)
            q, k, v = self.split_heads(q), self.split_heads(k), self.split_heads(v)
            if cache is not None:  # self-attention: this step joins the past; cross: kept for later
                k, v = cache.store(k, v) if cache.static else cache.append(k, v)

        batch, q_len, k_len = query.shape[0], query.shape[1], k.shape[2]
        if mask is not None:
            if mask.dim() == 4:
                check_mask(mask, "mask", (batch, self.num_heads, q_len, k_len))
            else:
                check_mask(mask, "mask", (batch, q_len, k_len))
                mask = mask.unsqueeze(-3)  # insert the head axis: (B, 1, q_len, k_len)
        dropout_p = self.dropout if self.training else 0.0

        # With dropout on a CPU, PyTorch's fused kernel computes the weights explicitly too and
        # draws their mask with bernoulli_; the package's masks make the explicit path faster.
        if need_weights or self.record_weights or (dropout_p > 0.0 and kernels.applies_to(q)):
            heads, weights = _attention(q, k, v, mask, dropout_p)
            if self.record_weights:
                self.last_weights = weights.detach()
            return self.out_proj(self.merge_heads(heads)), weights if need_weights else None
        if cache is not None and q_len == 1 and dropout_p == 0.0:  # a decoding step (chapter 9)
            return self.out_proj(one_query_attention(q, k, v, mask)), None
        # PyTorch's fused kernel: the same result without materialising the weights.
        heads = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        return self.out_proj(self.merge_heads(heads)), None


_recording = 0  # record_attention() blocks open now


def recording_attention() -> bool:
    """Whether a :func:`record_attention` block is open (a decoding step then takes the path
    that records)."""
    return _recording > 0


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
    global _recording
    modules = {name: m for name, m in model.named_modules() if isinstance(m, MultiHeadAttention)}
    maps: dict[str, Tensor] = {}
    for module in modules.values():
        module.record_weights, module.last_weights = True, None
    _recording += 1
    try:
        yield maps
    finally:
        _recording -= 1
        for name, module in modules.items():
            if module.last_weights is not None:
                maps[name] = module.last_weights
            module.record_weights, module.last_weights = False, None
