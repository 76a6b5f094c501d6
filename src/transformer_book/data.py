"""Chapter 8 (part): the data the model learns from, generated here, nothing downloaded.

Two tasks:

- **copy**: the output repeats the input (seed 003's toy task: vocabulary 11,
  length 10, every sequence starting with id 1). Trivial for a person, and the
  quickest proof that the whole model can learn.
- **dates**: a date written out in French words ("vingt-deux novembre deux mille
  vingt-six") translated to its ISO form ("2026-11-22"). A real, if small,
  translation: words must be reordered, numbers composed, and a held-out set of
  dates is never seen in training.

Each task has three sets, disjoint by construction: training batches, a
validation set that training may look at to choose (when to stop, which weights
to keep), and a test set that is scored once, after training.

A third generator, ``labelled_bits``, has no recipe and no fixed sets: each of its
answers needs several places of the source at once, and chapter 8's last section
uses it to compare one attention head with eight.
"""

from __future__ import annotations

import datetime as dt
import functools
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

from .checks import (
    check_pairs,
    check_positive,
    check_token_id,
    require_instance,
    shape_of,
)
from .masking import padding_mask, target_mask

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"


def chooser(rng: random.Random | None) -> random.Random | ModuleType:
    """``rng`` (a ``random.Random``, for a repeatable draw), or Python's global generator
    when it is None; anything else is a ``ValueError`` (an int seed would fail, or, if 0,
    silently draw from the global generator)."""
    if rng is None:
        return random  # the module's functions draw from its hidden Random instance
    require_instance(rng, "rng", random.Random)
    return rng


class Vocabulary:
    """A fixed list of tokens; ``<pad>``, ``<bos>`` and ``<eos>`` are ids 0, 1 and 2."""

    def __init__(self, tokens: Iterable[str]) -> None:
        self.tokens = [PAD, BOS, EOS] + sorted(set(tokens) - {PAD, BOS, EOS})
        self.index = {token: i for i, token in enumerate(self.tokens)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, tokens: Sequence[str]) -> list[int]:
        unknown = [t for t in tokens if t not in self.index]
        if unknown:
            raise ValueError(f"tokens not in the vocabulary: {unknown}")
        return [self.index[t] for t in tokens]

    def decode(self, ids: Iterable[int], strip: bool = True) -> list[str]:
        """Ids back to tokens; with ``strip`` stop at ``<eos>`` and drop ``<bos>``/``<pad>``."""
        words = []
        for k, i in enumerate(ids):
            check_token_id(i, f"ids[{k}]", len(self.tokens))
            token = self.tokens[int(i)]
            if strip and token == EOS:
                break
            if not (strip and token in (PAD, BOS)):
                words.append(token)
        return words


@dataclass
class Batch:
    """One training batch for teacher forcing.

    ``src (B, S)``; ``tgt_in (B, T)`` is the target shifted right (it starts with
    BOS) and ``tgt_out (B, T)`` the tokens to predict (it ends with EOS), so
    position ``t`` of the decoder predicts ``tgt_out[:, t]`` having seen
    ``tgt_in[:, :t+1]``. ``src_mask (B, 1, S)``, ``tgt_mask (B, T, T)`` (True = may
    attend); ``num_tokens`` counts the non-padding targets the loss averages over.
    """

    src: Tensor
    tgt_in: Tensor
    tgt_out: Tensor
    src_mask: Tensor
    tgt_mask: Tensor
    num_tokens: int

    @classmethod
    def from_pairs(cls, src: Tensor, tgt: Tensor, pad_id: int = 0) -> Batch:
        """``src (B, S)`` and the full target ``tgt (B, T + 1)`` (BOS … EOS, then padding)."""
        check_pairs(src, tgt)
        if tgt.shape[1] < 2:
            raise ValueError(
                f"tgt {shape_of(tgt)} must be at least 2 long (BOS, then one token)"
            )
        tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
        return cls(
            src=src,
            tgt_in=tgt_in,
            tgt_out=tgt_out,
            src_mask=padding_mask(src, pad_id),
            tgt_mask=target_mask(tgt_in, pad_id),
            num_tokens=int((tgt_out != pad_id).sum()),
        )

    def to(self, device: torch.device | str) -> Batch:
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return Batch(
            move(self.src),
            move(self.tgt_in),
            move(self.tgt_out),
            move(self.src_mask),
            move(self.tgt_mask),
            self.num_tokens,
        )


def copy_task_batch(
    batch_size: int,
    vocab_size: int = 11,
    length: int = 10,
    generator: torch.Generator | None = None,
) -> Batch:
    """Random sequences whose target is themselves: ids in ``[1, vocab_size)``, the first one set to 1.

    Id 1 doubles as the start token, id 0 is padding (never drawn). There is no
    end token: decode exactly ``length`` tokens (``greedy_decode(..., eos_id=None)``).
    """
    check_positive(batch_size, "batch_size")
    check_positive(length, "length")
    if vocab_size < 3:
        raise ValueError(
            f"vocab_size must be at least 3 (padding, start, one symbol), got {vocab_size}"
        )
    data = torch.randint(1, vocab_size, (batch_size, length), generator=generator)
    data[:, 0] = 1
    return Batch.from_pairs(data.clone(), data, pad_id=0)


def labelled_bits(
    batch_size: int,
    num_bits: int = 8,
    length: int = 16,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Sources that hide ``num_bits`` labelled bits among blanks, and the one-token answer.

    Each source row has ``length`` slots. Label ``j`` (the letters a, b, c, … in the
    pages) sits in one random slot with a random bit ``b``, as the id ``2 + 2j + b``;
    the other slots hold the blank, id 1 (id 0, padding, is never drawn): a source
    vocabulary of ``2 + 2 * num_bits`` ids. The target is ``<bos>`` (id 1) and one token,
    ``2 + value``, where ``value`` reads the bits as a binary number, label 0 the most
    significant: a target vocabulary of ``2 + 2 ** num_bits`` ids. No answer can be given
    without reading every labelled slot.

    Returns ``src (batch_size, length)`` and ``tgt (batch_size, 2)``; decode one token
    after ``<bos>`` (``exact_match(..., bos_id=1, eos_id=None)``).
    """
    check_positive(batch_size, "batch_size")
    check_positive(num_bits, "num_bits")
    if num_bits > min(length, 16):
        raise ValueError(
            f"num_bits must be at most length and at most 16, "
            f"got num_bits={num_bits} and length={length}"
        )
    # A random order of the slots per row: label j goes to slot places[:, j].
    places = torch.rand(batch_size, length, generator=generator).argsort(dim=1)
    places = places[:, :num_bits]
    bits = torch.randint(0, 2, (batch_size, num_bits), generator=generator)
    src = torch.ones(batch_size, length, dtype=torch.long)  # all blank
    src.scatter_(1, places, 2 + 2 * torch.arange(num_bits) + bits)
    value = (bits * 2 ** torch.arange(num_bits - 1, -1, -1)).sum(dim=1)
    tgt = torch.stack([torch.ones_like(value), 2 + value], dim=1)
    return src, tgt


def _distinct_rows(
    count: int,
    vocab_size: int,
    length: int,
    generator: torch.Generator,
    exclude: set[tuple[int, ...]],
) -> Tensor:
    """``count`` copy-task sequences ``(count, length)``, none in ``exclude`` and no two alike.

    Rows are drawn as ``copy_task_batch`` draws them; a row already taken is drawn again.
    The new rows are added to ``exclude``.
    """
    rows: list[list[int]] = []
    while len(rows) < count:
        draw = torch.randint(
            1, vocab_size, (count - len(rows), length), generator=generator
        )
        draw[:, 0] = 1
        for row in draw.tolist():
            if tuple(row) not in exclude:
                exclude.add(tuple(row))
                rows.append(row)
    return torch.tensor(rows, dtype=torch.long).reshape(count, length)


def held_out_sizes(
    held_out: int, validation: int | None, most: int, of: str
) -> tuple[int, int]:
    """The sizes of a task's test and validation sets, ``validation`` defaulting to
    ``held_out``: a ``ValueError`` unless both are positive and together at most ``most``
    of the ``of`` (what the task draws from), so that enough is left to train on."""
    validation = held_out if validation is None else validation
    check_positive(held_out, "held_out")
    check_positive(validation, "validation")
    if held_out + validation > most:
        raise ValueError(
            f"held_out={held_out} and validation={validation} take more than {most} "
            f"of the {of}: too few would be left to train on"
        )
    return held_out, validation


class CopyTask:
    """The copy task with fixed validation and test sets, shaped like :class:`DateTask`.

    From ``seed``, ``held_out`` test sequences are drawn, then ``validation`` more
    (``held_out`` unless given), each set without repeats and the two disjoint.
    Training batches come from ``train_batch(batch_size, rng)``, which draws afresh
    and draws again any sequence of the two sets, so no test or validation sequence
    is ever trained on.
    """

    bos_id, eos_id, pad_id = 1, None, 0

    def __init__(
        self,
        vocab_size: int = 11,
        length: int = 10,
        held_out: int = 1000,
        seed: int = 0,
        validation: int | None = None,
    ) -> None:
        check_positive(length, "length")
        if vocab_size < 3:
            raise ValueError(
                f"vocab_size must be at least 3 (padding, start, one symbol), "
                f"got {vocab_size}"
            )
        if vocab_size**length >= 2**63:
            raise ValueError(
                f"vocab_size={vocab_size} and length={length}: a sequence must fit "
                "one 64-bit integer (vocab_size ** length < 2 ** 63)"
            )
        possible = (vocab_size - 1) ** (length - 1)  # the first token is always 1
        # At least half of the possible sequences are left to train on.
        held_out, validation = held_out_sizes(
            held_out, validation, possible // 2, f"{possible} possible sequences"
        )
        self.vocab_size, self.length = vocab_size, length
        self.src_vocab_size = self.tgt_vocab_size = vocab_size
        generator = torch.Generator().manual_seed(seed)
        self.held_out_rows: set[tuple[int, ...]] = set()
        self.test_src = _distinct_rows(
            held_out, vocab_size, length, generator, self.held_out_rows
        )
        self.validation_src = _distinct_rows(
            validation, vocab_size, length, generator, self.held_out_rows
        )
        # Each sequence as one integer (its digits in base vocab_size), for a fast lookup.
        self._powers = vocab_size ** torch.arange(length - 1, -1, -1, dtype=torch.long)
        held_out_src = torch.cat([self.test_src, self.validation_src])
        self._held_out_codes = (held_out_src * self._powers).sum(-1)

    def train_batch(self, batch_size: int, rng: random.Random | None = None) -> Batch:
        """A batch of fresh random sequences, none from the validation or test set;
        ``rng`` (a ``random.Random``) makes it repeatable."""
        check_positive(batch_size, "batch_size")
        seed = chooser(rng).getrandbits(63)
        generator = torch.Generator().manual_seed(seed)
        data = torch.randint(
            1, self.vocab_size, (batch_size, self.length), generator=generator
        )
        data[:, 0] = 1
        # Draw again any row of the validation or test set (repeats within a
        # batch are allowed, as in any random batch).
        while True:
            codes = (data * self._powers).sum(-1)
            taken = torch.isin(codes, self._held_out_codes).nonzero().flatten()
            if len(taken) == 0:
                break
            again = torch.randint(
                1, self.vocab_size, (len(taken), self.length), generator=generator
            )
            again[:, 0] = 1
            data[taken] = again
        return Batch.from_pairs(data.clone(), data, pad_id=0)

    def test_set(self) -> tuple[Tensor, Tensor]:
        """The test sequences as ``(src, tgt)``, both ``(held_out, length)``: the target is the source.
        Score it once, after training."""
        return self.test_src, self.test_src

    def validation_set(self) -> tuple[Tensor, Tensor]:
        """The validation sequences as ``(src, tgt)``, both ``(validation, length)``:
        what training may look at to choose."""
        return self.validation_src, self.validation_src


# --- dates ---------------------------------------------------------------------------------

FRENCH_MONTHS = [
    "janvier",
    "février",
    "mars",
    "avril",
    "mai",
    "juin",
    "juillet",
    "août",
    "septembre",
    "octobre",
    "novembre",
    "décembre",
]


@functools.cache  # a few hundred distinct numbers, looked up tens of thousands of times
def french_words(number: int) -> str:
    """A number in French words, e.g. 71 → "soixante et onze" (via the num2words library)."""
    from num2words import num2words  # imported here: only the dates task needs it

    return num2words(number, lang="fr")


def date_to_french(date: dt.date) -> str:
    """``2026-11-22`` → ``"vingt-deux novembre deux mille vingt-six"``; the 1st is "premier"."""
    day = "premier" if date.day == 1 else french_words(date.day)
    return f"{day} {FRENCH_MONTHS[date.month - 1]} {french_words(date.year)}"


# Source words are separated by runs of spaces and hyphens (chapter 10's page splits with this too).
WORD_SEPARATORS = r"[\s\-]+"


def split_words(text: str) -> list[str]:
    """Source tokens: words, split at spaces and hyphens ("vingt-deux" → "vingt", "deux")."""
    return [w for w in re.split(WORD_SEPARATORS, text) if w]


class DateTask:
    """French dates to ISO dates, with fixed validation and test sets.

    Every date of the ``years`` is a candidate; a seeded shuffle
    puts the first ``held_out`` aside as the test set and the next ``validation``
    (``held_out`` unless given) as the validation set, and training batches are
    drawn from the rest only. Source tokens are French words; target tokens are
    the characters of ``YYYY-MM-DD``.
    """

    def __init__(
        self,
        years: range = range(1950, 2050),
        held_out: int = 1000,
        seed: int = 0,
        validation: int | None = None,
    ) -> None:
        if not isinstance(years, range) or years.step != 1 or len(years) == 0:
            raise ValueError(f"years must be a range of whole years, got {years!r}")
        start, end = dt.date(years[0], 1, 1), dt.date(years[-1], 12, 31)
        dates = [start + dt.timedelta(days=i) for i in range((end - start).days + 1)]
        # At least one date is left to train on.
        held_out, validation = held_out_sizes(
            held_out, validation, len(dates) - 1, f"{len(dates)} dates"
        )
        random.Random(seed).shuffle(dates)
        cut = held_out + validation
        self.test_dates = dates[:held_out]
        self.validation_dates = dates[held_out:cut]
        self.train_dates = dates[cut:]
        self.sources = {d: split_words(date_to_french(d)) for d in dates}
        self.src_vocab = Vocabulary(w for words in self.sources.values() for w in words)
        self.tgt_vocab = Vocabulary("0123456789-")
        self.src_len = max(len(words) for words in self.sources.values())
        self.tgt_len = 10 + 2  # BOS, YYYY-MM-DD, EOS
        self.src_vocab_size, self.tgt_vocab_size = (
            len(self.src_vocab),
            len(self.tgt_vocab),
        )
        self.bos_id, self.eos_id, self.pad_id = (
            self.tgt_vocab.bos_id,
            self.tgt_vocab.eos_id,
            self.tgt_vocab.pad_id,
        )

    def encode(self, dates: Sequence[dt.date]) -> tuple[Tensor, Tensor]:
        """Source ids ``(n, src_len)`` padded, and target ids ``(n, 12)``: BOS, 10 characters, EOS."""
        src = torch.zeros(len(dates), self.src_len, dtype=torch.long)
        tgt = torch.empty(len(dates), self.tgt_len, dtype=torch.long)
        for row, date in enumerate(dates):
            ids = self.src_vocab.encode(self.sources[date])
            src[row, : len(ids)] = torch.tensor(ids)
            tgt[row] = torch.tensor(
                [
                    self.tgt_vocab.bos_id,
                    *self.tgt_vocab.encode(list(date.isoformat())),
                    self.tgt_vocab.eos_id,
                ]
            )
        return src, tgt

    def train_batch(self, batch_size: int, rng: random.Random | None = None) -> Batch:
        """A batch of training dates (never a validation or test one), drawn with ``rng`` (a ``random.Random``)."""
        check_positive(batch_size, "batch_size")
        return Batch.from_pairs(
            *self.encode(chooser(rng).choices(self.train_dates, k=batch_size)),
            pad_id=self.src_vocab.pad_id,
        )

    def test_set(self) -> tuple[Tensor, Tensor]:
        """The test dates, encoded: ``(held_out, src_len)`` and ``(held_out, 12)``.
        Score it once, after training."""
        return self.encode(self.test_dates)

    def validation_set(self) -> tuple[Tensor, Tensor]:
        """The validation dates, encoded: ``(validation, src_len)`` and ``(validation, 12)``:
        what training may look at to choose."""
        return self.encode(self.validation_dates)

    def to_iso(self, ids: Iterable[int]) -> str:
        return "".join(self.tgt_vocab.decode(ids))
