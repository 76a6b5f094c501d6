"""Graded parts: DecoderLayer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ...decoder import DecoderLayer
from ...masking import causal_mask
from .ch06_encoder import (
    _connected,
    _layer_mistakes,
    _pre_norm,
    _run_layer,
)
from .engine import (
    Case,
    Part,
    _generator,
    _key_padding,
    _random_state,
)
from .results import mistake_maker
from .sections import DECODER, ENCODER


def _decoder_cases() -> list[Case]:
    """Masks come only with a memory as long as x, so that a version that gives each mask to the
    other attention still runs (and differs); the inputs without masks have lengths that differ."""

    def make(
        offset: int,
        shape: tuple[int, int, int],
        norm_first: bool,
        with_masks: bool = False,
        dtype=torch.float32,
    ):
        batch, tgt_len, src_len = shape

        def inputs() -> dict[str, Any]:
            g = _generator(700 + offset)
            state = _random_state(DecoderLayer(8, 2, 16, 0.0, norm_first), g)
            x = 2.0 * torch.randn(batch, tgt_len, 8, generator=g, dtype=torch.float64)
            memory = torch.randn(batch, src_len, 8, generator=g, dtype=torch.float64)
            masks = {}
            if with_masks:
                masks["tgt_mask"] = causal_mask(tgt_len)
                lengths = torch.arange(batch) % 2 + src_len - 1
                masks["src_mask"] = _key_padding(lengths, src_len)
            return dict(
                state=state,
                args=((x + 0.5).to(dtype), (1.5 * memory - 0.3).to(dtype)),
                masks=masks,
                norm_first=norm_first,
                dtype=dtype,
            )

        return inputs

    pre = ("norm_first",)
    return [
        Case(
            "post-norm, d_model 8, 2 heads, d_ff 16, x (2, 4, 8), memory (2, 3, 8)",
            make(1, (2, 4, 3), False),
        ),
        Case(
            "post-norm, tgt_mask causal_mask(4), a source padding mask (2, 1, 4)",
            make(2, (2, 4, 4), False, True),
        ),
        Case(
            "post-norm, batch 1, length 1, memory (1, 3, 8)", make(3, (1, 1, 3), False)
        ),
        Case(
            "post-norm, float64, causal_mask(5), a source padding mask (2, 1, 5)",
            make(4, (2, 5, 5), False, True, torch.float64),
        ),
        Case(
            "pre-norm (norm_first=True), causal_mask(4), a source padding mask (2, 1, 4)",
            make(5, (2, 4, 4), True, True),
            needs=pre,
        ),
        Case(
            "pre-norm, float64, x (2, 3, 8), memory (2, 5, 8)",
            make(6, (2, 3, 5), True, False, torch.float64),
            needs=pre,
        ),
    ]


def _decoder_variant(
    order: str = "asked",
    residual: str = "yes",
    norms: tuple[int, int, int] = (0, 1, 2),
    causal: bool = True,
    swap_masks: bool = False,
    cross_reads: str = "memory",
    cross_first: str = "",
) -> type:
    """A decoder layer (eval mode, so without dropout) with one thing changed. ``norms`` says
    which LayerNorm each sublayer uses; ``cross_reads`` is "memory", "itself" or
    "normalised memory" (the memory through the cross-attention's own norm, in pre-norm)."""

    class Variant(DecoderLayer):
        def forward(self, x: Tensor, memory: Tensor, **masks: Tensor) -> Tensor:
            self_mask, cross_mask = masks.get("tgt_mask"), masks.get("src_mask")
            if swap_masks:
                self_mask, cross_mask = cross_mask, self_mask
            pre = _pre_norm(order, self.norm_first)
            layer_norms = (self.norm1, self.norm2, self.norm3)
            norm1, norm2, norm3 = (layer_norms[i] for i in norms)

            def attend(h: Tensor, norm: Callable) -> Tensor:
                return self.self_attn(h, h, h, self_mask if causal else None)[0]

            def cross(h: Tensor, norm: Callable) -> Tensor:
                kv = memory
                if cross_reads == "itself":
                    kv = h
                elif cross_reads == "normalised memory" and pre:
                    kv = norm(memory)
                return self.cross_attn(h, kv, kv, cross_mask)[0]

            def feed_forward(h: Tensor, norm: Callable) -> Tensor:
                return self.feed_forward(h)

            steps = [(attend, norm1), (cross, norm2), (feed_forward, norm3)]
            if cross_first == "with_norms":
                steps = [steps[1], steps[0], steps[2]]
            elif cross_first == "in_place":
                steps = [(cross, norm1), (attend, norm2), (feed_forward, norm3)]
            return _connected(x, steps, pre, residual)

    return Variant


_mistake = mistake_maker(
    _decoder_variant, DECODER["7.2 One decoder layer, equation by equation"]
)

_DECODER_MISTAKES = (
    *_layer_mistakes(
        mistake_maker(_decoder_variant, ENCODER["The sublayer connection, two ways"])
    ),
    _mistake(
        "norms_swapped",
        "used the three LayerNorms in another order",
        "the three LayerNorms are used in another order; norm1 belongs to the self-attention, norm2 to "
        "the cross-attention and norm3 to the feed-forward network",
        *(
            {"norms": order}
            for order in ((1, 0, 2), (0, 2, 1), (2, 1, 0), (1, 2, 0), (2, 0, 1))
        ),
    ),
    _mistake(
        "causal_mask_ignored",
        "called the self-attention without tgt_mask",
        "tgt_mask is not passed to the self-attention, so every target position also reads the "
        "positions after it",
        causal=False,
        section=DECODER["7.4 Masked self-attention and teacher forcing"],
    ),
    _mistake(
        "masks_swapped",
        "gave src_mask to the self-attention and tgt_mask to the cross-attention",
        "src_mask is given to the self-attention and tgt_mask to the cross-attention; tgt_mask hides "
        "the target's future from its self-attention, src_mask the source's padding from the "
        "cross-attention",
        swap_masks=True,
    ),
    _mistake(
        "cross_attention_on_itself",
        "gave the cross-attention x as its keys and values",
        "the cross-attention takes its keys and values from the decoder's own states instead of the "
        "encoder's memory, so the layer never reads the source",
        cross_reads="itself",
        section=DECODER["7.3 Cross-attention: four queries, three keys"],
    ),
    _mistake(
        "sublayers_reordered",
        "ran the cross-attention before the self-attention",
        "the cross-attention runs before the masked self-attention; the layer first attends to the "
        "target's own past, then to the memory, then transforms each position",
        {"cross_first": "with_norms"},
        {"cross_first": "in_place"},
    ),
    _mistake(
        "memory_normalised",
        "passed the memory through norm2 as well",
        "pre-norm passes the memory through the cross-attention's LayerNorm too; norm2 normalises "
        "the decoder's queries only, the memory is the encoder's output as it is",
        cross_reads="normalised memory",
        section=DECODER["7.3 Cross-attention: four queries, three keys"],
    ),
)


PARTS = (
    Part(
        "DecoderLayer",
        DecoderLayer,
        "class (d_model, num_heads, d_ff, dropout=0.1, norm_first=False) with self_attn, cross_attn, "
        "feed_forward, norm1, norm2, norm3; forward(x, memory, *, src_mask=None, tgt_mask=None)",
        DECODER["7.2 One decoder layer, equation by equation"],
        _decoder_cases,
        _run_layer,
        _DECODER_MISTAKES,
        axes={"output": ("batch", "position", "feature")},
    ),
)
