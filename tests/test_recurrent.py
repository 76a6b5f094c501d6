"""The GRU baselines of chapter 0 and the Table 1 measurements (transformer_book.book.recurrent)."""

from __future__ import annotations

import copy
import shutil
from importlib import resources

import pytest
import torch
from torch import nn

import transformer_book as tb
from transformer_book import MultiHeadAttention
from transformer_book.book.recurrent import (
    BASELINE_PACKAGE,
    BASELINES,
    RecurrentConfig,
    RecurrentSeq2Seq,
    count_flops,
    match_per_row,
    path_length,
    rnn_gradients_in_eval,
    sequential_depth,
    train_baseline,
    trained_baseline,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize("attention", [False, True])
def test_shapes_and_teacher_forcing_agrees_with_greedy(attention):
    torch.manual_seed(0)
    model = RecurrentSeq2Seq(RecurrentConfig(9, 7, hidden=8, embed=4, attention=attention)).eval()
    src = torch.tensor([[3, 4, 5, 0], [6, 7, 0, 0]])
    decoded, weights = model.greedy(src, 5, bos_id=1)
    assert decoded.shape == (2, 5) and (decoded[:, 0] == 1).all()
    # feeding the greedy output back with teacher forcing gives the same argmax at every step
    logits = model(src, decoded[:, :-1])
    assert logits.shape == (2, 4, 7)
    assert torch.equal(logits.argmax(-1), decoded[:, 1:])
    if attention:
        assert weights.shape == (2, 4, 4)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4))
        assert (weights[1, :, 2:] == 0).all()  # padding is never attended
    else:
        assert weights is None


def test_odd_hidden_is_rejected():
    with pytest.raises(ValueError, match="hidden must be even"):
        RecurrentSeq2Seq(RecurrentConfig(9, 7, hidden=7))


def test_shipped_baselines_hold_the_chapter_claim():
    gru, attention = trained_baseline("gru", CPU), trained_baseline("gru_attention", CPU)
    src, tgt = gru.task.test_set()
    measured = {}
    for trained in (gru, attention):
        measured[trained.name] = match_per_row(trained.model, src, tgt, trained.task.bos_id, trained.task.eos_id)
        assert abs(measured[trained.name].float().mean().item() - trained.accuracy) < 0.01
    assert measured["gru_attention"].float().mean() >= 0.99
    assert measured["gru"].float().mean() <= measured["gru_attention"].float().mean() - 0.3


def test_a_short_retrain_reproduces_the_shipped_curves():
    # The first point of each shipped training curve (step 100), retrained from seed 0.
    torch.set_num_threads(1)
    shipped = {name: dict(trained_baseline(name, CPU).curve) for name in BASELINES}
    step = min(shipped["gru"])
    for name in BASELINES:
        retrained = train_baseline(name, seed=0, steps=step, device=CPU)
        assert retrained.curve[-1][0] == step
        assert abs(retrained.curve[-1][1] - shipped[name][step]) <= 0.05, (name, retrained.curve, shipped[name][step])
    # the claim at that point: attention has nearly learned the task, the plain GRU has not started
    assert shipped["gru_attention"][step] >= 0.8 and shipped["gru"][step] <= 0.1


def test_a_tampered_checkpoint_is_refused(tmp_path):
    source = resources.files(BASELINE_PACKAGE)
    for name in ["gru.pt", "SHA256SUMS"]:
        with resources.as_file(source / name) as path:
            shutil.copy(path, tmp_path / name)
    trained_baseline("gru", CPU, folder=tmp_path)  # an intact copy loads
    data = bytearray((tmp_path / "gru.pt").read_bytes())
    data[-10] ^= 1
    (tmp_path / "gru.pt").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="SHA-256"):
        trained_baseline("gru", CPU, folder=tmp_path)
    with pytest.raises(ValueError, match="name must be one of"):
        trained_baseline("lstm")


def test_table_one_measures():
    torch.manual_seed(0)
    d = 16
    attention, gru = MultiHeadAttention(d, 2).eval(), nn.GRU(d, d, batch_first=True)
    for n in (8, 16, 32):
        x = torch.randn(1, n, d)
        assert count_flops(lambda t: attention(t, t, t, need_weights=True), x) == 8 * n * d**2 + 4 * n**2 * d
        assert count_flops(gru, x) == 12 * n * d**2
    depths, paths = [], []
    for n in (4, 8, 12):
        xs = [torch.randn(1, d, requires_grad=True) for _ in range(n)]
        state, out = None, None
        for x in xs:  # one position at a time: x_0 enters at the first step only
            out, state = gru(x.unsqueeze(1), state)
        depths.append(sequential_depth(out))
        paths.append(path_length(out.sum(), xs[0]))
        y = attention(*(torch.stack(xs, 1),) * 3)[0]
        assert path_length(y[0, -1].sum(), xs[0]) == path_length(y[0, -1].sum(), xs[-1])  # O(1)
    # a recurrent layer: both grow by the same number of operations per position
    assert depths[2] - depths[1] == depths[1] - depths[0] > 0
    assert paths[2] - paths[1] == paths[1] - paths[0] > 0
    unrelated = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="does not depend"):
        path_length((xs[1] * 2).sum(), unrelated)


def _position_by_position(gru, xs):
    """Chapter 0's graph measures of a recurrent layer: positions fed one at a time, gradients of the last output."""
    state, out = None, None
    for x in xs:
        out, state = gru(x.unsqueeze(1), state)
    last = out.sum()
    gradients = torch.autograd.grad(last, xs, retain_graph=True)
    return out, gradients, sequential_depth(out), path_length(last, xs[0])


def test_rnn_gradients_in_eval_keeps_eval_mode_and_the_numbers():
    # On a GPU, chapter 0 differentiates an eval-mode nn.GRU, which cuDNN refuses; the context switches
    # cuDNN off. This checks on the CPU what the GPU path rests on: inside, cuDNN is off at every call
    # of the layer, the layer stays in eval mode (two layers with dropout: training mode would be another
    # computation), and every number is the one computed without the context.
    torch.manual_seed(0)
    gru = nn.GRU(8, 8, num_layers=2, dropout=0.5, batch_first=True).eval()
    xs = [torch.randn(1, 8, requires_grad=True) for _ in range(6)]
    before = torch.backends.cudnn.enabled
    plain = _position_by_position(gru, xs)
    calls = []
    hook = gru.register_forward_pre_hook(lambda m, args: calls.append((m.training, torch.backends.cudnn.enabled)))
    try:
        with rnn_gradients_in_eval():
            inside = _position_by_position(gru, xs)
    finally:
        hook.remove()
    assert calls == [(False, False)] * len(xs)
    assert not gru.training and torch.backends.cudnn.enabled == before
    assert torch.equal(inside[0], plain[0])
    assert all(torch.equal(a, b) for a, b in zip(inside[1], plain[1], strict=True))
    assert inside[2:] == plain[2:]  # the same graph: depth and path length
    assert 0 < inside[1][0].norm() < inside[1][-1].norm()  # the first position's gradient has faded


def test_rnn_gradients_in_eval_restores_the_cudnn_flag(monkeypatch):
    for enabled in (True, False):
        monkeypatch.setattr(torch.backends.cudnn, "enabled", enabled)
        with pytest.raises(RuntimeError, match="inside"), rnn_gradients_in_eval():
            assert torch.backends.cudnn.enabled is False
            raise RuntimeError("inside")
        assert torch.backends.cudnn.enabled is enabled
        with rnn_gradients_in_eval(), rnn_gradients_in_eval():
            pass
        assert torch.backends.cudnn.enabled is enabled


def test_rnn_gradients_in_eval_on_the_test_device():
    """On the device the suite runs on (TRANSFORMER_BOOK_DEVICE=cuda in the GPU job, where cuDNN
    refuses an eval-mode RNN backward without the context), the CPU's gradients."""
    device = tb.get_device()
    torch.manual_seed(0)
    gru = nn.GRU(8, 8, batch_first=True).eval()
    xs = [torch.randn(1, 8, requires_grad=True) for _ in range(6)]
    on_cpu = _position_by_position(gru, xs)
    inputs = [x.detach().to(device).requires_grad_() for x in xs]
    with rnn_gradients_in_eval():
        on_device = _position_by_position(copy.deepcopy(gru).to(device).eval(), inputs)
    torch.testing.assert_close(on_device[0].cpu(), on_cpu[0], atol=1e-5, rtol=1e-4)
    for a, b in zip(on_device[1], on_cpu[1], strict=True):
        torch.testing.assert_close(a.cpu(), b, atol=1e-5, rtol=1e-4)
