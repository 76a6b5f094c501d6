"""The model the decoding checks run on: a one-layer Transformer whose next-token logits are
written by hand (``_script``), so that greedy decoding and beam search have known answers."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...model import ModelConfig, Transformer

_PAD, _BOS, _EOS = 0, 1, 2


_TGT_VOCAB = 10  # 0 padding, 1 BOS, 2 EOS, 3..9 words


_SOURCES = 9  # source ids 1..7 (0 is padding); each names one script of next-token probabilities


# source → log P(short) / log P(long), see _script
_BEAM_RATIOS = {4: 0.585, 5: 0.535, 6: 0.3, 7: 0.8, 9: 0.9}


def _beam_log_probs(ratio: float) -> tuple[float, float]:
    """``(log p_short, log p_long)`` with ``p_short + p_long = 1`` and ``log p_short = ratio · log p_long``."""
    low, high = -50.0, -1e-9
    for _ in range(100):  # bisection on log p_long
        middle = (low + high) / 2
        low, high = (
            (middle, high)
            if math.exp(ratio * middle) + math.exp(middle) < 1
            else (low, middle)
        )
    return ratio * low, low


def _script() -> dict[tuple[int, int], dict[int, float]]:
    """The next-token logits of each state (last token, source) the tests of decoding rely on.

    Sources 1-3 are for greedy decoding: 1 → "3 4 EOS", 2 → "5 EOS", 3 → "6 7 8 6 7 8 …" (never
    ends). Sources 4-7 are for beam search: after BOS, EOS (a hypothesis of length 1) or "3 4 EOS"
    (length 3), whose log-probabilities have the ratio of ``_BEAM_RATIOS``. Which one wins depends
    on how the length penalty counts: with α = 2 and these ratios, counting |y| right, counting BOS,
    not counting EOS, no penalty and |y|^α pick five different patterns of winners over the four
    sources. After EOS, every script continues with 9, so a decoder that does not stop there shows it.
    """
    script: dict[tuple[int, int], dict[int, float]] = {}
    chains = {1: [_BOS, 3, 4, _EOS], 2: [_BOS, 5, _EOS], 3: [_BOS, 6, 7, 8, 6]}
    for source, chain in chains.items():
        for current, following in zip(chain, chain[1:]):
            script[current, source] = {following: 4.0}
    for source, ratio in _BEAM_RATIOS.items():
        short, long = _beam_log_probs(ratio)
        script[_BOS, source] = {_EOS: short, 3: long}
        script[3, source] = {4: 0.0}
        script[4, source] = {_EOS: 0.0}
    # Source 8: where pruning by the penalised score matters (beam 2, alpha 2). After BOS: EOS or
    # 5; after 5: EOS or 7; after 7: EOS. Raw log-probabilities keep [EOS] and [5 EOS] at step 2,
    # penalised scores keep [5 EOS] and [5 7], and [5 7 EOS] wins; its top beam ends at step 2.
    script[_BOS, 8] = {_EOS: -1.0, 5: -0.55}
    script[5, 8] = {_EOS: -0.65, 7: -0.75}
    script[7, 8] = {_EOS: 0.0}
    for source in range(1, _SOURCES + 1):
        script[_EOS, source] = {9: 4.0}
    return script


def _build_scripted_model() -> Transformer:
    """A one-layer Transformer whose next-token logits, given the last token c and the source s,
    are ``_script()[c, s]`` (9 when the state is not scripted), whatever came before.

    Every sublayer but the decoder's cross-attention and feed-forward network adds nothing. The
    embeddings are large one-hot vectors, so the positional encoding barely moves them. Cross-attention
    averages the memory (its queries are 0), which adds the source's one-hot vector; the feed-forward
    network has one unit per (c, s) pair that fires only when both are there and writes a one-hot
    vector of its own; the generator maps that to the pair's logits. LayerNorm gives every pair the
    same numbers, so the generator's weights can be solved for exactly.
    """
    v, sources = _TGT_VOCAB, _SOURCES
    # source s sits at v - 1 + s
    source_at, source_pad_at, pair_at = (v - 1, v + sources, v + sources + 1)
    pairs = [(c, s) for s in range(1, sources + 1) for c in range(v)]
    d_model = pair_at + len(pairs)
    d_model += d_model % 2  # the positional encoding needs an even width
    config = ModelConfig(
        sources + 1,
        v,
        d_model=d_model,
        num_heads=1,
        d_ff=len(pairs),
        num_layers=1,
        dropout=0.0,
        max_len=64,
    )
    model = Transformer(config).eval()
    big = 1e5  # the positional encoding (entries in [-1, 1]) moves these rows by 1 part in 1e6
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
        model.src_embed.weight[0, source_pad_at] = big
        for s in range(1, sources + 1):
            model.src_embed.weight[s, source_at + s] = big
        for c in range(v):
            model.tgt_embed.weight[c, c] = big
        cross = model.decoder.layers[0].cross_attn
        cross.v_proj.weight.copy_(torch.eye(d_model))
        cross.out_proj.weight.copy_(torch.eye(d_model))

        # What LayerNorm makes of the vectors at each stage, for any pair (all pairs look alike).
        def norm(x: Tensor) -> Tensor:
            return F.layer_norm(x, (d_model,))

        def one_hot(i: int) -> Tensor:
            return F.one_hot(torch.tensor(i), d_model).double()

        scale = big * math.sqrt(d_model)
        x2 = norm(norm(scale * one_hot(0)) + norm(norm(scale * one_hot(source_at + 1))))
        peak, base = x2[0].item(), x2[pair_at].item()
        # A unit sees 2·peak when both its token and its source are there, far less otherwise (one of
        # them, or a source averaged with padding); it fires only within `margin` of the full sum.
        margin = 0.1 * (peak - base)
        threshold = 2 * peak - margin
        spike = 20.0
        x3 = norm(x2 + spike * one_hot(pair_at))
        at_pair, elsewhere = x3[pair_at].item(), x3[-1].item()

        ff = model.decoder.layers[0].feed_forward
        script = _script()
        logits = torch.zeros(len(pairs), v, dtype=torch.float64)
        for unit, (c, s) in enumerate(pairs):
            ff.linear1.weight[unit, c] = 1.0
            ff.linear1.weight[unit, source_at + s] = 1.0
            ff.linear1.bias[unit] = -threshold
            ff.linear2.weight[pair_at + unit, unit] = spike / margin
            # distinct: no ties
            row = torch.tensor([-14.0 - 0.1 * t for t in range(v)], dtype=torch.float64)
            for token, value in script.get((c, s), {9: 4.0}).items():
                row[token] = value
            logits[unit] = row
        columns = logits.T / (at_pair - elsewhere)  # (v, pairs)
        model.generator.weight[:, pair_at : pair_at + len(pairs)] = columns.float()
        model.generator.bias.copy_((-elsewhere * columns.sum(dim=1)).float())
    return model


_SCRIPTED: list[Transformer] = []


def _scripted_model(shared: bool = False) -> Transformer:
    """The scripted model (built once, with the global generator saved and restored): the one
    shared copy for the package's functions and the catalogue's, which change nothing, or a
    fresh copy for a reader's function."""
    if not _SCRIPTED:
        with torch.random.fork_rng(devices=[]):
            _SCRIPTED.append(_build_scripted_model())
    return _SCRIPTED[0] if shared else copy.deepcopy(_SCRIPTED[0])
