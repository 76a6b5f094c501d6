"""Device choice and seeding."""

from __future__ import annotations

import pytest
import torch

import transformer_book as tb
from transformer_book.runtime import DEVICE_ENV


def test_forced_cpu(monkeypatch):
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert tb.get_device() == torch.device("cpu")


def test_forcing_a_missing_gpu_is_an_error(monkeypatch):
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    if torch.cuda.is_available():
        assert tb.get_device().type == "cuda"
    else:
        with pytest.raises(RuntimeError, match="torch.cuda.is_available"):
            tb.get_device()


def test_unknown_device_name(monkeypatch):
    monkeypatch.setenv(DEVICE_ENV, "tpu-please")
    with pytest.raises(ValueError, match=DEVICE_ENV):
        tb.get_device()


@pytest.mark.parametrize(
    "cuda, mps, expected", [(True, True, "cuda"), (True, False, "cuda"), (False, True, "mps"), (False, False, "cpu")]
)
def test_default_device_prefers_an_accelerator(monkeypatch, cuda, mps, expected):
    """Without the variable: CUDA before MPS before the CPU, whatever this machine has."""
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    assert tb.get_device().type == expected


def test_seed_everything_reproduces_a_model_and_its_output():
    def run():
        tb.seed_everything(42)
        model = tb.make_model(tb.ModelConfig.small(11)).train()  # dropout on: the seed covers it too
        return model(torch.randint(1, 11, (2, 6)), torch.randint(1, 11, (2, 5)))

    torch.testing.assert_close(run(), run(), rtol=0, atol=0)


def test_describe_environment_names_device_and_torch():
    text = tb.describe_environment(torch.device("cpu"))
    assert "device: cpu" in text and torch.__version__ in text


def test_the_book_seed_comes_from_the_environment(monkeypatch):
    from transformer_book.runtime import SEED_ENV

    monkeypatch.delenv(SEED_ENV, raising=False)
    assert tb.book_seed() == 0 and tb.seed_everything() == 0
    monkeypatch.setenv(SEED_ENV, "17")
    assert tb.seed_everything() == 17
    first = torch.rand(3)
    assert tb.seed_everything(17 + 1) == 18  # an explicit seed is used as given
    tb.seed_everything()
    torch.testing.assert_close(torch.rand(3), first, rtol=0, atol=0)
    monkeypatch.setenv(SEED_ENV, "seventeen")
    with pytest.raises(ValueError, match=SEED_ENV):
        tb.book_seed()
