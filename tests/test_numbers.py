"""Chapter 11's task, tokenizer, models and checkpoints (transformer_book.numbers)."""

from __future__ import annotations

import random
import re

import pytest
import torch
from num2words import num2words

import transformer_book as tb
from transformer_book import numbers as nums
from transformer_book.book.exercises import ch11_subwords


def test_english_words_are_num2words_split():
    rng = random.Random(0)
    for n in [0, 7, 21, 100, 101, 1000, 1005, 1100, 101_000, 999_999] + [rng.randrange(nums.LIMIT) for _ in range(200)]:
        assert nums.english_words(n) == re.split(r"[ ,\-]+", num2words(n, lang="en"))
        assert set(nums.english_words(n)) <= set(nums.ENGLISH)


def test_german_words_fix_num2words_fault_only():
    assert nums.german_words(101_000) == "einhunderteintausend"
    assert nums.german_words(97) == "siebenundneunzig"
    assert nums.german_words(21_001) == "einundzwanzigtausendeins"
    rng = random.Random(1)
    for n in [rng.randrange(nums.LIMIT) for _ in range(200)] + [201_005, 901_999]:
        faulty = n // 1000 in {101, 201, 301, 401, 501, 601, 701, 801, 901}
        assert (nums.german_words(n) != nums.num2words_german(n)) == faulty, n


@pytest.mark.parametrize("bad", [-1, nums.LIMIT, 1.5, "7"])
def test_numbers_out_of_range_are_refused(bad):
    with pytest.raises(ValueError, match="number"):
        nums.german_words(bad)


def test_three_sets_are_disjoint_and_fixed():
    split = nums.split_numbers()
    assert split == nums.split_numbers()  # the data's seed, not the book's
    validation = [n for v in split.validation.values() for n in v]
    test = [n for v in split.test.values() for n in v]
    assert len(set(validation)) == len(validation) and len(set(test)) == len(test)
    assert not set(validation) & set(test)
    for d in nums.DIGITS:
        assert all(nums.digit_count(n) == d for n in split.test[d])
        assert len(split.test[d]) == min(nums.PER_STRATUM, len(nums.stratum(d)) // 5)
    drawn = nums.sample_training(split, 3000, random.Random(0))
    assert not set(drawn) & split.held_out()
    assert min(sum(nums.digit_count(n) == d for n in drawn) for d in nums.DIGITS) > 350


@pytest.fixture(scope="module")
def task():
    return nums.NumberTask()


def test_tokenizer_pieces_and_round_trip(task):
    assert task.pieces(97) == ["sieben", "und", "neunzig"]
    assert task.tgt_vocab_size <= 128
    numbers = [0, 1, 97, 101_000, 999_999, 345_678]
    src, tgt = task.encode(numbers)
    assert src.shape == (6, task.src_len) and tgt.shape == (6, task.tgt_len)
    assert task.translations(tgt) == [nums.german_words(n) for n in numbers]
    assert nums.number_words("siebenundneunzig") == ["sieben", "und", "neunzig"]
    assert nums.number_words("einhunderteins") == ["ein", "hundert", "eins"]


def test_bpe_without_a_rule_keeps_special_letters():
    bpe = nums.train_bpe(["dreißig", "fünf", "dreißigtausend"] * 3, 40, split_rule=False)
    assert "ß" in bpe.get_vocab() and "ü" in bpe.get_vocab()
    assert "".join(nums.pieces(bpe, "dreißig")) == "dreißig"


def test_merge_step_agrees_with_tokenizers_and_grader_names_mistakes():
    for case in ch11_subwords._cases():
        (words,), _ = case.make()
        assert nums.bpe_merge_step(words) == ch11_subwords.library_merge_step(words)
    assert tb.exercises.check("bpe_merge_step", nums.bpe_merge_step).passed
    for mistake in ch11_subwords._MISTAKES:
        result = tb.exercises.check("bpe_merge_step", mistake.variants[0])
        assert not result.passed and result.mistake == mistake.name


def test_joint_sequences_pad_the_english_on_the_left(task):
    joint = nums.JointTask(task)
    numbers = [97, 5, 777_777]
    src, tgt = joint.encode(numbers)
    assert src.shape == (3, task.src_len - 1) and torch.equal(tgt, task.encode(numbers)[1])
    for row, n in zip(src.tolist(), numbers):
        words = [t - joint.offset for t in row if t]
        assert words == task.src_vocab.encode(nums.english_words(n))
        assert row[-len(words) :] == [w + joint.offset for w in words]  # padding first
    assert src.min() == 0 and int(src.max()) < joint.src_vocab_size
    assert int(src[src > 0].min()) >= task.tgt_vocab_size  # no id of a German piece


def test_decoder_only_is_causal_reads_the_source_and_decodes_like_the_loops(task):
    joint = nums.JointTask(task)
    config = tb.ModelConfig.small(joint.src_vocab_size, joint.tgt_vocab_size, dropout=0.0)
    tb.seed_everything(3)
    model = tb.init_weights(nums.DecoderOnly(config)).eval()
    src, tgt = joint.encode([123_456, 97])
    later, other_source = tgt.clone(), src.clone()
    later[:, -2] = 5
    other_source[0, -1] = joint.offset + 5
    with torch.no_grad():
        a, b, c = model(src, tgt), model(src, later), model(other_source, tgt)
    assert a.shape == (2, tgt.shape[1], task.tgt_vocab_size)
    torch.testing.assert_close(a[:, :-2], b[:, :-2])  # the future is hidden
    assert not torch.allclose(a[0], c[0]) and torch.equal(a[1], c[1])
    greedy = tb.greedy_decode(model, src, 8, task.bos_id, task.eos_id, use_cache=False)
    beam = tb.beam_search(model, src, 8, task.bos_id, task.eos_id, 1, use_cache=False)
    assert torch.equal(greedy, beam)
    # Its KV cache: the same tokens, and step by step the same hidden states.
    assert torch.equal(tb.greedy_decode(model, src, 8, task.bos_id, task.eos_id), greedy)
    four = [tb.beam_search(model, src, 8, task.bos_id, task.eos_id, 4, use_cache=u) for u in (True, False)]
    assert torch.equal(*four)
    # Step by step against the whole sequence. Decoded without an end token, no row is
    # padded after one (the argmax check below needs that); a padding id in the middle,
    # which an untrained model may pick as a word, is hidden by the cache as by the mask.
    ids = tb.greedy_decode(model, src, 8, task.bos_id, None)
    assert ids.shape == (2, 8)
    for fed in (ids, ids.index_fill(1, torch.tensor([3]), task.pad_id)):
        cache = model.decoder.new_cache(src, fed.shape[1])
        with torch.no_grad():
            steps = [model.decode(src, fed[:, t : t + 1], cache=cache) for t in range(fed.shape[1])]
            torch.testing.assert_close(torch.cat(steps, dim=1), model.decode(src, fed), atol=1e-5, rtol=1e-5)
        assert int(cache.position) == src.shape[1] + fed.shape[1]
    with pytest.raises(ValueError, match="holds ids"):  # not an IndexError in the embedding
        model(src, torch.full_like(tgt, joint.src_vocab_size))
    with pytest.raises(ValueError, match="beyond max_len"):
        model.decoder.new_cache(src, config.max_len)
    with torch.no_grad():  # greedy's tokens are the model's argmax, step by step
        steps = model(src, ids[:, :-1]).argmax(-1)
    assert torch.equal(steps, ids[:, 1:])


def test_shipped_models_load_and_score():
    trained = nums.trained_numbers()
    task, model = trained.task, trained.model
    for d, numbers in task.split.test.items():
        src = task.encode(numbers)[0]
        said = task.translations(tb.greedy_decode(model, src, task.tgt_len, 1, 2))
        right = sum(s == nums.german_words(n) for s, n in zip(said, numbers))
        assert right >= 0.99 * len(numbers), d
    assert nums.reversal_fails(model, task) == []
    solo = nums.trained_numbers("decoder_only")
    assert solo.steps == trained.steps
    p_ed, p_solo = tb.count_parameters(model), tb.count_parameters(solo.model)
    assert abs(p_solo - p_ed) <= 0.1 * p_ed
    assert nums.trained_numbers("uniform").steps == trained.steps


def test_a_changed_checkpoint_is_refused(monkeypatch):
    real = nums.hashlib.sha256
    monkeypatch.setattr(nums.hashlib, "sha256", lambda data: real(data + b"x"))
    with pytest.raises(ValueError, match="SHA-256"):
        nums.read_numbers_checkpoint("encoder_decoder")
