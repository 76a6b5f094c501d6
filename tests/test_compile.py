"""The model compiles whole: ``torch.compile(model, fullgraph=True)`` traces a training step and
an evaluation without a break in the graph, and gives eager's numbers. Where no compiler can
build kernels, ``compile_model`` runs the model eagerly and says why.

``aot_eager`` checks the capture and the autograd graph quickly; one test runs Inductor itself
(C++ kernels on a CPU), with an Inductor cache of its own. benchmarks/bench_model.py times both.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import transformer_book as tb


def small_model(dropout: float = 0.0) -> tb.Transformer:
    """One layer a side: every kind of module and kernel, half the graph to trace."""
    tb.seed_everything(5)
    return tb.make_model(tb.ModelConfig.small(13, dropout=dropout, num_layers=1))


def batch() -> tb.Batch:
    generator = torch.Generator().manual_seed(1)
    src = torch.randint(3, 13, (4, 9), generator=generator)
    tgt = torch.randint(3, 13, (4, 8), generator=generator)
    src[1, 6:], tgt[2, 5:] = 0, 0  # padding in both
    tgt[:, 0] = 1
    return tb.Batch.from_pairs(src, tgt)


def loss_and_grads(model: torch.nn.Module, forward) -> tuple[torch.Tensor, list[torch.Tensor]]:
    b = batch()
    model.train()
    model.zero_grad(set_to_none=True)
    logits = forward(b.src, b.tgt_in, b.src_mask, b.tgt_mask)
    loss = tb.LabelSmoothingLoss(13, 0.1)(logits, b.tgt_out)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.fixture(autouse=True)
def fresh_compiler_state():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def test_a_training_step_is_one_graph_with_eager_loss_and_gradients():
    model = small_model()
    eager_loss, eager_grads = loss_and_grads(model, model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss, grads = loss_and_grads(model, compiled)
    torch.testing.assert_close(loss, eager_loss, atol=1e-4, rtol=1e-4)
    for ours, theirs in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_training_with_dropout_compiles_whole():
    model = small_model(dropout=0.1)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss, grads = loss_and_grads(model, compiled)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)


def test_inductor_builds_the_evaluation_and_matches_eager(tmp_path, monkeypatch):
    """The real compiler: Inductor writes and builds C++ kernels for the whole eval forward.
    And on a CPU, compile_model's dropout draws eager's masks (fallback_random): one encoder
    layer in training, the same seed, the same output. Inductor's own random numbers would
    give another (by 1.8 at most, tried by hand); one test, so Inductor's start is paid once."""
    if tb.compile_unavailable(torch.device("cpu")):
        pytest.fail(f"this machine should have a C++ compiler: {tb.compile_unavailable(torch.device('cpu'))}")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model = small_model().eval()
    b = batch()
    with torch.no_grad():
        expected = model(b.src, b.tgt_in)
        logits = tb.compile_model(model)(b.src, b.tgt_in)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert any((tmp_path / "inductor").rglob("*.cpp")) or any((tmp_path / "inductor").rglob("*.py"))

    tb.seed_everything(3)
    layer = tb.EncoderLayer(16, 2, 32, dropout=0.5).train()  # on weights, sums, ReLU
    x = torch.randn(2, 5, 16)

    def seeded(forward) -> torch.Tensor:
        torch.manual_seed(7)
        with torch.no_grad():
            return forward(x)

    eager = seeded(layer)
    torch.testing.assert_close(seeded(tb.compile_model(layer)), eager, atol=1e-5, rtol=1e-5)


def test_without_a_compiler_the_model_runs_eagerly_and_says_why(monkeypatch):
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CXX", raising=False)
    reason = tb.compile_unavailable(torch.device("cpu"))
    assert reason is not None and "C++ compiler" in reason
    model = small_model().eval()
    with pytest.warns(UserWarning, match="running eagerly: no C\\+\\+ compiler"):
        same = tb.compile_model(model)
    assert same is model
    b = batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(b.src, b.tgt_in)


def test_a_bad_id_in_a_batch_is_a_value_error_before_the_device_sees_it():
    """fit reads each batch's ids where they are, once, before the model (compiled or not)
    runs inside trusted_ids: a bad id is a ValueError, never a device-side assert."""
    model = small_model()
    bad = batch()
    bad.src[0, 0] = 13
    optimizer, schedule = tb.noam_optimizer(model, 64, warmup=10)
    with pytest.raises(ValueError, match=r"batch.src holds ids in \[0, 13\] but the vocabulary has 13"):
        tb.fit(model, lambda step: bad, 1, optimizer, schedule, progress=False)


def test_ids_are_not_read_inside_trusted_ids_but_are_outside():
    ids = torch.tensor([[1, 99]])
    with pytest.raises(ValueError, match="holds ids"):
        tb.check_tokens(ids, "tgt", 13)
    with tb.trusted_ids():
        tb.check_tokens(ids, "tgt", 13)  # the caller vouches for them: no read
        with tb.trusted_ids():
            pass
        tb.check_tokens(ids, "tgt", 13)
    with pytest.raises(ValueError, match="holds ids"):
        tb.check_tokens(ids, "tgt", 13)
