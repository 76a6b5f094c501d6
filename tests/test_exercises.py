"""The Build-it checker: the package passes its own checks, every catalogued mistake is named when a
reader makes it, correct versions written another way pass, and nothing a reader writes makes it crash.

The broken versions below are written here, one by one, the way a reader might write them; they
share no code with the catalogue in ``transformer_book.book.exercises``.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import transformer_book as tb
import transformer_book.numbers  # noqa: F401  (tb.numbers: chapter 11, the book extra)
from transformer_book import exercises
from transformer_book.book.exercises import CheckResult, check

ROOT = Path(__file__).resolve().parents[1]

PACKAGE = {
    "TokenEmbedding": tb.TokenEmbedding,
    "sinusoidal_positional_encoding": tb.sinusoidal_positional_encoding,
    "scaled_dot_product_attention": tb.scaled_dot_product_attention,
    "split_heads": lambda x, num_heads: tb.MultiHeadAttention(x.shape[-1], num_heads).split_heads(x),
    "merge_heads": lambda x, num_heads: tb.MultiHeadAttention(x.shape[1] * x.shape[-1], num_heads).merge_heads(x),
    "MultiHeadAttention": tb.MultiHeadAttention,
    "padding_mask": tb.padding_mask,
    "causal_mask": tb.causal_mask,
    "target_mask": tb.target_mask,
    "sublayer_connection": tb.sublayer_connection,
    "EncoderLayer": tb.EncoderLayer,
    "DecoderLayer": tb.DecoderLayer,
    "LabelSmoothingLoss": tb.LabelSmoothingLoss,
    "noam_rate": tb.noam_rate,
    "greedy_decode": tb.greedy_decode,
    "beam_search": tb.beam_search,
    "bpe_merge_step": tb.numbers.bpe_merge_step,
}


# --------------------------------------------------------------------------------------------
# Chapter 1: token embeddings
# --------------------------------------------------------------------------------------------


class Embedding(nn.Module):
    """A reader's embedding, its table under another name than the package's, scaled by factor()."""

    def __init__(self, vocab_size: int, d_model: int, padding_idx: int | None = None) -> None:
        super().__init__()
        self.vocab_size, self.d_model = vocab_size, d_model
        self.table = nn.Embedding(vocab_size, d_model, padding_idx=padding_idx)

    def factor(self) -> float:
        return math.sqrt(self.d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table(tokens) * self.factor()


class EmbeddingUnscaled(Embedding):
    def factor(self) -> float:
        return 1.0


class EmbeddingTimesDModel(Embedding):
    def factor(self) -> float:
        return self.d_model


class EmbeddingDividedBySqrt(Embedding):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table(tokens) / math.sqrt(self.d_model)


class EmbeddingSqrtVocab(Embedding):
    def factor(self) -> float:
        return math.sqrt(self.vocab_size)


class EmbeddingNoPaddingIdx(nn.Module):
    def __init__(self, vocab_size: int, d_model: int, padding_idx: int | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab_size, d_model))
        self.d_model = d_model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight) * self.d_model**0.5


class EmbeddingOneRowShort(nn.Module):
    def __init__(self, vocab_size: int, d_model: int, padding_idx: int | None = None) -> None:
        super().__init__()
        self.lookup = nn.Embedding(vocab_size - 1, d_model)
        self.d_model = d_model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lookup(tokens) * math.sqrt(self.d_model)


# --------------------------------------------------------------------------------------------
# Chapter 2: positional encoding (the reader's signature has no interleaved= or dtype=)
# --------------------------------------------------------------------------------------------


def _angles(max_len: int, d_model: int, first: int = 0) -> torch.Tensor:
    position = torch.arange(first, first + max_len, dtype=torch.float64).unsqueeze(1)
    return position / 10000 ** (torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)


def pe_cos_first(max_len, d_model):
    table = torch.zeros(max_len, d_model, dtype=torch.float64)
    table[:, 0::2] = _angles(max_len, d_model).cos()
    table[:, 1::2] = _angles(max_len, d_model).sin()
    return table.float()


def pe_from_one(max_len, d_model):
    table = torch.zeros(max_len, d_model)
    table[:, 0::2] = _angles(max_len, d_model, first=1).sin()
    table[:, 1::2] = _angles(max_len, d_model, first=1).cos()
    return table


def pe_concatenated(max_len, d_model):
    angle = _angles(max_len, d_model)
    return torch.cat([angle.sin(), angle.cos()], dim=1).float()


def pe_column_as_i(max_len, d_model):
    table = torch.empty(max_len, d_model)
    for pos in range(max_len):
        for col in range(d_model):
            angle = pos / 10000 ** (2 * col / d_model)
            table[pos, col] = math.sin(angle) if col % 2 == 0 else math.cos(angle)
    return table


def pe_columns_from_one(max_len, d_model):
    table = torch.empty(max_len, d_model)
    for pos in range(max_len):
        for j in range(1, d_model + 1):  # the entry formula read with j = 1 .. d_model
            table[pos, j - 1] = (
                math.sin(pos / 10000 ** (j / d_model)) if j % 2 == 0 else math.cos(pos / 10000 ** ((j - 1) / d_model))
            )
    return table


def pe_without_two(max_len, d_model):
    position = torch.arange(max_len).unsqueeze(1).double()
    angle = position / 10000 ** (torch.arange(d_model // 2).double() / d_model)
    return torch.stack([angle.sin(), angle.cos()], dim=-1).reshape(max_len, d_model).float()


def pe_times_frequency(max_len, d_model):
    position = torch.arange(max_len).unsqueeze(1).double()
    angle = position * 10000 ** (torch.arange(0, d_model, 2).double() / d_model)
    return torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(1).float()


def pe_sine_only(max_len, d_model):
    table = torch.zeros(max_len, d_model)
    angle = _angles(max_len, d_model)
    table[:, 0::2] = angle.sin()
    table[:, 1::2] = angle.sin()
    return table


# --------------------------------------------------------------------------------------------
# Chapter 3: scaled dot-product attention
# --------------------------------------------------------------------------------------------


def attention_unscaled(query, key, value, mask=None):
    scores = query @ key.transpose(-2, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim=-1).nan_to_num(0.0)
    return weights @ value, weights


def attention_over_d_k(query, key, value, mask=None):
    scores = query @ key.transpose(-2, -1) / query.size(-1)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, float("-inf"))
    return torch.softmax(scores, -1).nan_to_num(0.0) @ value


def attention_over_d_v(query, key, value, mask=None):
    scores = torch.matmul(query, key.mT) / math.sqrt(value.size(-1))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1).nan_to_num(0.0) @ value


def attention_over_length(query, key, value, mask=None):
    scores = torch.matmul(query, key.mT) / key.size(-2) ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1).nan_to_num(0.0) @ value


def attention_softmax_over_queries(query, key, value, mask=None):
    scores = query @ key.mT / math.sqrt(query.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=1 if scores.dim() == 3 else 2)
    return weights @ value


def attention_mask_inverted(query, key, value, mask=None):
    scores = query @ key.mT / math.sqrt(query.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    weights = scores.softmax(-1)
    return torch.where(weights.isnan(), torch.zeros_like(weights), weights) @ value


def attention_fill_zero(query, key, value, mask=None):
    scores = query @ key.mT / math.sqrt(query.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, 0.0)
    return scores.softmax(-1) @ value


def attention_nan_rows(query, key, value, mask=None):
    scores = query @ key.mT / math.sqrt(query.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(-1)
    return weights @ value, weights


def attention_minus_1e9(query, key, value, mask=None):
    scores = query @ key.mT / math.sqrt(query.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    weights = scores.softmax(-1)
    return weights @ value, weights


# --------------------------------------------------------------------------------------------
# Chapter 4: multi-head attention
# --------------------------------------------------------------------------------------------


class Heads(nn.Module):
    """A reader's multi-head attention; the broken ones override one step."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.d_model, self.h = d_model, num_heads
        self.d_k = d_model // num_heads
        self.q_proj, self.k_proj = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.v_proj, self.out_proj = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)

    def split(self, x):
        return x.view(x.size(0), x.size(1), self.h, self.d_k).transpose(1, 2)

    def merge(self, x):
        return x.transpose(1, 2).contiguous().view(x.size(0), x.size(2), self.d_model)

    def scale(self):
        return math.sqrt(self.d_k)

    def values(self, value):
        return self.v_proj(value)

    def finish(self, x):
        return self.out_proj(x)

    def forward(self, query, key, value, mask=None):
        q, k, v = self.split(self.q_proj(query)), self.split(self.k_proj(key)), self.split(self.values(value))
        scores = q @ k.transpose(-2, -1) / self.scale()
        if mask is not None:
            scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        return self.finish(self.merge(weights @ v)), weights


class HeadsMergedByView(Heads):
    def merge(self, x):
        return x.reshape(x.size(0), x.size(2), self.d_model)


class HeadsSplitByView(Heads):
    def split(self, x):
        return x.view(x.size(0), self.h, x.size(1), self.d_k)


class HeadsWidthSwapped(Heads):
    def split(self, x):
        return x.view(x.size(0), x.size(1), self.d_k, self.h).transpose(1, 2)


class HeadsSixParts(Heads):
    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__(d_model, num_heads)
        self.h = 6  # N = 6, the number of layers
        self.d_k = d_model // 6


class HeadsNoOutProj(nn.Module):
    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.h = num_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, d_model) for _ in range(3))

    def forward(self, query, key, value, mask=None):
        b = query.size(0)
        q, k, v = (
            p(t).view(b, -1, self.h, t.size(-1) // self.h).transpose(1, 2)
            for p, t in ((self.q_proj, query), (self.k_proj, key), (self.v_proj, value))
        )
        m = None if mask is None else mask.unsqueeze(1)
        heads = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        return torch.cat(heads.unbind(dim=1), dim=-1)  # the heads side by side, and nothing after


class HeadsValuesUnprojected(Heads):
    def values(self, value):
        return value


class HeadsScaledByDModel(Heads):
    def scale(self):
        return math.sqrt(self.d_model)


def split_by_view(x, num_heads):
    b, n, d = x.shape
    return x.view(b, num_heads, n, d // num_heads)


def split_width_swapped(x, num_heads):
    b, n, d = x.shape
    return x.view(b, n, d // num_heads, num_heads).transpose(1, 2)


def split_strided(x, num_heads):
    return torch.stack([x[..., i::num_heads] for i in range(num_heads)], dim=1)


def split_keys_transposed(x, num_heads):
    b, n, d = x.shape
    return x.view(b, n, num_heads, d // num_heads).permute(0, 2, 3, 1)


def split_six(x, num_heads):
    b, n, d = x.shape
    return x.view(b, n, 6, d // 6).transpose(1, 2)


def merge_by_view(x, num_heads):
    b, h, n, w = x.shape
    return x.reshape(b, n, h * w)


def merge_strided(x, num_heads):
    return torch.stack(x.unbind(1), dim=-1).flatten(-2)


def merge_summed(x, num_heads):
    return x.sum(1)


def merge_averaged(x, num_heads):
    return x.mean(dim=1)


def merge_along_positions(x, num_heads):
    return torch.cat(x.unbind(1), dim=1)


# --------------------------------------------------------------------------------------------
# Chapter 5: masks
# --------------------------------------------------------------------------------------------


def padding_true_at_pads(tokens, pad_id=0):
    return (tokens == pad_id).unsqueeze(1)


def padding_no_query_axis(tokens, pad_id=0):
    return tokens != pad_id


def padding_hides_queries(tokens, pad_id=0):
    return (tokens != pad_id).unsqueeze(-1)


def padding_with_head_axis(tokens, pad_id=0):
    return (tokens != pad_id)[:, None, None, :]


def padding_as_floats(tokens, pad_id=0):
    return (tokens != pad_id).unsqueeze(1).float()


def padding_zero_hard_coded(tokens, pad_id=0):
    return (tokens != 0).unsqueeze(1)


def causal_upper(size, device=None):
    return torch.triu(torch.ones(1, size, size)).bool()


def causal_strict(size, device=None):
    return torch.tril(torch.ones(size, size), diagonal=-1).bool().unsqueeze(0)


def causal_blocked(size, device=None):
    return torch.triu(torch.ones(size, size, dtype=torch.bool), diagonal=1)


def causal_additive(size, device=None):
    return nn.Transformer.generate_square_subsequent_mask(size)


def causal_one_ahead(size, device=None):
    row, col = torch.arange(size).unsqueeze(1), torch.arange(size)
    return (col <= row + 1).unsqueeze(0)


def causal_ones_and_zeros(size, device=None):
    return torch.ones(size, size).tril().unsqueeze(0)


# --------------------------------------------------------------------------------------------
# Chapter 6: the sublayer connection and the encoder layer
# --------------------------------------------------------------------------------------------


def sublayer_swapped(x, sublayer, norm, dropout, norm_first):
    return norm(x + dropout(sublayer(x))) if norm_first else x + dropout(sublayer(norm(x)))


def sublayer_always_post(x, sublayer, norm, dropout, norm_first):
    return norm(x + dropout(sublayer(x)))


def sublayer_no_residual(x, sublayer, norm, dropout, norm_first):
    return dropout(sublayer(norm(x))) if norm_first else norm(dropout(sublayer(x)))


def sublayer_dropout_on_sum(x, sublayer, norm, dropout, norm_first):
    return dropout(x + sublayer(norm(x))) if norm_first else norm(dropout(x + sublayer(x)))


def sublayer_norm_then_add(x, sublayer, norm, dropout, norm_first):
    if norm_first:
        return x + dropout(sublayer(norm(x)))
    return x + norm(dropout(sublayer(x)))


def sublayer_overwritten_input(x, sublayer, norm, dropout, norm_first):
    if norm_first:
        x = norm(x)  # the source's `src_embedded = norm(src_embedded)`
        return x + dropout(sublayer(x))
    return norm(x + dropout(sublayer(x)))


def sublayer_without_dropout(x, sublayer, norm, dropout, norm_first):
    return x + sublayer(norm(x)) if norm_first else norm(x + sublayer(x))


class Layer(nn.Module):
    """A reader's encoder layer built from the package's parts."""

    def __init__(self, d_model, num_heads, d_ff, dropout=0.1, norm_first=False):
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = tb.MultiHeadAttention(d_model, num_heads, dropout)
        self.feed_forward = tb.FeedForward(d_model, d_ff, dropout)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)

    def attend(self, x, mask):
        return self.self_attn(x, x, x, mask)[0]

    def forward(self, x, mask=None):
        if self.norm_first:
            x = x + self.attend(self.norm1(x), mask)
            return x + self.feed_forward(self.norm2(x))
        x = self.norm1(x + self.attend(x, mask))
        return self.norm2(x + self.feed_forward(x))


class LayerSwapped(Layer):
    def __init__(self, d_model, num_heads, d_ff, dropout=0.1, norm_first=False):
        super().__init__(d_model, num_heads, d_ff, dropout, not norm_first)


class LayerWithoutResiduals(Layer):
    def forward(self, x, mask=None):
        if self.norm_first:
            return self.feed_forward(self.norm2(self.attend(self.norm1(x), mask)))
        return self.norm2(self.feed_forward(self.norm1(self.attend(x, mask))))


class LayerNormsSwapped(Layer):
    def forward(self, x, mask=None):
        self.norm1, self.norm2 = self.norm2, self.norm1
        try:
            return super().forward(x, mask)
        finally:
            self.norm1, self.norm2 = self.norm2, self.norm1


class LayerMaskIgnored(Layer):
    def attend(self, x, mask):
        return self.self_attn(x, x, x)[0]


class LayerFeedForwardFirst(Layer):
    def forward(self, x, mask=None):
        if self.norm_first:
            x = x + self.feed_forward(self.norm2(x))
            return x + self.attend(self.norm1(x), mask)
        x = self.norm2(x + self.feed_forward(x))
        return self.norm1(x + self.attend(x, mask))


class LayerNormalisedResidual(Layer):
    def forward(self, x, mask=None):
        if not self.norm_first:
            return super().forward(x, mask)
        x = self.norm1(x)
        x = x + self.attend(x, mask)
        x = self.norm2(x)
        return x + self.feed_forward(x)


# --------------------------------------------------------------------------------------------
# Chapter 7: the decoder layer (the reader's takes no cache)
# --------------------------------------------------------------------------------------------


class Decoder(nn.Module):
    """A reader's decoder layer, written out without sublayer_connection: three residual blocks."""

    def __init__(self, d_model, num_heads, d_ff, dropout=0.1, norm_first=False):
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = tb.MultiHeadAttention(d_model, num_heads, dropout)
        self.cross_attn = tb.MultiHeadAttention(d_model, num_heads, dropout)
        self.feed_forward = tb.FeedForward(d_model, d_ff, dropout)
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(d_model) for _ in range(3))

    def looking_back(self, h, src_mask, tgt_mask):
        return self.self_attn(h, h, h, tgt_mask)[0]

    def reading_source(self, h, memory, src_mask, tgt_mask):
        return self.cross_attn(h, memory, memory, src_mask)[0]

    def blocks(self, memory, src_mask, tgt_mask):
        return [
            (lambda h: self.looking_back(h, src_mask, tgt_mask), self.norm1),
            (lambda h: self.reading_source(h, memory, src_mask, tgt_mask), self.norm2),
            (self.feed_forward, self.norm3),
        ]

    def forward(self, x, memory, *, src_mask=None, tgt_mask=None):
        for block, norm in self.blocks(memory, src_mask, tgt_mask):
            x = x + block(norm(x)) if self.norm_first else norm(x + block(x))
        return x


class DecoderPrePostSwapped(Decoder):
    def forward(self, x, memory, *, src_mask=None, tgt_mask=None):
        for block, norm in self.blocks(memory, src_mask, tgt_mask):
            x = norm(x + block(x)) if self.norm_first else x + block(norm(x))
        return x


class DecoderWithoutResiduals(Decoder):
    def forward(self, x, memory, *, src_mask=None, tgt_mask=None):
        for block, norm in self.blocks(memory, src_mask, tgt_mask):
            x = block(norm(x)) if self.norm_first else norm(block(x))
        return x


class DecoderNormsRotated(Decoder):
    def __init__(self, d_model, num_heads, d_ff, dropout=0.1, norm_first=False):
        super().__init__(d_model, num_heads, d_ff, dropout, norm_first)
        self.order = ("norm3", "norm1", "norm2")

    def blocks(self, memory, src_mask, tgt_mask):
        sublayers = [block for block, _ in super().blocks(memory, src_mask, tgt_mask)]
        return list(zip(sublayers, (getattr(self, name) for name in self.order)))


class DecoderCausalMaskIgnored(Decoder):
    def looking_back(self, h, src_mask, tgt_mask):
        return self.self_attn(h, h, h)[0]


class DecoderMasksSwapped(Decoder):
    def looking_back(self, h, src_mask, tgt_mask):
        return self.self_attn(h, h, h, src_mask)[0]

    def reading_source(self, h, memory, src_mask, tgt_mask):
        return self.cross_attn(h, memory, memory, tgt_mask)[0]


class DecoderReadsItself(Decoder):
    def reading_source(self, h, memory, src_mask, tgt_mask):
        return self.cross_attn(h, h, h, src_mask)[0]


class DecoderSourceFirst(Decoder):
    def blocks(self, memory, src_mask, tgt_mask):
        own, source, ffn = super().blocks(memory, src_mask, tgt_mask)
        return [source, own, ffn]


class DecoderMemoryNormalised(Decoder):
    def reading_source(self, h, memory, src_mask, tgt_mask):
        if self.norm_first:
            memory = self.norm2(memory)
        return self.cross_attn(h, memory, memory, src_mask)[0]


# --------------------------------------------------------------------------------------------
# Chapter 8: label smoothing and the learning rate
# --------------------------------------------------------------------------------------------


class Smoothing(nn.Module):
    """A reader's label-smoothed loss; the broken ones override target() or reduce()."""

    def __init__(self, vocab_size, smoothing=0.1, pad_id=0):
        super().__init__()
        self.v, self.eps, self.pad = vocab_size, smoothing, pad_id

    def target(self, target):
        dist = torch.full((*target.shape, self.v), self.eps / (self.v - 2))
        dist.scatter_(-1, target.unsqueeze(-1), 1 - self.eps)
        dist[..., self.pad] = 0
        return dist

    def reduce(self, per_position, target):
        real = target != self.pad
        return (per_position * real).sum() / real.sum().clamp(min=1)

    def forward(self, logits, target):
        per_position = -(self.target(target) * logits.float().log_softmax(-1)).sum(-1)
        return self.reduce(per_position, target)


class SmoothingPadColumnKept(Smoothing):
    def target(self, target):
        dist = torch.full((*target.shape, self.v), self.eps / (self.v - 2))
        return dist.scatter(-1, target.unsqueeze(-1), 1 - self.eps)


class SmoothingOverVMinusOne(Smoothing):
    def target(self, target):
        dist = torch.full((*target.shape, self.v), self.eps / (self.v - 1))
        dist.scatter_(-1, target.unsqueeze(-1), 1 - self.eps)
        dist[..., self.pad] = 0
        return dist


class SmoothingLikePyTorch(nn.Module):
    def __init__(self, vocab_size, smoothing=0.1, pad_id=0):
        super().__init__()
        self.eps, self.pad = smoothing, pad_id

    def forward(self, logits, target):
        flat = logits.float().reshape(-1, logits.shape[-1])
        return F.cross_entropy(flat, target.reshape(-1), ignore_index=self.pad, label_smoothing=self.eps)


class SmoothingMeanOverAll(Smoothing):
    def reduce(self, per_position, target):
        return (per_position * (target != self.pad)).mean()


class SmoothingFullConfidence(Smoothing):
    def target(self, target):
        dist = super().target(target)
        dist.scatter_(-1, target.unsqueeze(-1), 1.0)
        return dist


class SmoothingSummed(Smoothing):
    def reduce(self, per_position, target):
        return per_position[target != self.pad].sum()


class SmoothingKL(Smoothing):
    def forward(self, logits, target):
        log_probs = logits.float().log_softmax(-1)
        per_position = F.kl_div(log_probs, self.target(target), reduction="none").sum(-1)
        return self.reduce(per_position, target)


class SmoothingPadZero(Smoothing):
    def __init__(self, vocab_size, smoothing=0.1, pad_id=0):
        super().__init__(vocab_size, smoothing, 0)


def _taper(rate, step, total_steps):
    return rate if total_steps is None else rate * max(0.0, 1 - step / total_steps)


def rate_unscaled(step, d_model, warmup, factor=1.0, total_steps=None):
    step = max(step, 1)
    return _taper(factor * min(step**-0.5, step * warmup**-1.5), step, total_steps)


def rate_warmup_power_one(step, d_model, warmup, factor=1.0, total_steps=None):
    step = max(step, 1)
    return _taper(factor * d_model**-0.5 * min(step**-0.5, step / warmup), step, total_steps)


def rate_one_step_ahead(step, d_model, warmup, factor=1.0, total_steps=None):
    step = step + 1  # steps counted from 0
    return _taper(factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5), step, total_steps)


def rate_max(step, d_model, warmup, factor=1.0, total_steps=None):
    step = max(step, 1)
    return _taper(factor * d_model**-0.5 * max(step**-0.5, step * warmup**-1.5), step, total_steps)


def rate_no_warmup(step, d_model, warmup, factor=1.0, total_steps=None):
    step = max(step, 1)
    return _taper(factor / math.sqrt(d_model * step), step, total_steps)


def rate_factor_ignored(step, d_model, warmup, factor=1.0, total_steps=None):
    step = max(step, 1)
    rate = d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
    return rate if total_steps is None else rate * max(0.0, 1 - step / total_steps)


def rate_no_taper(step, d_model, warmup, factor=1.0, total_steps=None):
    step = max(step, 1)
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def rate_zero_at_start(step, d_model, warmup, factor=1.0, total_steps=None):
    rate = factor * d_model**-0.5 * float(torch.tensor(float(step)).pow(-0.5).clamp(max=step * warmup**-1.5))
    return rate if total_steps is None else rate * max(0.0, 1 - step / total_steps)


# --------------------------------------------------------------------------------------------
# Chapter 9: decoding, written without a cache
# --------------------------------------------------------------------------------------------


def greedy(
    model,
    src,
    max_len,
    bos_id,
    eos_id,
    *,
    pad=True,
    stop=True,
    bos=True,
    steps=None,
    any_eos=False,
    src_pad_visible=False,
    read=-1,
):
    """A reader's greedy loop that recomputes the prefix; the keywords make it go wrong one way each."""
    with torch.no_grad():
        src_mask = tb.padding_mask(src, model.config.pad_id)
        memory = model.encode(src, src_mask)
        ys = torch.full((src.size(0), 1), bos_id, dtype=torch.long)
        ended = torch.zeros(src.size(0), dtype=torch.bool)
        for _ in range(max_len - 1 if steps is None else steps(max_len)):
            hidden = model.decode(
                memory, ys, src_mask=None if src_pad_visible else src_mask, tgt_mask=tb.causal_mask(ys.size(1))
            )
            nxt = model.generator(hidden[:, read]).argmax(-1)
            if pad:
                nxt[ended] = model.config.pad_id
            ys = torch.cat([ys, nxt.unsqueeze(1)], 1)
            ended = ended | (nxt == eos_id)
            if (any_eos and ended.any()) or (stop and ended.all()):
                break
    return ys if bos else ys[:, 1:]


def beams(
    model,
    src,
    max_len,
    bos_id,
    eos_id,
    beam_size=4,
    src_mask=None,
    alpha=0.6,
    *,
    length_start=0,
    eos_counts=True,
    penalty=None,
    freeze=True,
):
    """A reader's beam search, one source at a time with lists of hypotheses (tokens, log P, |y|, done)."""
    pad = model.config.pad_id
    lp = penalty or (lambda n: ((5 + n) / 6) ** alpha)
    winners = []
    with torch.no_grad():
        for row in src:
            row = row.unsqueeze(0)
            row_mask = tb.padding_mask(row, pad)
            memory = model.encode(row, row_mask)
            alive = [([bos_id], 0.0, length_start, False)]
            for _ in range(max_len - 1):
                if all(done for *_, done in alive):
                    break
                candidates = []
                for tokens, score, length, done in alive:
                    if done and freeze:
                        candidates.append((tokens + [pad], score, length, True))
                        continue
                    ys = torch.tensor([tokens])
                    hidden = model.decode(memory, ys, src_mask=row_mask, tgt_mask=tb.causal_mask(len(tokens)))
                    log_probs = model.generator(hidden[:, -1]).log_softmax(-1)[0]
                    for token, lp_token in enumerate(log_probs.tolist()):
                        grows = 1 if eos_counts or token != eos_id else 0
                        candidates.append(
                            (tokens + [token], score + lp_token, length + grows, freeze and token == eos_id)
                        )
                candidates.sort(key=lambda c: c[1] / lp(c[2]), reverse=True)
                alive = candidates[:beam_size]
            winners.append(max(alive, key=lambda c: c[1] / lp(c[2]))[0])
    width = max(len(tokens) - next(i for i, t in enumerate(reversed(tokens)) if t != pad) for tokens in winners)
    return torch.tensor([(tokens + [pad] * max_len)[:width] for tokens in winners])


def greedy_no_padding(model, src, max_len, bos_id, eos_id):
    return greedy(model, src, max_len, bos_id, eos_id, pad=False)


def greedy_runs_to_max_len(model, src, max_len, bos_id, eos_id):
    return greedy(model, src, max_len, bos_id, eos_id, stop=False)


def greedy_without_bos(model, src, max_len, bos_id, eos_id):
    return greedy(model, src, max_len, bos_id, eos_id, bos=False)


def greedy_max_len_steps(model, src, max_len, bos_id, eos_id):
    return greedy(model, src, max_len, bos_id, eos_id, steps=lambda n: n)


def greedy_stops_at_first(model, src, max_len, bos_id, eos_id):
    return greedy(model, src, max_len, bos_id, eos_id, any_eos=True)


def greedy_sees_source_padding(model, src, max_len, bos_id, eos_id):
    return greedy(model, src, max_len, bos_id, eos_id, src_pad_visible=True)


def greedy_reads_first(model, src, max_len, bos_id, eos_id):
    return greedy(model, src, max_len, bos_id, eos_id, read=0)


def beams_counting_bos(model, src, max_len, bos_id, eos_id, beam_size=4, src_mask=None, alpha=0.6):
    return beams(model, src, max_len, bos_id, eos_id, beam_size, src_mask, alpha, length_start=1)


def beams_eos_uncounted(model, src, max_len, bos_id, eos_id, beam_size=4, src_mask=None, alpha=0.6):
    return beams(model, src, max_len, bos_id, eos_id, beam_size, src_mask, alpha, eos_counts=False)


def beams_unpenalised(model, src, max_len, bos_id, eos_id, beam_size=4, src_mask=None, alpha=0.6):
    return beams(model, src, max_len, bos_id, eos_id, beam_size, src_mask, alpha, penalty=lambda n: 1.0)


def beams_length_power(model, src, max_len, bos_id, eos_id, beam_size=4, src_mask=None, alpha=0.6):
    return beams(model, src, max_len, bos_id, eos_id, beam_size, src_mask, alpha, penalty=lambda n: n**alpha)


def beams_unfrozen(model, src, max_len, bos_id, eos_id, beam_size=4, src_mask=None, alpha=0.6):
    return beams(model, src, max_len, bos_id, eos_id, beam_size, src_mask, alpha, freeze=False)


BROKEN = [
    ("TokenEmbedding", "missing_scale", EmbeddingUnscaled),
    ("TokenEmbedding", "scaled_by_d_model", EmbeddingTimesDModel),
    ("TokenEmbedding", "divided_by_sqrt_d_model", EmbeddingDividedBySqrt),
    ("TokenEmbedding", "scaled_by_sqrt_vocab_size", EmbeddingSqrtVocab),
    ("TokenEmbedding", "padding_idx_ignored", EmbeddingNoPaddingIdx),
    ("TokenEmbedding", "table_one_row_short", EmbeddingOneRowShort),
    ("sinusoidal_positional_encoding", "sine_cosine_swapped", pe_cos_first),
    ("sinusoidal_positional_encoding", "positions_from_one", pe_from_one),
    ("sinusoidal_positional_encoding", "halves_concatenated", pe_concatenated),
    ("sinusoidal_positional_encoding", "exponent_uses_column", pe_column_as_i),
    ("sinusoidal_positional_encoding", "columns_counted_from_one", pe_columns_from_one),
    ("sinusoidal_positional_encoding", "exponent_without_two", pe_without_two),
    ("sinusoidal_positional_encoding", "frequency_inverted", pe_times_frequency),
    ("sinusoidal_positional_encoding", "sine_only", pe_sine_only),
    ("scaled_dot_product_attention", "no_scale", attention_unscaled),
    ("scaled_dot_product_attention", "divided_by_d_k", attention_over_d_k),
    ("scaled_dot_product_attention", "scale_uses_d_v", attention_over_d_v),
    ("scaled_dot_product_attention", "scale_uses_length", attention_over_length),
    ("scaled_dot_product_attention", "softmax_over_queries", attention_softmax_over_queries),
    ("scaled_dot_product_attention", "mask_inverted", attention_mask_inverted),
    ("scaled_dot_product_attention", "masked_scores_zero", attention_fill_zero),
    ("scaled_dot_product_attention", "empty_row_nan", attention_nan_rows),
    ("scaled_dot_product_attention", "empty_row_average", attention_minus_1e9),
    ("split_heads", "split_without_transpose", split_by_view),
    ("split_heads", "heads_and_width_swapped", split_width_swapped),
    ("split_heads", "strided_heads", split_strided),
    ("split_heads", "keys_transposed", split_keys_transposed),
    ("split_heads", "split_by_layers", split_six),
    ("merge_heads", "merge_without_transpose", merge_by_view),
    ("merge_heads", "strided_merge", merge_strided),
    ("merge_heads", "heads_summed", merge_summed),
    ("merge_heads", "heads_averaged", merge_averaged),
    ("merge_heads", "concatenated_along_positions", merge_along_positions),
    ("MultiHeadAttention", "merge_without_transpose", HeadsMergedByView),
    ("MultiHeadAttention", "split_without_transpose", HeadsSplitByView),
    ("MultiHeadAttention", "heads_and_width_swapped", HeadsWidthSwapped),
    ("MultiHeadAttention", "split_by_layers", HeadsSixParts),
    ("MultiHeadAttention", "missing_out_proj", HeadsNoOutProj),
    ("MultiHeadAttention", "values_not_projected", HeadsValuesUnprojected),
    ("MultiHeadAttention", "scaled_by_d_model", HeadsScaledByDModel),
    ("padding_mask", "inverted", padding_true_at_pads),
    ("padding_mask", "missing_query_axis", padding_no_query_axis),
    ("padding_mask", "hides_queries", padding_hides_queries),
    ("padding_mask", "head_axis_added", padding_with_head_axis),
    ("padding_mask", "not_boolean", padding_as_floats),
    ("padding_mask", "pad_id_ignored", padding_zero_hard_coded),
    ("causal_mask", "transposed", causal_upper),
    ("causal_mask", "diagonal_hidden", causal_strict),
    ("causal_mask", "blocked_convention", causal_blocked),
    ("causal_mask", "additive_float_mask", causal_additive),
    ("causal_mask", "one_future_token_visible", causal_one_ahead),
    ("causal_mask", "not_boolean", causal_ones_and_zeros),
    ("sublayer_connection", "pre_post_swapped", sublayer_swapped),
    ("sublayer_connection", "norm_first_ignored", sublayer_always_post),
    ("sublayer_connection", "missing_residual", sublayer_no_residual),
    ("sublayer_connection", "dropout_after_residual", sublayer_dropout_on_sum),
    ("sublayer_connection", "residual_added_after_norm", sublayer_norm_then_add),
    ("sublayer_connection", "normalised_residual", sublayer_overwritten_input),
    ("sublayer_connection", "dropout_missing", sublayer_without_dropout),
    ("EncoderLayer", "pre_post_swapped", LayerSwapped),
    ("EncoderLayer", "missing_residual", LayerWithoutResiduals),
    ("EncoderLayer", "norms_swapped", LayerNormsSwapped),
    ("EncoderLayer", "mask_ignored", LayerMaskIgnored),
    ("EncoderLayer", "feed_forward_first", LayerFeedForwardFirst),
    ("EncoderLayer", "normalised_residual", LayerNormalisedResidual),
    ("DecoderLayer", "pre_post_swapped", DecoderPrePostSwapped),
    ("DecoderLayer", "missing_residual", DecoderWithoutResiduals),
    ("DecoderLayer", "norms_swapped", DecoderNormsRotated),
    ("DecoderLayer", "causal_mask_ignored", DecoderCausalMaskIgnored),
    ("DecoderLayer", "masks_swapped", DecoderMasksSwapped),
    ("DecoderLayer", "cross_attention_on_itself", DecoderReadsItself),
    ("DecoderLayer", "sublayers_reordered", DecoderSourceFirst),
    ("DecoderLayer", "memory_normalised", DecoderMemoryNormalised),
    ("LabelSmoothingLoss", "mass_on_padding", SmoothingPadColumnKept),
    ("LabelSmoothingLoss", "wrong_share", SmoothingOverVMinusOne),
    ("LabelSmoothingLoss", "pytorch_label_smoothing", SmoothingLikePyTorch),
    ("LabelSmoothingLoss", "padding_positions_counted", SmoothingMeanOverAll),
    ("LabelSmoothingLoss", "confidence_not_one_minus_smoothing", SmoothingFullConfidence),
    ("LabelSmoothingLoss", "summed_not_averaged", SmoothingSummed),
    ("LabelSmoothingLoss", "kl_divergence", SmoothingKL),
    ("LabelSmoothingLoss", "pad_id_ignored", SmoothingPadZero),
    ("noam_rate", "missing_d_model_factor", rate_unscaled),
    ("noam_rate", "wrong_warmup_power", rate_warmup_power_one),
    ("noam_rate", "step_off_by_one", rate_one_step_ahead),
    ("noam_rate", "max_instead_of_min", rate_max),
    ("noam_rate", "no_warmup", rate_no_warmup),
    ("noam_rate", "factor_ignored", rate_factor_ignored),
    ("noam_rate", "taper_ignored", rate_no_taper),
    ("noam_rate", "zero_at_step_zero", rate_zero_at_start),
    ("greedy_decode", "no_padding_after_eos", greedy_no_padding),
    ("greedy_decode", "no_early_stop", greedy_runs_to_max_len),
    ("greedy_decode", "bos_missing", greedy_without_bos),
    ("greedy_decode", "max_len_off_by_one", greedy_max_len_steps),
    ("greedy_decode", "stops_at_first_eos", greedy_stops_at_first),
    ("greedy_decode", "source_padding_visible", greedy_sees_source_padding),
    ("greedy_decode", "reads_first_position", greedy_reads_first),
    ("beam_search", "length_counts_bos", beams_counting_bos),
    ("beam_search", "length_without_eos", beams_eos_uncounted),
    ("beam_search", "no_length_penalty", beams_unpenalised),
    ("beam_search", "length_power_penalty", beams_length_power),
    ("beam_search", "finished_not_frozen", beams_unfrozen),
]


# --------------------------------------------------------------------------------------------
# Correct versions written another way than the package's
# --------------------------------------------------------------------------------------------


def attention_einsum_float64(query, key, value, mask=None):
    """Scores with einsum in float64, the scale applied to the queries first, empty rows by where."""
    q = query.double() / math.sqrt(query.shape[-1])
    scores = torch.einsum("...qd,...kd->...qk", q, key.double())
    if mask is not None:
        scores = torch.where(mask, scores, torch.tensor(float("-inf"), dtype=torch.float64))
    weights = torch.exp(scores - scores.amax(-1, keepdim=True).clamp(min=-1e300))
    weights = weights / weights.sum(-1, keepdim=True).clamp(min=1e-300)
    weights = weights.nan_to_num(0.0)
    return (weights @ value.double()).to(query.dtype)


def pe_by_loops(max_len, d_model):
    table = torch.zeros(max_len, d_model, dtype=torch.float64)
    for pos in range(max_len):
        for i in range(d_model // 2):
            table[pos, 2 * i] = math.sin(pos / 10000 ** (2 * i / d_model))
            table[pos, 2 * i + 1] = math.cos(pos / 10000 ** (2 * i / d_model))
    return table.float()


def pe_float32(max_len, d_model):
    """The usual float32 recipe: exp of a log for the frequencies, and slices for the columns."""
    table = torch.zeros(max_len, d_model)
    position = torch.arange(0, max_len).unsqueeze(1).float()
    frequency = torch.exp(torch.arange(0, d_model, 2).float() * -(math.log(10000.0) / d_model))
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)
    return table


def pe_full_signature(max_len, d_model, interleaved=True, dtype=torch.float32):
    angle = _angles(max_len, d_model)
    if interleaved:
        return torch.stack([angle.sin(), angle.cos()], dim=2).reshape(max_len, d_model).to(dtype)
    return torch.cat([angle.sin(), angle.cos()], dim=1).to(dtype)


def padding_by_comparison(tokens, pad_id=0):
    return (tokens.unsqueeze(-2) != pad_id).to(torch.bool)


def causal_by_aranges(size, device=None):
    return (torch.arange(size)[None, :] <= torch.arange(size)[:, None]).unsqueeze(0)


def causal_two_dimensional(size, device=None):
    return torch.tril(torch.ones(size, size, dtype=torch.bool))


class SmoothingByEntropy(nn.Module):
    """The loss as KL divergence plus the target's entropy, in float64."""

    def __init__(self, vocab_size, smoothing=0.1, pad_id=0):
        super().__init__()
        self.v, self.eps, self.pad = vocab_size, smoothing, pad_id

    def forward(self, logits, target):
        q = F.one_hot(target, self.v).double() * (1 - self.eps - self.eps / (self.v - 2)) + self.eps / (self.v - 2)
        q[..., self.pad] = 0
        log_p = logits.double().log_softmax(-1)
        entropy = -(q * q.clamp(min=1e-300).log()).sum(-1)
        per_position = F.kl_div(log_p, q, reduction="none").sum(-1) + entropy
        real = target != self.pad
        return per_position[real].sum() / real.sum().clamp(min=1)


def rate_piecewise(step, d_model, warmup, factor=1.0, total_steps=None):
    step = max(step, 1)
    rate = factor / math.sqrt(d_model) * (step / warmup**1.5 if step < warmup else 1 / math.sqrt(step))
    return rate * max(0.0, 1 - step / total_steps) if total_steps else rate


class HeadsEinsum(nn.Module):
    def __init__(self, d_model, num_heads):
        super().__init__()
        self.h = num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, query, key, value, mask=None):
        def heads(t):
            return t.unflatten(-1, (self.h, -1))  # (B, len, heads, d_head)

        q, k, v = heads(self.q_proj(query)), heads(self.k_proj(key)), heads(self.v_proj(value))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None], float("-inf"))
        weights = scores.softmax(-1)
        return self.out_proj(torch.einsum("bhqk,bkhd->bqhd", weights, v).flatten(-2))


def correct_greedy(model, src, max_len, bos_id, eos_id):
    return greedy(model, src, max_len, bos_id, eos_id)


def correct_beams(model, src, max_len, bos_id, eos_id, beam_size=4, src_mask=None, alpha=0.6):
    return beams(model, src, max_len, bos_id, eos_id, beam_size, src_mask, alpha)


CORRECT = [
    ("scaled_dot_product_attention", attention_einsum_float64),
    ("sinusoidal_positional_encoding", pe_by_loops),
    ("sinusoidal_positional_encoding", pe_full_signature),
    ("sinusoidal_positional_encoding", pe_float32),
    ("padding_mask", padding_by_comparison),
    ("causal_mask", causal_by_aranges),
    ("causal_mask", causal_two_dimensional),
    ("TokenEmbedding", Embedding),
    ("MultiHeadAttention", Heads),
    ("MultiHeadAttention", HeadsEinsum),
    ("EncoderLayer", Layer),
    ("DecoderLayer", Decoder),
    ("LabelSmoothingLoss", SmoothingByEntropy),
    ("LabelSmoothingLoss", Smoothing),
    ("noam_rate", rate_piecewise),
    ("greedy_decode", correct_greedy),
    ("beam_search", correct_beams),
]


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


def test_every_component_is_listed_and_documented():
    assert exercises.names() == list(PACKAGE)
    for name in exercises.names():
        assert f'``"{name}"``' in check.__doc__, name
        assert len(exercises.catalogue(name)[name]) >= 4, name


@pytest.mark.parametrize("name", list(PACKAGE))
def test_the_package_passes_its_own_checks(name):
    result = check(name, PACKAGE[name])
    assert result.passed and bool(result) and result.mistake is None, result.message
    assert "agrees with the package's" in result.message
    assert result.cases >= 3


def test_every_mistake_in_the_catalogue_has_a_broken_version_here():
    from reader_versions import WRONG  # the bank of tests/test_exercises_bank.py

    catalogued = {(name, mistake) for name, mistakes in exercises.catalogue().items() for mistake in mistakes}
    assert {(name, mistake) for name, mistake, _ in BROKEN + WRONG} == catalogued


@pytest.mark.parametrize(("name", "mistake", "broken"), BROKEN, ids=[f"{n}-{m}" for n, m, _ in BROKEN])
def test_a_broken_version_is_failed_with_its_mistake_named(name, mistake, broken):
    result = check(name, broken)
    assert not result.passed and not result, result.message
    assert result.mistake == mistake, result.message
    entry = next(m for m in exercises._spec(name).mistakes if m.name == mistake)
    # The message names the mistake, says what it computes and where the results differ, and sends
    # the reader to the section that explains it (and to the errata rows of a source that does it).
    did = f" You {entry.did}:" if entry.did else ""
    assert f"Recognised mistake “{mistake}”:{did} {entry.does}." in result.message
    assert "differ" in result.message and "On “" in result.message
    section = entry.section or exercises._spec(name).section
    assert result.section == section and f"Re-read {section} ({section.link})." in result.message
    for row in entry.errata:
        assert f"appendix/a_errata.html#errata-{row})" in result.message
    # It describes; it never prescribes a change, which could be the wrong one.
    assert not re.search(r"\b(should|try|change it|replace it|fix)\b", result.message, re.IGNORECASE)
    for other in exercises._spec(name).mistakes:  # nor does it describe another mistake than the one named
        assert other.name == mistake or other.does not in result.message


@pytest.mark.parametrize(("name", "correct"), CORRECT, ids=[f"{n}-{getattr(f, '__name__', f)}" for n, f in CORRECT])
def test_a_correct_version_written_another_way_passes(name, correct):
    result = check(name, correct)
    assert result.passed, result.message


def test_a_version_without_the_optional_parameters_passes_and_says_what_it_skipped():
    result = check("sinusoidal_positional_encoding", pe_by_loops)
    assert result.passed
    assert "Not checked: 2 input(s)" in result.message and "dtype, interleaved" in result.message


def test_a_version_that_takes_none_of_the_needed_parameters_is_told_so():
    def beam_without_beam_size(model, src, max_len, bos_id, eos_id):
        return tb.greedy_decode(model, src, max_len, bos_id, eos_id)

    result = check("beam_search", beam_without_beam_size)
    assert not result.passed and "needs the parameter(s) beam_size" in result.message


def test_a_mask_without_the_batch_axis_passes_with_a_note():
    result = check("causal_mask", causal_two_dimensional)
    assert result.passed and "broadcast the same way" in result.message


def test_a_function_that_raises_gets_its_exception_named_not_a_traceback():
    def my_attention(query, key, value, mask=None):
        scores = query @ key  # forgot the transpose
        return scores.softmax(-1) @ value

    result = check("scaled_dot_product_attention", my_attention)
    assert not result.passed and result.mistake is None
    assert "raised RuntimeError" in result.message
    assert "in my_attention, line" in result.message and "`scores = query @ key  # forgot the transpose`" in (
        result.message
    )
    assert "Traceback" not in result.message and "transformer_book" not in result.message


def test_a_class_whose_constructor_raises_and_a_function_that_exits():
    class Broken(nn.Module):
        def __init__(self, d_model, num_heads):
            raise KeyError("no heads today")

    result = check("MultiHeadAttention", Broken)
    assert not result.passed and "Building your" in result.message and "KeyError: 'no heads today'" in result.message

    def leaves(size, device=None):
        sys.exit(3)

    result = check("causal_mask", leaves)
    assert not result.passed and "raised SystemExit: 3" in result.message


def test_a_wrong_shape_is_reported_with_both_shapes():
    result = check("sinusoidal_positional_encoding", lambda max_len, d_model: torch.zeros(d_model, max_len))
    assert not result.passed
    assert "output has shape (2, 1) where the package's has shape (1, 2)" in result.message

    result = check("noam_rate", lambda step, d_model, warmup: None)
    assert not result.passed and "returned NoneType for step=1; the package returns a float" in result.message


def test_an_unrecognised_difference_is_still_located():
    def slightly_off(query, key, value, mask=None):
        out, weights = tb.scaled_dot_product_attention(query, key, value, mask)
        out = out.clone()
        out[..., 0, 1] += 0.5  # the first query's second feature, in every batch
        return out, weights

    result = check("scaled_dot_product_attention", slightly_off)
    assert not result.passed and result.mistake is None
    assert "output: 2 of 36 entries differ; the first at batch 0, query 0, feature 1" in result.message
    assert "the largest difference is 0.5" in result.message
    assert "(all differences lie at query 0; feature 1)" in result.message
    assert f"Re-read {exercises._spec('scaled_dot_product_attention').section}" in result.message


def test_a_decoder_that_never_stops_is_stopped():
    def stuck(model, src, max_len, bos_id, eos_id):
        ys = torch.full((len(src), 1), bos_id)
        while ys.shape[1] < max_len:
            hidden = model.decode(model.encode(src), ys)
            longer = torch.cat([ys, model.generator(hidden[:, -1]).argmax(-1, keepdim=True)], dim=1)  # noqa: F841
        return ys  # never reached: `longer` was meant to be `ys`

    result = check("greedy_decode", stuck)
    assert not result.passed and "the loop did not end" in result.message


def test_wrong_arguments_are_explained():
    with pytest.raises(ValueError, match="knows: TokenEmbedding, sinusoidal_positional_encoding"):
        check("softmax", torch.softmax)
    result = check("MultiHeadAttention", tb.MultiHeadAttention(8, 2))
    assert not result.passed and "needs your class itself, not an instance" in result.message
    result = check("causal_mask", 3)
    assert not result.passed and "needs your function" in result.message


def test_parameters_under_other_names_are_reported():
    class Named(nn.Module):
        def __init__(self, d_model, num_heads):
            super().__init__()
            self.w_q = nn.Linear(d_model, d_model)

    result = check("MultiHeadAttention", Named)
    assert (
        not result.passed and "w_q.weight (12, 12)" in result.message and "q_proj.weight (12, 12)" in (result.message)
    )


def test_the_verdict_does_not_depend_on_or_disturb_the_global_random_state():
    torch.manual_seed(1)
    before = torch.get_rng_state()
    first = check("MultiHeadAttention", HeadsScaledByDModel)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(2)
    torch.rand(5)
    second = check("MultiHeadAttention", HeadsScaledByDModel)
    assert first.message == second.message and first.mistake == second.mistake
    threads = torch.get_num_threads()
    check("noam_rate", tb.noam_rate)
    assert torch.get_num_threads() == threads


def test_the_result_renders_in_a_notebook():
    passed = check("causal_mask", tb.causal_mask)
    failed = check("causal_mask", causal_upper)
    assert str(passed).startswith("✅ causal_mask: passed")
    assert str(failed).startswith("❌ causal_mask: mistake “transposed”")
    assert repr(failed).startswith("CheckResult(name='causal_mask', passed=False, mistake='transposed')")
    html = failed._repr_html_()
    assert '<a href="05_masking.html#the-causal-subsequent-mask">' in html and "<strong>" in html
    markdown = failed._repr_markdown_()
    assert "[05_masking.html#the-causal-subsequent-mask](05_masking.html#the-causal-subsequent-mask)" in markdown
    assert isinstance(passed, CheckResult) and bool(passed) and not bool(failed)


def _sections() -> set[exercises.Section]:
    found = {spec.section for spec in exercises._REGISTRY.values()}
    return found | {m.section for spec in exercises._REGISTRY.values() for m in spec.mistakes if m.section}


def test_the_sections_and_errata_rows_the_messages_cite_exist():
    for section in _sections():
        notebook = ROOT / "chapters" / f"{section.page}.ipynb"
        text = "\n".join("".join(cell["source"]) for cell in json.loads(notebook.read_text())["cells"])
        if section.anchor:
            assert f"({section.anchor})=" in text, section
        else:
            assert re.search(rf"^#+ {re.escape(section.title)}$", text, re.MULTILINE), section
    errata = (ROOT / "chapters" / "appendix" / "a_errata.ipynb").read_text()
    rows = {row for spec in exercises._REGISTRY.values() for m in spec.mistakes for row in m.errata}
    for row in rows:
        assert f"(errata-{row})=" in errata, row


def test_the_anchors_are_the_ones_sphinx_makes():
    nodes = pytest.importorskip("docutils.nodes")
    for section in _sections():
        if not section.anchor:
            title = re.sub(r"[`$]", "", section.title)
            assert section.link.split("#")[1] == nodes.make_id(title), section
