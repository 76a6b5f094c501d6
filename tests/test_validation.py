"""Bad input fails early with a ValueError that names the argument and the shapes."""

from __future__ import annotations

import copy

import pytest
import torch

import transformer_book as tb
from transformer_book import numbers as nums
from transformer_book.decoder_only import DecoderOnly


@pytest.fixture(scope="module")
def model() -> tb.Transformer:
    return tb.make_model(tb.ModelConfig.small(11, max_len=16)).eval()


def attention() -> tb.MultiHeadAttention:
    return tb.MultiHeadAttention(16, 4)


x = torch.randn(2, 5, 16)
ids = torch.randint(1, 11, (2, 5))


def overfill(m: tb.Transformer | DecoderOnly, capacity: int = 2, step: int = 1) -> None:
    """Decode with a cache of ``capacity`` target positions until it runs out of room."""
    memory = m.encode(ids)
    cache = m.decoder.new_cache(memory, capacity)
    for _ in range(capacity // step + 1):
        m.decode(memory, ids[:, :step], cache=cache)


def first_batch() -> tb.Batch:
    return tb.Batch.from_pairs(ids, torch.tensor([[1, 3, 4, 2], [1, 5, 2, 0]]))


def on_meta(m: tb.Transformer) -> tb.Transformer:
    """A copy of ``m`` on the meta device: another device than the CPU's ids, without a GPU."""
    return copy.deepcopy(m).to("meta")


CASES = {
    "a GPU model given the CPU's ids (as test_set() makes them)": (
        lambda m: tb.greedy_decode(on_meta(m), ids, max_tokens=4, bos_id=1, eos_id=2),
        r"src with shape \(2, 5\) is on cpu, but the model is on meta: move it there with \.to\('meta'\)",
    ),
    "a target on another device than the memory": (
        lambda m: m.decode(m.encode(ids).to("meta"), ids),
        r"tgt with shape \(2, 5\) is on cpu, but memory is on meta",
    ),
    "a source mask on another device than the source": (
        lambda m: m.encode(ids, torch.ones(2, 1, 5, dtype=torch.bool, device="meta")),
        r"src_mask with shape \(2, 1, 5\) is on meta, but the query is on cpu",
    ),
    "keys on another device than the queries": (
        lambda m: tb.scaled_dot_product_attention(x, x.to("meta"), x),
        r"key with shape \(2, 5, 16\) is on meta, but query is on cpu",
    ),
    "d_model not divisible by heads": (lambda m: tb.MultiHeadAttention(512, 7), r"d_model=512 .*num_heads=7"),
    "config heads": (lambda m: tb.ModelConfig(11, 11, d_model=30, num_heads=4), r"d_model=30 .*num_heads=4"),
    "odd d_model for sinusoids": (lambda m: tb.sinusoidal_positional_encoding(10, 7), r"d_model must be even .*got 7"),
    "mask does not broadcast": (
        lambda m: attention()(x, x, x, torch.ones(2, 5, 4, dtype=torch.bool)),
        r"mask with shape \(2, 5, 4\) does not broadcast to \(2, 5, 5\)",
    ),
    "mask has wrong batch": (
        lambda m: attention()(x, x, x, torch.ones(3, 1, 5, dtype=torch.bool)),
        r"mask with shape \(3, 1, 5\) does not broadcast to \(2, 5, 5\)",
    ),
    "float mask": (
        lambda m: attention()(x, x, x, torch.zeros(2, 1, 5)),
        r"mask must be a boolean tensor .*torch.float32 with shape \(2, 1, 5\)",
    ),
    "token id above the vocabulary": (
        lambda m: m.encode(torch.tensor([[1, 2, 11]])),
        r"src holds ids in \[1, 11\] but the vocabulary has 11 ids .*shape \(1, 3\)",
    ),
    "negative token id": (lambda m: m(ids, torch.tensor([[1, -1]])), r"tgt holds ids in \[-1, 1\]"),
    "source longer than max_len": (
        lambda m: m.encode(torch.ones(1, 17, dtype=torch.long)),
        r"src has 17 positions, more than max_len=16; shape \(1, 17\)",
    ),
    "target longer than max_len": (
        lambda m: m.decode(torch.randn(1, 3, 64), torch.ones(1, 17, dtype=torch.long)),
        r"tgt reaches position 16 .*\(1, 17\).*max_len=16",
    ),
    "empty batch": (lambda m: m(torch.ones(0, 5, dtype=torch.long), ids), r"src is empty: shape \(0, 5\)"),
    "float token ids": (
        lambda m: m.src_embed(torch.ones(2, 3)),
        r"tokens must hold integer token ids, got dtype torch.float32 with shape \(2, 3\)",
    ),
    "tokens of the wrong rank": (
        lambda m: m.encode(torch.ones(5, dtype=torch.long)),
        r"src must have shape \(batch, seq\), got \(5\)",
    ),
    "features of the wrong width": (
        lambda m: attention()(torch.randn(2, 5, 8), x, x),
        r"query must have last dimension d_model=16, got shape \(2, 5, 8\)",
    ),
    "integer features": (
        lambda m: m.encoder(torch.ones(2, 5, 64, dtype=torch.long)),
        r"x must be a floating-point tensor, got dtype torch.int64",
    ),
    "key and value lengths differ": (
        lambda m: attention()(x, x, torch.randn(2, 4, 16)),
        r"key and value must share \(batch, len\), got key \(2, 5, 16\) and value \(2, 4, 16\)",
    ),
    "query and key d_k differ": (
        lambda m: tb.scaled_dot_product_attention(torch.randn(3, 8), torch.randn(4, 6), torch.randn(4, 6)),
        r"query and key must share d_k, got query \(3, 8\) and key \(4, 6\)",
    ),
    "memory of another batch size": (
        lambda m: m.decode(torch.randn(3, 4, 64), ids),
        r"tgt \(2, 5\) and memory \(3, 4, 64\) must have the same batch size",
    ),
    "masks swapped: the target's causal mask given as src_mask": (
        lambda m: m.decode(torch.randn(2, 4, 64), ids, src_mask=tb.causal_mask(5), tgt_mask=tb.padding_mask(ids)),
        r"src_mask with shape \(1, 5, 5\) does not broadcast to \(2, 5, 4\)",
    ),
    "dropout out of range": (
        lambda m: tb.MultiHeadAttention(16, 4, dropout=1.5),
        r"dropout must be in \[0, 1\), got 1.5",
    ),
    "shared embeddings with two vocabularies": (
        lambda m: tb.ModelConfig(11, 12, share_embeddings=True),
        r"src_vocab_size=11 and tgt_vocab_size=12",
    ),
    "pad id outside the vocabulary": (
        lambda m: tb.ModelConfig(11, 11, pad_id=11),
        r"pad_id must be an id of the vocabulary, an int in \[0, 11\), got 11",
    ),
    "a float pad id, which would hide no padding": (
        lambda m: tb.ModelConfig(11, 11, pad_id=1.5),
        r"pad_id must be an id of the vocabulary, an int in \[0, 11\), got 1.5",
    ),
    "a flag given as a string": (
        lambda m: tb.ModelConfig.small(11, norm_first="no"),
        r"norm_first must be of type bool, got str",
    ),
    "a dropout rate given as a string": (
        lambda m: tb.ModelConfig.small(11, dropout="0.1"),
        r"dropout must be in \[0, 1\), got '0.1'",
    ),
    "positional offset beyond max_len": (
        lambda m: tb.PositionalEncoding(16, max_len=8)(torch.randn(1, 4, 16), offset=6),
        r"positions 6..9 of x with shape \(1, 4, 16\) exceed max_len=8",
    ),
    "eos outside the target vocabulary": (
        lambda m: tb.greedy_decode(m, ids, max_tokens=5, bos_id=1, eos_id=99),
        r"eos_id must be an id of the vocabulary, an int in \[0, 11\), got 99",
    ),
    "a float bos id, which a tensor would truncate": (
        lambda m: tb.beam_search(m, ids, max_tokens=5, bos_id=1.5, eos_id=2),
        r"bos_id must be an id of the vocabulary, an int in \[0, 11\), got 1.5",
    ),
    "bos is the padding id": (
        lambda m: tb.greedy_decode(m, ids, max_tokens=5, bos_id=0, eos_id=2),
        r"bos_id=0 is the padding id",
    ),
    "a cache made for another memory": (
        lambda m: m.decode(torch.randn(2, 3, 64), ids[:, :1], cache=m.decoder.new_cache(m.encode(ids), 4)),
        r"memory \(2, 3, 64\) has another shape than the memory the cache was made for "
        r"\(2 rows of 5 positions\)",
    ),
    "a cache of another model's decoder": (
        lambda m: m.decode(
            m.encode(ids),
            ids[:, :1],
            cache=tb.make_model(tb.ModelConfig.small(11, num_layers=1)).decoder.new_cache(m.encode(ids), 4),
        ),
        r"the cache has 1 layers but the decoder has 2: make the cache with this model's decoder.new_cache",
    ),
    "a one-slot mask over a cache": (
        lambda m: m.decode(
            m.encode(ids), ids[:, :1], tgt_mask=tb.causal_mask(1), cache=m.decoder.new_cache(m.encode(ids), 4)
        ),
        r"tgt_mask with shape \(1, 1, 1\): with a cache its last axis must be the cache's 4 slots",
    ),
    "a chunked loss whose hidden states and targets do not line up": (
        lambda m: tb.chunked_loss(torch.randn(2, 5, 64), m.generator, ids[:, :4], tb.LabelSmoothingLoss(11), 4),
        r"hidden \(2, 5, 64\) must be target \(2, 4\) plus a last axis",
    ),
    "a learning-rate factor of -1": (
        lambda m: tb.noam_rate(10, 64, 100, factor=-1.0),
        r"factor must be a positive number",
    ),
    "resuming past the last step": (
        lambda m: tb.fit(m, lambda step: first_batch(), 3, torch.optim.SGD(m.parameters(), lr=0.0), start_step=5),
        r"start_step must be an int in \[0, steps=3\), got 5",
    ),
    "fit given noam_optimizer's pair": (
        lambda m: tb.fit(m, lambda step: first_batch(), 1, tb.noam_optimizer(m, 64, 10), progress=False),
        r"optimizer must be of type Optimizer, got tuple",
    ),
    "an exact match of nothing": (
        lambda m: tb.exact_match(m, ids[:0], ids[:0], 1, 2),
        r"src \(0, 5\) and tgt \(0, 5\) must be 2-d with the same number of rows, at least one",
    ),
    "an integer seed for a task's draws": (
        lambda m: tb.CopyTask(held_out=10).train_batch(4, rng=0),
        r"rng must be of type Random, got int",
    ),
    "ids the vocabulary does not have": (
        lambda m: tb.Vocabulary("abc").decode([3, -1, 99]),
        r"ids\[1\] must be an id of the vocabulary, an int in \[0, 6\), got -1",
    ),
    "a batch from lists": (
        lambda m: tb.Batch.from_pairs([[1, 2, 3]], [[1, 2, 3]]),
        r"src must be of type Tensor, got list",
    ),
    "cross-attention of a decoder-only model": (
        lambda m: nums.cross_attention(DecoderOnly(tb.ModelConfig.small(11)), None, 97),
        r"model \(a decoder-only model has no cross-attention\) must be of type Transformer, got DecoderOnly",
    ),
    "numbers of a part that is not held out": (
        lambda m: nums.NumberTask().numbers("train"),
        r"part must be one of \['test', 'validation'\], got 'train'",
    ),
    "a recipe with a misspelt task": (
        lambda m: tb.Recipe("copyy", 0.1, 32, 100, 1.0, None, 1e-9, 100, 10, 1.0),
        r"task must be one of \['copy', 'dates', 'numbers'\], got 'copyy'",
    ),
    "decoding a weight average itself": (
        lambda m: tb.greedy_decode(tb.weight_average(m, 0.9), ids, 5, 1, 2),
        r"model must be one of the book's models, with a config; got AveragedModel \(.*decode its .module\)",
    ),
    "a decoder-only model from a number": (lambda m: DecoderOnly(11), r"config must be of type ModelConfig, got int"),
    "a decoder-only cache of another model": (
        lambda m: DecoderOnly(tb.ModelConfig.small(11, num_layers=3)).decode(
            ids, ids[:, :1], cache=DecoderOnly(tb.ModelConfig.small(11)).decoder.new_cache(ids, 4)
        ),
        r"the cache has 2 layers but the decoder has 3",
    ),
    "a mask of one dimension": (
        lambda m: tb.greedy_decode(m, ids, 5, 1, 2, src_mask=torch.ones(5, dtype=torch.bool)),
        r"src_mask with shape \(5\) needs at least 2 dimensions, \(queries, keys\)",
    ),
    "a cache of another kind": (
        lambda m: m.decode(m.encode(ids), ids[:, :1], cache=[1]),
        r"cache must be of type DecoderCache or NoneType, got list",
    ),
    "a float id, which would be truncated": (
        lambda m: tb.Vocabulary("abc").decode([3.7]),
        r"ids\[0\] must be an id of the vocabulary, an int in \[0, 6\), got 3.7",
    ),
    "a subword vocabulary smaller than its alphabet": (
        lambda m: nums.NumberTask(vocab_size=5),
        r"vocab_size=5 is below the 24 tokens of the alphabet and the special tokens",
    ),
    "a device that is not one": (lambda m: tb.describe_environment("gpu0"), r"device must be a torch.device or a name"),
    "decoding longer than the model's max_len": (
        lambda m: tb.beam_search(m, ids, max_tokens=20, bos_id=1, eos_id=2),
        r"max_tokens=20 must be at least 2 .* and at most the model's max_len=16",
    ),
    "a budget of BOS alone": (
        lambda m: tb.greedy_decode(m, ids, max_tokens=1, bos_id=1, eos_id=2, use_cache=False),
        r"max_tokens=1 must be at least 2 \(BOS and one decoded token\)",
    ),
    "non-positive beam": (
        lambda m: tb.beam_search(m, ids, max_tokens=5, bos_id=1, eos_id=2, beam_size=0),
        r"beam_size must be a positive integer, got 0",
    ),
    "not a tensor": (lambda m: tb.padding_mask([[1, 2, 0]]), r"tokens must be of type Tensor, got list"),
    "causal mask of size 0": (lambda m: tb.causal_mask(0), r"size must be a positive integer, got 0"),
    "logits of another vocabulary": (
        lambda m: tb.LabelSmoothingLoss(11)(torch.randn(2, 5, 12), ids),
        r"logits \(2, 5, 12\) must be target \(2, 5\) plus a last axis of vocab_size=11",
    ),
    "smoothing over a vocabulary of two": (lambda m: tb.LabelSmoothingLoss(2), r"vocab_size must be at least 3"),
    "no warm-up": (lambda m: tb.noam_optimizer(m, 64, warmup=0), r"warmup must be a positive integer, got 0"),
    "a float position from a cache": (
        lambda m: m.positional(torch.randn(1, 1, 64), offset=torch.tensor(2.0)),
        r"offset must be an int or a 0-d integer tensor, got torch.float32",
    ),
    "a cache beyond max_len": (
        lambda m: m.decode(torch.randn(2, 4, 64), ids[:, :1], cache=m.decoder.new_cache(torch.randn(2, 4, 64), 20)),
        r"tgt \(2, 1\) and a cache of capacity 20: .* max_len=16",
    ),
    "a step past the cache's capacity": (
        lambda m: overfill(m),
        r"the cache holds 2 of its 2 positions: no room for 1 more \(tgt \(2, 1\)\)",
    ),
    "two positions where one slot is left": (
        lambda m: overfill(m, capacity=3, step=2),
        r"the cache holds 2 of its 3 positions: no room for 2 more \(tgt \(2, 2\)\)",
    ),
    "a step past a decoder-only cache": (
        lambda m: overfill(DecoderOnly(tb.ModelConfig.small(11, max_len=16)).eval()),
        r"the cache holds 7 of its 7 positions: no room for 1 more \(src and tgt \(2, 1\)\)",
    ),
    "a loss target outside the vocabulary": (
        lambda m: tb.LabelSmoothingLoss(11)(torch.randn(2, 3, 11), torch.tensor([[1, 2, 11], [-1, 2, 3]])),
        r"target holds ids in \[-1, 11\] but the vocabulary has 11 ids .*shape \(2, 3\)",
    ),
    "a clipping norm of zero": (
        lambda m: tb.train_step(
            m, first_batch(), tb.LabelSmoothingLoss(11), torch.optim.SGD(m.parameters(), lr=0.0), clip_norm=0
        ),
        r"clip_norm must be a positive number, got 0",
    ),
    "next_batch gives no batch": (
        lambda m: tb.fit(m, lambda step: None, 1, torch.optim.SGD(m.parameters(), lr=0.0), progress=False),
        r"next_batch\(step\)'s result must be of type Batch, got NoneType",
    ),
    "an unknown recipe": (lambda m: tb.recipe("date"), r"name must be one of \['copy', 'dates'\], got 'date'"),
    "an unknown shipped numbers model": (
        lambda m: nums.trained_numbers("encoder-decoder"),
        r"name must be one of \['decoder_only', 'encoder_decoder', 'uniform'\], got 'encoder-decoder'",
    ),
    "a layer the model does not have": (
        lambda m: nums.cross_attention(m, None, 97, layer=2),
        r"layer must be one of \[-2, -1, 0, 1\], got 2",
    ),
    "a seed that is not an integer": (lambda m: tb.seed_everything("7"), r"seed must be of type int, got str"),
    "a model from something not a config": (
        lambda m: tb.make_model(11),
        r"config must be of type ModelConfig, got int",
    ),
    "recording attention of something not a module": (
        lambda m: tb.record_attention("model").__enter__(),
        r"model must be of type Module, got str",
    ),
    "a learning rate for d_model 0": (lambda m: tb.noam_rate(1, 0, 4000), r"d_model must be a positive integer, got 0"),
    "an exact match scored in batches of 0": (
        lambda m: tb.exact_match(m, ids, ids, 1, 2, batch_size=0),
        r"batch_size must be a positive integer, got 0",
    ),
    "a length penalty's exponent that is not a number": (
        lambda m: tb.beam_search(m, ids, max_tokens=5, bos_id=1, eos_id=2, alpha="0.6"),
        r"alpha must be a non-negative number, got '0.6'",
    ),
    "evaluating every -1 steps": (
        lambda m: tb.fit(m, lambda step: first_batch(), 1, torch.optim.SGD(m.parameters(), lr=0.0), eval_every=-1),
        r"eval_every must be a positive integer, got -1",
    ),
    "no held-out numbers": (
        lambda m: nums.split_numbers(per_stratum=0),
        r"per_stratum must be a positive integer, got 0",
    ),
    "compiling something not a module": (
        lambda m: tb.compile_model("model"),
        r"module must be of type Module, got str",
    ),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bad_input_raises_value_error_naming_argument_and_shape(case, model):
    call, message = CASES[case]
    with pytest.raises(ValueError, match=message):
        call(model)


def test_every_check_helper_is_the_one_that_raises_in_some_case(model, monkeypatch):
    """Each public ``check_*`` helper that the package's code calls is the helper that raises in at
    least one case above: no check is dead, and no case is caught by something else."""
    import sys

    helpers = [name for name in dir(tb.checks) if name.startswith("check_")]
    raised: set[str] = set()

    def recording(name, helper):
        def call(*args, **kwargs):
            try:
                return helper(*args, **kwargs)
            except ValueError:
                raised.add(name)
                raise

        return call

    originals = {name: getattr(tb.checks, name) for name in helpers}
    modules = [m for n, m in sys.modules.items() if n == "transformer_book" or n.startswith("transformer_book.")]
    for module in modules:
        for name, helper in originals.items():
            if getattr(module, name, None) is helper:
                monkeypatch.setattr(module, name, recording(name, helper))
    for call, _ in CASES.values():
        with pytest.raises(ValueError):
            call(model)
    assert set(helpers) == raised, sorted(set(helpers) - raised)


def test_masks_cannot_be_passed_by_position(model):
    """nn.TransformerDecoderLayer takes (tgt_mask, memory_mask) in that order; ours would take
    (src_mask, tgt_mask): keyword-only masks make a silent swap impossible."""
    memory, mask = torch.randn(2, 4, 64), tb.padding_mask(ids)
    layer = model.decoder.layers[0]
    for call in (
        lambda: layer(torch.randn(2, 5, 64), memory, mask, tb.causal_mask(5)),
        lambda: model.decoder(torch.randn(2, 5, 64), memory, mask, tb.causal_mask(5)),
        lambda: model.decode(memory, mask, ids),
    ):
        with pytest.raises(TypeError, match="positional argument"):
            call()


def test_every_check_helper_is_exported():
    """The API page promises that a listing calling a check runs after ``from transformer_book
    import *``: every public ``check_*`` function of ``checks.py`` is in ``__all__``."""
    import inspect

    defined = {
        name
        for name, value in vars(tb.checks).items()
        if name.startswith("check_") and inspect.isfunction(value) and value.__module__ == tb.checks.__name__
    }
    assert defined and defined <= set(tb.__all__), sorted(defined - set(tb.__all__))
