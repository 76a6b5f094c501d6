"""Chapter 11: one step of byte-pair encoding, as readers write it (right and wrong)."""

from __future__ import annotations

from collections import Counter, defaultdict


def _pairs(words, weighted=True):
    counts = Counter()
    for word, freq in words.items():
        for a, b in zip(word, word[1:]):
            counts[(a, b)] += freq if weighted else 1
    return counts


def _apply(words, pair, joiner=""):
    new = defaultdict(int)
    for word, freq in words.items():
        out, i = [], 0
        while i < len(word):
            if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
                out.append(pair[0] + joiner + pair[1])
                i += 2
            else:
                out.append(word[i])
                i += 1
        new[tuple(out)] += freq
    return dict(new)


def merge_with_sorted_ties(words):
    counts = _pairs(words)
    top = max(counts.values())
    best = sorted(p for p, c in counts.items() if c == top)[0]
    return best, _apply(words, best)


def merge_with_a_string_join(words):
    """Works on space-joined strings, as many tutorials do."""
    counts = Counter()
    for word, freq in words.items():
        for i in range(len(word) - 1):
            counts[word[i], word[i + 1]] += freq
    best = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))[0]
    merged = {}
    for word, freq in words.items():
        text = " ".join(word)
        key = tuple(_apply({word: 1}, best))[0]
        merged[key] = merged.get(key, 0) + freq
        assert text  # the reader kept it for printing
    return best, merged


def counts_each_word_once(words):
    counts = _pairs(words, weighted=False)
    best = min(counts, key=lambda p: (-counts[p], p))
    return best, _apply(words, best)


def first_most_common(words):
    best = _pairs(words).most_common(1)[0][0]
    return best, _apply(words, best)


def largest_of_the_tied(words):
    counts = _pairs(words)
    best = max(counts, key=lambda p: (counts[p], p))
    return best, _apply(words, best)


def merges_the_first_occurrence_only(words):
    counts = _pairs(words)
    best = min(counts, key=lambda p: (-counts[p], p))
    new = {}
    for word, freq in words.items():
        out, i, done = [], 0, False
        while i < len(word):
            if not done and tuple(word[i : i + 2]) == best:
                out, i, done = out + [best[0] + best[1]], i + 2, True
            else:
                out, i = out + [word[i]], i + 1
        new[tuple(out)] = new.get(tuple(out), 0) + freq
    return best, new


def merges_from_the_right(words):
    counts = _pairs(words)
    best = min(counts, key=lambda p: (-counts[p], p))
    new = {}
    for word, freq in words.items():
        out, i = [], len(word) - 1
        while i >= 0:
            if i > 0 and (word[i - 1], word[i]) == best:
                out.insert(0, best[0] + best[1])
                i -= 2
            else:
                out.insert(0, word[i])
                i -= 1
        new[tuple(out)] = new.get(tuple(out), 0) + freq
    return best, new


def joins_with_a_space(words):
    counts = _pairs(words)
    best = min(counts, key=lambda p: (-counts[p], p))
    return best, _apply(words, best, joiner=" ")


def forgets_to_merge(words):
    counts = _pairs(words)
    return min(counts, key=lambda p: (-counts[p], p)), words


WRONG = [
    ("bpe_merge_step", "unweighted_counts", counts_each_word_once),
    ("bpe_merge_step", "ties_by_first_seen", first_most_common),
    ("bpe_merge_step", "ties_by_largest_pair", largest_of_the_tied),
    ("bpe_merge_step", "merged_once_per_word", merges_the_first_occurrence_only),
    ("bpe_merge_step", "merged_right_to_left", merges_from_the_right),
    ("bpe_merge_step", "symbols_joined_with_a_space", joins_with_a_space),
    ("bpe_merge_step", "words_not_merged", forgets_to_merge),
]
RIGHT = [
    ("bpe_merge_step", merge_with_sorted_ties),
    ("bpe_merge_step", merge_with_a_string_join),
]
