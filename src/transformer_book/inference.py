"""Chapter 9: turning a trained model into output tokens.

Decoding is a loop: feed the tokens chosen so far, read the distribution over
the next one, choose, repeat until EOS. Greedy decoding takes the most likely
token; beam search keeps the ``beam_size`` best prefixes. With a KV cache each
step feeds only the newest token, and the keys and values of earlier positions
are read back instead of recomputed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_decoding, check_positive
from .masking import causal_mask, padding_mask
from .model import Transformer


@torch.inference_mode()
def greedy_decode(
    model: Transformer,
    src: Tensor,
    max_len: int,
    bos_id: int,
    eos_id: int | None,
    src_mask: Tensor | None = None,
    use_cache: bool = True,
) -> Tensor:
    """``src (batch, src_len)`` → ids ``(batch, ≤ max_len)``: BOS, then the likeliest
    token at each step; ``pad_id`` after EOS. No cache: the same tokens, more slowly."""
    check_decoding(model.config, src, max_len, bos_id, eos_id)
    pad = model.config.pad_id
    src_mask = padding_mask(src, pad) if src_mask is None else src_mask
    memory = model.encode(src, src_mask)
    ys = torch.full((len(src), 1), bos_id, device=src.device)
    done = torch.zeros(len(src), dtype=torch.bool, device=src.device)
    cache = model.decoder.new_cache() if use_cache else None
    while ys.shape[1] < max_len and not done.all():
        if use_cache:  # only the newest token: the cache holds the rest
            hidden = model.decode(memory, ys[:, -1:], src_mask=src_mask, cache=cache)
        else:  # the whole prefix, causally masked
            causal = causal_mask(ys.shape[1], ys.device)
            hidden = model.decode(memory, ys, src_mask=src_mask, tgt_mask=causal)
        token = model.generator(hidden[:, -1]).argmax(-1).masked_fill(done, pad)
        ys = torch.cat([ys, token[:, None]], dim=1)
        done |= token == eos_id if eos_id is not None else False
    return ys


def length_penalty(length: Tensor, alpha: float) -> Tensor:
    """GNMT's length normalisation ``((5 + length) / 6) ** alpha`` (Wu et al., 2016)."""
    return ((5.0 + length) / 6.0) ** alpha


@torch.inference_mode()
def beam_search(
    model: Transformer,
    src: Tensor,
    max_len: int,
    bos_id: int,
    eos_id: int | None,
    beam_size: int = 4,
    src_mask: Tensor | None = None,
    alpha: float = 0.6,
) -> Tensor:
    """Keep the ``beam_size`` best prefixes per source; return the best finished one per row.

    Hypotheses are ranked by ``log P(prefix) / length_penalty(length, alpha)``
    (``alpha=0`` ranks by log-probability alone). A finished hypothesis keeps its
    score and is extended only by padding. ``src (batch, src_len)`` → ids
    ``(batch, ≤ max_len)`` starting with ``bos_id``, padded with ``pad_id``.
    With ``beam_size=1`` this is greedy decoding.
    """
    check_decoding(model.config, src, max_len, bos_id, eos_id)
    check_positive(beam_size, "beam_size")
    pad_id, vocab = model.config.pad_id, model.config.tgt_vocab_size
    batch, k = src.shape[0], beam_size
    device = src.device
    if src_mask is None:
        src_mask = padding_mask(src, pad_id)
    # Each source is repeated once per beam: rows b*k .. b*k + k-1 belong to source b.
    memory = model.encode(src, src_mask).repeat_interleave(k, dim=0)
    memory_mask = src_mask.repeat_interleave(k, dim=0)
    cache = model.decoder.new_cache()

    ys = torch.full((batch * k, 1), bos_id, dtype=torch.long, device=device)
    scores = torch.full((batch, k), float("-inf"), device=device)
    scores[:, 0] = 0.0  # at the start all beams are the same prefix: expand only one
    lengths = torch.zeros(
        batch, k, device=device
    )  # |y|: tokens after BOS so far, EOS included
    finished = torch.zeros(batch, k, dtype=torch.bool, device=device)

    for _step in range(max_len - 1):
        hidden = model.decode(memory, ys[:, -1:], src_mask=memory_mask, cache=cache)
        log_probs = (
            model.generator(hidden[:, -1]).log_softmax(dim=-1).view(batch, k, vocab)
        )
        # A finished hypothesis may only be continued by padding, at no cost.
        pad_only = torch.full_like(log_probs[0, 0], float("-inf"))
        pad_only[pad_id] = 0.0
        log_probs = torch.where(finished.unsqueeze(-1), pad_only, log_probs)

        candidates = (scores.unsqueeze(-1) + log_probs).view(batch, k * vocab)
        candidate_lengths = (
            (lengths + (~finished).float())
            .unsqueeze(-1)
            .expand(batch, k, vocab)
            .reshape(batch, k * vocab)
        )
        ranked = candidates / length_penalty(candidate_lengths, alpha)
        _, best = ranked.topk(k, dim=-1)  # (batch, k)

        beam = best // vocab
        token = best % vocab
        rows = (beam + torch.arange(batch, device=device).unsqueeze(1) * k).view(-1)
        scores = candidates.gather(1, best)
        lengths = candidate_lengths.gather(1, best)
        finished = finished.gather(1, beam) | (
            token == eos_id if eos_id is not None else False
        )
        ys = torch.cat([ys.index_select(0, rows), token.view(-1, 1)], dim=1)
        for (
            layer_cache
        ) in cache:  # the cross-attention cache is the same for every beam of a source
            layer_cache.self_attn.reorder(rows)
        if finished.all():
            break

    final = scores / length_penalty(lengths, alpha)
    best_beam = final.argmax(dim=-1)  # (batch,)
    rows = best_beam + torch.arange(batch, device=device) * k
    best_ys = ys.index_select(0, rows)
    # Other beams may have run longer than every winner: drop columns that are padding in every row.
    keep = int((best_ys != pad_id).any(dim=0).nonzero().max()) + 1
    return best_ys[:, :keep]
