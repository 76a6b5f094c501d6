"""The speed wing, transformer_book.fast (appendix C): ``accelerate(model)`` is the same model
(same parameters, the same numbers to float rounding, the same gradients), ``plain(model)`` undoes
it, the taught package never imports it, and its C kernels never harm the process: a damaged,
foreign or shared compiled file is not loaded, a failed build is remembered with the compiler's
reason, and what a kernel cannot do safely is a ValueError."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import transformer_book as tb
from transformer_book import fast
from transformer_book.fast import _native, dropout_kernel, few_rows, kernels
from transformer_book.fast.kernels import FastDropout, FastLinear
from transformer_book.fast.modules import FastFeedForward, FastMultiHeadAttention, FastTransformer

needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None,
    reason="no C compiler ($CC, else cc): the wing's C kernels cannot be built here",
)

# Eval forward: the wing's products (oneDNN, one stacked q/k/v product, the few-row kernel) add
# in other orders than MKL's; measured differences were under 4e-6 on logits of size about 4.
FORWARD_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
# Gradients after one backward pass: measured differences under 3e-7 (some gradients, such as
# the key projection's bias, are zero but for rounding, hence the absolute term).
GRADIENT_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def make(width: str = "small", **sizes) -> tb.Transformer:
    """The small preset, or wider (d_model 256, d_ff 1024: decoding steps use the few-row kernel)."""
    tb.seed_everything(0)
    config = tb.ModelConfig.small(30, **sizes)
    if width == "wider":
        config = dataclasses.replace(config, d_model=256, d_ff=1024)
    return tb.make_model(config)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(3, 30, (4, 9), generator=generator), torch.randint(3, 30, (4, 7), generator=generator)
    src[1, 5:] = 0  # padding in the source
    return src, tgt


def run_python(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with this environment (a crash shows as a negative return code)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=os.environ)


# --- the same model ------------------------------------------------------------------------------


def test_accelerate_keeps_every_parameter_and_plain_restores_the_classes() -> None:
    model = make()
    classes = {name: type(module) for name, module in model.named_modules()}
    before = model.state_dict(keep_vars=True)
    assert fast.accelerate(model) is model and fast.is_accelerated(model)
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(before) and all(after[name] is before[name] for name in before)  # the same objects
    assert type(model) is FastTransformer and isinstance(model, tb.Transformer)
    assert type(model.generator) is FastLinear and type(model.positional.dropout) is FastDropout
    assert type(model.encoder.layers[0].feed_forward) is FastFeedForward
    assert type(model.decoder.layers[0].cross_attn) is FastMultiHeadAttention
    assert fast.accelerate(model) is model and model.state_dict(keep_vars=True) == after  # twice is once
    src, tgt = batch()
    with torch.inference_mode():
        tb.greedy_decode(model.eval(), src, 6, 1, 2)
    assert fast.plain(model) is model and not fast.is_accelerated(model)
    assert {name: type(module) for name, module in model.named_modules()} == classes
    for module in model.modules():
        assert not {"packed", "stacked", "plans", "step_masks"} & set(vars(module)), module
    assert all(value is before[name] for name, value in model.state_dict(keep_vars=True).items())


def test_classes_of_your_own_are_left_alone() -> None:
    class MyLinear(nn.Linear):
        pass

    layer = nn.Sequential(MyLinear(4, 4), nn.Linear(4, 4), nn.ReLU())
    fast.accelerate(layer)
    assert [type(m) for m in layer] == [MyLinear, FastLinear, nn.ReLU]


@pytest.mark.parametrize("width", ["small", "wider"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_eval_forward_is_the_plain_models(width: str, norm_first: bool) -> None:
    """To float tolerance (FORWARD_TOLERANCE), with and without inference mode."""
    plain = make(width, norm_first=norm_first).eval()
    accelerated = fast.accelerate(copy.deepcopy(plain))
    src, tgt = batch()
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            torch.testing.assert_close(accelerated(src, tgt), plain(src, tgt), **FORWARD_TOLERANCE)


@pytest.mark.parametrize("norm_first", [False, True])
def test_training_gives_the_plain_models_gradients_without_dropout(norm_first: bool) -> None:
    """Dropout 0: forward and backward of a training step on the wing's kernels give the plain
    model's loss and gradients to GRADIENT_TOLERANCE. (With dropout the masks differ by design:
    see the next test.)"""
    plain = make(dropout=0.0, norm_first=norm_first).train()
    accelerated = fast.accelerate(copy.deepcopy(plain))
    src, tgt = batch()
    losses = []
    for model in (plain, accelerated):
        logits = model(src, tgt[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten())
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], **GRADIENT_TOLERANCE)
    pairs = zip(plain.named_parameters(), accelerated.parameters(), strict=True)
    for (name, theirs), ours in pairs:
        torch.testing.assert_close(ours.grad, theirs.grad, **GRADIENT_TOLERANCE, msg=name)


def test_fast_dropout_draws_keep_mask_with_the_rate_p() -> None:
    """The accelerated model's dropout is not nn.Dropout's draw, so its training numbers are not
    the plain model's. What holds instead: each mask is ``dropout_kernel.keep_mask`` of a seed
    drawn from PyTorch's generator (so torch.manual_seed repeats it), drops p of the elements,
    and scales the rest by 1 / (1 - p)."""
    model = fast.accelerate(make(dropout=0.1)).train()
    layer = model.decoder.layers[0].dropout1
    assert type(layer) is FastDropout
    x = torch.randn(8, 64, 256)
    torch.manual_seed(3)
    y = layer(x)
    torch.manual_seed(3)
    keep = dropout_kernel.keep_mask(x.shape, 0.1, dropout_kernel.draw_seed())
    assert torch.equal(y, x * keep * (1 / 0.9))
    dropped = 1 - keep.float().mean().item()  # 131072 draws: 5 standard deviations are 0.0041
    assert abs(dropped - 0.1) < 0.0041
    src, tgt = batch()
    torch.manual_seed(5)
    first = model(src, tgt)
    torch.manual_seed(5)
    assert torch.equal(model(src, tgt), first)


def test_importing_the_package_does_not_import_the_wing() -> None:
    """The model is the lesson: building, training and decoding the plain model never touches fast/."""
    code = (
        "import sys, torch, transformer_book as tb\n"
        "model = tb.make_model(tb.ModelConfig.small(20))\n"
        "src = torch.randint(3, 20, (2, 5))\n"
        "model(src, src).sum().backward()\n"
        "tb.greedy_decode(model.eval(), src, 5, 1, 2)\n"
        "print(sorted(name for name in sys.modules if name.startswith('transformer_book.fast')))\n"
        "print(hasattr(tb, 'fast'))\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]", "False"]


def test_without_a_compiler_the_wing_runs_on_pytorchs_operators(monkeypatch: pytest.MonkeyPatch) -> None:
    """No C compiler: the kernels are off with the reason, and the accelerated model still decodes
    the plain model's tokens and trains (its dropout masks then come from PyTorch's operators)."""
    monkeypatch.setenv("CC", "no-such-compiler")
    for module in (few_rows, dropout_kernel):
        monkeypatch.setattr(module, "_library", None)
        monkeypatch.setattr(module, "_unavailable", None)
    status = fast.status()
    assert "no C compiler 'no-such-compiler' on PATH" in status["few_rows"]
    assert "no C compiler 'no-such-compiler' on PATH" in status["dropout_kernel"]
    plain = make("wider").eval()
    accelerated = fast.accelerate(copy.deepcopy(plain))
    src, tgt = batch()
    assert torch.equal(tb.greedy_decode(accelerated, src, 12, 1, 2), tb.greedy_decode(plain, src, 12, 1, 2))
    accelerated.train()
    x = torch.randn(3, 40)
    torch.manual_seed(2)
    y = accelerated.positional.dropout(x)
    torch.manual_seed(2)
    assert torch.equal(y, x * dropout_kernel.keep_mask(x.shape, 0.1, dropout_kernel.draw_seed()) * (1 / 0.9))
    accelerated(src, tgt).sum().backward()
    assert all(p.grad is not None for p in accelerated.decoder.parameters())


# --- the C kernels never harm the process ---------------------------------------------------------


@pytest.fixture
def own_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty cache folder of this test's own (not created yet), and both kernel modules as
    before their first use; restored afterwards."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TRANSFORMER_BOOK_CACHE", str(cache))
    for module in (few_rows, dropout_kernel):
        monkeypatch.setattr(module, "_library", None)
        monkeypatch.setattr(module, "_unavailable", None)
    monkeypatch.setattr(few_rows, "_lanes", 0)
    return cache


def matches_its_record(library: Path) -> bool:
    record = json.loads(library.with_suffix(".json").read_text())
    data = library.read_bytes()
    return record == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@needs_compiler
def test_a_truncated_library_is_built_again_never_loaded(own_cache: Path) -> None:
    """A library cut short (a full disk, a killed build) would raise SIGBUS once mapped: the next
    process sees that it does not match its record, builds it again and runs."""
    library = _native.compiled(few_rows.SOURCE)  # built and recorded, not loaded by this process
    size = library.stat().st_size
    os.truncate(library, size // 2)
    result = run_python(
        "import torch\n"
        "from transformer_book.fast import few_rows\n"
        "assert few_rows.available(), few_rows.unavailable_reason()\n"
        "panels = few_rows.pack(torch.ones(8, 4))\n"
        "print(few_rows.product(torch.ones(2, 4), panels, None, 8).sum().item())\n"
    )
    assert result.returncode == 0, f"return code {result.returncode} (negative: killed by a signal)\n{result.stderr}"
    assert result.stdout.strip() == "64.0"
    assert library.stat().st_size == size and matches_its_record(library)


@needs_compiler
def test_a_library_that_is_not_what_its_record_says_is_not_loaded(own_cache: Path) -> None:
    """Other bytes in the library's place (a planted file), or a library and record that others
    can write to: built again before anything is loaded."""
    library = _native.compiled(dropout_kernel.SOURCE)
    genuine = library.read_bytes()
    planted = b"\x7fELF" + bytes(len(genuine) - 4)  # the same size, other bytes
    library.write_bytes(planted)
    assert _native.compiled(dropout_kernel.SOURCE) == library
    assert library.read_bytes() != planted and matches_its_record(library)
    # A planted file with a record to match, both writable by others: not trusted either.
    library.write_bytes(planted)
    record = library.with_suffix(".json")
    record.write_text(json.dumps({"size": len(planted), "sha256": hashlib.sha256(planted).hexdigest()}))
    for path in (library, record):
        path.chmod(0o766)
    _native.compiled(dropout_kernel.SOURCE)
    assert library.read_bytes() != planted and matches_its_record(library)
    assert oct(library.stat().st_mode & 0o777) == "0o700" and oct(record.stat().st_mode & 0o777) == "0o600"
    # A link in the library's place is not followed.
    library.unlink()
    library.symlink_to(own_cache / "elsewhere.so")
    (own_cache / "elsewhere.so").write_bytes(planted)
    _native.compiled(dropout_kernel.SOURCE)
    assert not library.is_symlink() and matches_its_record(library)
    assert dropout_kernel.available(), dropout_kernel.unavailable_reason()


@needs_compiler
def test_a_cache_folder_others_can_write_to_is_not_used(
    own_cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Anyone who can write to the folder could swap the library: even a library that matches its
    record there is ignored, and the build goes to a private folder of this process's own."""
    library = _native.compiled(dropout_kernel.SOURCE)
    own_cache.chmod(0o777)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    private = _native.compiled(dropout_kernel.SOURCE)
    assert private.parent.parent == scratch and private.parent.name.startswith("transformer_book-")
    assert oct(private.parent.stat().st_mode & 0o777) == "0o700" and matches_its_record(private)
    assert private.name == library.name and sorted(p.name for p in own_cache.iterdir()) == sorted(
        [library.name, library.with_suffix(".json").name]
    )
    assert dropout_kernel.available(), dropout_kernel.unavailable_reason()


@pytest.mark.skipif(os.name != "posix", reason="the failing compiler is a shell script")
def test_a_failed_build_gives_the_compilers_reason_and_is_not_tried_again(
    own_cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    log = tmp_path / "compiler-calls.log"
    compiler = tmp_path / "failing-cc"
    compiler.write_text(  # logs the C file it was asked to compile, then fails as a compiler does
        f'#!/bin/sh\nfor a in "$@"; do case "$a" in *.c) basename "$a" >> "{log}";; esac; done\n'
        'echo "few_rows.c:1:1: error: boom" >&2\nexit 1\n'
    )
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    assert not few_rows.available()
    reason = few_rows.unavailable_reason()
    assert "\n" not in reason and reason.endswith("failed: few_rows.c:1:1: error: boom"), reason
    (failed,) = own_cache.glob("few_rows-*.failed")
    assert "error: boom" in failed.read_text() and log.read_text().splitlines() == ["few_rows.c"]
    assert fast.status()["few_rows"] == reason  # (which tries the dropout kernel, and fails alike)
    assert log.read_text().splitlines() == ["few_rows.c", "dropout_kernel.c"]
    result = run_python(
        "from transformer_book.fast import few_rows\n"
        "print(few_rows.available())\n"
        "print(few_rows.unavailable_reason())\n"
    )
    assert result.returncode == 0, result.stderr
    available, remembered = result.stdout.splitlines()
    assert available == "False" and "an earlier build failed" in remembered and "error: boom" in remembered
    assert log.read_text().splitlines() == ["few_rows.c", "dropout_kernel.c"]  # not run again
    with torch.inference_mode():  # and the wing works without the kernel
        layer, x = fast.accelerate(nn.Linear(256, 512)), torch.randn(8, 256)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_a_mask_on_another_device_is_a_value_error() -> None:
    """A mask on another device than the queries (here 'meta', which every machine has) is named,
    not read from the wrong memory: the plain attention, the formula, the accelerated attention
    and the decoding plan."""
    attention = tb.MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 3, 16)
    mask = torch.ones(2, 3, 3, dtype=torch.bool, device="meta")
    message = r"mask with shape \(2, 3, 3\) is on meta, but the queries are on cpu"
    with pytest.raises(ValueError, match=message):
        attention(x, x, x, mask)
    with pytest.raises(ValueError, match=message):
        fast.accelerate(copy.deepcopy(attention))(x, x, x, mask)
    q = torch.randn(2, 4, 3, 4)
    with pytest.raises(ValueError, match=r"mask with shape \(2, 1, 3, 3\) is on meta"):
        tb.scaled_dot_product_attention(q, q, q, mask[:, None])
    model = fast.accelerate(make()).eval()
    src = batch()[0]
    with torch.inference_mode():
        memory, cache = model.encode(src), model.decoder.new_cache()
        token = torch.ones(4, 1, dtype=torch.long)
        model.decode(memory, token, cache=cache)  # the plan path from here on
        with pytest.raises(ValueError, match=r"src_mask with shape \(4, 1, 9\) is on meta"):
            model.decode(memory, token, src_mask=torch.ones(4, 1, 9, dtype=torch.bool, device="meta"), cache=cache)


@needs_compiler
def test_the_few_row_kernels_refuse_what_they_cannot_do_safely() -> None:
    """Panels that do not hold the outputs asked for, a mask on another device, and tensors that
    need a gradient (the kernels have no backward) are ValueErrors; without grad mode they run."""
    panels = few_rows.pack(torch.randn(10, 6))  # 2 panels of 8 outputs
    with pytest.raises(ValueError, match=r"out_features=17 does not fit panels \(2, 6, 8\)"):
        few_rows.product(torch.randn(2, 6), panels, None, 17)
    with pytest.raises(ValueError, match=r"out_features=10 does not fit panels \(1, 6, 8\)"):
        few_rows.product(torch.randn(2, 6), panels[:1], None, 10)
    x = torch.randn(2, 6, requires_grad=True)
    with pytest.raises(ValueError, match=r"x \(2, 6\) requires grad; the few-row kernels have no backward"):
        few_rows.product(x, panels, None, 10)
    with pytest.raises(ValueError, match=r"bias \(10\) requires grad"):
        few_rows.product(x.detach(), panels, torch.zeros(10, requires_grad=True), 10)
    q, k = torch.randn(1, 2, 1, 4, requires_grad=True), torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"q \(1, 2, 1, 4\) requires grad"):
        few_rows.attention(q, k, k)
    with pytest.raises(ValueError, match=r"mask with shape \(1, 1, 1, 3\) is on meta"):
        few_rows.attention(q.detach(), k, k, torch.ones(1, 1, 1, 3, dtype=torch.bool, device="meta"))
    with torch.no_grad():
        assert few_rows.product(x, panels, None, 10).shape == (2, 10)
        assert few_rows.attention(q, k, k).shape == (1, 1, 8)


def test_dropout_keeps_the_gradient_that_its_kernel_refuses() -> None:
    """``dropout_kernel.apply`` refuses a tensor that needs a gradient; ``kernels.dropout`` and
    ``kernels.relu_dropout`` carry it (backward recomputes the mask from its seed)."""
    x = torch.randn(4, 50, requires_grad=True)
    with pytest.raises(ValueError, match="requires grad"):
        dropout_kernel.apply(x, 0.5, 1)
    torch.manual_seed(0)
    y = kernels.dropout(x, 0.5)
    torch.manual_seed(0)
    keep = dropout_kernel.keep_mask(x.shape, 0.5, dropout_kernel.draw_seed())
    y.backward(torch.ones_like(y))
    assert y.requires_grad and torch.equal(x.grad, keep * 2.0)
    x.grad = None
    torch.manual_seed(0)
    kernels.relu_dropout(x, FastDropout(0.5)).backward(torch.ones_like(x))
    assert torch.equal(x.grad, (keep & (x > 0)) * 2.0)
