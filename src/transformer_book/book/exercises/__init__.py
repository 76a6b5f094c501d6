"""Build it: grade a reader's own version of a component against the package's, and name the mistake.

Each chapter ends with an exercise in which the reader writes the chapter's component
themselves, then runs::

    from transformer_book.book.exercises import check
    check("scaled_dot_product_attention", my_attention)

:func:`check` runs both versions on the same small inputs (random shapes, masks, batch size 1,
length 1, a query whose every key is hidden, float64, ... whatever the component needs) and
returns a :class:`CheckResult`. When the reader's version differs, the result says where
(which rows, columns or positions, the largest error, the shapes) and, when the difference has
the signature of a known mistake, names it: every component has a catalogue of broken versions,
and a reader's version that gives the same numbers as one of them on every input has made that
mistake. Mistakes that one of the book's source documents makes link to their row of the errata
appendix. The verdict never depends on the global random state, which checking leaves as it found.

The package
-----------

- ``engine`` — the grading machinery: ``engine.Case`` (one input), ``engine.Part``
  (one graded part: its reference, cases, runner and mistakes), running the reader's code under a
  time budget with its printing captured, recognising a mistake, ``engine.run_check``;
- ``results`` — :class:`Mistake`, :class:`CheckResult`, :class:`Section`, ``Page``; ``sections``
  the book's pages, so that a mistake cites its section where it stands
  (``section=MASKING["The padding mask"]``); ``compare`` how two outputs are compared and a
  difference located;
- one module per chapter, ``chNN_topic.py``, with its parts' cases, broken variants and mistakes,
  ending in a tuple ``PARTS``.

Adding a chapter's graded parts
-------------------------------

Write ``chNN_topic.py`` beside the others: for each part, a function returning its
``engine.Case`` list, a runner (``run_function(("output",))`` from ``engine`` for a plain function),
its broken versions (one factory that makes a version of the part, with its own signature, with
one thing changed; ``engine._signature_of`` gives a function the package's), its mistakes
(``mistake = results.mistake_maker(factory)``, then ``mistake(name, did, does, **changes)`` for
each) and finally ``PARTS = (Part(...), ...)``. Then add the module's name
to ``CHAPTER_MODULES`` below. ``tests/test_exercises_bank.py`` then asks for at least six wrong
reader versions of each part, each failed with its named mistake.
"""

from __future__ import annotations

import importlib
from typing import Any

from .engine import Part, run_check
from .results import CheckResult, Mistake, Section

__all__ = [
    "CHAPTER_MODULES",
    "CheckResult",
    "Mistake",
    "Section",
    "catalogue",
    "check",
    "names",
]

CHAPTER_MODULES = (
    "ch01_embedding",
    "ch02_positional",
    "ch03_attention",
    "ch04_heads",
    "ch05_masking",
    "ch06_encoder",
    "ch07_decoder",
    "ch08_training",
    "ch09_inference",
    "ch11_subwords",
)
"""The modules whose ``PARTS`` :func:`check` grades, in the order of the book."""

_REGISTRY: dict[str, Part] = {}


def _registry() -> dict[str, Part]:
    if not _REGISTRY:
        for module in CHAPTER_MODULES:
            for part in importlib.import_module(f".{module}", __name__).PARTS:
                _REGISTRY[part.name] = part
    return _REGISTRY


def names() -> list[str]:
    """The components :func:`check` can grade, in the order of the book."""
    return list(_registry())


def catalogue(name: str | None = None) -> dict[str, dict[str, str]]:
    """The recognised mistakes: ``{component: {mistake: what a version with it computes}}``
    (only ``name``'s when given)."""
    chosen = [_spec(name)] if name is not None else list(_registry().values())
    return {spec.name: {m.name: m.does for m in spec.mistakes} for spec in chosen}


def _spec(name: str) -> Part:
    registry = _registry()
    if not isinstance(name, str):
        raise ValueError(
            f"check() takes the part's name as a string, such as {next(iter(registry))!r}, "
            f"not {type(name).__name__}; it knows: {', '.join(registry)}"
        )
    if name not in registry:
        raise ValueError(
            f"check() knows no component named {name!r}; it knows: {', '.join(registry)}"
        )
    return registry[name]


def check(name: str, fn: Any) -> CheckResult:
    """Grade ``fn``, your own version of the package's ``name``, and name the mistake if it is a known one.

    ``fn`` has the package's signature: a function for a function's name, a class for a class's
    name (it is built with the package's arguments, and the package's weights are copied into it
    by parameter name). Both versions run on the same small inputs; the result is a
    :class:`CheckResult` whose ``passed``, ``mistake`` and ``message`` say how yours compares.
    A function may return only the output where the package's returns (output, weights).

    The names (see also :func:`names` and :func:`catalogue`):

    - ``"TokenEmbedding"`` (chapter 1): class ``(vocab_size, d_model, padding_idx=None)``
    - ``"sinusoidal_positional_encoding"`` (chapter 2): ``(max_len, d_model)`` → ``(max_len, d_model)``
    - ``"scaled_dot_product_attention"`` (chapter 3): ``(query, key, value, mask=None)``
    - ``"split_heads"``, ``"merge_heads"`` (chapter 4): ``(x, num_heads)``
    - ``"MultiHeadAttention"`` (chapter 4): class ``(d_model, num_heads)`` with ``q_proj``, ``k_proj``,
      ``v_proj``, ``out_proj``
    - ``"padding_mask"``, ``"causal_mask"``, ``"target_mask"`` (chapter 5): ``(tokens, pad_id=0)``,
      ``(size)``, ``(tokens, pad_id=0)`` → ``(batch, seq, seq)``, padding and causal at once
    - ``"sublayer_connection"`` (chapter 6): ``(x, sublayer, norm, drop, norm_first)``
    - ``"EncoderLayer"`` (chapter 6): class ``(d_model, num_heads, d_ff, dropout=0.1, norm_first=False)``
    - ``"DecoderLayer"`` (chapter 7): class ``(d_model, num_heads, d_ff, dropout=0.1, norm_first=False)``
      with ``forward(x, memory, *, src_mask=None, tgt_mask=None)``, the masks by keyword only
    - ``"LabelSmoothingLoss"`` (chapter 8): class ``(vocab_size, smoothing=0.1, pad_id=0)``
    - ``"noam_rate"`` (chapter 8): ``(step, d_model, warmup, factor=1.0, total_steps=None)``
    - ``"greedy_decode"``, ``"beam_search"`` (chapter 9): ``(model, src, max_tokens, bos_id, eos_id, ...)``
    - ``"bpe_merge_step"`` (chapter 11): ``(words)`` → ``(pair, new_words)``, one merge of byte-pair
      encoding against the ``tokenizers`` library (needs the ``book`` extra)

    An unknown ``name`` (or one that is not a string) raises ``ValueError``. Checking uses its own
    seeded generators; it puts back PyTorch's random state, default dtype, thread count and grad
    mode; whatever ``fn`` raises ends up in the message, what it prints is kept in
    ``result.printed`` and summarised, and a call that runs past the time budget
    (``engine.TIME_BUDGET_S``) is stopped (see ``engine`` for what cannot be).
    """
    return run_check(_spec(name), fn)
