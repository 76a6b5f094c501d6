"""The model the chapters teach is plain PyTorch, its listings are the lesson, and it runs on any device.

- The model's modules import only the standard library, ``torch`` and each other, and the
  package holds no C, no ctypes and no private PyTorch name: its speed is PyTorch's own.
- Every object a chapter shows with ``literalinclude`` is short and runs when pasted into a
  fresh notebook that has ``import math, torch``, ``from torch import nn``,
  ``import torch.nn.functional as F`` and ``from transformer_book import *``: the test pastes
  it into exactly that namespace and runs its example, which checks shapes and values against
  a reference that is not the listing's own source (PyTorch's modules and functions with the
  same weights, the paper's formulas, literal tensors). Every listing has one example, and
  every example a listing.
- A forward pass, the loss and the backward pass run with model and inputs on the ``meta``
  device: a tensor created without the input's device (the usual bug that only a GPU shows)
  would land on the CPU and fail there.
"""

from __future__ import annotations

import ast
import copy
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import tomllib
import torch
import torch.nn.functional as F
from listings import ROOT, Listing, listings
from test_parity import TOL
from torch import nn

import transformer_book as tb
from transformer_book.book.parity import to_pytorch

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
ALLOWED |= {"warnings", "numbers", "operator"}  # checks.py: a warning, ids and real numbers
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


def small_model(seed: int = 0, **overrides) -> tb.Transformer:
    tb.seed_everything(seed)
    return tb.make_model(tb.ModelConfig.small(11, dropout=0.0, **overrides)).eval()


# Each listing's example: one function per listing id, which gets the namespace the listing was
# pasted into and checks what the pasted code computes against a reference that is not its own
# source (PyTorch's modules and functions, the paper's formulas, literal tensors). Against PyTorch's
# modules the tolerance is test_parity's TOL (1e-5): their kernels sum in another order, in float32.
Example = Callable[[dict], None]
EXAMPLES: dict[str, Example] = {}


def example(listing_id: str) -> Callable[[Example], Example]:
    """Register the function below as the example of ``listing_id``."""

    def register(function: Example) -> Example:
        assert listing_id not in EXAMPLES, f"two examples for {listing_id}"
        EXAMPLES[listing_id] = function
        return function

    return register


TOKENS = torch.tensor([[3, 4, 5, 0, 0], [6, 7, 8, 9, 10]])  # id 0 pads the end of row 0
REAL = (TOKENS != 0)[:, None, :]  # the book's padding mask, (batch, 1, seq), True = may attend
PADDED = TOKENS == 0  # PyTorch's key_padding_mask: True = ignore


def blocked_future(size: int) -> torch.Tensor:
    """PyTorch's causal ``attn_mask`` (True = blocked): everything above the diagonal."""
    return torch.ones(size, size, dtype=torch.bool).triu(1)


def paper_sinusoid(length: int, d_model: int) -> torch.Tensor:
    """PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos(p / 10000^(2i/d)), in float64, then float32."""
    angle = [[p / 10000 ** (2 * (j // 2) / d_model) for j in range(d_model)] for p in range(length)]
    return torch.tensor([[(math.sin, math.cos)[j % 2](a) for j, a in enumerate(row)] for row in angle])


def embedded(embedding: tb.TokenEmbedding, ids: torch.Tensor) -> torch.Tensor:
    """The model's input written out: the table's rows times sqrt(64) = 8, plus the sinusoids."""
    return embedding.weight[ids] * 8.0 + paper_sinusoid(ids.shape[1], 64)


@example("embedding.TokenEmbedding")
def token_embedding_is_nn_embedding_times_sqrt_d_model(ns):
    table = nn.Embedding(11, 64, padding_idx=0)
    embedding = ns["TokenEmbedding"](11, 64, padding_idx=0)
    embedding.load_state_dict({"lookup.weight": table.weight})
    out = embedding(TOKENS)
    assert out.shape == (2, 5, 64)
    assert torch.equal(out, table(TOKENS) * 8.0)  # sqrt(64) = 8, a power of two: exact
    assert not out[0, 3:].any()  # the padding rows stay zero


@example("positional.sinusoidal_positional_encoding")
def sinusoids_are_the_papers_formula(ns):
    table = ns["sinusoidal_positional_encoding"](50, 16)
    assert table.shape == (50, 16) and table.dtype == torch.float32
    # Both round a float64 value to float32: at most one float32 step (6e-8 here) apart.
    torch.testing.assert_close(table, paper_sinusoid(50, 16), rtol=0, atol=1e-7)
    sines_first = ns["sinusoidal_positional_encoding"](50, 16, interleaved=False)
    assert torch.equal(sines_first, torch.cat([table[:, 0::2], table[:, 1::2]], dim=1))


@example("attention.scaled_dot_product_attention")
def attention_is_pytorchs_fused_attention(ns):
    query, key, value = torch.randn(2, 4, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 5)
    mask = torch.rand(2, 4, 6) > 0.3
    mask[0, 1] = False  # a query that may see no key
    out, weights = ns["scaled_dot_product_attention"](query, key, value, mask)
    assert out.shape == (2, 4, 5) and weights.shape == (2, 4, 6)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(query, key, value, attn_mask=mask), **TOL)
    # PyTorch's weights: attending over the identity matrix as values returns them, row by row.
    identity = torch.eye(6).expand(2, 6, 6)
    torch.testing.assert_close(weights, F.scaled_dot_product_attention(query, key, identity, attn_mask=mask), **TOL)
    assert not weights[0, 1].any() and not out[0, 1].any()  # no key to see: zeros, not NaN (as PyTorch)


TWO_HEADS_OF_FOUR = torch.tensor([[[[0.0, 1, 2, 3], [8, 9, 10, 11]], [[4, 5, 6, 7], [12, 13, 14, 15]]]])


@example("attention.MultiHeadAttention.split_heads")
def split_heads_gives_each_head_its_columns(ns):
    x = torch.arange(16.0).view(1, 2, 8)  # 1 sequence, 2 positions, 8 features
    heads = ns["split_heads"](tb.MultiHeadAttention(8, 2), x)
    assert torch.equal(heads, TWO_HEADS_OF_FOUR)  # (1, 2 heads, 2 positions, 4): head 0 holds columns 0-3


@example("attention.MultiHeadAttention.merge_heads")
def merge_heads_puts_the_heads_side_by_side(ns):
    merged = ns["merge_heads"](tb.MultiHeadAttention(8, 2), TWO_HEADS_OF_FOUR)
    assert torch.equal(merged, torch.arange(16.0).view(1, 2, 8))


@example("attention.MultiHeadAttention.keys_values")
def keys_values_are_the_projections_split_and_cached(ns):
    attention, x = tb.MultiHeadAttention(64, 4), torch.randn(2, 5, 64)
    keys_values = ns["keys_values"]
    project = lambda linear, h: torch.stack(F.linear(h, linear.weight, linear.bias).chunk(4, dim=-1), dim=1)
    key, value = keys_values(attention, x, 2 * x)
    assert key.shape == value.shape == (2, 4, 5, 16)
    torch.testing.assert_close(key, project(attention.k_proj, x), **TOL)
    torch.testing.assert_close(value, project(attention.v_proj, 2 * x), **TOL)
    cache = tb.KVCache.allocate((2, 4, 8, 16), x, torch.tensor(4))  # decoding: 3 new positions at slots 4, 5, 6
    key, value = keys_values(attention, x[:, :3], 2 * x[:, :3], cache)
    assert key is cache.key and value is cache.value  # the whole buffers come back
    torch.testing.assert_close(value[:, :, 4:7], project(attention.v_proj, 2 * x[:, :3]), **TOL)
    assert not key[:, :, :4].any() and not key[:, :, 7:].any()  # the other slots are untouched
    cross = tb.KVCache(key, value)  # no position: cross-attention's, read, not recomputed
    assert keys_values(attention, x, x, cross)[0] is cache.key


@example("attention.MultiHeadAttention.forward")
def multi_head_attention_is_nn_multihead_attention(ns):
    attention = tb.MultiHeadAttention(64, 4).eval()
    theirs = to_pytorch(attention).eval()  # nn.MultiheadAttention holding the same weights
    query, memory = torch.randn(2, 3, 64), torch.randn(2, 5, 64)
    out, weights = ns["forward"](attention, query, memory, memory, REAL, need_weights=True)
    want, want_weights = theirs(query, memory, memory, key_padding_mask=PADDED, average_attn_weights=False)
    assert out.shape == (2, 3, 64) and weights.shape == (2, 4, 3, 5)
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(weights, want_weights, **TOL)
    fused, no_weights = ns["forward"](attention, query, memory, memory, REAL)  # PyTorch's fused kernel
    assert no_weights is None
    torch.testing.assert_close(fused, want, **TOL)
    causal = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    out, _ = ns["forward"](attention, memory, memory, memory, causal.bool())
    torch.testing.assert_close(out, theirs(memory, memory, memory, attn_mask=blocked_future(5))[0], **TOL)


@example("masking.padding_mask")
def padding_mask_hides_the_padding_ids(ns):
    mask = ns["padding_mask"](TOKENS)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, torch.tensor([[[1, 1, 1, 0, 0]], [[1, 1, 1, 1, 1]]]).bool())
    assert torch.equal(
        ns["padding_mask"](TOKENS, pad_id=4), torch.tensor([[[1, 0, 1, 1, 1]], [[1, 1, 1, 1, 1]]]).bool()
    )


@example("masking.causal_mask")
def causal_mask_is_the_lower_triangle(ns):
    mask = ns["causal_mask"](4)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]]).bool())


@example("masking.target_mask")
def target_mask_hides_the_future_and_the_padding(ns):
    mask = ns["target_mask"](torch.tensor([[5, 6, 0], [7, 8, 9]]))
    want = [[[1, 0, 0], [1, 1, 0], [1, 1, 0]], [[1, 0, 0], [1, 1, 0], [1, 1, 1]]]
    assert mask.dtype == torch.bool and torch.equal(mask, torch.tensor(want).bool())


@example("layers.sublayer_connection")
def sublayer_connection_is_post_norm_or_pre_norm(ns):
    x = torch.tensor([1.0, 2.0])
    sublayer, norm, dropout = (lambda h: 2 * h), (lambda h: h + 100), (lambda h: -h)  # stand-ins: the order shows
    post = ns["sublayer_connection"](x, sublayer, norm, dropout, False)
    assert torch.equal(post, torch.tensor([99.0, 98.0]))  # norm(x + dropout(sublayer(x))) = (x - 2x) + 100
    pre = ns["sublayer_connection"](x, sublayer, norm, dropout, True)
    assert torch.equal(pre, torch.tensor([-201.0, -202.0]))  # x + dropout(sublayer(norm(x))) = x - 2(x + 100)


@example("encoder.EncoderLayer")
def encoder_layer_is_nn_transformer_encoder_layer(ns):
    for norm_first in (False, True):
        package = tb.EncoderLayer(64, 4, 128, dropout=0.1, norm_first=norm_first).eval()
        layer = ns["EncoderLayer"](64, 4, 128, dropout=0.1, norm_first=norm_first).eval()
        layer.load_state_dict(package.state_dict())  # the weights to_pytorch copies into PyTorch's layer
        x = torch.randn(2, 5, 64)
        out = layer(x, REAL)
        assert out.shape == (2, 5, 64)
        torch.testing.assert_close(out, to_pytorch(package).eval()(x, src_key_padding_mask=PADDED), **TOL)


@example("decoder.DecoderLayer.forward")
def decoder_layer_is_nn_transformer_decoder_layer_cached_or_not(ns):
    for norm_first in (False, True):
        layer = tb.DecoderLayer(64, 4, 128, dropout=0.1, norm_first=norm_first).eval()
        x, memory, causal = torch.randn(2, 4, 64), torch.randn(2, 5, 64), ~blocked_future(4)
        want = to_pytorch(layer).eval()(x, memory, tgt_mask=blocked_future(4), memory_key_padding_mask=PADDED)
        out = ns["forward"](layer, x, memory, src_mask=REAL, tgt_mask=causal[None])
        assert out.shape == (2, 4, 64)
        torch.testing.assert_close(out, want, **TOL)
        cross = tb.KVCache(*layer.cross_attn.keys_values(memory, memory))
        position = torch.tensor(0)
        cache = tb.LayerCache(tb.KVCache.allocate((2, 4, 4, 16), x, position), cross)
        for t in range(4):  # one position at a time: row t of the causal mask is the cache's slot mask
            row = causal[None, t : t + 1]
            step = ns["forward"](layer, x[:, t : t + 1], memory, src_mask=REAL, tgt_mask=row, cache=cache)
            torch.testing.assert_close(step, want[:, t : t + 1], **TOL)
            position += 1  # what Transformer.decode does after every layer has written


@example("model.Transformer.__init__")
def transformer_init_builds_the_packages_parameters(ns):
    # Structural: no reference builds this model (nn.Transformer has no embeddings and no output layer).
    source = next(listing for listing in LISTINGS if listing.id == "model.Transformer.__init__").source()
    body = "".join("    " + line + "\n" for line in source.splitlines())
    exec("class Pasted(nn.Module):\n" + body, ns)
    for share in (False, True):
        model = small_model(share_embeddings=share)
        pasted = ns["Pasted"](model.config)
        assert {k: v.shape for k, v in pasted.state_dict().items()} == {
            k: v.shape for k, v in model.state_dict().items()
        }
        pasted.load_state_dict(model.state_dict(), strict=True)
        assert tb.count_parameters(pasted) == tb.count_parameters(model)
        assert (pasted.generator.weight is pasted.src_embed.weight) == share


@example("model.Transformer.encode")
def encode_is_pytorchs_encoder_on_the_embedded_source(ns):
    for norm_first in (False, True):
        model = small_model(norm_first=norm_first)
        memory = ns["encode"](model, TOKENS)
        want = to_pytorch(model.encoder).eval()(embedded(model.src_embed, TOKENS), src_key_padding_mask=PADDED)
        assert memory.shape == (2, 5, 64)
        torch.testing.assert_close(memory, want, **TOL)


@example("model.Transformer.forward")
def forward_is_nn_transformer_between_the_embeddings_and_the_output_layer(ns):
    for norm_first in (False, True):
        model = small_model(norm_first=norm_first)
        tgt = torch.tensor([[1, 5, 6, 0], [1, 7, 8, 9]])
        logits = ns["forward"](model, TOKENS, tgt)
        hidden = to_pytorch(model).eval()(
            embedded(model.src_embed, TOKENS),
            embedded(model.tgt_embed, tgt),
            tgt_mask=blocked_future(4),
            src_key_padding_mask=PADDED,
            tgt_key_padding_mask=tgt == 0,
            memory_key_padding_mask=PADDED,
        )
        assert logits.shape == (2, 4, 11)
        torch.testing.assert_close(logits, model.generator(hidden), **TOL)


@example("training.noam_optimizer")
def noam_optimizer_is_the_papers_adam_and_rate(ns):
    model = small_model()
    optimizer, schedule = ns["noam_optimizer"](model, 64, 2)
    group = optimizer.param_groups[0]
    assert isinstance(optimizer, torch.optim.Adam) and group["betas"] == (0.9, 0.98) and group["eps"] == 1e-9
    assert len(group["params"]) == len(list(model.parameters()))
    # d_model^-0.5 · min(step^-0.5, step · warmup^-1.5), d_model 64 and warm-up 2: updates 1 to 4.
    for rate in (0.125 * 1 * 2**-1.5, 0.125 * 2 * 2**-1.5, 0.125 * 3**-0.5, 0.125 * 4**-0.5):
        assert math.isclose(group["lr"], rate)
        optimizer.step()  # no gradients: moves nothing, but lets the schedule step
        schedule.step()


@example("training.train_step")
def train_step_is_forward_loss_backward_update(ns):
    model, batch = small_model(), tb.CopyTask(vocab_size=11, length=5).train_batch(4)
    reference = copy.deepcopy(model).train()  # dropout 0: the step is deterministic
    loss_fn = lambda logits, target: F.cross_entropy(logits.flatten(0, 1), target.flatten())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 1 / (done + 1))  # 0.5, then 0.25
    loss, rate = ns["train_step"](model, batch, loss_fn, optimizer, schedule)
    # The step written out: the teacher-forced forward, the loss, its gradients, w ← w - 0.5 · grad
    # (the same operations in the same order: float32's default tolerance).
    want = loss_fn(reference(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask), batch.tgt_out)
    want.backward()
    assert model.training and loss.shape == () and not loss.requires_grad
    torch.testing.assert_close(loss, want.detach())
    assert rate == 0.5 and optimizer.param_groups[0]["lr"] == 0.25
    for updated, original in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(updated, original - 0.5 * original.grad)


@example("training.LabelSmoothingLoss")
def label_smoothing_is_pytorchs_cross_entropy_over_the_real_tokens(ns):
    logits, target = torch.randn(2, 5, 11), TOKENS
    plain = ns["LabelSmoothingLoss"](11, 0.0, 0)(logits, target)  # smoothing 0: cross-entropy, padding ignored
    torch.testing.assert_close(plain, F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=0))
    # The package spreads `smoothing` over the V - 2 wrong real ids (not the target, not padding id 0);
    # PyTorch's label_smoothing ε over all its C classes. They agree when padding has no probability
    # (logit -1e4: exp underflows to 0) and PyTorch sees the C = V - 1 real ids with ε = 0.1 · 10 / 9,
    # so that every wrong id gets ε / C = 0.1 / 9 and the target 1 - ε + ε / C = 0.9. Ids shift down
    # by one, padding to -1, ignored. Float32 sums in another order: the default tolerance (1.3e-6).
    logits[..., 0] = -1e4
    smoothed = ns["LabelSmoothingLoss"](11, 0.1, 0)(logits, target)
    real_logits, real_target, epsilon = logits[..., 1:].flatten(0, 1), target.flatten() - 1, 0.1 * 10 / 9
    want = F.cross_entropy(real_logits, real_target, ignore_index=-1, label_smoothing=epsilon)
    assert smoothed.shape == ()
    torch.testing.assert_close(smoothed, want)


@example("training.noam_rate")
def noam_rate_is_the_papers_formula(ns):
    rate = ns["noam_rate"]
    assert math.isclose(rate(4000, 512, 4000), 512**-0.5 * 4000**-0.5)  # the peak, at the end of warm-up
    assert math.isclose(rate(4000, 512, 4000), 6.987712429686843e-4)  # 1 / sqrt(512 · 4000)
    assert math.isclose(rate(1, 512, 4000), 512**-0.5 * 1 * 4000**-1.5)  # warm-up: linear in the step
    assert rate(0, 512, 4000) == rate(1, 512, 4000)  # step 0 counts as step 1
    assert math.isclose(rate(16000, 512, 4000), 512**-0.5 * 16000**-0.5)  # then 1/sqrt(step): half the peak
    assert math.isclose(rate(2000, 512, 4000, factor=2.0, total_steps=8000), 2 * 512**-0.5 * 2000 * 4000**-1.5 * 0.75)


@example("inference.greedy_decode")
def greedy_decode_takes_the_argmax_of_the_models_forward_step_by_step(ns):
    model = small_model(seed=3)  # seed 3: a model whose two rows emit EOS (2) at different steps
    ys, done = torch.ones(2, 1, dtype=torch.long), torch.zeros(2, dtype=torch.bool)
    while ys.shape[1] < 8 and not done.all():  # the whole forward on the prefix; padding after EOS
        token = model(TOKENS, ys)[:, -1].argmax(-1).masked_fill(done, 0)
        ys, done = torch.cat([ys, token[:, None]], dim=1), done | (token == 2)
    assert ys.shape[1] < 8 and done.all(), f"the example should stop at EOS: pick another seed, got {ys}"
    for use_cache in (True, False):
        assert torch.equal(ns["greedy_decode"](model, TOKENS, 8, 1, 2, use_cache=use_cache), ys)


@example("book.export.DecoderGraph.forward")
def decoder_graph_is_pytorchs_decoder_on_the_embedded_prefix(ns):
    model = small_model()
    memory, tgt = torch.randn(2, 5, 64), torch.tensor([[1, 4, 5, 0, 0, 0], [1, 6, 7, 8, 9, 10]])
    logits, weights = ns["forward"](tb.DecoderGraph(model, 6).eval(), memory, TOKENS, tgt)
    # Causal mask only: the padding at the end of row 0 is seen by no earlier position.
    hidden = to_pytorch(model.decoder).eval()(
        embedded(model.tgt_embed, tgt), memory, tgt_mask=blocked_future(6), memory_key_padding_mask=PADDED
    )
    assert logits.shape == (2, 6, 11)
    torch.testing.assert_close(logits, model.generator(hidden), **TOL)
    # PyTorch's layer does not return its weights: they are distributions over the real source words.
    assert weights.shape == (2, 4, 6, 5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 6))
    assert not weights[0, :, :, 3:].any()


@pytest.mark.parametrize("listing", LISTINGS, ids=[listing.id for listing in LISTINGS])
def test_listing_runs_when_pasted_into_a_fresh_notebook(listing: Listing):
    if listing.id not in EXAMPLES:
        pytest.fail(f"{listing.notebook} shows {listing.id}, which has no example: add one with @example")
    namespace = pasted(listing)
    tb.seed_everything(0)
    EXAMPLES[listing.id](namespace)


def test_every_example_has_a_listing():
    stale = sorted(set(EXAMPLES) - {listing.id for listing in LISTINGS})
    assert not stale, f"examples for listings no chapter shows: {stale}"


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
