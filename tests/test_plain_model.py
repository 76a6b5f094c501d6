"""The model the chapters teach is plain PyTorch, its listings are the lesson, and it runs on any device.

- The model's modules import only the standard library, ``torch`` and each other, and the
  package holds no C, no ctypes and no private PyTorch name: its speed is PyTorch's own.
- Every object a chapter shows with ``literalinclude`` is short and runs when pasted into a
  fresh notebook that has ``import math, torch``, ``from torch import nn``,
  ``import torch.nn.functional as F`` and ``from transformer_book import *``: the test pastes
  it into exactly that namespace and runs it on its chapter's example, against the package.
- A forward pass, the loss and the backward pass run with model and inputs on the ``meta``
  device: a tensor created without the input's device (the usual bug that only a GPU shows)
  would land on the CPU and fail there.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import tomllib
import torch
from listings import ROOT, Listing, listings
from torch import nn

import transformer_book as tb

PACKAGE = Path(tb.__file__).parent
MODEL_MODULES = [
    "checks",
    "embedding",
    "positional",
    "attention",
    "masking",
    "layers",
    "encoder",
    "decoder",
    "model",
    "inference",
    "training",
]
ALLOWED = {"__future__", "math", "copy", "collections", "contextlib", "dataclasses", "itertools", "torch", "typing"}
LISTINGS = listings()


def imports_of(module: str) -> set[str]:
    """Top-level names imported by ``module`` (relative imports as ``.name``)."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add("." * node.level + (node.module or ""))
    return found


LESSON = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("module", LESSON)
def test_no_lesson_module_imports_the_books_support_or_the_tools(module):
    """The three rooms: the lesson (this folder), the book's support (``book/``) and the tools
    (``tools/``). The support and the tools import the lesson, never the other way round."""
    for name in imports_of(module):
        parts = name.lstrip(".").split(".")
        inside = name.startswith(".") or parts[0] == "transformer_book"
        assert not (inside and {"book", "tools"} & set(parts)), f"{module}.py imports {name}"


@pytest.mark.parametrize("module", MODEL_MODULES)
def test_model_modules_import_plain_pytorch_and_each_other(module):
    for name in imports_of(module):
        if name.startswith("."):
            assert name[1:] in MODEL_MODULES + ["data", "progress"], f"{module}.py imports {name}: not a model module"
        else:
            top = name.split(".")[0]
            allowed = ALLOWED | ({"tqdm", "sys", "time"} if module == "training" else set())
            assert top in allowed, f"{module}.py imports {name}"
            private = [part for part in name.split(".") if part.startswith("_") and not part.startswith("__")]
            assert not private, f"{module}.py imports a private module {name}"


def dotted(node: ast.AST) -> str:
    """``torch.nn.functional`` for the attribute chain ``node``, or "" if it is not a plain chain."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def test_the_package_holds_no_c_no_ctypes_and_no_private_pytorch_name():
    sources = sorted(p for p in PACKAGE.rglob("*") if p.suffix in {".c", ".h", ".cc", ".cpp", ".so"})
    assert not sources, sources
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{alias.name}" for alias in node.names] if node.level == 0 else []
            else:
                names = [dotted(node)] if isinstance(node, ast.Attribute) else []
            for name in names:
                parts = name.split(".")
                assert parts[0] != "ctypes", f"{path.name}:{node.lineno}: {name}"
                private = [p for p in parts if p.startswith("_") and not p.startswith("__")]
                assert parts[0] != "torch" or not private, f"{path.name}:{node.lineno}: {name}"


def test_the_chapters_show_listings():
    assert len(LISTINGS) >= 18, LISTINGS
    assert {listing.notebook[:2] for listing in LISTINGS} >= {f"{n:02d}" for n in range(1, 10)}


@pytest.mark.parametrize("listing", LISTINGS, ids=[listing.id for listing in LISTINGS])
def test_listing_is_short_and_uses_no_private_name(listing: Listing):
    lines = listing.source().splitlines()
    limit = 25 if listing.name == "MultiHeadAttention.forward" else 30
    assert len(lines) <= limit, f"{listing.id} is {len(lines)} lines, more than {limit}"
    # The page's code column holds the chapters' line length (tests/test_book.py measures it).
    settings = tomllib.loads((ROOT / "chapters" / "ruff.toml").read_text())
    width = settings["lint"]["pycodestyle"]["max-line-length"]
    wide = [line for line in lines if len(line) > width]
    assert not wide, f"{listing.id} has lines wider than the code column ({width}): {wide}"
    tree = ast.parse(listing.source())
    private = {
        node.id if isinstance(node, ast.Name) else node.attr
        for node in ast.walk(tree)
        if isinstance(node, (ast.Name, ast.Attribute))
    }
    private = {name for name in private if name.startswith("_") and name != "_" and not name.startswith("__")}
    assert not private, f"{listing.id} uses private names {private}"


def fresh_namespace() -> dict:
    """What a reader's notebook has: the four imports the chapters name."""
    namespace: dict = {}
    exec(
        "import math, torch\nfrom torch import nn\nimport torch.nn.functional as F\nfrom transformer_book import *\n",
        namespace,
    )
    return namespace


def pasted(listing: Listing) -> dict:
    namespace = fresh_namespace()
    exec(compile(listing.source(), f"<{listing.id}>", "exec"), namespace)
    return namespace


def small_model(**overrides) -> tb.Transformer:
    tb.seed_everything(0)
    return tb.make_model(tb.ModelConfig.small(11, dropout=0.0, **overrides)).eval()


def run_listing(listing: Listing) -> None:
    """Paste ``listing`` and run it on its chapter's example, checking it against the package."""
    ns = pasted(listing)
    name = listing.name.split(".")[-1]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 64, generator=generator)
    tokens = torch.tensor([[3, 4, 5, 0, 0], [6, 7, 8, 9, 10]])
    if listing.id == "embedding.TokenEmbedding":
        ours, theirs = ns["TokenEmbedding"](11, 64), tb.TokenEmbedding(11, 64)
        ours.load_state_dict(theirs.state_dict())
        torch.testing.assert_close(ours(tokens), theirs(tokens))
    elif listing.id == "positional.sinusoidal_positional_encoding":
        torch.testing.assert_close(ns[name](50, 16), tb.sinusoidal_positional_encoding(50, 16))
    elif listing.id == "attention.scaled_dot_product_attention":
        q, k, v = torch.randn(3, 2, 4, 8, generator=generator).unbind(0)
        mask = torch.rand(2, 4, 4, generator=generator) > 0.3
        for got, want in zip(ns[name](q, k, v, mask), tb.scaled_dot_product_attention(q, k, v, mask)):
            torch.testing.assert_close(got, want)
    elif listing.name.startswith("MultiHeadAttention."):
        attention = tb.MultiHeadAttention(64, 4).eval()
        mask = tb.padding_mask(tokens)
        if name == "split_heads":
            torch.testing.assert_close(ns[name](attention, x), attention.split_heads(x))
        elif name == "merge_heads":
            heads = attention.split_heads(x)
            torch.testing.assert_close(ns[name](attention, heads), attention.merge_heads(heads))
        elif name == "keys_values":  # without a cache, and writing into one at a position
            for got, want in zip(ns[name](attention, x, x), attention.keys_values(x, x)):
                torch.testing.assert_close(got, want)
            ours, theirs = (tb.KVCache.allocate(2, 4, 8, 16, like=x) for _ in range(2))
            position = torch.tensor(3)
            for got, want in zip(
                ns[name](attention, x, x, ours, position), attention.keys_values(x, x, theirs, position)
            ):
                torch.testing.assert_close(got, want)
        else:
            got = ns[name](attention, x, x, x, mask, need_weights=True)
            want = attention(x, x, x, mask, need_weights=True)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b)
    elif listing.module == "masking":
        arguments = (5,) if name == "causal_mask" else (tokens,)
        assert torch.equal(ns[name](*arguments), getattr(tb, name)(*arguments))
    elif listing.id == "layers.sublayer_connection":
        norm, linear = nn.LayerNorm(64), nn.Linear(64, 64)
        for norm_first in (False, True):
            got = ns[name](x, linear, norm, nn.Identity(), norm_first)
            torch.testing.assert_close(got, tb.sublayer_connection(x, linear, norm, nn.Identity(), norm_first))
    elif listing.id == "encoder.EncoderLayer":
        theirs = tb.EncoderLayer(64, 4, 128, dropout=0.0).eval()
        ours = ns["EncoderLayer"](64, 4, 128, dropout=0.0).eval()
        ours.load_state_dict(theirs.state_dict())
        torch.testing.assert_close(ours(x, tb.padding_mask(tokens)), theirs(x, tb.padding_mask(tokens)))
    elif listing.id == "decoder.DecoderLayer.forward":
        layer = tb.DecoderLayer(64, 4, 128, dropout=0.0).eval()
        memory, causal = torch.randn(2, 7, 64, generator=generator), tb.causal_mask(5)
        got = ns[name](layer, x, memory, tgt_mask=causal)
        torch.testing.assert_close(got, layer(x, memory, tgt_mask=causal))
    elif listing.name.startswith("Transformer."):
        model = small_model()
        if name == "__init__":  # pasted into a class of the reader's own, as a reader would
            body = "".join("    " + line + "\n" for line in listing.source().splitlines())
            exec("class Pasted(nn.Module):\n" + body, ns)
            pasted_model = ns["Pasted"](model.config)
            assert {k: v.shape for k, v in pasted_model.state_dict().items()} == {
                k: v.shape for k, v in model.state_dict().items()
            }
            pasted_model.load_state_dict(model.state_dict(), strict=True)
        elif name == "encode":
            torch.testing.assert_close(ns[name](model, tokens), model.encode(tokens))
        else:
            torch.testing.assert_close(ns[name](model, tokens, tokens), model(tokens, tokens))
    elif listing.id == "training.LabelSmoothingLoss":
        logits, target = torch.randn(2, 5, 11, generator=generator), tokens
        ours, theirs = ns["LabelSmoothingLoss"](11, 0.1, 0), tb.LabelSmoothingLoss(11, 0.1, 0)
        torch.testing.assert_close(ours(logits, target), theirs(logits, target))
    elif listing.id == "training.noam_rate":
        for step in (1, 10, 4000, 10_000):
            assert math.isclose(ns[name](step, 512, 4000), tb.noam_rate(step, 512, 4000))
    elif listing.id == "training.noam_optimizer":
        optimizer, schedule = ns[name](small_model(), 64, 100)
        assert optimizer.param_groups[0]["betas"] == (0.9, 0.98)
        assert math.isclose(schedule.get_last_lr()[0], tb.noam_rate(1, 64, 100))
    elif listing.id == "training.train_step":
        task = tb.CopyTask(vocab_size=11, length=5)
        model = small_model()
        optimizer, _ = tb.noam_optimizer(model, 64, 100)
        loss, rate = ns[name](model, task.train_batch(4), tb.LabelSmoothingLoss(11), optimizer)
        assert loss.dim() == 0 and math.isfinite(loss.item()) and rate > 0
    elif listing.id == "inference.greedy_decode":
        model = small_model()
        assert torch.equal(ns[name](model, tokens, 8, 1, 2), tb.greedy_decode(model, tokens, 8, 1, 2))
        assert torch.equal(ns[name](model, tokens, 8, 1, 2, use_cache=False), tb.greedy_decode(model, tokens, 8, 1, 2))
    elif listing.id == "export.DecoderGraph.forward":
        model, src = small_model(), tokens
        graph = tb.DecoderGraph(model, 6).eval()
        memory = model.encode(src)
        tgt = torch.tensor([[1, 4, 5], [1, 6, 0]])
        for got, want in zip(ns[name](graph, memory, src, tgt), graph(memory, src, tgt)):
            torch.testing.assert_close(got, want)
    else:
        pytest.fail(f"no example for the listing {listing.id}: add one here")


@pytest.mark.parametrize("listing", LISTINGS, ids=[listing.id for listing in LISTINGS])
def test_listing_runs_when_pasted_into_a_fresh_notebook(listing: Listing):
    run_listing(listing)


@pytest.mark.parametrize("norm_first", [False, True])
def test_forward_loss_and_backward_run_on_the_meta_device(norm_first):
    """Every tensor the model makes follows its input's device: on ``meta`` one made on the CPU
    by default would meet a meta tensor and fail."""
    model = tb.make_model(tb.ModelConfig.small(11, norm_first=norm_first)).to("meta").train()
    src = torch.randint(1, 11, (2, 7)).to("meta")
    tgt = torch.randint(1, 11, (2, 6)).to("meta")
    logits = model(src, tgt[:, :-1])
    assert logits.device.type == "meta" and logits.shape == (2, 5, 11)
    loss = tb.LabelSmoothingLoss(11)(logits, tgt[:, 1:])
    loss.backward()
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in model.parameters())
    with tb.record_attention(model) as maps:
        model.eval()(src, tgt)
    assert all(w.device.type == "meta" for w in maps.values()) and len(maps) == 6
    memory = model.encode(src)
    cache = model.decoder.new_cache(memory, capacity=3)
    for position in range(3):  # cached decoding steps: the cache is written on the meta device too
        hidden = model.decode(memory, tgt[:, position : position + 1], src_mask=tb.padding_mask(src), cache=cache)
    assert hidden.device.type == "meta" and cache.position.device.type == "meta"
    assert cache.layers[0].self_attn.key.device.type == "meta"
