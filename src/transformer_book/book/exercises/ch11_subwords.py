"""Graded part: one step of byte-pair encoding (chapter 11's Build it), against ``tokenizers``.

The reference is the library itself: a Hugging Face ``tokenizers`` BPE trainer asked for
the corpus's alphabet plus one piece learns exactly one merge; that merge and the words
re-encoded with it are the answer. ``check("bpe_merge_step", fn)`` grades a reader's step.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable

from tokenizers import Tokenizer, models, trainers

from .engine import Case, Part, run_function
from .results import mistake_maker
from .sections import REAL_LANGUAGE

Words = dict[tuple[str, ...], int]


def library_merge_step(words: Words) -> tuple[tuple[str, str], Words]:
    """What ``tokenizers`` learns first from ``words`` (single characters, with
    frequencies), and the words split with that one merge."""
    text = ["".join(w) for w, freq in words.items() for _ in range(freq)]
    alphabet = set("".join(text))
    tokenizer = Tokenizer(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + 1, show_progress=False)
    tokenizer.train_from_iterator(text, trainer)
    (merge,) = json.loads(tokenizer.to_str())["model"]["merges"]
    pair = tuple(merge.split(" ")) if isinstance(merge, str) else tuple(merge)
    merged: Words = {}
    for w, freq in words.items():
        key = tuple(tokenizer.encode("".join(w)).tokens)
        merged[key] = merged.get(key, 0) + freq
    return pair, merged


def _corpus(*items: tuple[str, int]) -> Callable[[], tuple]:
    return lambda: (({tuple(w): f for w, f in items},), {})


def _cases() -> list[Case]:
    return [
        Case("one word", _corpus(("sechs", 1))),
        Case("frequencies decide", _corpus(("aab", 2), ("abab", 1), ("bba", 3))),
        Case("a rare word with a frequent pair", _corpus(("abab", 1), ("cd", 5))),
        Case(
            "a frequent short word", _corpus(("und", 10), ("neun", 1), ("neunzig", 1))
        ),
        Case("a tie: the smaller pair wins", _corpus(("ba", 1), ("ab", 1))),
        Case("a pair twice in one word", _corpus(("abcab", 1), ("cd", 1))),
        Case("a run of one letter: left to right", _corpus(("aaa", 3), ("ab", 1))),
        Case(
            "German numbers",
            _corpus(
                ("siebenundneunzig", 3),
                ("neunundsiebzig", 2),
                ("sieben", 5),
                ("neun", 4),
            ),
        ),
    ]


def _rebuild(
    words: Words,
    best: tuple[str, str],
    first_only: bool = False,
    joiner: str = "",
    backwards: bool = False,
) -> Words:
    merged: Words = {}
    pair = tuple(reversed(best)) if backwards else best
    for symbols, freq in words.items():
        symbols = tuple(reversed(symbols)) if backwards else symbols
        out, i, done = [], 0, False
        while i < len(symbols):
            if tuple(symbols[i : i + 2]) == pair and not done:
                out, i, done = out + [best[0] + joiner + best[1]], i + 2, first_only
            else:
                out, i = out + [symbols[i]], i + 1
        out = list(reversed(out)) if backwards else out
        merged[tuple(out)] = merged.get(tuple(out), 0) + freq
    return merged


def _variant(
    weighted: bool = True,
    ties: str = "sorted",
    first_only: bool = False,
    merge: bool = True,
    joiner: str = "",
    backwards: bool = False,
):
    def merge_step(words: Words) -> tuple[tuple[str, str], Words]:
        counts: Counter[tuple[str, str]] = Counter()
        for symbols, freq in words.items():
            for pair in zip(symbols, symbols[1:]):
                counts[pair] += freq if weighted else 1
        if ties == "sorted":
            best = min(counts, key=lambda p: (-counts[p], p))
        elif ties == "largest":
            best = max(counts, key=lambda p: (counts[p], p))
        else:  # the first pair seen among the most frequent
            best = counts.most_common(1)[0][0]
        if not merge:
            return best, dict(words)
        return best, _rebuild(words, best, first_only, joiner, backwards)

    return merge_step


_mistake = mistake_maker(_variant)

_MISTAKES = (
    _mistake(
        "unweighted_counts",
        "counted a pair once per word instead of once per occurrence of the word",
        "counts each word once, whatever its frequency",
        weighted=False,
    ),
    _mistake(
        "ties_by_first_seen",
        "took the first of the most frequent pairs",
        "breaks a tie by the pair seen first, not by the smaller pair",
        ties="first",
    ),
    _mistake(
        "merged_once_per_word",
        "merged the pair once per word instead of everywhere",
        "merges only the first occurrence of the pair in each word",
        first_only=True,
    ),
    _mistake(
        "ties_by_largest_pair",
        "took the last of the tied pairs in sorted order",
        "breaks a tie by the larger pair in sorted order",
        ties="largest",
    ),
    _mistake(
        "merged_right_to_left",
        "scanned each word from the right",
        "merges from the end of the word, so a run like a a a becomes a|aa",
        backwards=True,
    ),
    _mistake(
        "symbols_joined_with_a_space",
        "joined the pair with a space",
        "writes the new symbol with a space between its two halves",
        joiner=" ",
    ),
    _mistake(
        "words_not_merged",
        "returned the old words",
        "finds the right pair but returns the words unchanged",
        merge=False,
    ),
)

PARTS = (
    Part(
        name="bpe_merge_step",
        reference=library_merge_step,
        summary="``(words)`` → ``(pair, new_words)``, one merge of byte-pair encoding",
        section=REAL_LANGUAGE["11.3 A learned subword vocabulary"],
        cases=_cases,
        run=run_function(("pair", "words")),
        mistakes=_MISTAKES,
    ),
)
