"""Argument checks, one call at the top of each public function or module.

Bad input fails early with a ``ValueError`` that names the argument and its shape,
instead of a stack trace from deep inside PyTorch. The chapters' listings call these
helpers by their public names, so a listing pasted into a notebook after
``from transformer_book import *`` runs as it is.

Shapes, dtypes and devices are facts the host knows, so checking them costs nothing and
``torch.compile`` traces them away. Token ids are values: reading them back makes the host
wait for the device, and so does reading a KV cache's position. So values are read in
eager code only, and not inside :func:`trusted_ids`, where the caller has checked them
already (``fit`` checks each batch on the CPU before moving it; a decoding loop feeds back
its own argmax into a cache it sized itself). Under ``torch.compile`` they are not read
either: check them before the compiled call.
"""

from __future__ import annotations

import itertools
import numbers
import operator
import warnings
from collections.abc import Collection, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

_ids_trusted = False


def shape_of(tensor: Tensor) -> str:
    """``(2, 3, 4)``-style text for error messages."""
    return "(" + ", ".join(str(size) for size in tensor.shape) + ")"


def broadcast_shape(*shapes: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape ``shapes`` broadcast to, or ``None`` where they do not broadcast."""
    result: list[int] = []
    for sizes in itertools.zip_longest(
        *(reversed(shape) for shape in shapes), fillvalue=1
    ):
        wanted = {size for size in sizes if size != 1}
        if len(wanted) > 1:
            return None
        result.append(wanted.pop() if wanted else 1)
    return tuple(reversed(result))


def require_instance(value: object, name: str, kind: type | tuple[type, ...]) -> None:
    """``value`` must be a ``kind`` (a ``Batch``, a module; or one of a tuple of types), else a
    ``ValueError`` naming ``name``."""
    if not isinstance(value, kind):
        kinds = " or ".join(
            k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,))
        )
        raise ValueError(f"{name} must be of type {kinds}, got {type(value).__name__}")


def require_tensor(value: object, name: str) -> Tensor:
    """``value`` itself if it is a tensor, else a ``ValueError`` naming ``name``."""
    require_instance(value, name, Tensor)
    return value


def check_choice(value: object, name: str, choices: Collection) -> None:
    """``value`` must be one of ``choices`` (a recipe's name, a layer's index)."""
    try:
        known = value in choices
    except TypeError:  # an unhashable value is in no dict
        known = False
    if not known:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")


def check_positive(value: int, name: str) -> None:
    """``value`` must be a positive integer (not a bool)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def is_real(value: object) -> bool:
    """Whether ``value`` is a real number (an int, a float, NumPy's; not a bool, not a string)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_positive_number(value: float, name: str) -> None:
    """``value`` must be a real number above zero (a clipping norm, Adam's eps)."""
    if not is_real(value) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def check_non_negative(value: float, name: str) -> None:
    """``value`` must be a real number, zero or more (a length penalty's exponent)."""
    if not is_real(value) or not value >= 0:
        raise ValueError(f"{name} must be a non-negative number, got {value!r}")


def check_probability(value: float, name: str) -> None:
    """``value`` must be a real number in ``[0, 1)`` (a dropout rate, a smoothing mass)."""
    if not is_real(value) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")


def is_index(value: object, stop: int) -> bool:
    """Whether ``value`` is an integer (a Python, NumPy or 0-d tensor one; not a bool, and not
    a float, which a tensor would silently truncate) in ``[0, stop)``."""
    try:
        # What an integer type gives, and nothing else does.
        index = operator.index(value)
    except TypeError:
        return False
    return not isinstance(value, bool) and 0 <= index < stop


def check_token_id(value: int, name: str, vocab_size: int) -> None:
    """``value`` must be one id of a vocabulary of ``vocab_size`` (see :func:`is_index`)."""
    if not is_index(value, vocab_size):
        raise ValueError(
            f"{name} must be an id of the vocabulary, an int in [0, {vocab_size}), got {value!r}"
        )


def check_embedding(
    vocab_size: int,
    d_model: int,
    padding_idx: int | None = None,
    name: str = "padding_idx",
) -> None:
    """An embedding table's sizes: positive, and ``padding_idx`` (if any; called ``name`` in
    the message) an id of the vocabulary."""
    check_positive(vocab_size, "vocab_size")
    check_positive(d_model, "d_model")
    if padding_idx is not None:
        check_token_id(padding_idx, name, vocab_size)


def check_encoding(max_len: int, d_model: int) -> None:
    """A positional table's sizes: positive, ``d_model`` even (a sine and a cosine per frequency)."""
    check_positive(max_len, "max_len")
    check_positive(d_model, "d_model")
    if d_model % 2:
        raise ValueError(
            f"d_model must be even (a sine and a cosine per frequency), got {d_model}"
        )


def check_sizes(d_model: int, num_heads: int, dropout: float = 0.0) -> None:
    """A layer's sizes: positive, ``d_model`` divisible by ``num_heads``, dropout in [0, 1)."""
    check_positive(d_model, "d_model")
    check_positive(num_heads, "num_heads")
    check_probability(dropout, "dropout")
    if d_model % num_heads:
        raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")


def check_smoothing(vocab_size: int, smoothing: float, pad_id: int) -> None:
    """Label smoothing's settings: ``smoothing`` in [0, 1) spread over at least one wrong token
    (so ``vocab_size`` ≥ 3: padding, the right token, another), ``pad_id`` an id of the vocabulary."""
    check_probability(smoothing, "smoothing")
    if not isinstance(vocab_size, int) or vocab_size < 3:
        raise ValueError(
            f"vocab_size must be at least 3 (padding, the right token, another), got {vocab_size!r}"
        )
    check_token_id(pad_id, "pad_id", vocab_size)


def check_schedule(
    warmup: int, total_steps: int | None = None, eps: float = 1e-9
) -> None:
    """The learning-rate schedule's settings: positive ``warmup`` (and ``total_steps`` if given),
    and a positive Adam ``eps``."""
    check_positive(warmup, "warmup")
    if total_steps is not None:
        check_positive(total_steps, "total_steps")
    check_positive_number(eps, "eps")


def check_logits(logits: Tensor, target: Tensor, vocab_size: int) -> None:
    """``logits (..., vocab_size)`` floating, for integer ``target (...)`` ids of the same
    leading shape, in ``[0, vocab_size)`` (read as :func:`check_ids` says)."""
    require_tensor(logits, "logits")
    require_tensor(target, "target")
    if (
        not logits.is_floating_point()
        or target.is_floating_point()
        or target.dtype == torch.bool
    ):
        raise ValueError(
            f"logits must be floating and target integer ids, got {logits.dtype} and {target.dtype}"
        )
    if logits.shape[:-1] != target.shape or logits.shape[-1] != vocab_size:
        raise ValueError(
            f"logits {shape_of(logits)} must be target {shape_of(target)} plus a last axis of vocab_size={vocab_size}"
        )
    check_ids(target, "target", vocab_size)


def check_features(x: Tensor, name: str, d_model: int, ndim: int = 3) -> None:
    """``x`` must be a floating tensor ``(batch, seq, d_model)`` with batch and seq > 0."""
    require_tensor(x, name)
    if not x.is_floating_point():
        raise ValueError(
            f"{name} must be a floating-point tensor, got dtype {x.dtype} with shape {shape_of(x)}"
        )
    if x.dim() != ndim:
        raise ValueError(
            f"{name} must have {ndim} dimensions (batch, seq, d_model), got shape {shape_of(x)}"
        )
    if x.shape[-1] != d_model:
        raise ValueError(
            f"{name} must have last dimension d_model={d_model}, got shape {shape_of(x)}"
        )
    if x.numel() == 0:
        raise ValueError(f"{name} is empty: shape {shape_of(x)}")


def as_device(device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device`` (``"cpu"``, ``"cuda:0"`` or a device itself); anything
    else is a ``ValueError`` that names it."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device must be a torch.device or a name such as 'cpu' or 'cuda', got {device!r}"
        ) from None


def check_device(
    tensor: Tensor, name: str, device: torch.device | str, owner: str = "the model"
) -> None:
    """``tensor`` must be on ``device``, where ``owner`` is (``"cuda"`` without an index: any
    GPU). A tensor on another device fails deep inside PyTorch, with a message that names
    neither; a model on a GPU is given ids made on the CPU, for one."""
    device = as_device(device)
    same_index = device.index is None or device.index == tensor.device.index
    if tensor.device.type != device.type or not same_index:
        raise ValueError(
            f"{name} with shape {shape_of(tensor)} is on {tensor.device}, but {owner} is on "
            f"{device}: move it there with .to({str(device)!r})"
        )


def check_tokens(
    tokens: Tensor,
    name: str,
    vocab_size: int | None = None,
    max_len: int | None = None,
    device: torch.device | None = None,
) -> None:
    """``tokens`` must be integer ids ``(batch, seq)``; in ``[0, vocab_size)``, at most
    ``max_len`` long and on the model's ``device`` when those are given."""
    require_tensor(tokens, name)
    if device is not None:
        check_device(tokens, name, device)
    if (
        tokens.dtype.is_floating_point
        or tokens.dtype == torch.bool
        or tokens.is_complex()
    ):
        raise ValueError(
            f"{name} must hold integer token ids, got dtype {tokens.dtype} with shape {shape_of(tokens)}"
        )
    if tokens.dim() != 2:
        raise ValueError(f"{name} must have shape (batch, seq), got {shape_of(tokens)}")
    if tokens.numel() == 0:
        raise ValueError(f"{name} is empty: shape {shape_of(tokens)}")
    if max_len is not None and tokens.shape[1] > max_len:
        raise ValueError(
            f"{name} has {tokens.shape[1]} positions, more than max_len={max_len}; shape {shape_of(tokens)}"
        )
    if vocab_size is not None:
        check_ids(tokens, name, vocab_size)


def check_ids(ids: Tensor, name: str, vocab_size: int) -> None:
    """Integer ``ids`` (any shape) must lie in ``[0, vocab_size)``; read only where
    :func:`reads_values` says (an empty tensor has nothing to read)."""
    if ids.numel() == 0 or not reads_values(ids):
        return
    low, high = map(int, ids.aminmax())
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"{name} holds ids in [{low}, {high}] but the vocabulary has {vocab_size} ids (0..{vocab_size - 1}); "
            f"shape {shape_of(ids)}"
        )


def check_cache_room(
    position: Tensor, new: Tensor, capacity: int, name: str = "tgt"
) -> None:
    """A KV cache at ``position`` (a 0-d tensor: the positions written) must have room for
    the ``new (batch, new)`` ids of a step (called ``name``) in its ``capacity`` slots; read
    only where :func:`reads_values` says (a decoding loop sizes its cache for its steps)."""
    if not reads_values(position):
        return
    written = int(position)
    if written + new.shape[1] > capacity:
        raise ValueError(
            f"the cache holds {written} of its {capacity} positions: no room for "
            f"{new.shape[1]} more ({name} {shape_of(new)}); make a larger cache"
        )


@contextmanager
def trusted_ids() -> Iterator[None]:
    """Within the block, the checks read no values back (token ids, a cache's position):
    the caller has checked them (or made them), so the host need not wait for the device."""
    global _ids_trusted
    before, _ids_trusted = _ids_trusted, True
    try:
        yield
    finally:
        _ids_trusted = before


def reads_values(tensor: Tensor) -> bool:
    """Whether the checks read ``tensor``'s values here (ids, a cache's position): in eager
    code, outside :func:`trusted_ids`, and for a tensor that holds values (not on meta)."""
    if torch.compiler.is_compiling():
        return False
    return not _ids_trusted and tensor.device.type != "meta"


def check_offset(offset: int | Tensor, x: Tensor, max_len: int) -> None:
    """Positions ``offset .. offset + seq - 1`` of ``x (batch, seq, d_model)`` must lie in
    ``[0, max_len)``. A tensor ``offset`` (a KV cache's position, on the device) must be a
    0-d integer; it is never read: its range is the cache's, whose capacity is checked."""
    if isinstance(offset, Tensor):
        if offset.dim() != 0 or offset.is_floating_point():
            raise ValueError(
                f"offset must be an int or a 0-d integer tensor, got {offset.dtype} {shape_of(offset)}"
            )
        return
    end = offset + x.shape[1]
    if offset < 0 or end > max_len:
        raise ValueError(
            f"positions {offset}..{end - 1} of x with shape {shape_of(x)} exceed max_len={max_len}"
        )


def check_mask(
    mask: Tensor | None,
    name: str,
    target: tuple[int, ...],
    device: torch.device | None = None,
) -> None:
    """A mask must be boolean (True = may attend), broadcast to ``target`` and, when ``device``
    is given, live there (a mask on another device would otherwise fail deep inside, or worse)."""
    if mask is None:
        return
    require_tensor(mask, name)
    if mask.dtype != torch.bool:
        raise ValueError(
            f"{name} must be a boolean tensor (True = may attend), got dtype {mask.dtype} with shape {shape_of(mask)}"
        )
    broadcasts = all(
        size in (1, goal) for size, goal in zip(reversed(mask.shape), reversed(target))
    )
    if mask.dim() < 2:
        raise ValueError(
            f"{name} with shape {shape_of(mask)} needs at least 2 dimensions, (queries, keys)"
        )
    if mask.dim() > len(target) or not broadcasts:
        expected = "(" + ", ".join(str(size) for size in target) + ")"
        problem = (
            "has more dimensions than"
            if mask.dim() > len(target)
            else "does not broadcast to"
        )
        raise ValueError(f"{name} with shape {shape_of(mask)} {problem} {expected}")
    if device is not None:
        check_device(mask, name, device, "the query")


def check_attention(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, dropout_p: float
) -> None:
    """The inputs of scaled dot-product attention: ``query (..., q_len, d_k)``, ``key (..., k_len, d_k)``,
    ``value (..., k_len, d_v)`` floating tensors on one device, ``mask`` boolean and broadcastable to
    ``(..., q_len, k_len)``, ``dropout_p`` in [0, 1)."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        require_tensor(tensor, name)
        if tensor.dim() < 2 or not tensor.is_floating_point():
            raise ValueError(
                f"{name} must be a floating tensor (..., len, features), got {tensor.dtype} {shape_of(tensor)}"
            )
        check_device(tensor, name, query.device, "query")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"query and key must share d_k, got query {shape_of(query)} and key {shape_of(key)}"
        )
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(
            f"key and value must have the same length, got key {shape_of(key)} and value {shape_of(value)}"
        )
    batch = broadcast_shape(query.shape[:-2], key.shape[:-2], value.shape[:-2])
    if batch is None:
        raise ValueError(
            f"the leading axes of query {shape_of(query)}, key {shape_of(key)} and value {shape_of(value)} "
            "do not broadcast"
        )
    check_probability(dropout_p, "dropout_p")
    check_mask(mask, "mask", (*batch, query.shape[-2], key.shape[-2]), query.device)


def check_heads_input(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    d_model: int,
    num_heads: int,
    cache: object = None,
) -> None:
    """The inputs of multi-head attention: ``query (B, q_len, d_model)``, ``key`` and ``value
    (B, k_len, d_model)``, ``mask`` broadcastable to ``(B, q_len, keys)`` or, with the
    head axis, ``(B, num_heads, q_len, keys)``: ``keys`` is ``k_len``, or with a ``cache``
    (a ``KVCache``) its capacity, since attention then reads every slot of the cache."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        check_features(tensor, name, d_model)
    if key.shape[:2] != value.shape[:2]:
        raise ValueError(
            f"key and value must share (batch, len), got key {shape_of(key)} and value {shape_of(value)}"
        )
    if key.shape[0] != query.shape[0]:
        raise ValueError(
            f"query and key must share the batch size, got query {shape_of(query)} and key {shape_of(key)}"
        )
    keys = cache.capacity if cache is not None else key.shape[1]
    if cache is not None and cache.key.shape[0] != query.shape[0]:
        raise ValueError(
            f"the cache holds {cache.key.shape[0]} rows but query has shape {shape_of(query)}"
        )
    target = (query.shape[0], query.shape[1], keys)
    if mask is not None and mask.dim() == 4:
        target = (target[0], num_heads, *target[1:])
    check_mask(mask, "mask", target, query.device)


def check_target(
    tgt: Tensor,
    memory: Tensor,
    vocab_size: int,
    max_len: int,
    src_mask: Tensor | None = None,
    tgt_mask: Tensor | None = None,
    cache: object = None,
    num_layers: int | None = None,
) -> None:
    """The decoder's input: ids ``tgt (batch, new)`` in the vocabulary, at most ``max_len``
    positions, for a ``memory (batch, src_len, d_model)`` of the same batch; ``src_mask``
    broadcastable to ``(batch, new, src_len)``, ``tgt_mask`` to ``(batch, new, new)``, or with
    a ``cache`` (a ``DecoderCache``, see :func:`check_cache`) to ``(batch, new, capacity)``,
    its last axis the capacity itself."""
    check_tokens(tgt, "tgt", vocab_size)
    keys = tgt.shape[1] if cache is None else cache.capacity
    if cache is None and keys > max_len:
        raise ValueError(
            f"tgt reaches position {keys - 1} (shape {shape_of(tgt)}), beyond max_len={max_len}"
        )
    require_tensor(memory, "memory")
    if memory.dim() != 3 or tgt.shape[0] != memory.shape[0]:
        raise ValueError(
            f"tgt {shape_of(tgt)} and memory {shape_of(memory)} must have the same batch size"
        )
    check_device(tgt, "tgt", memory.device, "memory")
    if cache is not None:
        check_cache(cache, tgt, memory, max_len, num_layers)
    batch, new = tgt.shape
    check_mask(src_mask, "src_mask", (batch, new, memory.shape[1]), memory.device)
    check_mask(tgt_mask, "tgt_mask", (batch, new, keys), memory.device)
    # With a cache, a key axis of 1 would broadcast over the slots not written yet.
    if cache is not None and tgt_mask is not None and tgt_mask.shape[-1] != keys:
        raise ValueError(
            f"tgt_mask with shape {shape_of(tgt_mask)}: with a cache its last axis must be the "
            f"cache's {keys} slots (or leave it None for the cache's own mask)"
        )


def check_cache_layers(cache: object, num_layers: int) -> None:
    """A KV cache (any with ``layers``) must hold one layer cache per decoder layer: one made
    by another model's decoder would fail deep inside, or feed a layer another's keys."""
    if len(cache.layers) != num_layers:
        raise ValueError(
            f"the cache has {len(cache.layers)} layers but the decoder has {num_layers}: "
            "make the cache with this model's decoder.new_cache"
        )


def check_cache(
    cache: object,
    tgt: Tensor,
    memory: Tensor,
    max_len: int,
    num_layers: int | None = None,
) -> None:
    """A decoding step's ``cache`` (a ``DecoderCache``) for ``tgt (batch, new)`` and ``memory
    (batch, src_len, d_model)``: one layer cache per decoder layer (``num_layers``, if
    given), a capacity within ``max_len`` with room for the ``new`` positions, as many rows
    as ``tgt``, and the cross-attention keys of this very memory's length (the cache holds
    them, projected when it was made, and would silently use them instead)."""
    capacity, rows = cache.capacity, cache.layers[0].self_attn.key.shape[0]
    if num_layers is not None:
        check_cache_layers(cache, num_layers)
    if capacity > max_len or tgt.shape[1] > capacity:
        raise ValueError(
            f"tgt {shape_of(tgt)} and a cache of capacity {capacity}: the new positions must fit "
            f"in the cache, and the cache in max_len={max_len}"
        )
    if rows != tgt.shape[0]:
        raise ValueError(f"tgt {shape_of(tgt)} and the cache's {rows} rows differ")
    cross = cache.layers[0].cross_attn.key  # (batch, heads, src_len, d_head)
    if (cross.shape[0], cross.shape[2]) != (memory.shape[0], memory.shape[1]):
        raise ValueError(
            f"memory {shape_of(memory)} has another shape than the memory the cache was made "
            f"for ({cross.shape[0]} rows of {cross.shape[2]} positions): make a new cache"
        )
    check_cache_room(cache.position, tgt, capacity)


def check_aligned(hidden: Tensor, target: Tensor) -> None:
    """``hidden (..., d_model)`` must hold one vector per id of ``target (...)``: the same
    shape but for its last axis (else the loss would pair positions out of line)."""
    require_tensor(hidden, "hidden")
    require_tensor(target, "target")
    if hidden.dim() < 1 or hidden.shape[:-1] != target.shape:
        raise ValueError(
            f"hidden {shape_of(hidden)} must be target {shape_of(target)} plus a last axis"
        )


def check_start(start_step: int, steps: int) -> None:
    """A resumed run's ``start_step``: the steps already done, an int in ``[0, steps)``."""
    if not is_index(start_step, steps):
        raise ValueError(
            f"start_step must be an int in [0, steps={steps}), got {start_step!r}"
        )


def check_pairs(src: Tensor, tgt: Tensor) -> None:
    """Sources and targets to score: ``src (n, S)`` and ``tgt (n, T)``, ``n`` at least 1."""
    require_tensor(src, "src")
    require_tensor(tgt, "tgt")
    if (
        src.dim() != 2
        or tgt.dim() != 2
        or src.shape[0] != tgt.shape[0]
        or not src.shape[0]
    ):
        raise ValueError(
            f"src {shape_of(src)} and tgt {shape_of(tgt)} must be 2-d with the same number of "
            "rows, at least one"
        )


def check_decoding(
    model: torch.nn.Module,
    src: Tensor,
    max_tokens: int,
    bos_id: int,
    eos_id: int | None,
) -> None:
    """A decoding loop's arguments: a ``model`` with a ``config`` (a ``ModelConfig``),
    ``src`` ids of its source vocabulary, ``max_tokens`` (the output's length, BOS
    included: at least 2, so that one token is decoded) within the model's ``max_len``,
    ``bos_id`` and ``eos_id`` target ids. A model left in training mode decodes with
    dropout on, so each call may give other tokens: a warning says so."""
    require_instance(model, "model", torch.nn.Module)
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(
            f"model must be one of the book's models, with a config; got {type(model).__name__}"
            " (for a weight average, decode its .module)"
        )
    if model.training:
        warnings.warn(
            "the model is in training mode: any dropout it has is on, so decoding may "
            "differ from call to call; call model.eval() first",
            stacklevel=4,  # check_decoding, the loop, inference_mode, the caller
        )
    check_tokens(src, "src", config.src_vocab_size, config.max_len)
    check_positive(max_tokens, "max_tokens")
    if not 2 <= max_tokens <= config.max_len:
        raise ValueError(
            f"max_tokens={max_tokens} must be at least 2 (BOS and one decoded token) and "
            f"at most the model's max_len={config.max_len}"
        )
    check_token_id(bos_id, "bos_id", config.tgt_vocab_size)
    if eos_id is not None:
        check_token_id(eos_id, "eos_id", config.tgt_vocab_size)
    if bos_id == config.pad_id:
        raise ValueError(
            f"bos_id={bos_id} is the padding id: the decoder would read its first token as padding"
        )
