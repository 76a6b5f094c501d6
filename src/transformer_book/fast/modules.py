"""``accelerate(model)``: the same model, on the wing's kernels (appendix C).

The swap is of classes, in place: each module keeps its parameters, buffers and
``state_dict``, and gains a ``forward`` that computes the same thing on other kernels.

- ``nn.Linear`` → :class:`~.kernels.FastLinear`: oneDNN for training's products, packed weights
  and the few-row kernel for inference's;
- ``nn.Dropout`` → :class:`~.kernels.FastDropout`: one pass, its mask a hash of seed and position;
- :class:`~transformer_book.layers.FeedForward` → :class:`FastFeedForward`: ReLU and dropout in one pass;
- :class:`~transformer_book.attention.MultiHeadAttention` → :class:`FastMultiHeadAttention`: q, k and v
  projected by one wider product, training's attention with the one-pass dropout, a decoding
  step's attention on the few-row kernel;
- :class:`~transformer_book.model.Transformer` → :class:`FastTransformer`: a decoding step that
  runs a :class:`DecodingPlan`, the layer's products bound once to their packed weights.

Every shortcut computes what the plain module computes; each steps aside (to the plain code)
where it could not: autograd through the kernels it lacks, a device or dtype they do not
handle, a hook or a dispatch mode that must see the modules' calls.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention import KVCache, MultiHeadAttention, scaled_dot_product_attention
from ..checks import check_heads_input, check_mask, check_target
from ..decoder import DecoderLayer, LayerCache
from ..layers import FeedForward
from ..model import Transformer
from . import dropout_kernel, few_rows, kernels
from .kernels import (
    FastDropout,
    FastLinear,
    PackedWeight,
    applies_to,
    relu_dropout,
    weight_stamp,
)

_SWAPS: dict[type, type] = {}  # plain class → fast class, filled below


def one_query_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Attention of a decoding step's one new position, heads merged: ``q (B, heads, 1, d_head)``,
    ``k``, ``v (B, heads, len, d_head)``, ``mask`` broadcastable to ``(B, heads, 1, len)`` or
    ``None`` → ``(B, 1, heads * d_head)``: the few-row kernel where it applies, else PyTorch's
    fused kernel (the same numbers to float rounding)."""
    if not torch.is_grad_enabled() and applies_to(q, k, v) and few_rows.available():
        return few_rows.attention(q, k, v, mask)
    return (
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        .transpose(1, 2)
        .reshape(q.shape[0], 1, -1)
    )


class FastFeedForward(FeedForward):
    """:class:`~transformer_book.layers.FeedForward` with its ReLU and dropout in one pass."""

    def forward(self, x: Tensor) -> Tensor:
        return self.linear2(relu_dropout(self.linear1(x), self.dropout))


class FastMultiHeadAttention(MultiHeadAttention):
    """:class:`~transformer_book.attention.MultiHeadAttention` on the wing's kernels; same results."""

    stacked: dict[str, tuple]  # "qkv"/"kv" → (stamp, weight, bias, PackedWeight)

    def __getstate__(self) -> dict:
        """Copies and saved models leave the stacked weights behind: they are derived from the
        weights, and their stamps name this process's memory."""
        state = super().__getstate__()
        state.pop("stacked", None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.stacked = {}

    def projections(
        self, query: Tensor, key: Tensor, value: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The three projections; inputs that are one tensor go through one wider product (stacked
        weights, as ``nn.MultiheadAttention``'s ``in_proj_weight``): the same numbers, faster."""
        if query is key and key is value:
            return self._stacked(query, "qkv")
        if key is value:
            return (self.q_proj(query), *self._stacked(key, "kv"))
        return self.q_proj(query), self.k_proj(key), self.v_proj(value)

    def _modules_of(self, which: str) -> list[nn.Linear]:
        return (
            [self.q_proj, self.k_proj, self.v_proj]
            if which == "qkv"
            else [self.k_proj, self.v_proj]
        )

    def _stacked(self, x: Tensor, which: str) -> tuple[Tensor, ...]:
        parts = self._modules_of(which)
        if (
            not torch.is_inference_mode_enabled()
        ):  # the concatenation joins the autograd graph
            weight = torch.cat([p.weight for p in parts])
            bias = (
                torch.cat([p.bias for p in parts])
                if parts[0].bias is not None
                else None
            )
            return kernels.affine(x, weight, bias).chunk(len(parts), dim=-1)
        stamp, weight, bias, packed = self.stacked_weights(which)
        return packed.apply(x, weight, bias, stamp).chunk(len(parts), dim=-1)

    def stacked_weights(self, which: str) -> tuple:
        """``(stamp, weight, bias, PackedWeight)`` of the ``which`` projections stacked, made once
        per change of the weights (in inference mode)."""
        parts = self._modules_of(which)
        stamp = weight_stamp(*[t for p in parts for t in (p.weight, p.bias)])
        cached = self.stacked.get(which)
        if cached is None or cached[0] != stamp or stamp is None:
            weight = torch.cat([p.weight for p in parts]).detach()
            bias = (
                torch.cat([p.bias for p in parts]).detach()
                if parts[0].bias is not None
                else None
            )
            cached = self.stacked[which] = (stamp, weight, bias, PackedWeight())
        return cached

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
        if cache is not None and cache.static and cache.length:
            q, k, v = self.split_heads(self.q_proj(query)), cache.key, cache.value
        else:
            q, k, v = map(self.split_heads, self.projections(query, key, value))
            if cache is not None:
                k, v = cache.update(k, v)
        if mask is not None and mask.dim() == 3:
            mask = mask.unsqueeze(1)
        p = self.dropout if self.training else 0.0
        if need_weights or self.record_weights or (p > 0.0 and applies_to(q)):
            # the explicit formula; in training on a CPU its weights take the one-pass dropout
            heads, weights = scaled_dot_product_attention(q, k, v, mask)
            heads = kernels.dropout(weights, p) @ v if p > 0.0 else heads
            self.last_weights = weights.detach() if self.record_weights else None
            return self.out_proj(
                self.merge_heads(heads)
            ), weights if need_weights else None
        if cache is not None and q.shape[2] == 1 and p == 0.0:  # a decoding step
            return self.out_proj(one_query_attention(q, k, v, mask)), None
        heads = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        return self.out_proj(self.merge_heads(heads)), None


@dataclass
class DecodingPlan:
    """One decoder layer's work in a decoding step, each product a function of its input
    bound once to the packed weight it reads, and each norm bound to its parameters."""

    self_qkv: Callable[
        [Tensor], Tensor
    ]  # stacked q/k/v projection: (..., d_model) → (..., 3 * d_model)
    self_out: Callable[[Tensor], Tensor]
    cross_q: Callable[[Tensor], Tensor]
    cross_out: Callable[[Tensor], Tensor]
    ff_in: Callable[[Tensor], Tensor]
    ff_out: Callable[[Tensor], Tensor]
    norms: tuple[Callable[[Tensor], Tensor], ...]  # norm1, norm2, norm3
    # The self-attention cache's keys and values live in these buffers, which double when full.
    buffers: dict[str, Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, layer: DecoderLayer, rows: int) -> DecodingPlan:
        """Bind ``layer``'s products and norms for steps of ``rows`` rows (the batch)."""
        self_attn, cross_attn, ff = (
            layer.self_attn,
            layer.cross_attn,
            layer.feed_forward,
        )
        stamp, weight, bias, packed = self_attn.stacked_weights("qkv")
        qkv = packed.kernel(weight, bias, rows, stamp) or (
            lambda x: F.linear(x, weight, bias)
        )
        norms = tuple(
            partial(
                F.layer_norm,
                normalized_shape=n.normalized_shape,
                weight=n.weight,
                bias=n.bias,
                eps=n.eps,
            )
            for n in (layer.norm1, layer.norm2, layer.norm3)
        )
        return cls(
            self_qkv=qkv,
            self_out=self_attn.out_proj.kernel(rows),
            cross_q=cross_attn.q_proj.kernel(rows),
            cross_out=cross_attn.out_proj.kernel(rows),
            ff_in=ff.linear1.kernel(rows),
            ff_out=ff.linear2.kernel(rows),
            norms=norms,
        )

    def append(
        self, cache: KVCache, key: Tensor, value: Tensor
    ) -> tuple[Tensor, Tensor]:
        """``cache.update(key, value)`` for one new position ``(B, heads, 1, d_head)``, written
        into buffers that double when full: a step copies its own position, where
        ``torch.cat`` would copy the whole past again. ``cache.key``/``cache.value`` become
        views of the buffers, so the plain code reads the same cache."""
        length, buffers = cache.length, self.buffers
        if (
            buffers.get("view") is not cache.key
        ):  # filled elsewhere (a first step, a reorder)
            buffers.clear()
        if "key" not in buffers or length + 1 > buffers["key"].shape[2]:
            capacity = max(16, 2 * (length + 1))
            for name, past in (("key", cache.key), ("value", cache.value)):
                grown = past.new_empty(*past.shape[:2], capacity, past.shape[3])
                grown.narrow(2, 0, length).copy_(past)
                buffers[name] = grown
        buffers["key"].narrow(2, length, 1).copy_(key)
        buffers["value"].narrow(2, length, 1).copy_(value)
        cache.key = buffers["key"].narrow(2, 0, length + 1)
        cache.value = buffers["value"].narrow(2, 0, length + 1)
        buffers["view"] = cache.key
        return cache.key, cache.value

    def step(
        self, layer: DecoderLayer, x: Tensor, src_mask: Tensor | None, cache: LayerCache
    ) -> Tensor:
        """What ``layer(x, memory, src_mask=src_mask, cache=cache)`` computes for one new
        position ``x (B, 1, d_model)``, in eval mode, once the cache holds the memory's keys."""
        batch, heads, d_head = (
            x.shape[0],
            layer.self_attn.num_heads,
            layer.self_attn.d_head,
        )

        def split(t: Tensor) -> Tensor:  # (B, 1, d_model) → (B, heads, 1, d_head)
            return t.view(batch, heads, 1, d_head)

        def self_attention(h: Tensor) -> Tensor:
            q, k, v = self.self_qkv(h).chunk(3, dim=-1)
            k, v = self.append(cache.self_attn, split(k), split(v))
            return self.self_out(one_query_attention(split(q), k, v, None))

        def cross_attention(h: Tensor) -> Tensor:
            memory = cache.cross_attn
            return self.cross_out(
                one_query_attention(
                    split(self.cross_q(h)), memory.key, memory.value, src_mask
                )
            )

        def feed_forward(h: Tensor) -> Tensor:
            return self.ff_out(self.ff_in(h).relu())

        for sublayer, norm in zip(
            (self_attention, cross_attention, feed_forward), self.norms
        ):
            x = x + sublayer(norm(x)) if layer.norm_first else norm(x + sublayer(x))
        return x


class FastTransformer(Transformer):
    """:class:`~transformer_book.model.Transformer` whose cached decoding steps run a
    :class:`DecodingPlan` per layer: the same kernels on the same numbers as its modules, with
    less Python around them (a decoding step of a few rows is dominated by that Python).

    A plan is made at a cache's first cached step and serves that cache for its life: a KV
    cache already holds keys and values computed with the weights of that moment, so it is
    only valid while the weights stay as they are."""

    plans: weakref.WeakKeyDictionary  # cache[0] → (rows, [DecodingPlan per layer])
    step_masks: weakref.WeakKeyDictionary  # cache[0] → (src_mask, as the plan uses it)

    def __getstate__(self) -> dict:
        """Copies and saved models leave the plans behind (a weak dictionary cannot be pickled,
        and a plan serves only the caches of this model)."""
        state = super().__getstate__()
        state.pop("plans", None)
        state.pop("step_masks", None)
        state.pop("decoder_modules", None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.plans = weakref.WeakKeyDictionary()
        self.step_masks = weakref.WeakKeyDictionary()

    def decode(
        self,
        memory: Tensor,
        tgt: Tensor,
        *,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        cache: list[LayerCache] | None = None,
    ) -> Tensor:
        if not self._plan_applies(tgt, tgt_mask, cache):
            return super().decode(
                memory, tgt, src_mask=src_mask, tgt_mask=tgt_mask, cache=cache
            )
        past = cache[0].self_attn.length
        check_target(tgt, memory, past, self.config.tgt_vocab_size, self.config.max_len)
        rows, plans = self.plans.get(cache[0], (None, None))
        if rows != tgt.shape[0]:
            plans = [
                DecodingPlan.of(layer, tgt.shape[0]) for layer in self.decoder.layers
            ]
            self.plans[cache[0]] = (tgt.shape[0], plans)
        src_mask = self._step_mask(src_mask, tgt.shape[0], cache, memory.device)
        # The embedding and positions as their modules compute them in eval mode (dropout is
        # the identity); check_target has checked the ids and the length already.
        scale = math.sqrt(self.config.d_model)
        x = self.tgt_embed.lookup(tgt) * scale + self.positional.pe[past : past + 1]
        for layer, plan, layer_cache in zip(
            self.decoder.layers, plans, cache, strict=True
        ):
            x = plan.step(layer, x, src_mask, layer_cache)
        return self.decoder.norm(x)

    def _step_mask(
        self,
        src_mask: Tensor | None,
        rows: int,
        cache: list[LayerCache],
        device: torch.device,
    ) -> Tensor | None:
        """``src_mask`` checked and given its head axis, or ``None`` where it hides nothing (the
        kernels run faster without a mask); worked out once per mask a cache is decoded with."""
        if src_mask is None:
            return None
        remembered = self.step_masks.get(cache[0])
        if remembered is not None and remembered[0] is src_mask:
            return remembered[1]
        src_len = cache[0].cross_attn.length
        target = (rows, 1, 1, src_len) if src_mask.dim() == 4 else (rows, 1, src_len)
        check_mask(src_mask, "src_mask", target, device)
        with_heads = src_mask.unsqueeze(1) if src_mask.dim() == 3 else src_mask
        step_mask = None if bool(with_heads.all()) else with_heads
        self.step_masks[cache[0]] = (src_mask, step_mask)
        return step_mask

    def _watched(self) -> bool:
        """Whether a forward hook or :func:`~transformer_book.attention.record_attention` watches a
        module of the decoder: then every step goes through the modules. The decoder's modules
        are listed once (walking the tree at every step cost more than a step's Python)."""
        modules = self.__dict__.get("decoder_modules")
        if modules is None:
            modules = self.__dict__["decoder_modules"] = list(self.decoder.modules())
        return any(
            m._forward_hooks
            or m._forward_pre_hooks
            or (isinstance(m, MultiHeadAttention) and m.record_weights)
            for m in modules
        )

    def _plan_applies(
        self, tgt: Tensor, tgt_mask: Tensor | None, cache: list[LayerCache] | None
    ) -> bool:
        """A cached step of one position in eval and inference mode, the memory's keys already
        cached, where nothing must watch the modules' calls (hooks, record_attention, a
        dispatch mode) and every tensor suits the kernels."""
        return (
            cache is not None
            and len(cache) == len(self.decoder.layers)
            and cache[0].self_attn.length > 0
            and cache[0].cross_attn.length > 0
            and tgt_mask is None
            and isinstance(tgt, Tensor)
            and tgt.dim() == 2
            and tgt.shape[1] == 1
            and not self.training
            and torch.is_inference_mode_enabled()
            and applies_to(cache[0].cross_attn.key)
            and not self._watched()
            and not kernels.global_hooks_registered()
        )


_SWAPS.update(
    {
        nn.Linear: FastLinear,
        nn.Dropout: FastDropout,
        FeedForward: FastFeedForward,
        MultiHeadAttention: FastMultiHeadAttention,
        Transformer: FastTransformer,
    }
)
_PLAIN = {fast: plain for plain, fast in _SWAPS.items()}


def accelerate(model: nn.Module) -> nn.Module:
    """Run ``model`` (any module of the package: a whole :class:`~transformer_book.model.Transformer`,
    an encoder, a layer) on the wing's kernels, in place; returns it.

    Parameters, buffers and ``state_dict`` stay exactly as they are; results are the plain
    model's to float rounding (bit for bit where the kernels are PyTorch's own), and decoding
    gives the same tokens. :func:`plain` undoes it. Modules of classes other than those listed
    in this module's docstring (a subclass of your own, say) are left alone.
    """
    for module in model.modules():
        fast = _SWAPS.get(type(module))
        if fast is None:
            continue
        module.__class__ = fast
        if fast is FastLinear:
            module.packed = PackedWeight()
        elif fast is FastMultiHeadAttention:
            module.stacked = {}
        elif fast is FastTransformer:
            module.plans = weakref.WeakKeyDictionary()
            module.step_masks = weakref.WeakKeyDictionary()
    return model


def plain(model: nn.Module) -> nn.Module:
    """Undo :func:`accelerate`: every module back to its plain class, in place; returns ``model``."""
    for module in model.modules():
        original = _PLAIN.get(type(module))
        if original is not None:
            module.__class__ = original
            for attribute in (
                "packed",
                "stacked",
                "plans",
                "step_masks",
                "decoder_modules",
            ):
                module.__dict__.pop(attribute, None)
    return model


def is_accelerated(model: nn.Module) -> bool:
    """Whether any module of ``model`` runs on the wing's classes."""
    return any(type(module) in _PLAIN for module in model.modules())


def status() -> dict[str, str]:
    """Each C kernel's state: ``"available"`` or the one-line reason it is off (``"not tried"``
    before first use is never returned: this tries)."""
    return {
        "few_rows": "available"
        if few_rows.available()
        else str(few_rows.unavailable_reason()),
        "dropout_kernel": "available"
        if dropout_kernel.available()
        else str(dropout_kernel.unavailable_reason()),
        "onednn": "available"
        if kernels._onednn_available()
        else "this PyTorch has no working oneDNN linear ops",
    }
