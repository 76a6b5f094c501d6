"""Data, label smoothing, the schedule, the loop: the model really learns, and a seed fixes the numbers."""

from __future__ import annotations

import datetime as dt
import functools
import random

import pytest
import torch
import torch.nn.functional as F

import transformer_book as tb
from transformer_book.data import date_to_french, split_words


def test_copy_task_batch_follows_seed_003():
    batch = tb.copy_task_batch(30, generator=torch.Generator().manual_seed(0))
    assert batch.src.shape == (30, 10) and (batch.src[:, 0] == 1).all()
    assert batch.src.min() >= 1 and batch.src.max() <= 10
    assert torch.equal(batch.tgt_in, batch.src[:, :-1]) and torch.equal(batch.tgt_out, batch.src[:, 1:])
    assert batch.src_mask.shape == (30, 1, 10) and batch.tgt_mask.shape == (30, 9, 9)
    assert batch.num_tokens == 30 * 9


def test_batch_masks_and_token_count_with_padding():
    src = torch.tensor([[5, 6, 0]])
    tgt = torch.tensor([[1, 7, 8, 2, 0]])
    batch = tb.Batch.from_pairs(src, tgt)
    assert batch.src_mask.tolist() == [[[True, True, False]]]
    assert batch.tgt_in.tolist() == [[1, 7, 8, 2]] and batch.tgt_out.tolist() == [[7, 8, 2, 0]]
    assert batch.num_tokens == 3
    assert torch.equal(batch.tgt_mask, tb.target_mask(batch.tgt_in))


def test_french_dates():
    assert date_to_french(dt.date(2026, 11, 22)) == "vingt-deux novembre deux mille vingt-six"
    assert date_to_french(dt.date(1971, 8, 1)) == "premier août mille neuf cent soixante et onze"
    assert split_words("vingt-deux novembre") == ["vingt", "deux", "novembre"]


def test_date_task_keeps_its_held_out_set_out_of_training():
    task = tb.DateTask(held_out=500, seed=3)
    assert not set(task.test_dates) & set(task.train_dates)
    src, tgt = task.test_set()
    assert src.shape == (500, task.src_len) and tgt.shape == (500, 12)
    assert task.to_iso(tgt[0]) == task.test_dates[0].isoformat()
    assert " ".join(task.src_vocab.decode(src[0])) == " ".join(split_words(date_to_french(task.test_dates[0])))
    batch = task.train_batch(256, random.Random(0))
    iso = {task.to_iso(row) for row in batch.tgt_out}
    assert not iso & {d.isoformat() for d in task.test_dates}


def test_label_smoothing_distribution_and_plain_cross_entropy():
    loss = tb.LabelSmoothingLoss(vocab_size=5, smoothing=0.4, pad_id=0)
    dist = loss.target_distribution(torch.tensor([2, 0]))
    torch.testing.assert_close(dist[0], torch.tensor([0.0, 0.4 / 3, 0.6, 0.4 / 3, 0.4 / 3]))
    assert (dist[1] == 0).all()  # a padding target contributes nothing
    logits, target = torch.randn(4, 7, 5), torch.randint(0, 5, (4, 7))
    plain = tb.LabelSmoothingLoss(5, smoothing=0.0)(logits, target)
    torch.testing.assert_close(plain, F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=0))


def test_noam_schedule_warms_up_then_decays():
    rates = [tb.noam_rate(step, 512, 4000) for step in range(1, 20001)]
    peak = max(range(len(rates)), key=rates.__getitem__) + 1
    assert peak == 4000
    torch.testing.assert_close(torch.tensor(rates[3999]), torch.tensor(512**-0.5 * 4000**-0.5))
    assert rates[15999] == pytest.approx(rates[3999] / 2)  # 1/sqrt(step): 4x the steps, half the rate


def test_taper_takes_the_rate_to_zero_at_the_last_step():
    for step in (1, 200, 500, 999):
        tapered = tb.noam_rate(step, 64, 200, 0.5, total_steps=1000)
        assert tapered == pytest.approx(tb.noam_rate(step, 64, 200, 0.5) * (1 - step / 1000))
    assert tb.noam_rate(1000, 64, 200, 0.5, total_steps=1000) == 0.0
    model = tb.make_model(tb.ModelConfig.small(11))
    optimizer, schedule = tb.noam_optimizer(model, 64, 10, total_steps=20)
    rates = []
    for _ in range(20):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert rates[0] > 0 and rates[-1] == pytest.approx(tb.noam_rate(20, 64, 10, total_steps=20))
    with pytest.raises(ValueError, match="total_steps"):
        tb.noam_optimizer(model, 64, 10, total_steps=0)


def test_fit_keeps_an_exponential_average_of_the_weights_and_evaluates_it():
    tb.seed_everything(0)
    model = tb.make_model(tb.ModelConfig.small(11, dropout=0.0))
    optimizer, schedule = tb.noam_optimizer(model, 64, 5)
    batches = [tb.copy_task_batch(8, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    decay, snapshots, scored = 0.9, [], []

    def next_batch(step):
        return batches[step - 1]

    def evaluate(m):
        scored.append(m)
        snapshots.append({k: v.clone() for k, v in model.state_dict().items()})
        return 0.0

    history = tb.fit(model, next_batch, 4, optimizer, schedule, evaluate=evaluate, eval_every=1,
                     progress=False, average=decay)  # fmt: skip
    # By hand: the first update copies the weights, every later one moves decay of the way less.
    expected = {k: v.clone() for k, v in snapshots[0].items()}
    for state in snapshots[1:]:
        for k in expected:
            if expected[k].is_floating_point():
                expected[k] = decay * expected[k] + (1 - decay) * state[k]
    averaged = history.averaged.state_dict()
    for name, _ in model.named_parameters():
        torch.testing.assert_close(averaged[name], expected[name])
    assert all(m is history.averaged for m in scored) and not history.averaged.training
    assert not torch.equal(averaged["generator.weight"], model.state_dict()["generator.weight"])


def test_fit_evaluates_in_evaluation_mode_and_trains_in_training_mode():
    """An evaluate that decodes (chapter 11's translate) must not see dropout: fit hands it
    the model in evaluation mode, and the next step trains in training mode again."""
    tb.seed_everything(0)
    model = tb.make_model(tb.ModelConfig.small(11, dropout=0.3))
    optimizer, schedule = tb.noam_optimizer(model, 64, 5)
    batch = tb.copy_task_batch(8, generator=torch.Generator().manual_seed(0))
    modes = []
    model.register_forward_pre_hook(lambda module, args: modes.append(("step", module.training)))

    def evaluate(m):
        modes.append(("evaluate", m.training))
        return 0.0

    tb.fit(model, lambda step: batch, 3, optimizer, schedule, evaluate=evaluate, eval_every=1, progress=False)
    assert modes == [("step", True), ("evaluate", False)] * 3
    assert model.training  # returned as the steps left it


def test_a_recipe_says_the_rate_its_optimizer_uses():
    for name in ("copy", "dates"):
        r = tb.recipe(name)
        optimizer, schedule = r.optimizer(tb.make_model(r.model_config(r.make_task(0))))
        for step in range(1, r.warmup + 3):
            assert optimizer.param_groups[0]["lr"] == pytest.approx(r.rate(step), rel=1e-12)
            optimizer.step()
            schedule.step()
        assert r.rate(r.max_steps) == (0.0 if r.taper else tb.noam_rate(r.max_steps, r.d_model, r.warmup, r.lr_factor))


def test_labelled_bits_hides_every_letter_once_and_answers_with_their_number():
    src, tgt = tb.labelled_bits(500, 4, 6, torch.Generator().manual_seed(0))
    assert src.shape == (500, 6) and tgt.shape == (500, 2) and (tgt[:, 0] == 1).all()
    assert src.min() >= 1 and src.max() < 2 + 2 * 4  # blanks (1) and the 8 letter ids, no padding
    for row, answer in zip(src.tolist(), tgt[:, 1].tolist()):
        letters = {(i - 2) // 2: (i - 2) % 2 for i in row if i >= 2}
        assert sorted(letters) == [0, 1, 2, 3] and sum(i >= 2 for i in row) == 4  # each letter once
        assert answer - 2 == int("".join(str(letters[j]) for j in range(4)), 2)  # letter 0 first
    assert len({tuple(r) for r in src.tolist()}) > 400  # places and bits are drawn, not fixed
    with pytest.raises(ValueError, match="num_bits"):
        tb.labelled_bits(2, num_bits=7, length=6)


def test_chunked_loss_gives_the_whole_loss_and_its_gradients():
    """The loss in chunks of positions (each chunk's logits made again in backward) is the
    loss of the whole batch's logits, with the same gradients, padding and a last short
    chunk included; it also compiles into one graph."""
    tb.seed_everything(3)
    model = tb.make_model(tb.ModelConfig.small(17, dropout=0.0))
    generator = torch.Generator().manual_seed(4)
    src = torch.randint(3, 17, (3, 6), generator=generator)
    tgt = torch.randint(3, 17, (3, 8), generator=generator)
    src[0, 4:], tgt[1, 5:] = 0, 0
    batch = tb.Batch.from_pairs(src, tgt)
    loss_fn = tb.LabelSmoothingLoss(17, 0.1)

    def loss_and_grads(loss_of_hidden):
        model.zero_grad(set_to_none=True)
        memory = model.encode(batch.src, batch.src_mask)
        hidden = model.decode(memory, batch.tgt_in, src_mask=batch.src_mask, tgt_mask=batch.tgt_mask)
        loss = loss_of_hidden(hidden)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    whole, whole_grads = loss_and_grads(lambda h: loss_fn(model.generator(h), batch.tgt_out))
    compiled = torch.compile(tb.chunked_loss, fullgraph=True, backend="aot_eager")
    for chunk, function in ((1, tb.chunked_loss), (5, tb.chunked_loss), (100, tb.chunked_loss), (5, compiled)):
        in_parts = functools.partial(function, generator=model.generator, target=batch.tgt_out, loss_fn=loss_fn)
        loss, grads = loss_and_grads(functools.partial(in_parts, chunk=chunk))
        torch.testing.assert_close(loss, whole, atol=1e-5, rtol=1e-5)
        for ours, theirs in zip(grads, whole_grads, strict=True):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="chunk"):
        tb.chunked_loss(torch.zeros(2, 3, 64), model.generator, batch.tgt_out[:2, :3], loss_fn, 0)
