"""Decoding: the KV cache changes nothing but the speed; beam search is exact when the beam is wide."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

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


def wider_model(vocab: int, **sizes) -> tb.Transformer:
    """A model wide enough that, at 6 rows, the few-row kernel computes some of a decoding
    step's products (the packed q/k/v, the first feed-forward matrix) and MKL the others."""
    config = tb.ModelConfig.small(vocab, **sizes)
    return tb.make_model(dataclasses.replace(config, d_model=128, d_ff=512)).eval()


def uses_the_few_row_kernel(model: tb.Transformer) -> bool:
    return "few rows" in repr(model.decoder.layers[0].feed_forward.linear1.packed)


@pytest.mark.parametrize("width", ["small", "wider"])
def test_kv_cache_gives_exactly_the_same_tokens(model, width):
    if width == "wider":
        tb.seed_everything(7)
        model = wider_model(12, num_layers=2)
        with torch.no_grad():
            model.generator.weight.mul_(4.0)
    src = source_batch()
    cached = tb.greedy_decode(model, src, max_len=40, bos_id=BOS, eos_id=EOS, use_cache=True)
    recomputed = tb.greedy_decode(model, src, max_len=40, bos_id=BOS, eos_id=EOS, use_cache=False)
    assert torch.equal(cached, recomputed)
    assert cached.shape[1] > 5  # long enough for the cache to matter
    assert uses_the_few_row_kernel(model) == (width == "wider" and tb.few_rows.available())


@pytest.mark.parametrize("width", ["small", "wider"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_decode_step_equals_decode_with_the_cache_bit_for_bit(norm_first, width):
    """The fast step (a plan of bound kernels) and the module path give the very same numbers,
    for both layer orders, with padding in the source, over steps that grow the cache's buffer,
    with MKL's products alone (small) or the few-row kernel's among them (wider)."""
    tb.seed_everything(5)
    sizes = {"num_layers": 3, "norm_first": norm_first}
    model = tb.make_model(tb.ModelConfig.small(30, **sizes)).eval() if width == "small" else wider_model(30, **sizes)
    src = source_batch()
    mask = tb.padding_mask(src, model.config.pad_id)
    with torch.inference_mode(), tb.kernels.frozen_weights():
        memory = model.encode(src, mask)
        module_cache, step_cache = model.decoder.new_cache(), model.decoder.new_cache()
        token = torch.full((src.shape[0], 1), BOS)
        for _ in range(20):  # past the buffer's first 16 positions
            expected = model.decode(memory, token, src_mask=mask, cache=module_cache)
            hidden = model.decode_step(memory, token, src_mask=mask, cache=step_cache)
            assert torch.equal(hidden, expected)
            token = model.generator(hidden[:, -1]).argmax(-1, keepdim=True)
        assert all(layer_cache.step_plan is not None for layer_cache in step_cache)  # the fast path ran
        assert uses_the_few_row_kernel(model) == (width == "wider" and tb.few_rows.available())
        for ours, theirs in zip(step_cache, module_cache):
            assert torch.equal(ours.self_attn.key, theirs.self_attn.key)
            assert torch.equal(ours.self_attn.value, theirs.self_attn.value)


def test_decode_step_takes_the_module_path_where_the_fast_one_would_be_wrong(model):
    src = source_batch()
    token = torch.full((src.shape[0], 1), BOS)
    with torch.inference_mode():
        memory = model.encode(src)
        cache = model.decoder.new_cache()
        model.decode_step(memory, token, cache=cache)
        model.decode_step(memory, token, cache=cache)  # outside frozen_weights(): no plan
        assert cache[0].step_plan is None
        with tb.kernels.frozen_weights(), tb.record_attention(model) as maps:
            model.decode_step(memory, token, cache=cache)
        assert cache[0].step_plan is None and maps["decoder.layers.0.cross_attn"].shape[-2:] == (1, src.shape[1])
        with tb.kernels.frozen_weights():
            model.decode_step(memory, token, cache=cache)
            plan = cache[0].step_plan
            assert plan is not None and plan.block == tb.kernels.frozen_block()
        with tb.kernels.frozen_weights():  # a new block makes a new plan: the weights may have changed
            model.decode_step(memory, token, cache=cache)
            assert cache[0].step_plan is not plan and cache[0].step_plan.block == tb.kernels.frozen_block()
    with pytest.raises(ValueError, match="tgt"):  # bad input still gets the module path's message
        with torch.inference_mode(), tb.kernels.frozen_weights():
            model.decode_step(memory, torch.full((src.shape[0], 1), 99), cache=cache)


def test_record_attention_sees_every_step_of_greedy_decoding(model):
    src = source_batch()[:1]
    with tb.record_attention(model) as maps:
        out = tb.greedy_decode(model, src, max_len=12, bos_id=BOS, eos_id=None)
    assert out.shape[1] == 12
    assert maps["decoder.layers.1.self_attn"].shape == (1, 4, 1, 11)  # the last step saw all 11 positions


def test_a_forward_hook_in_the_decoder_sees_every_step(model):
    """Chapter 9 counts decoder positions with a hook: the fast step must not hide them."""
    fed = []
    hook = model.decoder.layers[1].feed_forward.register_forward_hook(lambda m, i, out: fed.append(out.shape[1]))
    try:
        tb.greedy_decode(model, source_batch(), max_len=10, bos_id=BOS, eos_id=None)
    finally:
        hook.remove()
    assert fed == [1] * 9
    with torch.inference_mode(), tb.kernels.frozen_weights():
        assert not model._decoder_hooked()


def test_greedy_rows_start_with_bos_and_stop_at_their_own_eos(model):
    src = source_batch()
    out = tb.greedy_decode(model, src, max_len=40, bos_id=BOS, eos_id=EOS)
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
    assert torch.equal(tb.greedy_decode(model, src, max_len=12, bos_id=BOS, eos_id=EOS), ys)


def test_beam_of_one_equals_greedy(model):
    src = source_batch()
    greedy = tb.greedy_decode(model, src, max_len=30, bos_id=BOS, eos_id=EOS)
    beam = tb.beam_search(model, src, max_len=30, bos_id=BOS, eos_id=EOS, beam_size=1)
    assert torch.equal(beam, greedy)


def sequence_log_prob(model, src, ys) -> float:
    log_probs = model(src, ys[:, :-1]).log_softmax(-1)
    return log_probs.gather(-1, ys[:, 1:].unsqueeze(-1)).sum().item()


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_wide_beam_finds_the_best_sequence_by_exhaustive_search(alpha):
    tb.seed_everything(11)
    model = tb.make_model(tb.ModelConfig.small(5, num_layers=1)).eval()
    src = torch.tensor([[3, 4, 3]])
    max_len = 4  # BOS + up to 3 tokens
    best, best_score = None, float("-inf")
    for length in range(1, max_len):
        for body in itertools.product(range(5), repeat=length):
            ended = body[-1] == EOS
            if EOS in body[:-1] or (not ended and length < max_len - 1):
                continue  # a hypothesis either ends with EOS or runs to max_len
            ys = torch.tensor([[BOS, *body]])
            score = sequence_log_prob(model, src, ys) / tb.length_penalty(torch.tensor(float(length)), alpha).item()
            if score > best_score:
                best, best_score = ys, score
    found = tb.beam_search(model, src, max_len=max_len, bos_id=BOS, eos_id=EOS, beam_size=125, alpha=alpha)
    assert torch.equal(found, best), (found, best)


def test_beam_search_returns_valid_sequences(model):
    src = source_batch()
    out = tb.beam_search(model, src, max_len=25, bos_id=BOS, eos_id=EOS, beam_size=4)
    assert out.shape[0] == 6 and (out[:, 0] == BOS).all()
    assert (out != 0).any(dim=0)[-1]  # no all-padding column left at the end
