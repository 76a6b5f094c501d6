"""The dates model exported to ONNX (transformer_book.book.export) against PyTorch, run with onnxruntime.

One export per module (about five seconds, or a copy from the suite's export cache, which
tests/conftest.py sets): the graphs must give PyTorch's memory and logits to 1e-5, the
greedy loop the page runs must give tb.greedy_decode's tokens, and the cross-attention
the heatmap shows must be PyTorch's.
"""

from __future__ import annotations

import copy
import json
import os
import re

import numpy as np
import pytest
import torch

import transformer_book as tb
from transformer_book.book import export
from transformer_book.book.export import EXPORT_CACHE, MAX_MODEL_BYTES
from transformer_book.data import split_words

CHECKED = 64  # held-out dates compared one by one (the first ones of the task's list)


@pytest.fixture(scope="module")
def trained() -> tb.TrainedModel:
    return tb.trained_model("dates", device=torch.device("cpu"))


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory) -> tb.OnnxExport:
    with torch.no_grad():  # as a reader might call it: the export must not depend on grad mode
        return tb.export_onnx(trained, tmp_path_factory.mktemp("onnx"))


@pytest.fixture(scope="module")
def sessions(exported):
    return tb.onnx_sessions(exported)


def test_split_rule_is_the_packages(trained, exported):
    """The page splits words with tokenizer.json's source_split rule; the package with data.split_words."""
    rule = json.loads(exported.tokenizer.read_text(encoding="utf-8"))["source_split"]
    texts = [" ".join(words) for words in trained.task.sources.values()]
    texts += ["vingt-trois  novembre\tdeux-mille", " -premier- mai- ", "", "   ", "a--b - c"]
    as_the_page_does = [[word for word in re.split(rule, t) if word] for t in texts]
    assert as_the_page_does == [split_words(t) for t in texts]


def test_files_small_and_tokenizer_from_the_task(trained, exported):
    assert exported.model_bytes <= MAX_MODEL_BYTES, exported.model_bytes
    spec = json.loads(exported.tokenizer.read_text(encoding="utf-8"))
    task = trained.task
    assert spec["source_tokens"] == task.src_vocab.tokens
    assert spec["target_tokens"] == task.tgt_vocab.tokens
    assert (spec["pad_id"], spec["bos_id"], spec["eos_id"]) == (task.pad_id, task.bos_id, task.eos_id)
    assert spec["src_len"] == task.src_len and spec["max_len"] == task.tgt_len
    for name, info in spec["files"].items():
        assert (exported.folder / name).stat().st_size == info["bytes"]
    for example in spec["examples"]:  # held-out dates, never trained on
        assert tuple(split_words(example)) in {tuple(task.sources[d]) for d in task.test_dates}


def test_graphs_give_pytorchs_memory_and_logits(trained, exported, sessions):
    model, task = trained.model, trained.task
    src, tgt = (t[:CHECKED] for t in task.test_set())
    tgt_in = tgt[:, :-1]  # <bos> and the ten characters: the decoder's fixed length
    encoder, decoder = sessions
    with torch.no_grad():
        memory_ref = model.encode(src)
        logits_ref = model(src, tgt_in)
    worst_memory = worst_logits = 0.0
    for row in range(CHECKED):
        feeds = {"src": src[row : row + 1].numpy()}
        (memory,) = encoder.run(None, feeds)
        logits, _ = decoder.run(None, {**feeds, "memory": memory, "tgt": tgt_in[row : row + 1].numpy()})
        real = int((src[row] != task.pad_id).sum())  # padded positions of the memory are never read
        worst_memory = max(worst_memory, float(np.abs(memory[0, :real] - memory_ref[row, :real].numpy()).max()))
        worst_logits = max(worst_logits, float(np.abs(logits[0] - logits_ref[row].numpy()).max()))
    assert worst_memory <= 1e-5, worst_memory
    assert worst_logits <= 1e-5, worst_logits


def test_greedy_loop_gives_packages_tokens_and_attention(trained, exported, sessions):
    model, task = trained.model, trained.task
    for date in task.test_dates[:CHECKED]:
        words = task.sources[date]
        src = torch.tensor([task.src_vocab.encode(words)])  # unpadded, as a reader's sentence
        expected = tb.greedy_decode(model, src, task.tgt_len, task.bos_id, task.eos_id)
        decoding = tb.onnx_greedy_decode(exported, words, sessions)
        assert decoding.ids == expected[0].tolist(), " ".join(words)
        with tb.record_attention(model) as maps, torch.no_grad():
            model(src, expected[:, :-1])
        reference = maps[f"decoder.layers.{model.config.num_layers - 1}.cross_attn"][0].numpy()
        np.testing.assert_allclose(decoding.cross_attention, reference, atol=1e-5, rtol=0)
        assert decoding.probabilities.shape == (len(decoding.ids) - 1, task.tgt_vocab_size)


def test_export_leaves_the_model_as_it_was(trained, exported):
    assert not trained.model.training
    assert next(trained.model.parameters()).device.type == "cpu"


def test_only_the_dates_model(trained, tmp_path):
    other = tb.TrainedModel(trained.model, tb.CopyTask(), trained.recipe, 0, 0, 1.0)
    with pytest.raises(ValueError, match="dates model"):
        tb.export_onnx(other, tmp_path)


def test_words_outside_the_limits(trained, exported, sessions):
    with pytest.raises(ValueError, match="1 to"):
        tb.onnx_greedy_decode(exported, [], sessions)
    with pytest.raises(ValueError, match="1 to"):
        tb.onnx_greedy_decode(exported, ["mai"] * (trained.task.src_len + 1), sessions)
    with pytest.raises(ValueError, match="does not know.*'Mai', '<eos>'"):
        tb.onnx_greedy_decode(exported, ["premier", "Mai", "<eos>"], sessions)


def test_the_export_cache_copies_only_the_same_model(trained, exported, tmp_path, monkeypatch):
    """The suite's export cache (tests/conftest.py sets $TRANSFORMER_BOOK_EXPORT_CACHE): another
    export of the model is a copy of the one above, file for file; other weights are traced."""
    assert os.environ.get(EXPORT_CACHE), "tests/conftest.py sets the export cache"

    def refuse(*args):
        raise AssertionError("traced again")

    monkeypatch.setattr(export, "_trace_into", refuse)
    again = tb.export_onnx(trained, tmp_path / "again")
    assert again.spec == exported.spec
    for name in ("encoder", "decoder", "tokenizer"):
        assert getattr(again, name).read_bytes() == getattr(exported, name).read_bytes(), name
    other = copy.copy(trained)
    other.model = copy.deepcopy(trained.model)
    with torch.no_grad():
        other.model.generator.bias += 1e-3
    with pytest.raises(AssertionError, match="traced again"):
        tb.export_onnx(other, tmp_path / "other")
