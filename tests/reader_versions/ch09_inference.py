"""Chapter 9: beam searches that stop when the top beam ends, prune by the raw log-probability,
divide by |y|, take no alpha; a greedy loop whose ys runs away."""

import torch

import transformer_book as tb


def gnmt(length, alpha):
    return ((5 + length) / 6) ** alpha


def beam(model, src, max_len, bos_id, eos_id, beam_size=4, src_mask=None, alpha=0.6, *, raw=False, top=False, lp=gnmt):
    """One source at a time; a hypothesis is (tokens, log P, ended); |y| = tokens after BOS."""
    pad, found = model.config.pad_id, []

    def score(hyp):
        return hyp[1] / lp(len(hyp[0]) - 1, alpha)

    with torch.no_grad():
        for row in src:
            row = row[None]
            mask = tb.padding_mask(row, pad)
            memory = model.encode(row, mask)
            hyps = [([bos_id], 0.0, False)]
            for _ in range(max_len - 1):
                grown = []
                for tokens, logp, ended in hyps:
                    if ended:
                        grown.append((tokens, logp, True))
                        continue
                    ys = torch.tensor([tokens])
                    hidden = model.decode(memory, ys, src_mask=mask, tgt_mask=tb.causal_mask(len(tokens)))
                    for token, lp_token in enumerate(model.generator(hidden[:, -1]).log_softmax(-1)[0].tolist()):
                        grown.append((tokens + [token], logp + lp_token, token == eos_id))
                grown.sort(key=(lambda h: h[1]) if raw else score, reverse=True)
                hyps = grown[:beam_size]
                if all(h[2] for h in hyps) or (top and hyps[0][2]):
                    break
            found.append(max(hyps, key=score)[0])
    width = max(len(tokens) for tokens in found)
    return torch.tensor([tokens + [pad] * (width - len(tokens)) for tokens in found])


def beam_stop_top(model, src, max_len, bos_id, eos_id, beam_size=4, src_mask=None, alpha=0.6):
    return beam(model, src, max_len, bos_id, eos_id, beam_size, src_mask, alpha, top=True)


def beam_raw_pruning(model, src, max_len, bos_id, eos_id, beam_size=4, src_mask=None, alpha=0.6):
    return beam(model, src, max_len, bos_id, eos_id, beam_size, src_mask, alpha, raw=True)


def beam_over_length(model, src, max_len, bos_id, eos_id, beam_size=4, src_mask=None, alpha=0.6):
    return beam(model, src, max_len, bos_id, eos_id, beam_size, src_mask, alpha, lp=lambda n, a: n)


def beam_without_alpha(model, src, max_len, bos_id, eos_id, beam_size=4):
    return beam(model, src, max_len, bos_id, eos_id, beam_size, None, 0.6)


def beam_right(model, src, max_len, bos_id, eos_id, beam_size=4, src_mask=None, alpha=0.6):
    return beam(model, src, max_len, bos_id, eos_id, beam_size, src_mask, alpha)


WRONG = [
    ("beam_search", "stops_when_top_beam_finishes", beam_stop_top),
    ("beam_search", "penalty_only_at_final_pick", beam_raw_pruning),
    ("beam_search", "divided_by_length", beam_over_length),
    ("beam_search", "alpha_ignored", beam_without_alpha),
]
RIGHT = [("beam_search", beam_right)]
