"""Decoding: the static KV cache changes nothing but the speed, and its steps never make the
host wait for the device; beam search ranks by GNMT's length penalty with |y| counted right and
is exact when the beam is wide."""

from __future__ import annotations

import dataclasses
import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import transformer_book as tb

BOS, EOS = 1, 2


@pytest.fixture
def model() -> tb.Transformer:
    tb.seed_everything(7)
    # A narrow vocabulary and sharpened logits make an untrained model end rows at different steps.
    model = tb.make_model(tb.ModelConfig.small(12, num_layers=2)).eval()
    with torch.no_grad():
        model.generator.weight.mul_(4.0)
    return model


def source_batch() -> torch.Tensor:
    tb.seed_everything(3)
    src = torch.randint(3, 12, (6, 9))
    src[2, 5:] = 0
    src[4, 3:] = 0
    return src


def make(width: str, vocab: int = 12, **sizes) -> tb.Transformer:
    """A small-preset model, or a wider one (d_model 256, d_ff 1024) whose decoding steps of 6 to
    16 rows send their products to the few-row kernel; sharpened logits (see ``model``)."""
    tb.seed_everything(7)
    config = tb.ModelConfig.small(vocab, **sizes)
    if width == "wider":
        config = dataclasses.replace(config, d_model=256, d_ff=1024)
    model = tb.make_model(config).eval()
    with torch.no_grad():
        model.generator.weight.mul_(4.0)
    return model


def smallest_margin(model: tb.Transformer, src: torch.Tensor, ys: torch.Tensor) -> float:
    """The smallest gap between the best and the second-best logit over greedy's choices of
    ``ys``: kernels that round differently can change a token only where this is about their
    rounding (1e-5 here), so an example is fair only if it is far larger."""
    with torch.inference_mode():
        top2 = model(src, ys[:, :-1]).topk(2, dim=-1).values
    chosen = ys[:, 1:] != model.config.pad_id
    return float((top2[..., 0] - top2[..., 1])[chosen].min())


# --- the plain model's KV cache ---------------------------------------------------------------


@pytest.mark.parametrize("width", ["small", "wider"])
def test_kv_cache_gives_exactly_the_same_tokens(width):
    model = make(width)
    src = source_batch()
    cached = tb.greedy_decode(model, src, max_tokens=40, bos_id=BOS, eos_id=EOS, use_cache=True)
    recomputed = tb.greedy_decode(model, src, max_tokens=40, bos_id=BOS, eos_id=EOS, use_cache=False)
    assert torch.equal(cached, recomputed)
    assert cached.shape[1] > 5  # long enough for the cache to matter
    kwargs = dict(max_tokens=40, bos_id=BOS, eos_id=EOS, beam_size=3)
    beams = tb.beam_search(model, src, **kwargs, use_cache=True)
    assert torch.equal(beams, tb.beam_search(model, src, **kwargs, use_cache=False))


def test_greedy_rows_start_with_bos_and_stop_at_their_own_eos(model):
    src = source_batch()
    out = tb.greedy_decode(model, src, max_tokens=40, bos_id=BOS, eos_id=EOS)
    assert (out[:, 0] == BOS).all()
    for row in out.tolist():
        if EOS in row:
            end = row.index(EOS)
            assert all(token == 0 for token in row[end + 1 :])  # padding after its own EOS
        else:
            assert len(row) == 40
    ended_at = [row.index(EOS) if EOS in row else len(row) for row in out.tolist()]
    assert len(set(ended_at)) > 1, "rows should end at different steps for this test to mean anything"


def test_greedy_matches_a_hand_written_argmax_loop(model):
    src = source_batch()[:1]
    ys = torch.tensor([[BOS]])
    for _ in range(11):
        logits = model(src, ys)
        ys = torch.cat([ys, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        if ys[0, -1] == EOS:
            break
    assert torch.equal(tb.greedy_decode(model, src, max_tokens=12, bos_id=BOS, eos_id=EOS), ys)


def test_beam_of_one_equals_greedy(model):
    src = source_batch()
    greedy = tb.greedy_decode(model, src, max_tokens=30, bos_id=BOS, eos_id=EOS)
    beam = tb.beam_search(model, src, max_tokens=30, bos_id=BOS, eos_id=EOS, beam_size=1)
    assert torch.equal(beam, greedy)


def test_beam_search_returns_valid_sequences(model):
    src = source_batch()
    out = tb.beam_search(model, src, max_tokens=25, bos_id=BOS, eos_id=EOS, beam_size=4)
    assert out.shape[0] == 6 and (out[:, 0] == BOS).all()
    assert (out != 0).any(dim=0)[-1]  # no all-padding column left at the end


@pytest.mark.parametrize("shape", [(1, 1, 9), (1, 9)], ids=["batch-1", "no-batch-axis"])
def test_beam_search_takes_a_source_mask_that_broadcasts_as_greedy_does(model, shape):
    """A mask that hides the last 3 source positions of every row, with a batch axis of 1,
    one row per source or none: each beam of a source meets its source's row, so every
    shape gives the tokens of the per-row mask (before, a batch axis of 1 or none was
    repeated once per beam along the wrong axis)."""
    src = source_batch()[[0, 1, 3, 5]].repeat(2, 1)[:6]  # no padding: the mask is all ours
    visible = torch.arange(9) < 6
    mask = visible.expand(shape).clone()
    per_row = visible.expand(6, 1, 9).clone()
    for beams in (1, 3):
        expected = tb.beam_search(model, src, 12, BOS, EOS, beam_size=beams, src_mask=per_row)
        got = tb.beam_search(model, src, 12, BOS, EOS, beam_size=beams, src_mask=mask)
        assert torch.equal(got, expected), (shape, beams)
    assert torch.equal(tb.greedy_decode(model, src, 12, BOS, EOS, src_mask=mask),
                       tb.beam_search(model, src, 12, BOS, EOS, beam_size=1, src_mask=mask))  # fmt: skip


def test_decoding_a_model_in_training_mode_warns_that_dropout_is_on(model):
    src = source_batch()
    model.train()
    for decode in (tb.greedy_decode, tb.beam_search):
        with pytest.warns(UserWarning, match="training mode: any dropout it has is on") as caught:
            decode(model, src, 5, BOS, EOS)
        assert caught[0].filename == __file__  # it points at the caller's line
    model.eval()


def test_the_decoder_called_alone_with_a_cache_hides_the_unwritten_slots(model):
    """Decoder.forward with a cache and no tgt_mask uses the cache's slot mask, as
    Transformer.decode does: the same output as with that mask given, not attention over
    the empty slots (the model's own decode is the reference)."""
    src = source_batch()
    memory = model.encode(src)
    x = model.positional(model.tgt_embed(torch.full((6, 1), BOS)))
    with torch.no_grad():
        alone = model.decoder(x, memory, cache=model.decoder.new_cache(memory, 5))
        cache = model.decoder.new_cache(memory, 5)
        masked = model.decoder(x, memory, tgt_mask=cache.slot_mask(1), cache=cache)
        everything = torch.ones(1, 1, 5, dtype=torch.bool)
        unmasked = model.decoder(x, memory, tgt_mask=everything, cache=model.decoder.new_cache(memory, 5))
    torch.testing.assert_close(alone, masked)
    assert not torch.allclose(alone, unmasked)  # the empty slots would change it


def test_record_attention_sees_every_step_of_greedy_decoding(model):
    src = source_batch()[:1]
    with tb.record_attention(model) as maps:
        out = tb.greedy_decode(model, src, max_tokens=12, bos_id=BOS, eos_id=None)
    assert out.shape[1] == 12
    assert maps["decoder.layers.1.self_attn"].shape == (1, 4, 1, 11)  # the last step saw all 11 positions


def test_a_forward_hook_in_the_decoder_sees_every_step(model):
    """Chapter 9 counts decoder positions with a hook: every step runs the modules."""
    fed = []
    hook = model.decoder.layers[1].feed_forward.register_forward_hook(lambda m, i, out: fed.append(out.shape[1]))
    try:
        tb.greedy_decode(model, source_batch(), max_tokens=10, bos_id=BOS, eos_id=None)
    finally:
        hook.remove()
    assert fed == [1] * 9


# --- the static cache: fixed shapes, no host waits -------------------------------------------


class DeviceReads(TorchDispatchMode):
    """Counts the operations that hand a tensor's value to the host (``.item()``, ``bool(t)``,
    ``nonzero``): on a GPU each makes the host wait until the device has caught up."""

    READS = {"_local_scalar_dense", "is_nonzero", "nonzero", "item", "equal"}

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def test_a_cached_decoding_step_reads_nothing_back_and_keeps_its_shapes(model):
    """Each step of the cached loop (decode one token, the generator, argmax) asks the device for
    no value, and every tensor it makes has the same shape at every step: what CUDA graphs need."""
    src = source_batch()
    with torch.inference_mode():
        memory = model.encode(src)
        cache = model.decoder.new_cache(memory, capacity=12)
        token = torch.full((src.shape[0], 1), BOS)
        shapes = []
        for _ in range(12):
            with DeviceReads() as counter, tb.trusted_ids():
                hidden = model.decode(memory, token, src_mask=tb.padding_mask(src), cache=cache)
                token = model.generator(hidden[:, -1]).argmax(-1, keepdim=True)
            assert counter.reads == [], counter.reads
            shapes.append((tuple(hidden.shape), tuple(cache.layers[0].self_attn.key.shape)))
        assert int(cache.position) == 12
    assert len(set(shapes)) == 1


def test_outside_trusted_ids_a_step_still_checks_its_token(model):
    """A reader who drives the cache by hand gets the ValueError for a bad id, not an IndexError."""
    src = source_batch()
    with torch.inference_mode():
        memory = model.encode(src)
        cache = model.decoder.new_cache(memory, capacity=4)
        with pytest.raises(ValueError, match=r"tgt holds ids in \[1, 99\]"):
            model.decode(memory, torch.full((src.shape[0], 1), 99).index_fill(0, torch.tensor([0]), 1), cache=cache)
        with pytest.raises(ValueError, match="capacity 4"):
            model.decode(memory, torch.ones(src.shape[0], 5, dtype=torch.long), cache=cache)


@pytest.mark.parametrize("decoder", ["greedy", "beam"])
def test_the_loops_read_the_device_once_every_few_steps(model, decoder):
    """Whole loops: the ids of ``src`` are read once (two values), "has every row finished?" at
    most once every ``CHECK_EVERY`` steps, and the result's length once."""
    src = source_batch()
    call = tb.greedy_decode if decoder == "greedy" else lambda *a: tb.beam_search(*a, beam_size=3)
    with DeviceReads() as counter:
        out = call(model, src, 40, BOS, None)
    steps = 39
    assert out.shape[1] == 40
    assert len(counter.reads) <= 2 + steps // tb.inference.CHECK_EVERY + 2, counter.reads


def test_the_cache_mask_hides_the_slots_not_written_yet(model):
    src = source_batch()
    with torch.inference_mode():
        cache = model.decoder.new_cache(model.encode(src), capacity=5)
        cache.position += 2
        assert cache.slot_mask(2).tolist() == [[[True, True, True, False, False], [True, True, True, True, False]]]


def test_decoding_compiles_whole_with_a_step_of_fixed_shapes(model):
    """The model traced whole (``fullgraph=True``) through a cached decoding step: one graph,
    every step, and the very tokens of eager decoding. ``aot_eager`` checks the capture (Inductor's
    code generation is timed by benchmarks/bench_decoding.py)."""
    torch._dynamo.reset()
    src = source_batch()
    expected = tb.greedy_decode(model, src, max_tokens=16, bos_id=BOS, eos_id=None)
    decode = torch.compile(model.decode, fullgraph=True, backend="aot_eager")
    with torch.inference_mode():
        memory = model.encode(src)
        cache = model.decoder.new_cache(memory, capacity=15)
        ys = torch.full((src.shape[0], 1), BOS)
        for _ in range(15):
            hidden = decode(memory, ys[:, -1:], src_mask=tb.padding_mask(src), cache=cache)
            ys = torch.cat([ys, model.generator(hidden[:, -1]).argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(ys, expected)


# --- beam search: the length penalty counts |y|, and a wide beam is exhaustive -----------------


class TableModel(nn.Module):
    """What ``tb.beam_search`` needs of a model, with next-token log-probabilities that depend
    only on the prefix: ``next_log_probs(prefix)`` for the tokens after BOS so far. The prefixes
    travel in a real decoder cache (as keys of width 1), which beam search reorders with its
    hypotheses; ``decode`` returns the log-probabilities and the generator passes them on."""

    def __init__(self, vocab: int, next_log_probs) -> None:
        super().__init__()
        self.config = tb.ModelConfig(vocab, vocab, d_model=2, num_heads=1, d_ff=2, num_layers=1, max_len=16)
        self.next_log_probs = next_log_probs
        self.decoder = SimpleNamespace(new_cache=self.new_cache)
        self.generator = nn.Identity()
        self.eval()  # as a model to decode should be

    @staticmethod
    def new_cache(memory: torch.Tensor, capacity: int) -> tb.DecoderCache:
        position = torch.zeros((), dtype=torch.long)
        empty = tb.KVCache.allocate((memory.shape[0], 1, capacity, 1), memory, position)
        return tb.DecoderCache([tb.LayerCache(empty, empty)], position)

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        return torch.zeros(src.shape[0], src.shape[1], 2)

    def decode(self, memory, tgt, *, src_mask=None, tgt_mask=None, cache=None) -> torch.Tensor:
        assert cache is not None and tgt.shape[1] == 1
        fed = tgt[:, None, :, None].float()
        tokens, _ = cache.layers[0].self_attn.write(fed, fed)
        cache.position += 1
        prefixes = [tuple(int(t) for t in row[0, 1 : int(cache.position), 0]) for row in tokens]
        return torch.stack([self.next_log_probs(prefix) for prefix in prefixes]).float()[:, None, :]


def hypotheses(words: tuple[int, ...], max_len: int):
    """Every finished hypothesis (tokens after BOS): ending with EOS, or running to ``max_len``."""
    for length in range(1, max_len):
        for body in itertools.product((*words, EOS), repeat=length):
            if EOS not in body[:-1] and (body[-1] == EOS or length == max_len - 1):
                yield body


def log_prob(next_log_probs, body: tuple[int, ...]) -> float:
    return sum(float(next_log_probs(body[:i])[token]) for i, token in enumerate(body))


def test_the_length_penalty_counts_the_tokens_after_bos(monkeypatch):
    """GNMT's penalty ((5 + |y|) / 6)^alpha counts |y|, the tokens after BOS, EOS included. Two
    hypotheses are built so that the count decides: A = [EOS] (|y| = 1) and B = [w, EOS]
    (|y| = 2), with log-probabilities that rank B first when |y| is counted and A first when
    |y| + 1 is; everything else is far less likely. Beam search must return B."""
    vocab, w, alpha = 50, 3, 0.6
    others = [t for t in range(vocab) if t not in (0, BOS, EOS, w)]
    # alpha = 0.6: with |y|, B wins while log P(A) < log P(B) / (7/6)^0.6 = -1.823;
    # with |y| + 1, A wins while log P(A) > log P(B) (7/6)^0.6 / (8/6)^0.6 = -1.846.
    log_a, log_b, log_w = -1.835, -2.0, math.log(0.8)

    def next_log_probs(prefix: tuple[int, ...]) -> torch.Tensor:
        p = torch.zeros(vocab, dtype=torch.float64)
        if prefix == ():
            p[EOS], p[w] = math.exp(log_a), 0.8
            p[others] = (1 - p.sum()) / len(others)
        elif prefix == (w,):
            p[EOS] = math.exp(log_b - log_w)
            p[[w, *others]] = (1 - p.sum()) / (len(others) + 1)
        else:
            p[[EOS, w, *others]] = 1 / (len(others) + 2)
        return p.log()

    def ranked(body, shift):
        return log_prob(next_log_probs, body) / float(tb.length_penalty(torch.tensor(len(body) + shift), alpha))

    best = {shift: max(hypotheses((w, *others), 3), key=lambda body: ranked(body, shift)) for shift in (0, 1)}
    assert best == {0: (w, EOS), 1: (EOS,)}  # the two counts disagree, by a margin float32 keeps
    assert abs(ranked((w, EOS), 0) - ranked((EOS,), 0)) > 5e-3 and abs(ranked((w, EOS), 1) - ranked((EOS,), 1)) > 5e-3
    stub, src = TableModel(vocab, next_log_probs), torch.tensor([[3, 4, 5]])
    found = tb.beam_search(stub, src, max_tokens=3, bos_id=BOS, eos_id=EOS, beam_size=4, alpha=alpha)
    assert found.tolist() == [[BOS, w, EOS]]
    penalty = tb.inference.length_penalty  # the count off by one (issue 34) would pick A: the test tells
    monkeypatch.setattr(tb.inference, "length_penalty", lambda length, a: penalty(length + 1, a))
    found = tb.beam_search(stub, src, max_tokens=3, bos_id=BOS, eos_id=EOS, beam_size=4, alpha=alpha)
    assert found.tolist() == [[BOS, EOS]]


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_a_beam_that_holds_every_hypothesis_is_exhaustive_search(alpha):
    """Vocabulary of 5 (padding, BOS, EOS and two words), up to 3 tokens after BOS: a beam of
    5^3 = 125 never drops a hypothesis, so beam search returns what ranking every finished
    hypothesis returns, for random tables of next-token probabilities. A table whose best two
    hypotheses are within float32's rounding of each other is skipped (it would test rounding)."""
    vocab, words, max_len = 5, (3, 4), 4
    generator = torch.Generator().manual_seed(0)
    prefixes = [p for n in range(max_len) for p in itertools.product((*words, EOS), repeat=n)]
    checked = 0
    for _ in range(12):
        logits = torch.randn(len(prefixes), vocab, generator=generator, dtype=torch.float64) * 2
        logits[:, [0, BOS]] = -math.inf  # never padding or BOS: every hypothesis is one of hypotheses()
        table = dict(zip(prefixes, logits.log_softmax(-1)))

        def next_log_probs(prefix, table=table):
            return table.get(prefix, torch.zeros(vocab, dtype=torch.float64))

        penalty = {n: float(tb.length_penalty(torch.tensor(n), alpha)) for n in range(1, max_len)}
        scores = sorted(
            ((log_prob(next_log_probs, body) / penalty[len(body)], body) for body in hypotheses(words, max_len)),
            reverse=True,
        )
        if scores[0][0] - scores[1][0] < 1e-4:
            continue
        found = tb.beam_search(
            TableModel(vocab, next_log_probs), torch.tensor([[3, 4]]), max_len, BOS, EOS, beam_size=125, alpha=alpha
        )
        assert found.tolist() == [[BOS, *scores[0][1]]], (found, scores[:2])
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_wide_beam_finds_the_best_sequence_by_exhaustive_search(alpha):
    """The same with a real (untrained) model: its probabilities from its own forward pass."""
    tb.seed_everything(11)
    model = tb.make_model(tb.ModelConfig.small(5, num_layers=1)).eval()
    src = torch.tensor([[3, 4, 3]])
    max_len = 4  # BOS + up to 3 tokens
    best, best_score = None, float("-inf")
    for body in hypotheses((0, 1, 3, 4), max_len):
        ys = torch.tensor([[BOS, *body]])
        with torch.no_grad():
            log_probs = model(src, ys[:, :-1]).log_softmax(-1)
        score = log_probs.gather(-1, ys[:, 1:].unsqueeze(-1)).sum().item()
        score /= tb.length_penalty(torch.tensor(float(len(body))), alpha).item()
        if score > best_score:
            best, best_score = ys, score
    found = tb.beam_search(model, src, max_tokens=max_len, bos_id=BOS, eos_id=EOS, beam_size=125, alpha=alpha)
    assert torch.equal(found, best), (found, best)
