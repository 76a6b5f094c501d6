"""Graded parts: greedy_decode, beam_search."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ...inference import beam_search, greedy_decode
from ...masking import causal_mask, padding_mask
from ...model import Transformer
from .ch09_scripted_model import _BOS, _EOS, _scripted_model
from .engine import (
    Case,
    Part,
    _call,
    _display,
    _keywords,
    _ReaderError,
    _ReaderProblem,
    _signature_of,
)
from .results import Section, mistake_maker
from .sections import INFERENCE, MASKING


class _Runaway(RuntimeError):
    pass


def _watch(model: Transformer, max_tokens: int, hypotheses: int) -> None:
    """Stop a decoding loop that does not end, by counting its steps: the target it feeds the
    decoder has grown past ``max_tokens`` tokens, or it has called the generator far more often than
    ``max_tokens`` steps of ``hypotheses`` rows need (a loop with a cache feeds one token at a time).
    A loop that never calls the model is stopped by the time budget of every reader's call."""
    calls, limit = [0], 4 * max_tokens * (hypotheses + 1) + 10

    def count(module: nn.Module, args: tuple) -> None:
        calls[0] += 1
        if calls[0] > limit:
            raise _Runaway(
                f"was stopped after {calls[0]} calls of model.generator for max_tokens={max_tokens}: "
                "the loop did not end (the package's runs at most max_tokens − 1 steps)"
            )

    def length(module: nn.Module, args: tuple) -> None:
        tokens = args[0] if args else None
        if (
            isinstance(tokens, Tensor)
            and tokens.dim() == 2
            and tokens.shape[1] > max_tokens
        ):
            raise _Runaway(
                f"was stopped when its target reached {tokens.shape[1]} tokens, past the call's "
                f"max_tokens={max_tokens} (BOS included); its first row then: {tokens[0].tolist()}"
            )

    model.generator.register_forward_pre_hook(count)
    model.tgt_embed.register_forward_pre_hook(length)


def _decoding_cases(beam: bool) -> list[Case]:
    def make(
        rows: list[list[int]], max_tokens: int, **kwargs: Any
    ) -> Callable[[], dict]:
        return lambda: dict(
            src=torch.tensor(rows), max_tokens=max_tokens, kwargs=kwargs
        )

    if beam:
        return [
            Case(
                "6 sources, beam_size 2, alpha 2.0, max_tokens 6: outputs of length 1, 2 and 3 "
                "compete, and on the last pruning by the penalised score matters",
                make(
                    [[4, 0, 0], [5, 5, 0], [6, 6, 6], [7, 0, 0], [8, 8, 0], [9, 0, 0]],
                    6,
                    beam_size=2,
                    alpha=2.0,
                ),
                needs=("beam_size",),
            ),
            Case(
                "4 sources, beam_size 3, alpha 0.6, max_tokens 6, one never emits EOS",
                make(
                    [[1, 1, 0], [2, 0, 0], [3, 0, 0], [9, 9, 0]],
                    6,
                    beam_size=3,
                    alpha=0.6,
                ),
                needs=("beam_size",),
            ),
            Case(
                "alpha 0: no length penalty, the log-probability alone decides",
                make([[4, 0, 0], [6, 0, 0], [9, 0, 0]], 6, beam_size=2, alpha=0.0),
                needs=("beam_size",),
            ),
            Case(
                "batch 1, beam_size 2, alpha 2.0: the top beam ends first, a longer one "
                "overtakes it",
                make([[8, 8]], 6, beam_size=2, alpha=2.0),
                needs=("beam_size",),
            ),
            Case(
                "batch 1, source length 1, beam_size 1",
                make([[2]], 5, beam_size=1),
                needs=("beam_size",),
            ),
        ]
    return [
        Case(
            "2 sources with padding, max_tokens 8, both end early",
            make([[1, 0, 0], [2, 2, 0]], 8),
        ),
        Case(
            "3 sources, max_tokens 6, one never emits EOS",
            make([[1, 1, 0], [3, 0, 0], [2, 0, 0]], 6),
        ),
        Case("batch 1, source length 1, max_tokens 5", make([[2]], 5)),
        Case("max_tokens 2: BOS and one token", make([[3]], 2)),
    ]


def _run_decoding(fn: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    trusted = fn in (greedy_decode, beam_search) or getattr(
        fn, "_catalogue_variant", False
    )
    model = _scripted_model(shared=trusted)
    if not trusted:  # the reader's loop gets a copy of its own, watched
        _watch(
            model,
            inputs["max_tokens"],
            len(inputs["src"]) * inputs["kwargs"].get("beam_size", 1),
        )
    args = (model, inputs["src"], inputs["max_tokens"], _BOS, _EOS)
    # a search without alpha runs its own penalty
    kwargs = _keywords(fn, **inputs["kwargs"])
    try:
        tokens = _call(f"Your {_display(fn)}", fn, *args, **kwargs)
    except _ReaderError as problem:
        if isinstance(problem.error, _Runaway):
            raise _ReaderProblem(f"Your {_display(fn)} {problem.error}") from None
        raise
    return {"tokens": tokens}


def _greedy_variant(
    pad_after_eos: bool = True,
    stop_when_done: bool = True,
    keep_bos: bool = True,
    extra_steps: int = 0,
    stop_at_first: bool = False,
    hide_source_padding: bool = True,
    position: int = -1,
) -> Callable[..., Tensor]:
    """Greedy decoding (without a cache) with one thing changed."""

    @torch.inference_mode()
    @_signature_of(greedy_decode)
    def decode(model, src, max_tokens, bos_id, eos_id, **_):  # src_mask, use_cache
        pad = model.config.pad_id
        src_mask = padding_mask(src, pad)
        memory = model.encode(src, src_mask)
        ys = torch.full((len(src), 1), bos_id)
        done = torch.zeros(len(src), dtype=torch.bool)
        for _step in range(max_tokens - 1 + extra_steps):
            hidden = model.decode(
                memory,
                ys,
                src_mask=src_mask if hide_source_padding else None,
                tgt_mask=causal_mask(ys.shape[1]),
            )
            token = model.generator(hidden[:, position]).argmax(-1)
            token = token.masked_fill(done, pad) if pad_after_eos else token
            ys = torch.cat([ys, token[:, None]], dim=1)
            done |= token == eos_id
            if (stop_at_first and done.any()) or (stop_when_done and done.all()):
                break
        return ys if keep_bos else ys[:, 1:]

    decode._catalogue_variant = True
    return decode


_greedy_mistake = mistake_maker(_greedy_variant, INFERENCE["When does decoding stop?"])

_GREEDY_MISTAKES = (
    _greedy_mistake(
        "no_padding_after_eos",
        "kept appending the argmax after a row's EOS",
        "a row that has produced EOS goes on producing tokens; the package writes pad_id after a row's EOS "
        "while the other rows go on",
        pad_after_eos=False,
    ),
    _greedy_mistake(
        "no_early_stop",
        "always ran max_tokens − 1 steps",
        "the loop always runs to max_tokens, even when every row has produced EOS; the package stops as soon "
        "as all rows have ended",
        stop_when_done=False,
    ),
    _greedy_mistake(
        "bos_missing",
        "returned the rows without BOS",
        "the result leaves out the BOS column; the package returns every row starting with bos_id",
        keep_bos=False,
        section=INFERENCE["9.2 The decoding loop, one step at a time"],
    ),
    _greedy_mistake(
        "max_len_off_by_one",
        "ran another number of steps than max_tokens − 1",
        "rows can reach another length than max_tokens: the package's count includes BOS, so it makes at most "
        "max_tokens − 1 steps",
        {"extra_steps": 1},
        {"extra_steps": -1},
    ),
    _greedy_mistake(
        "stops_at_first_eos",
        "stopped when any row had ended",
        "the loop stops as soon as any row produces EOS; the package goes on until every row has ended",
        stop_at_first=True,
    ),
    _greedy_mistake(
        "source_padding_visible",
        "decoded without src_mask",
        "the decoder's cross-attention reads the source's padding: no src_mask is given to decode",
        hide_source_padding=False,
        section=MASKING["The padding mask"],
    ),
    _greedy_mistake(
        "reads_first_position",
        "read the next token from hidden[:, 0]",
        "the next token is read from the first position's output (hidden[:, 0]); it comes from the last "
        "position, hidden[:, -1]",
        position=0,
        section=INFERENCE["9.2 The decoding loop, one step at a time"],
    ),
)


def _beam_variant(
    first_length: float = 0.0,
    count_eos: bool = True,
    penalty: str = "gnmt",
    freeze: bool = True,
    prune: str = "penalised",
    stop: str = "all",
    fixed_alpha: float | None = None,
) -> Callable[..., Tensor]:
    """Beam search (without a cache) with one thing changed: where |y| starts, whether EOS counts
    in it, the length penalty ("gnmt", "power" |y|^α, "length" |y|, "none"), finished hypotheses
    not frozen, pruning by the raw log-probability, stopping when the top beam ends, or an alpha
    of its own whatever is given."""

    @torch.inference_mode()
    @_signature_of(beam_search)
    def search(model, src, max_tokens, bos_id, eos_id, beam_size, src_mask, alpha, **_):
        pad, vocab, batch, k = (
            model.config.pad_id,
            model.config.tgt_vocab_size,
            len(src),
            beam_size,
        )
        src_mask = padding_mask(src, pad) if src_mask is None else src_mask
        memory = model.encode(src, src_mask).repeat_interleave(k, dim=0)
        memory_mask = src_mask.repeat_interleave(k, dim=0)
        ys = torch.full((batch * k, 1), bos_id)
        scores = torch.full((batch, k), float("-inf"))
        scores[:, 0] = 0.0
        lengths = torch.full((batch, k), first_length)
        finished = torch.zeros(batch, k, dtype=torch.bool)
        # rows whose top beam has ended
        stopped = torch.zeros(batch, 1, dtype=torch.bool)

        a = alpha if fixed_alpha is None else fixed_alpha

        def normalise(length: Tensor) -> Tensor:
            if penalty == "none":
                return torch.ones_like(length)
            if penalty == "length":
                return length
            return length**a if penalty == "power" else ((5.0 + length) / 6.0) ** a

        for _step in range(max_tokens - 1):
            hidden = model.decode(
                memory, ys, src_mask=memory_mask, tgt_mask=causal_mask(ys.shape[1])
            )
            log_probs = (
                model.generator(hidden[:, -1]).log_softmax(-1).view(batch, k, vocab)
            )
            frozen = finished | stopped
            if freeze:
                pad_only = torch.full((vocab,), float("-inf"))
                pad_only[pad] = 0.0
                log_probs = torch.where(frozen[..., None], pad_only, log_probs)
            candidates = (scores[..., None] + log_probs).view(batch, k * vocab)
            grows = (~frozen)[..., None].expand(batch, k, vocab)
            if not count_eos:
                grows = grows & (torch.arange(vocab) != eos_id)
            candidate_lengths = (lengths[..., None] + grows.float()).reshape(
                batch, k * vocab
            )
            ranked = (
                candidates
                if prune == "raw"
                else candidates / normalise(candidate_lengths)
            )
            best = ranked.topk(k, dim=-1).indices
            beam, token = best // vocab, best % vocab
            rows = (beam + torch.arange(batch)[:, None] * k).view(-1)
            scores, lengths = (
                candidates.gather(1, best),
                candidate_lengths.gather(1, best),
            )
            if freeze:
                finished = finished.gather(1, beam) | (token == eos_id)
            ys = torch.cat([ys[rows], token.view(-1, 1)], dim=1)
            if stop == "top":
                stopped |= finished[:, :1]
            if (finished | stopped).all():
                break
        best_beam = (scores / normalise(lengths)).argmax(-1)
        best_ys = ys[best_beam + torch.arange(batch) * k]
        keep = int((best_ys != pad).any(dim=0).nonzero().max()) + 1
        return best_ys[:, :keep]

    search._catalogue_variant = True
    return search


_beam_mistake = mistake_maker(_beam_variant)

_BEAM_MISTAKES = (
    _beam_mistake(
        "length_counts_bos",
        "counted BOS in |y|",
        "|y| in the length penalty counts BOS, so a hypothesis is one token longer than it is; |y| counts "
        "the tokens after BOS, EOS included (the first generated token has length 1)",
        first_length=1.0,
    ),
    _beam_mistake(
        "stops_when_top_beam_finishes",
        "stopped when the top beam ended",
        "the search stops as soon as the best hypothesis has produced EOS; a longer one still "
        "growing can overtake it once the length penalty counts its length, so the package goes "
        "on until every beam has ended (or max_tokens)",
        stop="top",
    ),
    _beam_mistake(
        "penalty_only_at_final_pick",
        "kept the top-k by log-probability and divided by the penalty only at the end",
        "the beams are pruned by their raw log-probability and the length penalty is applied only "
        "to pick the final answer, so a longer hypothesis that the penalty favours is pruned before "
        "it can finish; the package ranks candidates by the penalised score at every step",
        prune="raw",
    ),
    _beam_mistake(
        "divided_by_length",
        "divided the log-probability by the length",
        "the score is divided by |y| itself, which ignores alpha; the package divides by GNMT's "
        "((5 + |y|)/6)^alpha",
        penalty="length",
    ),
    _beam_mistake(
        "length_without_eos",
        "left EOS out of |y|",
        "|y| in the length penalty leaves out EOS; |y| counts the tokens after BOS, EOS included",
        count_eos=False,
    ),
    _beam_mistake(
        "no_length_penalty",
        "ranked by the log-probability alone",
        "hypotheses are ranked by log-probability alone (alpha has no effect); the package divides by "
        "((5 + |y|)/6)^alpha, so that longer outputs are not penalised for their length",
        penalty="none",
    ),
    _beam_mistake(
        "alpha_ignored",
        "took no alpha parameter (or never read it)",
        "the given alpha has no effect: the search uses a strength of its own (or takes no alpha), "
        "so a call with alpha=2.0 ranks like one with the default",
        *({"fixed_alpha": alpha} for alpha in (0.6, 1.0, 0.7, 0.5)),
    ),
    _beam_mistake(
        "length_power_penalty",
        "divided by |y| ** alpha",
        "scores are divided by |y|^alpha; the package uses GNMT's penalty ((5 + |y|)/6)^alpha",
        penalty="power",
    ),
    _beam_mistake(
        "finished_not_frozen",
        "kept extending hypotheses after EOS",
        "a hypothesis that has produced EOS is extended further; the package freezes it: its score stays, "
        "and only padding follows",
        freeze=False,
    ),
)


def _decoding_part(
    name: str, reference: Any, summary: str, section: Section, mistakes: tuple
) -> Part:
    """A decoding part: run on the scripted model, its tokens compared whatever their
    integer dtype; beam search's cases have a beam size and a length penalty."""
    beam = name == "beam_search"
    return Part(
        name,
        reference,
        summary,
        section,
        lambda: _decoding_cases(beam),
        _run_decoding,
        mistakes,
        axes={"tokens": ("row", "position")},
        strict_dtype=False,
    )


PARTS = (
    _decoding_part(
        "greedy_decode",
        greedy_decode,
        "(model, src, max_tokens, bos_id, eos_id) → ids (batch, ≤ max_tokens), BOS first, padding after EOS",
        INFERENCE["9.2 The decoding loop, one step at a time"],
        _GREEDY_MISTAKES,
    ),
    _decoding_part(
        "beam_search",
        beam_search,
        "(model, src, max_tokens, bos_id, eos_id, beam_size=4, src_mask=None, alpha=0.6) → ids (batch, ≤ max_tokens)",
        INFERENCE["9.5 Greedy decoding against beam search"],
        _BEAM_MISTAKES,
    ),
)
