"""The checker's guards: a reader's code that never returns is stopped within the time budget, what
it prints is kept and summarised, PyTorch's global state is put back, and odd inputs get messages."""

from __future__ import annotations

import time

import pytest
import torch

import transformer_book as tb
from transformer_book.book import exercises
from transformer_book.book.exercises import check, engine


def test_a_function_that_never_returns_is_stopped_within_the_budget(monkeypatch):
    monkeypatch.setattr(engine, "TIME_BUDGET_S", 0.5)  # the same guard, a shorter wait

    def attention_forever(query, key, value, mask=None):
        while True:
            pass

    start = time.monotonic()
    result = check("scaled_dot_product_attention", attention_forever)
    elapsed = time.monotonic() - start
    assert not result.passed and result.mistake is None
    assert elapsed < engine.TIME_BUDGET_S + 3.0, elapsed
    assert f"was stopped after {engine.TIME_BUDGET_S:g} seconds" in result.message
    assert "never ends" in result.message


def test_a_greedy_loop_that_never_calls_the_generator_is_stopped(monkeypatch):
    monkeypatch.setattr(engine, "TIME_BUDGET_S", 0.5)

    def decode_forever(model, src, max_len, bos_id, eos_id):
        ys = torch.full((len(src), 1), bos_id)
        while ys.shape[1] < 10**9:
            pass
        return ys

    start = time.monotonic()
    result = check("greedy_decode", decode_forever)
    assert time.monotonic() - start < engine.TIME_BUDGET_S + 3.0
    assert not result.passed and "stopped" in result.message


def test_a_runaway_greedy_loop_is_stopped_by_its_own_max_len_with_its_rows():
    def grows_forever(model, src, max_len, bos_id, eos_id):
        src_mask = tb.padding_mask(src)
        memory = model.encode(src, src_mask)
        ys = torch.full((len(src), 1), bos_id)
        while True:  # forgot the bound
            hidden = model.decode(memory, ys, src_mask=src_mask, tgt_mask=tb.causal_mask(ys.shape[1]))
            ys = torch.cat([ys, model.generator(hidden[:, -1]).argmax(-1, keepdim=True)], 1)

    result = check("greedy_decode", grows_forever)
    assert not result.passed
    assert "past the call's max_tokens=8" in result.message and "max_len=64" not in result.message
    assert "its first row then: [1, 3, 4, 2, 9" in result.message


def test_greedy_mistakes_show_the_token_rows():
    def without_bos(model, src, max_len, bos_id, eos_id):
        return tb.greedy_decode(model, src, max_len, bos_id, eos_id)[:, 1:]

    result = check("greedy_decode", without_bos)
    assert result.mistake == "bos_missing"
    assert "yours [[3, 4, 2], [5, 2, 0]], the package's [[1, 3, 4, 2], [1, 5, 2, 0]]" in result.message


def test_printing_is_captured_and_summarised(capsys):
    def chatty(tokens, pad_id=0):
        for i in range(2000):
            print(f"line {i}")
        return (tokens != pad_id).unsqueeze(1)

    result = check("padding_mask", chatty)
    shown = capsys.readouterr()
    assert shown.out == "" and shown.err == ""
    assert result.passed
    assert result.printed.count("\n") == 2000 * result.cases
    assert f"printed {2000 * result.cases} line(s)" in result.message
    assert "line 0 | line 1 | line 2" in result.message and "the last: line 1999" in result.message
    assert len(result.message) < 1000


def test_state_changed_by_the_reader_is_put_back():
    def meddling(size, device=None):
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(3)
        torch.set_grad_enabled(False)
        torch.manual_seed(123)
        return torch.ones(size, size, dtype=torch.bool).tril()[None]

    torch.manual_seed(7)
    rng, threads = torch.get_rng_state(), torch.get_num_threads()
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    result = check("causal_mask", meddling)
    assert result.passed, result.message
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.get_num_threads() == threads
    assert torch.get_default_dtype() == dtype and torch.is_grad_enabled() == grad


def test_a_reader_default_dtype_does_not_change_the_verdict():
    torch.set_default_dtype(torch.float64)
    try:
        result = check("sinusoidal_positional_encoding", tb.sinusoidal_positional_encoding)
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(torch.float32)
    assert result.passed, result.message


def test_a_name_that_is_not_a_string_is_a_clear_value_error():
    with pytest.raises(ValueError, match="takes the part's name as a string"):
        check(["x"], tb.causal_mask)


def test_a_meta_tensor_is_reported_to_the_reader():
    def on_meta(query, key, value, mask=None):
        return torch.empty(*query.shape[:-1], value.shape[-1], device="meta")

    result = check("scaled_dot_product_attention", on_meta)
    assert not result.passed and "check itself failed" not in result.message
    assert "meta device" in result.message


def test_a_float32_table_cast_to_float64_is_said_to_be_the_dtype():
    class Float32Inside(torch.nn.Module):
        def __init__(self, vocab_size, d_model, padding_idx=None):
            super().__init__()
            self.lut = torch.nn.Embedding(vocab_size, d_model, padding_idx=padding_idx)
            self.scale = d_model**0.5

        def forward(self, tokens):
            out = self.lut(tokens)
            return (out.float() * self.scale).to(out.dtype)  # float32 on the way

    result = check("TokenEmbedding", Float32Inside)
    assert not result.passed
    assert "float32's rounding only" in result.message and "computed in float32" in result.message
    assert "yours 0.644218, the package's 0.644218" not in result.message


def test_a_median_check_stays_fast():
    times = []
    for name in ("causal_mask", "padding_mask", "target_mask", "noam_rate", "split_heads"):
        reference = exercises._spec(name).reference
        check(name, reference)  # the first call of a part builds its inputs' code paths
        start = time.perf_counter()
        check(name, reference)
        times.append(time.perf_counter() - start)
    assert sorted(times)[len(times) // 2] < 0.1, times


def test_the_alarm_is_disarmed_and_an_earlier_one_kept():
    import signal

    if not hasattr(signal, "setitimer"):
        pytest.skip("no setitimer on this platform")
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        assert check("causal_mask", tb.causal_mask).passed
        left, interval = signal.getitimer(signal.ITIMER_REAL)
        assert 25.0 < left <= 30.0 and interval == 0.0  # the earlier alarm, less the check's time
        assert signal.getsignal(signal.SIGALRM) is not None and not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
