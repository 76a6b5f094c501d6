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

from .checks import (
    check_decoding,
    check_non_negative,
    check_positive,
    check_tokens,
    trusted_ids,
)
from .masking import causal_mask, padding_mask
from .model import Transformer

#: How many steps the decoding loops take between their reads of the device, each of
#: which asks whether every row has finished.
CHECK_EVERY = 8


@torch.inference_mode()
def greedy_decode(
    model: Transformer,
    src: Tensor,
    max_tokens: int,
    bos_id: int,
    eos_id: int | None,
    src_mask: Tensor | None = None,
    use_cache: bool = True,
) -> Tensor:
    """``src (batch, src_len)`` → ids ``(batch, ≤ max_tokens)``: BOS, then the likeliest
    token at each step; ``pad_id`` after EOS. No cache: the same tokens, more slowly."""
    check_decoding(model, src, max_tokens, bos_id, eos_id)
    pad, batch, device = model.config.pad_id, src.shape[0], src.device
    src_mask = padding_mask(src, pad) if src_mask is None else src_mask
    ys = torch.full((batch, max_tokens), pad, device=device)  # filled step by step
    ys[:, 0] = bos_id
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    with trusted_ids():  # src is checked; later ids are the model's own argmax
        memory = model.encode(src, src_mask)
        cache = model.decoder.new_cache(memory, max_tokens - 1) if use_cache else None
        for t in range(1, max_tokens):
            tgt = ys[:, t - 1 : t] if use_cache else ys[:, :t]  # cache: the newest
            mask = None if use_cache else causal_mask(t, device)
            h = model.decode(memory, tgt, src_mask=src_mask, tgt_mask=mask, cache=cache)
            ys[:, t] = model.generator(h[:, -1]).argmax(-1).masked_fill(done, pad)
            done |= ys[:, t] == eos_id
            if t % CHECK_EVERY == 0 and done.all():  # the host waits here only
                break
    return ys[:, : decoded_length(ys, eos_id)]


def decoded_length(ys: Tensor, eos_id: int | None) -> int:
    """Columns up to the step at which the last row of ``ys (batch, max_tokens)`` emitted its
    EOS (all of them if a row never did): where a loop that checked every step would stop."""
    check_tokens(ys, "ys")
    if eos_id is None:
        return ys.shape[1]
    is_eos = ys[:, 1:] == eos_id
    if not is_eos.any(dim=1).all():
        return ys.shape[1]
    return int(is_eos.int().argmax(dim=1).max()) + 2


def length_penalty(length: Tensor, alpha: float) -> Tensor:
    """GNMT's length normalisation ``((5 + length) / 6) ** alpha`` (Wu et al., 2016)."""
    return ((5.0 + length) / 6.0) ** alpha


@torch.inference_mode()
def beam_search(
    model: Transformer,
    src: Tensor,
    max_tokens: int,
    bos_id: int,
    eos_id: int | None,
    beam_size: int = 4,
    src_mask: Tensor | None = None,
    alpha: float = 0.6,
    use_cache: bool = True,
) -> Tensor:
    """Keep the ``beam_size`` best prefixes per source; return the best finished one per row.

    Hypotheses are ranked by ``log P(prefix) / length_penalty(length, alpha)``
    (``alpha=0`` ranks by log-probability alone). A finished hypothesis keeps its
    score and is extended only by padding. ``src (batch, src_len)`` → ids
    ``(batch, ≤ max_tokens)`` starting with ``bos_id``, padded with ``pad_id``.
    With ``beam_size=1`` this is greedy decoding. No cache: each step feeds the whole
    prefix under the causal mask (the same tokens, more slowly).
    """
    check_decoding(model, src, max_tokens, bos_id, eos_id)
    check_positive(beam_size, "beam_size")
    check_non_negative(alpha, "alpha")
    pad_id, vocab = model.config.pad_id, model.config.tgt_vocab_size
    batch, k = src.shape[0], beam_size
    device = src.device
    if src_mask is None:
        src_mask = padding_mask(src, pad_id)
    with trusted_ids():  # src was checked above; the rest are the model's own tokens
        # Each source is repeated once per beam: rows b*k .. b*k + k-1 are source b's.
        memory = model.encode(src, src_mask).repeat_interleave(k, dim=0)
    # Each beam of source b needs row b of the mask; one without a batch axis (or of batch
    # 1, broadcast) serves every beam as it is.
    batched = src_mask.dim() == 3 and src_mask.shape[0] != 1
    memory_mask = src_mask.repeat_interleave(k, dim=0) if batched else src_mask
    cache = model.decoder.new_cache(memory, max_tokens - 1) if use_cache else None

    ys = torch.full((batch * k, 1), bos_id, dtype=torch.long, device=device)
    scores = torch.full((batch, k), float("-inf"), device=device)
    scores[:, 0] = 0.0  # at the start all beams are the same prefix: expand only one
    # |y|: tokens after BOS so far, EOS included
    lengths = torch.zeros(batch, k, device=device)
    finished = torch.zeros(batch, k, dtype=torch.bool, device=device)
    # A finished hypothesis may only be continued by padding, at no cost.
    pad_only = torch.full((vocab,), float("-inf"), device=device)
    pad_only[pad_id] = 0.0
    offsets = torch.arange(batch, device=device).unsqueeze(1) * k

    for step in range(1, max_tokens):
        tgt = ys[:, -1:] if use_cache else ys  # cache: the newest token only
        mask = None if use_cache else causal_mask(step, device)
        with trusted_ids():
            hidden = model.decode(
                memory, tgt, src_mask=memory_mask, tgt_mask=mask, cache=cache
            )
        log_probs = model.generator(hidden[:, -1]).log_softmax(dim=-1)
        log_probs = log_probs.view(batch, k, vocab)
        log_probs = torch.where(finished.unsqueeze(-1), pad_only, log_probs)

        candidates = (scores.unsqueeze(-1) + log_probs).view(batch, k * vocab)
        grown = lengths + (~finished).float()  # |y| of each beam's continuations
        candidate_lengths = grown.repeat_interleave(vocab, dim=1)
        ranked = candidates / length_penalty(candidate_lengths, alpha)
        _, best = ranked.topk(k, dim=-1)  # (batch, k)

        beam, token = best // vocab, best % vocab
        rows = (beam + offsets).view(-1)
        scores = candidates.gather(1, best)
        lengths = candidate_lengths.gather(1, best)
        finished = finished.gather(1, beam)
        if eos_id is not None:
            finished = finished | (token == eos_id)
        ys = torch.cat([ys.index_select(0, rows), token.view(-1, 1)], dim=1)
        if cache is not None:
            cache.reorder(rows)
        if step % CHECK_EVERY == 0 and finished.all():
            break

    final = scores / length_penalty(lengths, alpha)
    best_ys = ys.index_select(0, final.argmax(dim=-1) + offsets.view(-1))
    # Other beams may have run longer than every winner: drop columns that are padding in every row.
    keep = int((best_ys != pad_id).any(dim=0).nonzero().max()) + 1
    return best_ys[:, :keep]
