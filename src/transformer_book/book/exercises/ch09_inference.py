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
)
from .results import Mistake
from .sections import (
    _CH5_PADDING,
    _CH9_BEAM,
    _CH9_LOOP,
    _CH9_STOP,
)


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
    kwargs = _keywords(
        fn, **inputs["kwargs"]
    )  # a search without alpha runs its own penalty
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

    def decode(
        model: Transformer,
        src: Tensor,
        max_tokens: int,
        bos_id: int,
        eos_id: int | None,
        **_: Any,
    ) -> Tensor:
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
    return torch.inference_mode()(decode)


_GREEDY_MISTAKES = (
    Mistake(
        "no_padding_after_eos",
        "a row that has produced EOS goes on producing tokens; the package writes pad_id after a row's EOS "
        "while the other rows go on",
        (_greedy_variant(pad_after_eos=False),),
        section=_CH9_STOP,
        did="kept appending the argmax after a row's EOS",
    ),
    Mistake(
        "no_early_stop",
        "the loop always runs to max_tokens, even when every row has produced EOS; the package stops as soon "
        "as all rows have ended",
        (_greedy_variant(stop_when_done=False),),
        section=_CH9_STOP,
        did="always ran max_tokens − 1 steps",
    ),
    Mistake(
        "bos_missing",
        "the result leaves out the BOS column; the package returns every row starting with bos_id",
        (_greedy_variant(keep_bos=False),),
        section=_CH9_LOOP,
        did="returned the rows without BOS",
    ),
    Mistake(
        "max_len_off_by_one",
        "rows can reach another length than max_tokens: the package's count includes BOS, so it makes at most "
        "max_tokens − 1 steps",
        (_greedy_variant(extra_steps=1), _greedy_variant(extra_steps=-1)),
        section=_CH9_STOP,
        did="ran another number of steps than max_tokens − 1",
    ),
    Mistake(
        "stops_at_first_eos",
        "the loop stops as soon as any row produces EOS; the package goes on until every row has ended",
        (_greedy_variant(stop_at_first=True),),
        section=_CH9_STOP,
        did="stopped when any row had ended",
    ),
    Mistake(
        "source_padding_visible",
        "the decoder's cross-attention reads the source's padding: no src_mask is given to decode",
        (_greedy_variant(hide_source_padding=False),),
        section=_CH5_PADDING,
        did="decoded without src_mask",
    ),
    Mistake(
        "reads_first_position",
        "the next token is read from the first position's output (hidden[:, 0]); it comes from the last "
        "position, hidden[:, -1]",
        (_greedy_variant(position=0),),
        section=_CH9_LOOP,
        did="read the next token from hidden[:, 0]",
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

    def search(
        model: Transformer,
        src: Tensor,
        max_tokens: int,
        bos_id: int,
        eos_id: int | None,
        beam_size: int = 4,
        src_mask: Tensor | None = None,
        alpha: float = 0.6,
    ) -> Tensor:
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
        stopped = torch.zeros(
            batch, 1, dtype=torch.bool
        )  # rows whose top beam has ended

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
    return torch.inference_mode()(search)


_BEAM_MISTAKES = (
    Mistake(
        "length_counts_bos",
        "|y| in the length penalty counts BOS, so a hypothesis is one token longer than it is; |y| counts "
        "the tokens after BOS, EOS included (the first generated token has length 1)",
        (_beam_variant(first_length=1.0),),
        did="counted BOS in |y|",
    ),
    Mistake(
        "stops_when_top_beam_finishes",
        "the search stops as soon as the best hypothesis has produced EOS; a longer one still "
        "growing can overtake it once the length penalty counts its length, so the package goes "
        "on until every beam has ended (or max_tokens)",
        (_beam_variant(stop="top"),),
        section=_CH9_BEAM,
        did="stopped when the top beam ended",
    ),
    Mistake(
        "penalty_only_at_final_pick",
        "the beams are pruned by their raw log-probability and the length penalty is applied only "
        "to pick the final answer, so a longer hypothesis that the penalty favours is pruned before "
        "it can finish; the package ranks candidates by the penalised score at every step",
        (_beam_variant(prune="raw"),),
        section=_CH9_BEAM,
        did="kept the top-k by log-probability and divided by the penalty only at the end",
    ),
    Mistake(
        "divided_by_length",
        "the score is divided by |y| itself, which ignores alpha; the package divides by GNMT's "
        "((5 + |y|)/6)^alpha",
        (_beam_variant(penalty="length"),),
        section=_CH9_BEAM,
        did="divided the log-probability by the length",
    ),
    Mistake(
        "length_without_eos",
        "|y| in the length penalty leaves out EOS; |y| counts the tokens after BOS, EOS included",
        (_beam_variant(count_eos=False),),
        did="left EOS out of |y|",
    ),
    Mistake(
        "no_length_penalty",
        "hypotheses are ranked by log-probability alone (alpha has no effect); the package divides by "
        "((5 + |y|)/6)^alpha, so that longer outputs are not penalised for their length",
        (_beam_variant(penalty="none"),),
        did="ranked by the log-probability alone",
    ),
    Mistake(
        "alpha_ignored",
        "the given alpha has no effect: the search uses a strength of its own (or takes no alpha), "
        "so a call with alpha=2.0 ranks like one with the default",
        tuple(_beam_variant(fixed_alpha=a) for a in (0.6, 1.0, 0.7, 0.5)),
        section=_CH9_BEAM,
        did="took no alpha parameter (or never read it)",
    ),
    Mistake(
        "length_power_penalty",
        "scores are divided by |y|^alpha; the package uses GNMT's penalty ((5 + |y|)/6)^alpha",
        (_beam_variant(penalty="power"),),
        did="divided by |y| ** alpha",
    ),
    Mistake(
        "finished_not_frozen",
        "a hypothesis that has produced EOS is extended further; the package freezes it: its score stays, "
        "and only padding follows",
        (_beam_variant(freeze=False),),
        did="kept extending hypotheses after EOS",
    ),
)


PARTS = (
    Part(
        "greedy_decode",
        "function",
        greedy_decode,
        "(model, src, max_tokens, bos_id, eos_id) → ids (batch, ≤ max_tokens), BOS first, padding after EOS",
        _CH9_LOOP,
        lambda: _decoding_cases(beam=False),
        _run_decoding,
        _GREEDY_MISTAKES,
        axes={"tokens": ("row", "position")},
        strict_dtype=False,
    ),
    Part(
        "beam_search",
        "function",
        beam_search,
        "(model, src, max_tokens, bos_id, eos_id, beam_size=4, src_mask=None, alpha=0.6) → ids (batch, ≤ max_tokens)",
        _CH9_BEAM,
        lambda: _decoding_cases(beam=True),
        _run_decoding,
        _BEAM_MISTAKES,
        axes={"tokens": ("row", "position")},
        strict_dtype=False,
    ),
)
