"""Data, label smoothing, the schedule, the loop: the model really learns, and a seed fixes the numbers."""

from __future__ import annotations

import datetime as dt
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


def copy_run(steps: int) -> tuple[tb.Transformer, tb.History]:
    tb.seed_everything(0)
    config = tb.ModelConfig.small(11, dropout=0.0)
    model = tb.make_model(config)
    optimizer, schedule = tb.noam_optimizer(model, config.d_model, warmup=200, factor=0.5)
    generator = torch.Generator().manual_seed(1)
    history = tb.fit(model, lambda step: tb.copy_task_batch(64, generator=generator), steps, optimizer, schedule, progress=False)
    return model, history


def test_loss_falls_and_a_fixed_seed_reproduces_the_numbers():
    _, first = copy_run(30)
    _, second = copy_run(30)
    assert first.loss == second.loss  # the same floats, not just close
    assert sum(first.loss[-5:]) / 5 < 0.8 * sum(first.loss[:5]) / 5
    assert first.lr[0] < first.lr[-1]  # still warming up


def test_copy_task_reaches_full_accuracy_on_held_out_sequences():
    held_out = tb.copy_task_batch(1000, generator=torch.Generator().manual_seed(999))
    evaluate = lambda m: tb.exact_match(m, held_out.src, held_out.src, bos_id=1, eos_id=None)  # noqa: E731
    tb.seed_everything(0)
    config = tb.ModelConfig.small(11, dropout=0.0)
    model = tb.make_model(config)
    optimizer, schedule = tb.noam_optimizer(model, config.d_model, warmup=200, factor=0.5)
    generator = torch.Generator().manual_seed(1)
    history = tb.fit(
        model, lambda step: tb.copy_task_batch(64, generator=generator), 1500, optimizer, schedule,
        evaluate=evaluate, eval_every=100, stop_at=1.0, progress=False,
    )
    print(f"\ncopy task: {history.eval_metric[-1]:.1%} exact match on 1,000 held-out sequences after {history.eval_step[-1]} steps")
    assert history.eval_metric[-1] == 1.0


def test_dates_task_reaches_99_percent_on_held_out_dates():
    tb.seed_everything(0)
    task = tb.DateTask()
    config = tb.ModelConfig.small(len(task.src_vocab), len(task.tgt_vocab), dropout=0.0)
    model = tb.make_model(config)
    optimizer, schedule = tb.noam_optimizer(model, config.d_model, warmup=200, factor=0.5)
    rng = random.Random(1)
    src, tgt = task.test_set()
    history = tb.fit(
        model, lambda step: task.train_batch(64, rng), 1000, optimizer, schedule,
        evaluate=lambda m: tb.exact_match(m, src, tgt, bos_id=1, eos_id=2), eval_every=100, stop_at=0.99, progress=False,
    )
    print(f"\ndates: {history.eval_metric[-1]:.1%} exact match on {len(src):,} held-out dates after {history.eval_step[-1]} steps")
    assert history.eval_metric[-1] >= 0.99
