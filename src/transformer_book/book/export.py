"""Chapter 10: the trained dates model as two ONNX graphs, for onnxruntime and the reader's browser.

ONNX is a file format for computation graphs: operators (``MatMul``, ``Softmax``, ...)
wired together, with the weights stored alongside. ``torch.onnx.export`` traces the
model with ``torch.export`` and writes that graph; any ONNX runtime can then run it
without PyTorch (onnxruntime in Python, onnxruntime-web in a browser).

Two graphs, as chapter 9's decoding loop splits the work:

- :class:`EncoderGraph`: ``src (1, src_len)`` source ids, padded → ``memory (1, src_len, d_model)``;
- :class:`DecoderGraph`: ``memory``, ``src`` and a target prefix ``tgt (1, decoder_len)``
  padded at the end → ``logits (1, decoder_len, tgt_vocab)`` and the **cross-attention
  weights of the last decoder layer** ``(1, heads, decoder_len, src_len)``.

The shapes are fixed: a source shorter than ``src_len`` is padded (the padding mask
hides it, as in every training batch) and the decoder always reads ``decoder_len``
positions, of which the causal mask lets position ``t`` see only the first ``t + 1``;
the logits of position ``t`` are the prediction after ``t + 1`` tokens, whatever
follows. Fixed shapes make the export quick and the graph simple.

:func:`export_onnx` writes both graphs and ``tokenizer.json`` (the vocabularies, ids and
word-splitting rule the page uses); :func:`onnx_greedy_decode` runs the exported graphs
with onnxruntime exactly as the page does, for the checks against PyTorch.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import math
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from ..attention import record_attention
from ..data import WORD_SEPARATORS, DateTask, date_to_french
from ..masking import causal_mask, padding_mask
from ..model import Transformer
from ..recipes import TrainedModel

# The word-splitting rule of data.split_words, as a regular expression the page can use too
# (tests/test_export.py checks that both split every date, and odd spacing, the same way).

ENCODER_FILE, DECODER_FILE, TOKENIZER_FILE = (
    "encoder.onnx",
    "decoder.onnx",
    "tokenizer.json",
)
# The two graphs together may weigh this much: the page downloads them when the reader starts it.
MAX_MODEL_BYTES = 1_000_000
# A folder named here keeps each export, keyed by everything it depends on, and a later call
# for the same model copies it instead of tracing again: the test suite sets it, since the
# book build, chapter 10, its sections and tests/test_export.py all export the same model.
EXPORT_CACHE = "TRANSFORMER_BOOK_EXPORT_CACHE"


class EncoderGraph(nn.Module):
    """What ``Transformer.encode`` computes, in a form ``torch.export`` can trace.

    ``src (batch, src_len)`` → memory ``(batch, src_len, d_model)``. The model's own
    ``encode`` checks its ids against the vocabulary (a data-dependent test that an
    exported graph cannot contain); this wrapper leaves that to the caller and keeps only
    the ``src_len`` rows of the positional table it can use.
    """

    def __init__(self, model: Transformer, src_len: int) -> None:
        super().__init__()
        self.model = model
        self.register_buffer(
            "pe", model.positional.pe[:src_len].clone(), persistent=False
        )

    def forward(self, src: Tensor) -> Tensor:
        c = self.model.config
        src_mask = padding_mask(src, c.pad_id)  # (batch, 1, src_len): hide the padding
        x = (
            self.model.src_embed.lookup(src) * math.sqrt(c.d_model)
            + self.pe[: src.shape[1]]
        )
        return self.model.encoder(x, src_mask)


class DecoderGraph(nn.Module):
    """The decoder and generator on a whole target prefix, returning the last layer's cross-attention.

    ``memory (batch, src_len, d_model)``, ``src (batch, src_len)`` (for its padding mask)
    and ``tgt (batch, tgt_len)`` → logits ``(batch, tgt_len, tgt_vocab_size)`` and
    cross-attention weights ``(batch, heads, tgt_len, src_len)``. The target mask is causal
    only, as in ``greedy_decode(..., use_cache=False)``: positions after the prefix may hold
    anything, and no earlier position sees them.
    """

    def __init__(self, model: Transformer, tgt_len: int) -> None:
        super().__init__()
        self.model = model
        self.register_buffer(
            "pe", model.positional.pe[:tgt_len].clone(), persistent=False
        )

    def forward(
        self, memory: Tensor, src: Tensor, tgt: Tensor
    ) -> tuple[Tensor, Tensor]:
        c = self.model.config
        src_mask = padding_mask(src, c.pad_id)
        length = tgt.shape[1]
        causal = causal_mask(length, tgt.device)
        x = self.model.tgt_embed.lookup(tgt) * math.sqrt(c.d_model) + self.pe[:length]
        last = self.model.decoder.layers[-1]
        # The last layer's attentions keep their weights.
        with record_attention(last) as weights:
            hidden = self.model.decoder(x, memory, src_mask=src_mask, tgt_mask=causal)
        return self.model.generator(hidden), weights["cross_attn"]


@dataclass(frozen=True)
class OnnxExport:
    """The files :func:`export_onnx` wrote, and the tokenizer it wrote with them."""

    folder: Path
    encoder: Path
    decoder: Path
    tokenizer: Path
    spec: dict

    @property
    def model_bytes(self) -> int:
        """Size of the two graph files together (the weights are inside them)."""
        return self.encoder.stat().st_size + self.decoder.stat().st_size


def tokenizer_spec(trained: TrainedModel) -> dict:
    """Everything the page needs besides the graphs, taken from the task: one source of truth.

    Vocabularies (index = id), the special ids, the splitting rule, the graphs' fixed
    lengths, the model's sizes, where the weights came from, and a few held-out dates
    (the first of the task's held-out list) for the reader to try.
    """
    task: DateTask = trained.task
    config = trained.model.config
    return {
        "source_tokens": list(task.src_vocab.tokens),
        "target_tokens": list(task.tgt_vocab.tokens),
        "pad_id": task.pad_id,
        "bos_id": task.bos_id,
        "eos_id": task.eos_id,
        "source_split": WORD_SEPARATORS,  # the rule split_words uses
        "src_len": task.src_len,  # the most words a source may have (the longest date)
        "max_len": task.tgt_len,  # <bos> + 10 characters + <eos>, as greedy_decode is given
        "decoder_len": task.tgt_len - 1,  # the longest prefix the decoder reads
        "num_heads": config.num_heads,
        "num_layers": config.num_layers,
        "d_model": config.d_model,
        # The dates it was trained on span these years.
        "first_year": min(task.sources).year,
        "last_year": max(task.sources).year,
        "recipe": trained.recipe.task,
        "seed": trained.seed,
        "steps": trained.steps,
        "accuracy": trained.accuracy,
        # As a reader writes them:
        "examples": [date_to_french(d) for d in task.test_dates[:4]],
    }


@contextlib.contextmanager
def _quiet_exporter():
    """Silence what the exporter says about its own internals (not about the model)."""
    # It says "torchvision is not installed".
    registry = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registry.level
    registry.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=r".*LeafSpec.*is deprecated", category=FutureWarning
            )
            yield
    finally:
        registry.setLevel(level)


def _export_graph(
    module: nn.Module,
    args: tuple[Tensor, ...],
    inputs: list[str],
    outputs: list[str],
    path: Path,
):
    """``torch.onnx.export`` with fixed shapes, without the per-node source notes the exporter adds."""
    import onnx  # the book extra installs onnx, onnxscript and onnxruntime

    with _quiet_exporter():
        program = torch.onnx.export(
            module,
            args,
            input_names=inputs,
            output_names=outputs,
            dynamo=True,
            optimize=True,
            verbose=False,
        )
    proto = program.model_proto
    # The exporter annotates every node with the Python stack that made it: useful for
    # debugging, and a large part of the file for a model this small.
    for node in proto.graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
    del proto.graph.value_info[:]
    onnx.checker.check_model(proto)
    onnx.save(proto, path)


def export_onnx(trained: TrainedModel, folder: str | Path) -> OnnxExport:
    """Write ``encoder.onnx``, ``decoder.onnx`` and ``tokenizer.json`` for ``trained`` into ``folder``.

    The model is exported in evaluation mode, on the CPU, with fixed shapes
    ``src (1, src_len)`` and ``tgt (1, decoder_len)`` (see the module docstring).
    Takes a few seconds: ``torch.export`` traces each graph once (unless the folder
    that ``$TRANSFORMER_BOOK_EXPORT_CACHE`` names holds this very export).
    """
    if not isinstance(trained.task, DateTask):
        raise ValueError(
            f"export_onnx exports the dates model, got a {type(trained.task).__name__}"
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    spec = tokenizer_spec(trained)
    cached = _cached_export(trained, spec)
    if cached is not None and cached.is_dir():  # traced before, by this very code
        _copy_files(cached, folder)
        spec = json.loads((folder / TOKENIZER_FILE).read_text(encoding="utf-8"))
    else:
        _trace_into(trained, spec, folder)
        if cached is not None:  # whole or not at all: copy aside, then rename
            cached.parent.mkdir(parents=True, exist_ok=True)
            aside = Path(tempfile.mkdtemp(dir=cached.parent))
            _copy_files(folder, aside)
            try:
                aside.rename(cached)
            except OSError:  # another process has just cached it
                shutil.rmtree(aside)
    return OnnxExport(
        folder,
        folder / ENCODER_FILE,
        folder / DECODER_FILE,
        folder / TOKENIZER_FILE,
        spec,
    )


def _trace_into(trained: TrainedModel, spec: dict, folder: Path) -> None:
    """Export both graphs into ``folder``, then ``tokenizer.json`` with their sizes."""
    model = trained.model
    device, was_training = next(model.parameters()).device, model.training
    model.cpu().eval()
    try:
        # Example inputs fix the shapes; their values do not matter to the graph.
        src = torch.full((1, spec["src_len"]), spec["pad_id"], dtype=torch.long)
        src[0, 0] = spec["bos_id"]  # any id but padding: one source word
        tgt = torch.full((1, spec["decoder_len"]), spec["pad_id"], dtype=torch.long)
        tgt[0, 0] = spec["bos_id"]
        encoder = EncoderGraph(model, spec["src_len"]).eval()
        decoder = DecoderGraph(model, spec["decoder_len"]).eval()
        memory = encoder(src).detach()
        _export_graph(encoder, (src,), ["src"], ["memory"], folder / ENCODER_FILE)
        _export_graph(decoder, (memory, src, tgt), ["memory", "src", "tgt"], ["logits", "cross_attention"],
                      folder / DECODER_FILE)  # fmt: skip
    finally:
        model.to(device).train(was_training)
    for name in (ENCODER_FILE, DECODER_FILE):
        spec.setdefault("files", {})[name] = {
            "bytes": (folder / name).stat().st_size,
            "sha256": hashlib.sha256((folder / name).read_bytes()).hexdigest(),
        }
    (folder / TOKENIZER_FILE).write_text(
        json.dumps(spec, ensure_ascii=False, indent=1), encoding="utf-8"
    )


def _copy_files(source: Path, target: Path) -> None:
    """Copy the two graphs and ``tokenizer.json`` from ``source`` to ``target``."""
    for name in (ENCODER_FILE, DECODER_FILE, TOKENIZER_FILE):
        shutil.copyfile(source / name, target / name)


def _cached_export(trained: TrainedModel, spec: dict) -> Path | None:
    """Where ``$TRANSFORMER_BOOK_EXPORT_CACHE`` keeps this export, or None if it is not set.

    The key covers the weights, the config, the tokenizer, this module's code and the
    versions of the libraries that write the graphs."""
    root = os.environ.get(EXPORT_CACHE)
    if not root:
        return None
    import onnx
    import onnxscript

    state = io.BytesIO()
    torch.save(trained.model.state_dict(), state)
    key = hashlib.sha256(state.getvalue())
    for part in (repr(trained.model.config), json.dumps(spec, sort_keys=True),
                 Path(__file__).read_text(encoding="utf-8"),
                 torch.__version__, onnx.__version__, onnxscript.__version__):  # fmt: skip
        key.update(str(part).encode())
    return Path(root) / key.hexdigest()[:24]


@dataclass
class OnnxDecoding:
    """One greedy decoding by the exported graphs: what the page shows."""

    ids: list[int]  # <bos>, the chosen ids, <eos> (if produced)
    # (steps, tgt_vocab): the distribution each step chose from
    probabilities: np.ndarray
    # (heads, len(ids) - 1, source words): last layer, last step
    cross_attention: np.ndarray


def onnx_greedy_decode(
    export: OnnxExport, words: list[str], sessions: tuple | None = None
) -> OnnxDecoding:
    """Translate the source ``words`` with onnxruntime, step by step, as the page does.

    Each step runs the decoder on the prefix padded to ``decoder_len`` and takes the
    argmax of the logits at the prefix's last position; decoding stops at ``<eos>`` or
    after ``max_len`` tokens. ``sessions`` (encoder, decoder) reuses open
    ``onnxruntime.InferenceSession``\\ s.
    """
    spec = export.spec
    if sessions is None:
        sessions = onnx_sessions(export)
    encoder, decoder = sessions
    known = spec["source_tokens"]
    # ids 0-2 are <pad>, <bos>, <eos>
    unknown = [w for w in words if w not in known[3:]]
    if unknown:
        raise ValueError(f"words holds words the model does not know: {unknown}")
    if not 0 < len(words) <= spec["src_len"]:
        raise ValueError(
            f"words must hold 1 to {spec['src_len']} words, got {len(words)}"
        )
    ids = [known.index(w) for w in words]
    src = np.full((1, spec["src_len"]), spec["pad_id"], dtype=np.int64)
    src[0, : len(ids)] = ids
    (memory,) = encoder.run(None, {"src": src})
    ys, distributions = [spec["bos_id"]], []
    while len(ys) < spec["max_len"]:
        tgt = np.full((1, spec["decoder_len"]), spec["pad_id"], dtype=np.int64)
        tgt[0, : len(ys)] = ys
        logits, attention = decoder.run(
            None, {"memory": memory, "src": src, "tgt": tgt}
        )
        last = logits[0, len(ys) - 1].astype(np.float64)
        distributions.append(
            np.exp(last - last.max()) / np.exp(last - last.max()).sum()
        )
        ys.append(int(last.argmax()))
        if ys[-1] == spec["eos_id"]:
            break
    return OnnxDecoding(
        ys, np.stack(distributions), attention[0, :, : len(ys) - 1, : len(ids)]
    )


def onnx_sessions(export: OnnxExport) -> tuple:
    """Two ``onnxruntime.InferenceSession``\\ s (encoder, decoder) on the CPU."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    # Tiny graphs: threads only cost.
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return tuple(
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        for path in (export.encoder, export.decoder)
    )
