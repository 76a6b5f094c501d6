"""The bank of wrong reader versions: every graded part has at least six, each written the way a
reader would write it (tests/test_exercises.py's ``BROKEN`` and tests/reader_versions' ``WRONG``),
and each is failed with its own mistake named; correct versions written other ways pass."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from reader_versions import RIGHT, WRONG
from test_exercises import BROKEN, CORRECT

from transformer_book import exercises
from transformer_book.book.exercises import check


def test_every_part_has_at_least_six_wrong_versions_and_correct_ones():
    wrong = Counter(name for name, _, _ in BROKEN + WRONG)
    right = Counter(name for name, _ in CORRECT + RIGHT)
    for name in exercises.names():
        assert wrong[name] >= 6, (name, wrong[name])
    assert {name for name, _ in CORRECT + RIGHT} >= {"target_mask", "beam_search", "EncoderLayer"}
    assert sum(right.values()) >= 20


@pytest.mark.parametrize(("name", "mistake", "version"), WRONG, ids=[f"{n}-{m}-{v.__name__}" for n, m, v in WRONG])
def test_a_wrong_reader_version_fails_with_its_mistake_named(name, mistake, version):
    result = check(name, version)
    assert not result.passed
    assert result.mistake == mistake, result.message
    entry = next(m for m in exercises._spec(name).mistakes if m.name == mistake)
    assert entry.does in result.message and (not entry.did or entry.did in result.message)


@pytest.mark.parametrize(("name", "version"), RIGHT, ids=[f"{n}-{v.__name__}" for n, v in RIGHT])
def test_a_right_reader_version_passes(name, version):
    result = check(name, version)
    assert result.passed, result.message


def test_each_new_mistake_reads_as_one_entry():
    """Name, what the reader did, what it does, where the page explains it."""
    for name in exercises.names():
        spec = exercises._spec(name)
        for mistake in spec.mistakes:
            assert mistake.name.isidentifier() and mistake.does and mistake.variants
            assert re.match(r"\d\d_|appendix/", (mistake.section or spec.section).link)
    assert sum(bool(m.did) for n in exercises.names() for m in exercises._spec(n).mistakes) >= 20
