"""transformer_book: the encoder–decoder Transformer of "Attention Is All You Need", written to be read.

Three rooms:

- **the lesson**, flat in this folder, one module per chapter (the pages show these files):
  ``embedding`` (ch. 1), ``positional`` (2), ``attention`` (3–4), ``masking`` (5), ``layers`` and
  ``encoder`` (6), ``decoder`` and ``model`` (7), ``data``, ``training`` and ``recipes`` (8),
  ``inference`` (9); with ``checks`` (the argument checks every public function starts with),
  ``runtime`` (device, seed, glue, ``compile_model``) and ``progress`` (the loop's progress bar);
- **the book's support**, ``transformer_book.book``: charts, diagrams, the ``exercises`` grader,
  chapter 0's GRU baselines, chapter 10's ONNX export and the parity with PyTorch's modules;
- **the tools**, ``transformer_book.tools``: the command-line trainer.

The support and the tools import the lesson; the lesson never imports them.

The model is plain PyTorch. Its speed is PyTorch's (appendix C): it compiles whole with
``torch.compile(model, fullgraph=True)`` (``compile_model`` falls back to eager where no
compiler is found), attention runs on ``F.scaled_dot_product_attention``, and decoding keeps a
static KV cache (``DecoderCache``) whose steps never make the host wait for the device.
"""

from .attention import (
    KVCache,
    MultiHeadAttention,
    record_attention,
    scaled_dot_product_attention,
)
from .book.export import (
    DecoderGraph,
    EncoderGraph,
    OnnxExport,
    export_onnx,
    onnx_greedy_decode,
    onnx_sessions,
)
from .book.parity import to_pytorch
from .checks import (
    check_aligned,
    check_attention,
    check_cache,
    check_cache_layers,
    check_cache_room,
    check_choice,
    check_decoding,
    check_device,
    check_embedding,
    check_encoding,
    check_features,
    check_heads_input,
    check_ids,
    check_logits,
    check_mask,
    check_non_negative,
    check_offset,
    check_pairs,
    check_positive,
    check_positive_number,
    check_probability,
    check_schedule,
    check_sizes,
    check_smoothing,
    check_start,
    check_target,
    check_token_id,
    check_tokens,
    require_instance,
    require_tensor,
    shape_of,
    trusted_ids,
)
from .data import Batch, CopyTask, DateTask, Vocabulary, copy_task_batch, labelled_bits
from .decoder import Decoder, DecoderCache, DecoderLayer, LayerCache
from .embedding import TokenEmbedding
from .encoder import Encoder, EncoderLayer
from .inference import (
    CHECK_EVERY,
    beam_search,
    decoded_length,
    greedy_decode,
    length_penalty,
)
from .layers import FeedForward, sublayer_connection
from .masking import causal_mask, padding_mask, target_mask, to_pytorch_mask
from .model import ModelConfig, Transformer, count_parameters, init_weights, make_model
from .positional import PositionalEncoding, sinusoidal_positional_encoding
from .recipes import (
    RECIPES,
    Recipe,
    TrainedModel,
    recipe,
    test_accuracy,
    train_recipe,
    trained_model,
    validation_accuracy,
)
from .runtime import (
    book_seed,
    compile_model,
    compile_unavailable,
    describe_environment,
    get_device,
    glue,
    seed_everything,
)
from .training import (
    History,
    LabelSmoothingLoss,
    chunked_loss,
    exact_match,
    fit,
    noam_optimizer,
    noam_rate,
    train_step,
    weight_average,
)

__version__ = "0.1.0"

__all__ = [
    "exercises",
    "Batch",
    "CopyTask",
    "RECIPES",
    "Recipe",
    "TrainedModel",
    "book_seed",
    "recipe",
    "train_recipe",
    "train_step",
    "chunked_loss",
    "trained_model",
    "test_accuracy",
    "validation_accuracy",
    "DateTask",
    "History",
    "LabelSmoothingLoss",
    "Vocabulary",
    "copy_task_batch",
    "labelled_bits",
    "exact_match",
    "fit",
    "noam_optimizer",
    "noam_rate",
    "weight_average",
    "Decoder",
    "DecoderLayer",
    "Encoder",
    "EncoderLayer",
    "EncoderGraph",
    "DecoderGraph",
    "OnnxExport",
    "export_onnx",
    "onnx_greedy_decode",
    "onnx_sessions",
    "FeedForward",
    "KVCache",
    "LayerCache",
    "DecoderCache",
    "compile_model",
    "compile_unavailable",
    "check_offset",
    "trusted_ids",
    "ModelConfig",
    "MultiHeadAttention",
    "PositionalEncoding",
    "TokenEmbedding",
    "Transformer",
    "beam_search",
    "causal_mask",
    "count_parameters",
    "describe_environment",
    "get_device",
    "glue",
    "greedy_decode",
    "CHECK_EVERY",
    "decoded_length",
    "length_penalty",
    "init_weights",
    "make_model",
    "to_pytorch",
    "padding_mask",
    "record_attention",
    "scaled_dot_product_attention",
    "seed_everything",
    "sinusoidal_positional_encoding",
    "sublayer_connection",
    "target_mask",
    "to_pytorch_mask",
    "check_aligned",
    "check_attention",
    "check_cache",
    "check_cache_layers",
    "check_cache_room",
    "check_choice",
    "check_decoding",
    "check_device",
    "check_embedding",
    "check_encoding",
    "check_features",
    "check_heads_input",
    "check_ids",
    "check_logits",
    "check_mask",
    "check_non_negative",
    "check_pairs",
    "check_positive",
    "check_positive_number",
    "check_probability",
    "check_schedule",
    "check_sizes",
    "check_smoothing",
    "check_start",
    "check_target",
    "check_token_id",
    "check_tokens",
    "require_instance",
    "require_tensor",
    "shape_of",
]


def __getattr__(name: str) -> object:
    """``transformer_book.book.exercises`` is imported on first use: the checker's catalogue is large,
    and a reader who only runs the model never needs it."""
    if name == "exercises":
        import importlib

        return importlib.import_module(".book.exercises", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
