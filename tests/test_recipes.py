"""The training recipes: one per task, used everywhere, reaching their targets; the shipped checkpoint.

`benchmarks/bench_recipes.py` runs each recipe with ten seeds; chapter 8 trains both
recipes to their targets in the book build (seed 0, the run that made the shipped dates
checkpoint) and again, with another seed, in tests/test_sections.py. The shipped
checkpoint stores its recipe, and `trained_model` refuses it once the recipe changes.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
from importlib import resources
from pathlib import Path

import nbformat
import pytest
import torch
from book_helpers import REPO_ROOT

import transformer_book as tb
from transformer_book.recipes import CHECKPOINT_PACKAGE, checkpoint_state, read_checkpoint

CPU = torch.device("cpu")


def test_unknown_recipe_is_a_value_error():
    with pytest.raises(ValueError, match="name must be one of"):
        tb.recipe("poetry")


def test_recipes_build_their_models():
    for name, r in tb.RECIPES.items():
        task = r.make_task(0)
        config = r.model_config(task)
        assert (config.src_vocab_size, config.tgt_vocab_size) == (task.src_vocab_size, task.tgt_vocab_size)
        assert (config.d_model, config.num_layers, config.dropout) == (r.d_model, r.num_layers, r.dropout)
        assert r.eval_every < r.max_steps and 0 < r.target <= 1, name


def test_a_fixed_seed_reproduces_the_numbers_and_the_loss_falls():
    r = tb.recipe("copy")

    def losses() -> list[float]:
        tb.seed_everything(0)
        task = r.make_task(0)
        model = tb.make_model(r.model_config(task))
        optimizer, schedule = r.optimizer(model)
        rng = __import__("random").Random(1)
        history = tb.fit(model, lambda step: task.train_batch(64, rng), 30, optimizer, schedule,
                         progress=False, clip_norm=r.clip_norm)  # fmt: skip
        assert history.lr[0] < history.lr[-1]  # still warming up
        return history.loss

    first, second = losses(), losses()
    assert first == second  # the same floats, not just close
    assert sum(first[-5:]) / 5 < 0.8 * sum(first[:5]) / 5


def test_train_recipe_returns_the_average_it_evaluated(monkeypatch: pytest.MonkeyPatch):
    """train_recipe's wiring, on a copy recipe cut to 60 steps (chapter 8 trains the full recipes
    to their targets in the book build and again, with another seed, in the sections run)."""
    short = dataclasses.replace(tb.recipe("copy"), max_steps=60, eval_every=20, target=1.01)
    monkeypatch.setitem(tb.RECIPES, "copy", short)
    run = tb.train_recipe("copy", seed=3, until_target=False, device=CPU)
    assert run.history.averaged is run.model and not run.model.training
    assert run.steps == 60 and run.history.eval_step == [20, 40, 60]
    # Validation chose (it is what fit evaluated); the test set was scored once, afterwards.
    assert run.validation == run.history.eval_metric[-1] == tb.recipes.validation_accuracy(run.model, run.task)
    assert run.accuracy == tb.recipes.test_accuracy(run.model, run.task)
    assert run.history.lr[-1] == pytest.approx(short.rate(60)) and short.rate(60) == 0.0  # the taper


def test_chapter_8_trains_dates_on_the_code_path_of_train_recipe(monkeypatch: pytest.MonkeyPatch):
    """The run chapter 8 shows (its section 8.5 cell, executed here on the dates recipe cut to 6
    steps) and ``train_recipe``, which ``scripts/make_checkpoints.py`` calls for the shipped
    checkpoint, end with the same weights, bit for bit: one recipe, one code path, one model."""
    short = dataclasses.replace(tb.recipe("dates"), max_steps=6, eval_every=3, target=1.01)
    monkeypatch.setitem(tb.RECIPES, "dates", short)
    chapter = nbformat.read(REPO_ROOT / "chapters" / "08_training.ipynb", as_version=4)
    code = [c.source for c in chapter.cells if c.cell_type == "code"]
    [fit_at] = [i for i, source in enumerate(code) if "dates_history = fit(" in source]
    assert code[fit_at - 1].startswith('r = recipe("dates")')  # the run's set-up, in the cell before
    cell = code[fit_at - 1] + "\n" + code[fit_at]
    # the full recipe's claims, not true after 6 steps
    cut = cell.replace("assert dates_", "pass  # not after 6 steps: assert dates_")
    namespace = {"SEED": 0, "device": CPU, "random": random, "torch": torch}
    namespace.update({name: getattr(tb, name) for name in tb.__all__ if name != "exercises"})
    exec(cut, namespace)
    run = tb.train_recipe("dates", seed=0, until_target=False, device=CPU)
    chapter_weights, recipe_weights = namespace["dates_model"].state_dict(), run.model.state_dict()
    assert chapter_weights.keys() == recipe_weights.keys()
    for name, weights in chapter_weights.items():
        assert torch.equal(weights, recipe_weights[name]), name
    assert namespace["dates_history"].eval_metric == run.history.eval_metric
    assert namespace["dates_acc"] == run.accuracy and namespace["dates_val"] == run.validation
    script = (REPO_ROOT / "scripts" / "make_checkpoints.py").read_text()
    assert 'tb.train_recipe(name, seed=0, device=torch.device("cpu")' in script


@pytest.mark.parametrize("name", ["copy", "dates"])
def test_train_validation_and_test_sets_are_disjoint(name: str):
    """Disjoint by construction: the two held-out sets share nothing, and no training batch
    holds an example of either (the copy task draws such a sequence again)."""
    task = tb.recipe(name).make_task(3)
    rows = lambda t: {tuple(row) for row in t.tolist()}  # noqa: E731
    test, validation = rows(task.test_set()[0]), rows(task.validation_set()[0])
    assert len(test) == len(task.test_set()[0]) and len(validation) == len(task.validation_set()[0])
    assert not test & validation
    rng = random.Random(4)
    seen = set().union(*(rows(task.train_batch(256, rng).src) for _ in range(20)))
    assert not seen & (test | validation)
    if name == "dates":
        assert not set(task.train_dates) & (set(task.test_dates) | set(task.validation_dates))


def test_copy_training_draws_a_held_out_sequence_again():
    """With 5 ids of 2 symbols there are 16 sequences; 4 are held out, and a batch of 200
    would hold about 50 of them if it did not draw them again."""
    task = tb.CopyTask(vocab_size=3, length=5, held_out=2, seed=0)
    held_out = {tuple(row) for row in torch.cat([task.test_set()[0], task.validation_set()[0]]).tolist()}
    assert len(held_out) == 4
    batch = task.train_batch(200, random.Random(0))
    assert not {tuple(row) for row in batch.src.tolist()} & held_out
    with pytest.raises(ValueError, match="too few"):
        tb.CopyTask(vocab_size=3, length=5, held_out=5, seed=0)


def test_shipped_checkpoint_loads_and_translates():
    trained = tb.trained_model("dates", device=CPU)
    assert not trained.model.training and trained.history is None
    accuracy = tb.recipes.test_accuracy(trained.model, trained.task)
    validation = tb.recipes.validation_accuracy(trained.model, trained.task)
    # Another CPU's rounding may flip a date whose two best characters are within float noise.
    assert abs(accuracy - trained.accuracy) <= 0.002, (accuracy, trained.accuracy)
    assert abs(validation - trained.validation) <= 0.002, (validation, trained.validation)
    assert validation >= trained.recipe.target - 0.002  # where training stopped
    assert accuracy >= trained.recipe.target - 0.012  # measured once, afterwards


@pytest.fixture
def checkpoint_copy(tmp_path: Path) -> Path:
    folder = tmp_path / "checkpoints"
    shutil.copytree(Path(str(resources.files(CHECKPOINT_PACKAGE))), folder)
    return folder


def test_corrupt_checkpoint_is_refused(checkpoint_copy: Path):
    data = bytearray((checkpoint_copy / "dates.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (checkpoint_copy / "dates.pt").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="SHA-256 does not match"):
        read_checkpoint(checkpoint_copy, "dates")


def test_checkpoint_from_another_recipe_is_refused(checkpoint_copy: Path, monkeypatch):
    """Change the recipe without making the checkpoint again: loading says so."""
    changed = dataclasses.replace(tb.recipe("dates"), batch_size=tb.recipe("dates").batch_size + 1)
    monkeypatch.setitem(tb.RECIPES, "dates", changed)
    with pytest.raises(ValueError, match="another recipe"):
        read_checkpoint(checkpoint_copy, "dates")


def test_checkpoint_holds_only_plain_values(checkpoint_copy: Path):
    """Tensors, strings and numbers only: what ``torch.load(weights_only=True)`` accepts everywhere
    (a ``TorchVersion`` once slipped in and made the file unreadable)."""
    state = torch.load(checkpoint_copy / "dates.pt", weights_only=True)
    assert set(state) == set(checkpoint_state(tb.trained_model("dates", device=CPU)))
    assert all(isinstance(t, torch.Tensor) for t in state["model"].values())
    plain = (str, int, float, bool, type(None))
    assert type(state["torch"]) is str and all(type(v) in plain for v in state["recipe"].values())
    assert all(type(v) in plain for v in state["model_config"].values())
