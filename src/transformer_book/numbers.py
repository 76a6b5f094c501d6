"""Chapter 11: a real language, English number words to German number words.

``num2words`` writes every number from 0 to 999,999 in both languages by their
grammar: "ninety-seven" is "siebenundneunzig", units before tens, one compound.
This module makes the task:

- the words: English split on spaces, commas and hyphens (a closed vocabulary of
  number words); German as one compound, with ``num2words``' one fault fixed
  (:func:`num2words_german` against :func:`german_words`);
- three disjoint sets, chosen once by a fixed seed of the data (not the book's
  seed), each sampled evenly by digit count (:func:`split_numbers`);
- a learned subword vocabulary for German, byte-pair encoding from Hugging Face
  ``tokenizers`` (:func:`train_bpe`);
- :class:`NumberTask`, batches for :func:`~transformer_book.training.fit`;
- :class:`JointTask`, the same task as one sequence, for :class:`~transformer_book.decoder_only.DecoderOnly`
  (``decoder_only.py``), which it re-exports;
- the recipe both models train with and the shipped checkpoints.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import random
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from importlib import resources

import torch
from num2words import num2words
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
from torch import Tensor, nn

from .attention import record_attention
from .checks import check_choice, check_positive, require_instance
from .data import BOS, EOS, PAD, Batch, Vocabulary
from .decoder_only import DecoderOnly
from .inference import beam_search, greedy_decode
from .model import ModelConfig, Transformer, init_weights, make_model
from .recipes import Recipe
from .runtime import seed_everything
from .training import fit, strip_sequences

LIMIT = 1_000_000  # 0 .. 999,999: "eine Million" is two words
DIGITS = range(1, 7)  # the strata: numbers with 1, 2, ..., 6 digits
SPLIT_SEED = 11  # the data's own seed: the same three sets on every book seed
PER_STRATUM = 200  # validation and test numbers per digit count (at most)


# --- the words ---------------------------------------------------------------


@functools.cache
def _below_thousand(number: int, lang: str) -> str:
    return num2words(number, lang=lang)


def english_words(number: int) -> list[str]:
    """``number`` in English words, split on spaces, commas and hyphens.

    ``1999`` → ``['one', 'thousand', 'nine', 'hundred', 'and', 'ninety',
    'nine']``; the same words as ``num2words(number, lang="en")``, composed
    from its words for 0–999 (a call per number would be slow).
    """
    check_number(number)
    thousands, rest = divmod(number, 1000)
    if not thousands:
        text = _below_thousand(rest, "en")
    else:
        text = _below_thousand(thousands, "en") + " thousand"
        if rest:
            text += (" and " if rest < 100 else ", ") + _below_thousand(rest, "en")
    return [w for w in re.split(r"[ ,\-]+", text) if w]


def num2words_german(number: int) -> str:
    """What ``num2words`` itself writes (fault included)."""
    check_number(number)
    return num2words(number, lang="de")


def german_words(number: int) -> str:
    """``number`` as one German compound, built the way German builds it:
    the thousands part, "tausend", the rest. A count before "hundert" or
    "tausend" drops the final s of "eins" ("einhundert", "einundzwanzig-
    tausend", "einhunderteintausend"); num2words 0.5.14 keeps it in
    101,000 ("einhunderteinstausend"), which this fixes."""
    check_number(number)
    thousands, rest = divmod(number, 1000)
    if not thousands:
        return _below_thousand(rest, "de")
    head = _below_thousand(thousands, "de")
    head = head[:-1] if head.endswith("eins") else head
    return head + "tausend" + (_below_thousand(rest, "de") if rest else "")


def check_number(number: int) -> None:
    if not isinstance(number, int) or not 0 <= number < LIMIT:
        raise ValueError(f"number must be an int in [0, {LIMIT}), got {number!r}")


def digit_count(number: int) -> int:
    return len(str(number))


def stratum(digits: int) -> range:
    """The numbers with ``digits`` digits (0 counts as one digit)."""
    return range(0 if digits == 1 else 10 ** (digits - 1), 10**digits)


# --- three disjoint sets -------------------------------------------------------


@dataclass(frozen=True)
class NumberSplit:
    """Validation and test numbers per digit count; training is all the rest."""

    validation: dict[int, list[int]]
    test: dict[int, list[int]]

    def held_out(self) -> set[int]:
        return {
            n for part in (self.validation, self.test) for v in part.values() for n in v
        }


def split_numbers(
    seed: int = SPLIT_SEED, per_stratum: int = PER_STRATUM
) -> NumberSplit:
    """For each digit count, ``min(per_stratum, a fifth of it)`` numbers for
    validation and as many for test, drawn without replacement; every other
    number is for training. Disjoint by construction."""
    check_positive(per_stratum, "per_stratum")
    rng = random.Random(seed)
    validation, test = {}, {}
    for d in DIGITS:
        numbers = stratum(d)
        k = min(per_stratum, len(numbers) // 5)
        drawn = rng.sample(numbers, 2 * k)
        validation[d], test[d] = sorted(drawn[:k]), sorted(drawn[k:])
    return NumberSplit(validation, test)


def sample_training(
    split: NumberSplit, count: int, rng: random.Random, uniform: bool = False
) -> list[int]:
    """``count`` training numbers: a digit count uniformly, then a number of it;
    a held-out number is drawn again, digit count and all, so the lengths of
    which more is held out come up less often (with ``uniform``: a number of the
    whole range instead, as a careless sampler would)."""
    check_positive(count, "count")
    require_instance(rng, "rng", random.Random)
    held_out, numbers = split.held_out(), []
    while len(numbers) < count:
        n = rng.randrange(LIMIT) if uniform else rng.choice(stratum(rng.choice(DIGITS)))
        if n not in held_out:
            numbers.append(n)
    return numbers


# --- a learned subword vocabulary ----------------------------------------------

#: The split rule. Pieces never cross "und", "hundert" or "tausend".
SPLIT_RULE = Regex("und|hundert|tausend")


def train_bpe(
    words: Iterable[str], vocab_size: int, split_rule: bool = True
) -> Tokenizer:
    """Byte-pair encoding learned from ``words`` with Hugging Face ``tokenizers``.

    The alphabet is the words' characters (ß, ä, ö, ü are one symbol each: no
    byte-level pre-tokenizer); ``<pad>``, ``<bos>``, ``<eos>`` are ids 0, 1, 2.
    With ``split_rule`` the words are first cut before and after "und",
    "hundert" and "tausend", so no piece crosses them.
    """
    tokenizer = Tokenizer(models.BPE())
    if split_rule:
        tokenizer.pre_tokenizer = pre_tokenizers.Split(SPLIT_RULE, "isolated")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS], show_progress=False
    )
    tokenizer.train_from_iterator(words, trainer)
    return tokenizer


def number_words(german: str) -> list[str]:
    """A fixed split of a German number into number words, the same for any
    vocabulary: ``"siebenundneunzig"`` → ``['sieben', 'und', 'neunzig']``."""
    return [w for w in re.split(r"(und|hundert|tausend)", german) if w]


def pieces(tokenizer: Tokenizer, word: str) -> list[str]:
    """The pieces ``word`` splits into: ``"siebenundneunzig"`` → e.g.
    ``['sieben', 'und', 'neunzig']``."""
    return tokenizer.encode(word).tokens


def merges(tokenizer: Tokenizer) -> list[tuple[str, str]]:
    """The learned merges, in the order they were learned."""
    import json

    learned = json.loads(tokenizer.to_str())["model"]["merges"]
    return [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned]


def bpe_merge_step(
    words: dict[tuple[str, ...], int],
) -> tuple[tuple[str, str], dict[tuple[str, ...], int]]:
    """One step of byte-pair encoding: count adjacent pairs of symbols, each
    word weighted by its frequency; merge the most frequent pair (ties: the
    pair first in sorted order, as ``tokenizers`` breaks them) everywhere."""
    counts: Counter[tuple[str, str]] = Counter()
    for symbols, freq in words.items():
        for pair in zip(symbols, symbols[1:]):
            counts[pair] += freq
    best = min(counts, key=lambda p: (-counts[p], p))
    merged = {}
    for symbols, freq in words.items():
        out, i = [], 0
        while i < len(symbols):
            if symbols[i : i + 2] == best:
                out.append(best[0] + best[1])
                i += 2
            else:
                out.append(symbols[i])
                i += 1
        merged[tuple(out)] = merged.get(tuple(out), 0) + freq
    return best, merged


# --- the task -------------------------------------------------------------------


ENGLISH = sorted({w for n in range(1000) for w in english_words(n)} | {"thousand"})


class NumberTask:
    """English number words → German pieces, with three disjoint sets.

    ``src_vocab``: the closed list of English number words; ``tokenizer``: the
    German pieces (ids 0, 1, 2 are ``<pad>``, ``<bos>``, ``<eos>`` in both).
    """

    pad_id, bos_id, eos_id = 0, 1, 2

    def __init__(
        self,
        vocab_size: int = 128,
        split_rule: bool = True,
        tokenizer: Tokenizer | None = None,
        bpe_sample: int = 20_000,
    ) -> None:
        self.split = split_numbers()
        self.src_vocab = Vocabulary(ENGLISH)
        if tokenizer is None:  # learned from training numbers only
            corpus = sample_training(self.split, bpe_sample, random.Random(SPLIT_SEED))
            tokenizer = train_bpe(map(german_words, corpus), vocab_size, split_rule)
            # BPE never goes below its alphabet and special tokens.
            if tokenizer.get_vocab_size() > vocab_size:
                raise ValueError(
                    f"vocab_size={vocab_size} is below the {tokenizer.get_vocab_size()} tokens "
                    "of the alphabet and the special tokens"
                )
        self.tokenizer = tokenizer
        self.src_vocab_size = len(self.src_vocab)
        self.tgt_vocab_size = tokenizer.get_vocab_size()
        self.src_len = 12  # 999,999 is the longest: 11 words and <eos>
        # A word of the thousands part, "tausend", a word below a thousand.
        longest = max(len(self.pieces(n)) for n in range(1000))
        self.tgt_len = 1 + 2 * longest + 1 + 1  # <bos> ... <eos>

    def pieces(self, number: int) -> list[str]:
        return pieces(self.tokenizer, german_words(number))

    def encode(self, numbers: Sequence[int]) -> tuple[Tensor, Tensor]:
        """Source ids ``(n, src_len)`` (words, ``<eos>``) and target ids
        ``(n, tgt_len)`` (``<bos>``, pieces, ``<eos>``), padded with 0."""
        sources = [
            self.src_vocab.encode(english_words(n)) + [self.eos_id] for n in numbers
        ]
        encoded = self.tokenizer.encode_batch([german_words(n) for n in numbers])
        targets = [[self.bos_id, *e.ids, self.eos_id] for e in encoded]
        # Padded as lists, then one tensor each: a tensor per row would cost more than
        # the rows themselves (a training batch is 128 short rows).
        return self._padded(sources, self.src_len), self._padded(targets, self.tgt_len)

    def _padded(self, rows: list[list[int]], length: int) -> Tensor:
        """``(len(rows), length)`` ids: each row, then ``pad_id`` up to ``length``."""
        padded = [row + [self.pad_id] * (length - len(row)) for row in rows]
        return torch.tensor(padded, dtype=torch.long).view(len(rows), length)

    def train_batch(
        self, batch_size: int, rng: random.Random, uniform: bool = False
    ) -> Batch:
        numbers = sample_training(self.split, batch_size, rng, uniform)
        return Batch.from_pairs(*self.encode(numbers), pad_id=self.pad_id)

    def numbers(self, part: str = "test") -> list[int]:
        """The ``"validation"`` or ``"test"`` numbers, by digit count."""
        check_choice(part, "part", ("validation", "test"))
        return [n for ns in getattr(self.split, part).values() for n in ns]

    def decode(self, ids: Iterable[int]) -> str:
        """Target ids (after ``<bos>``, up to ``<eos>``) → the German word:
        the pieces joined without spaces."""
        return "".join(self.tokenizer.id_to_token(int(i)) for i in ids)

    def translations(self, rows: Tensor) -> list[str]:
        """Decoded ids ``(n, len)`` (``<bos>`` first) → German words."""
        return [self.decode(r) for r in strip_sequences(rows, self.eos_id, self.pad_id)]


# --- the task as one sequence, for a decoder-only model --------------------------


class JointTask:
    """The task for :class:`~transformer_book.decoder_only.DecoderOnly`: the
    English words, then ``<bos>``, the German pieces and ``<eos>``, as one
    sequence. One vocabulary: the German pieces' ids (``<pad>``, ``<bos>``,
    ``<eos>`` first), then the English words. Each source is padded on the left,
    so ``<bos>`` stands at the same position in every row. The loss reads only
    the German part."""

    def __init__(self, task: NumberTask) -> None:
        self.task = task
        self.offset = task.tgt_vocab_size - 3  # English id i (>= 3) -> i + offset
        self.src_vocab_size = self.offset + task.src_vocab_size  # both languages
        self.tgt_vocab_size = task.tgt_vocab_size  # German only

    def encode(self, numbers: Sequence[int]) -> tuple[Tensor, Tensor]:
        """``src (n, src_len - 1)``: the English words in the joint vocabulary,
        padded on the left (``<bos>`` ends them, not ``<eos>``); ``tgt`` as
        :meth:`NumberTask.encode` gives it."""
        src, tgt = self.task.encode(numbers)
        words = (src + self.offset).masked_fill(src < 3, self.task.pad_id)
        padding_first = (words != self.task.pad_id).long().argsort(dim=1, stable=True)
        return words.gather(1, padding_first)[:, 1:], tgt

    def train_batch(
        self, batch_size: int, rng: random.Random, uniform: bool = False
    ) -> Batch:
        numbers = sample_training(self.task.split, batch_size, rng, uniform)
        return Batch.from_pairs(*self.encode(numbers), pad_id=self.task.pad_id)


def translate(
    model: nn.Module, task: NumberTask, numbers: Sequence[int], beam_size: int = 1
) -> list[str]:
    """German words for ``numbers`` from either model: greedy decoding, or
    beam search (α = 0.6) with ``beam_size`` > 1."""
    decoder_only = isinstance(model, DecoderOnly)
    src = (JointTask(task) if decoder_only else task).encode(numbers)[0]
    device = next(model.parameters()).device
    args = (model, src.to(device), task.tgt_len, task.bos_id, task.eos_id)
    if beam_size == 1:
        ys = greedy_decode(*args)
    else:
        ys = beam_search(*args, beam_size, alpha=0.6)
    return task.translations(ys.cpu())


# --- word order -------------------------------------------------------------------


@torch.no_grad()
def cross_attention(
    model: Transformer, task: NumberTask, number: int, layer: int | None = None
) -> Tensor:
    """Cross-attention averaged over the heads of every decoder layer (or of
    decoder layer ``layer`` alone), teacher-forced on ``number``:
    ``(pieces + 1, words + 1)``. Row ``i`` is the step that writes the
    ``i``-th piece (the last writes ``<eos>``), column ``j`` the ``j``-th
    English word (the last is ``<eos>``)."""
    require_instance(
        model, "model (a decoder-only model has no cross-attention)", Transformer
    )
    depth = len(model.decoder.layers)
    if layer is not None:
        check_choice(layer, "layer", range(-depth, depth))
    src, tgt = task.encode([number])
    words, length = len(english_words(number)) + 1, len(task.pieces(number)) + 1
    device = next(model.parameters()).device
    layers = range(depth)
    chosen = layers if layer is None else [layers[layer]]
    with record_attention(model) as maps:
        model(src[:, :words].to(device), tgt[:, :length].to(device))
    weights = [maps[f"decoder.layers.{i}.cross_attn"][0] for i in chosen]
    return torch.stack(weights).mean((0, 1)).cpu()  # over layers and heads


def reversal_fails(
    model: Transformer, task: NumberTask, layer: int | None = None
) -> list[int]:
    """The two-digit numbers 21–99, round tens left out, on which the step
    that writes the first German piece (the unit) does *not* attend more to
    the English unit word than to the tens word, or the step that writes the
    tens piece does not attend more to the tens word than to the unit word
    (:func:`cross_attention`, every layer by default). ``[]`` when the
    reversal holds. The question is which English word a step reads, so the
    weight on ``<eos>`` is left out: the step that writes the tens piece,
    the last, also looks there (the number ends), by as much on some runs."""
    fails = []
    for n in range(21, 100):
        if n % 10:
            # ["ninety", "seven"]: column 0 the tens word, column 1 the unit
            weights = cross_attention(model, task, n, layer)[:, :2]
            tens_row = task.pieces(n).index("und") + 1
            unit_read, tens_read = weights[[0, tens_row]].argmax(-1).tolist()
            if unit_read != 1 or tens_read != 0:
                fails.append(n)
    return fails


# --- training: one recipe for both models ----------------------------------------

RECIPE = Recipe(
    task="numbers", dropout=0.0, batch_size=128, warmup=200, lr_factor=1.0,
    clip_norm=1.0, adam_eps=1e-9, max_steps=600, eval_every=50, target=0.995,
    taper=True, average=0.99,
)  # fmt: skip
# The decoder-only model's sizes against the recipe's: twice the layers, no
# cross-attention, so about as many parameters as the encoder–decoder.
DECODER_ONLY = dict(num_layers=4, d_ff=320)


@dataclass
class TrainedNumbers:
    """A model trained on the number task, and the task."""

    model: nn.Module
    task: NumberTask
    seed: int
    steps: int
    seconds: float
    validation: float  # exact match on the validation set, which chose the model


def exact_on(
    model: nn.Module, task: NumberTask, numbers: Sequence[int], beam_size: int = 1
) -> float:
    """The share of ``numbers`` that ``model`` translates exactly (:func:`translate`;
    the recipes' ``validation_accuracy`` is the dates and copy tasks')."""
    said = translate(model, task, numbers, beam_size)
    return sum(s == german_words(n) for s, n in zip(said, numbers)) / len(numbers)


def train_numbers(
    seed: int = 0,
    task: NumberTask | None = None,
    device: torch.device | None = None,
    progress: bool = False,
    uniform: bool = False,
    steps: int | None = None,
    decoder_only: bool = False,
) -> TrainedNumbers:
    """Train the encoder–decoder (or, with ``decoder_only``, the
    :class:`~transformer_book.decoder_only.DecoderOnly` of ``DECODER_ONLY``'s
    sizes) with ``RECIPE`` and ``seed``; the weight average is scored on the
    validation set every ``eval_every`` steps, and training stops once its exact
    match reaches ``RECIPE.target``. With ``steps``, exactly that many steps and
    no validation; with ``uniform``, numbers drawn from the whole range."""
    if steps is not None:
        check_positive(steps, "steps")
    device = device or torch.device("cpu")
    task = task or NumberTask()
    seed_everything(seed)
    r = RECIPE
    if decoder_only:
        source = JointTask(task)
        config = replace(r.model_config(source), **DECODER_ONLY)
        model = init_weights(DecoderOnly(config)).to(device)
    else:
        source, model = task, make_model(r.model_config(task)).to(device)
    optimizer, schedule = r.optimizer(model)
    rng = random.Random(seed + 1)
    held = task.numbers("validation")
    evaluate = None if steps else lambda m: exact_on(m, task, held)
    history = fit(
        model, lambda step: source.train_batch(r.batch_size, rng, uniform),
        steps or r.max_steps, optimizer, schedule, loss_fn=r.loss_fn(model.config),
        evaluate=evaluate, eval_every=r.eval_every, stop_at=r.target,
        progress=progress, clip_norm=r.clip_norm, average=r.average,
    )  # fmt: skip
    model = history.averaged if history.averaged is not None else model.eval()
    validation = history.eval_metric[-1] if history.eval_metric else float("nan")
    return TrainedNumbers(
        model, task, seed, history.step[-1], history.seconds, validation
    )


# --- the shipped checkpoints ------------------------------------------------------

CHECKPOINT_PACKAGE = "transformer_book.checkpoints.numbers"


def checkpoint_state(trained: TrainedNumbers) -> dict:
    """Weights, config, recipe, tokenizer (as JSON text) and the run's facts."""
    return {
        "model": trained.model.state_dict(),
        "model_config": dataclasses.asdict(trained.model.config),
        "recipe": dataclasses.asdict(RECIPE),
        "tokenizer": trained.task.tokenizer.to_str(),
        "seed": trained.seed,
        "steps": trained.steps,
        "seconds": trained.seconds,
        "validation": trained.validation,
        "torch": str(torch.__version__),
    }


def same_recipe(stored: dict) -> bool:
    """Whether a checkpoint's recipe is ``RECIPE`` (a field added to
    ``Recipe`` since counts as the same while ``RECIPE`` keeps its default)."""
    now = dataclasses.asdict(RECIPE)
    defaults = {
        f.name: f.default for f in dataclasses.fields(Recipe) if f.name not in stored
    }
    return all(now.get(k) == v for k, v in stored.items()) and all(
        now[k] == v for k, v in defaults.items()
    )


def read_numbers_checkpoint(name: str) -> dict:
    """``checkpoints/numbers/<name>.pt`` after checking its SHA-256 and recipe."""
    folder = resources.files(CHECKPOINT_PACKAGE)
    sums = (folder / "SHA256SUMS").read_text().split()
    shipped = {
        file.removesuffix(".pt"): sha for sha, file in zip(sums[::2], sums[1::2])
    }
    check_choice(name, "name", shipped)
    data = (folder / f"{name}.pt").read_bytes()
    if shipped[name] != hashlib.sha256(data).hexdigest():
        raise ValueError(f"checkpoint {name}.pt: its SHA-256 does not match SHA256SUMS")
    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if not same_recipe(state["recipe"]):
        raise ValueError(
            f"checkpoint {name}.pt was made by another recipe; "
            "run `python scripts/make_numbers_checkpoints.py`"
        )
    return state


def trained_numbers(
    name: str = "encoder_decoder", device: torch.device | None = None
) -> TrainedNumbers:
    """A shipped model, in evaluation mode, with its task (the tokenizer it
    was trained with): ``"encoder_decoder"`` (a
    :class:`~transformer_book.model.Transformer`), ``"decoder_only"`` (a
    :class:`~transformer_book.decoder_only.DecoderOnly`) or ``"uniform"`` (the
    encoder–decoder trained on numbers drawn uniformly, section 11.2)."""
    state = read_numbers_checkpoint(name)
    task = NumberTask(tokenizer=Tokenizer.from_str(state["tokenizer"]))
    config = ModelConfig(**state["model_config"])
    model = DecoderOnly(config) if name == "decoder_only" else make_model(config)
    model.load_state_dict(state["model"])
    model.to(device or torch.device("cpu")).eval()
    return TrainedNumbers(
        model,
        task,
        state["seed"],
        state["steps"],
        state["seconds"],
        state["validation"],
    )
