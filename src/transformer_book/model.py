"""Chapter 7 (end): the whole encoder–decoder model, its configuration and initialisation."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

from ._checks import check_mask, check_positive, check_probability, check_tokens, shape_of
from .attention import recording_attention
from .decoder import Decoder, DecoderLayer, LayerCache
from .embedding import TokenEmbedding
from .encoder import Encoder, EncoderLayer
from .kernels import Linear, frozen_block
from .masking import padding_mask, target_mask
from .positional import PositionalEncoding


@dataclass(frozen=True)
class ModelConfig:
    """Every size of the model in one place. Defaults are the paper's base model."""

    src_vocab_size: int
    tgt_vocab_size: int
    d_model: int = 512
    num_heads: int = 8
    d_ff: int = 2048
    num_layers: int = 6
    dropout: float = 0.1
    max_len: int = 5000
    norm_first: bool = False
    share_embeddings: bool = False
    pad_id: int = 0

    def __post_init__(self) -> None:
        for name in ("src_vocab_size", "tgt_vocab_size", "d_model", "num_heads", "d_ff", "num_layers", "max_len"):
            check_positive(getattr(self, name), name)
        check_probability(self.dropout, "dropout")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if self.d_model % 2:
            raise ValueError(f"d_model must be even for the sinusoidal positional encoding, got {self.d_model}")
        if not 0 <= self.pad_id < min(self.src_vocab_size, self.tgt_vocab_size):
            raise ValueError(
                f"pad_id={self.pad_id} must be an id of both vocabularies "
                f"(src_vocab_size={self.src_vocab_size}, tgt_vocab_size={self.tgt_vocab_size})"
            )
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(
                "share_embeddings needs one vocabulary, got "
                f"src_vocab_size={self.src_vocab_size} and tgt_vocab_size={self.tgt_vocab_size}"
            )

    @property
    def d_head(self) -> int:
        """``d_k = d_v = d_model / num_heads`` (64 in the paper)."""
        return self.d_model // self.num_heads

    @classmethod
    def base(cls, vocab_size: int = 37000, **overrides) -> ModelConfig:
        """The paper's base model: 6 layers, d_model 512, 8 heads, d_ff 2048, one shared
        vocabulary (37,000 byte-pair tokens for English–German) tied across both embeddings
        and the output layer."""
        return replace(cls(vocab_size, vocab_size, share_embeddings=True), **overrides)

    @classmethod
    def small(cls, src_vocab_size: int, tgt_vocab_size: int | None = None, **overrides) -> ModelConfig:
        """A model that trains in seconds to a minute on a laptop CPU: 2 layers, d_model 64, 4 heads."""
        config = cls(
            src_vocab_size,
            tgt_vocab_size if tgt_vocab_size is not None else src_vocab_size,
            d_model=64,
            num_heads=4,
            d_ff=256,
            num_layers=2,
            dropout=0.1,
            max_len=256,
        )
        return replace(config, **overrides)


class Transformer(nn.Module):
    """The encoder–decoder model of "Attention Is All You Need".

    ``src (batch, src_len)`` and ``tgt (batch, tgt_len)`` token ids → logits
    ``(batch, tgt_len, tgt_vocab_size)``. Masks are boolean, True = may attend.
    When a mask is not given it is derived from the tokens: the source mask hides
    padding, the target mask hides padding and the future.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.config = config
        self.src_embed = TokenEmbedding(c.src_vocab_size, c.d_model)
        self.tgt_embed = TokenEmbedding(c.tgt_vocab_size, c.d_model)
        self.positional = PositionalEncoding(c.d_model, c.max_len, c.dropout)
        self.encoder = Encoder(EncoderLayer(c.d_model, c.num_heads, c.d_ff, c.dropout, c.norm_first), c.num_layers)
        self.decoder = Decoder(DecoderLayer(c.d_model, c.num_heads, c.d_ff, c.dropout, c.norm_first), c.num_layers)
        self.generator = Linear(c.d_model, c.tgt_vocab_size)
        if c.share_embeddings:
            # The paper ties three matrices: both embeddings and the pre-softmax projection.
            self.tgt_embed.lookup.weight = self.src_embed.lookup.weight
            self.generator.weight = self.src_embed.lookup.weight

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """``src (batch, src_len)`` → memory ``(batch, src_len, d_model)``."""
        check_tokens(src, "src", self.config.src_vocab_size, self.config.max_len)
        if src_mask is None:
            src_mask = padding_mask(src, self.config.pad_id)
        check_mask(src_mask, "src_mask", (src.shape[0], src.shape[1], src.shape[1]))
        return self.encoder(self.positional(self.src_embed(src)), src_mask)

    def decode(
        self,
        memory: Tensor,
        tgt: Tensor,
        *,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        cache: list[LayerCache] | None = None,
    ) -> Tensor:
        """Decoder hidden states ``(batch, tgt_len, d_model)`` for target ids ``tgt (batch, tgt_len)``.

        The masks are keyword-only, so the source and target masks cannot be swapped silently.

        ``src_mask`` (broadcastable to ``(batch, 1, src_len)``) hides padding in the
        memory; ``None`` lets every memory position be seen. ``tgt_mask`` defaults to
        padding + causal. With ``cache`` (see :meth:`~transformer_book.decoder.Decoder.new_cache`), ``tgt`` holds
        only the positions not decoded yet, and keys and values of earlier ones come
        from the cache.
        """
        past = cache[0].self_attn.length if cache else 0
        check_tokens(tgt, "tgt", self.config.tgt_vocab_size)
        if past + tgt.shape[1] > self.config.max_len:
            raise ValueError(
                f"tgt reaches position {past + tgt.shape[1] - 1} (shape {shape_of(tgt)}, {past} cached), "
                f"beyond max_len={self.config.max_len}"
            )
        if tgt.shape[0] != memory.shape[0]:
            raise ValueError(f"tgt {shape_of(tgt)} and memory {shape_of(memory)} must have the same batch size")
        batch, new, src_len = tgt.shape[0], tgt.shape[1], memory.shape[1]
        if tgt_mask is None:
            if cache is None:
                tgt_mask = target_mask(tgt, self.config.pad_id)
            elif new > 1:  # new positions see every cached one and, among themselves, only the past
                tgt_mask = torch.ones(new, past + new, dtype=torch.bool, device=tgt.device).tril(past).unsqueeze(0)
            # else one new position, which may see every cached one: no mask (the fused kernel is faster without)
        check_mask(tgt_mask, "tgt_mask", (batch, new, past + new))
        check_mask(src_mask, "src_mask", (batch, new, src_len))
        x = self.positional(self.tgt_embed(tgt), offset=past)
        return self.decoder(x, memory, src_mask=src_mask, tgt_mask=tgt_mask, cache=cache)

    def decode_step(
        self, memory: Tensor, tgt: Tensor, *, src_mask: Tensor | None = None, cache: list[LayerCache]
    ) -> Tensor:
        """``decode(memory, tgt, src_mask=src_mask, cache=cache)`` for the one new position
        ``tgt (batch, 1)`` of a decoding loop: hidden states ``(batch, 1, d_model)``.

        The first call (an empty cache) is :meth:`decode`, which checks the memory and the
        mask and fills the caches; later calls read the memory's keys and values from them.
        When nothing can change the weights or watch the decoder's modules (eval mode,
        inference mode, inside :func:`~transformer_book.kernels.frozen_weights`, no
        :func:`~transformer_book.attention.record_attention`, no dispatch mode, no forward
        hook in the decoder), later calls run
        :meth:`Decoder.step <transformer_book.decoder.Decoder.step>`: the same kernels on the
        same numbers, with less Python around them (appendix C); otherwise they are
        :meth:`decode`. Hooks are looked for once per ``frozen_weights`` block: one
        registered inside a block counts from the next.
        """
        past = cache[0].self_attn.length if cache else 0
        fast = (
            past > 0
            and frozen_block()
            and not self.training
            and torch.is_inference_mode_enabled()
            and not recording_attention()
            and not torch._C._len_torch_dispatch_stack()
            and not self._decoder_hooked()
            and tgt.dim() == 2
            and tgt.shape[1] == 1
            and len(cache) == len(self.decoder.layers)
        )
        if not fast:
            return self.decode(memory, tgt, src_mask=src_mask, cache=cache)  # it checks, or raises
        x = self.positional(self.tgt_embed(tgt, name="tgt"), offset=past)  # both check their input
        if src_mask is not None and src_mask.dim() == 3:
            src_mask = src_mask.unsqueeze(-3)  # (batch, 1, src_len) → (batch, 1, 1, src_len): the head axis
        return self.decoder.step(x, src_mask=src_mask, cache=cache)

    def _decoder_hooked(self) -> bool:
        """Whether a forward hook watches the decoder or a module in it (or every module):
        :meth:`decode_step` then takes the path that calls them. Looked up once per block."""
        block = frozen_block()
        looked = self.__dict__.get("_hooks_looked_up")
        if looked is None or looked[0] != block:
            found = any(m._forward_hooks or m._forward_pre_hooks for m in self.decoder.modules())
            looked = self.__dict__["_hooks_looked_up"] = (block, found)
        return looked[1] or bool(_global_forward_hooks or _global_forward_pre_hooks)

    def forward(
        self, src: Tensor, tgt: Tensor, src_mask: Tensor | None = None, tgt_mask: Tensor | None = None
    ) -> Tensor:
        """Logits ``(batch, tgt_len, tgt_vocab_size)``; a softmax over the last axis gives probabilities."""
        if src_mask is None:  # derived once, used by both encoder and decoder
            src_mask = padding_mask(src, self.config.pad_id)
        memory = self.encode(src, src_mask)
        return self.generator(self.decode(memory, tgt, src_mask=src_mask, tgt_mask=tgt_mask))


def make_model(config: ModelConfig) -> Transformer:
    """Build a :class:`Transformer` and initialise it with :func:`init_weights`."""
    return init_weights(Transformer(config))


def init_weights(module: nn.Module) -> nn.Module:
    """Initialise every matrix of ``module`` with Xavier (Glorot) uniform, in place; returns it.

    Vectors (biases, LayerNorm's gain and shift) keep PyTorch's defaults. Works on any
    part of the model (an :class:`~transformer_book.encoder.Encoder`, a layer), so a chapter
    can build and initialise just that part.
    """
    for parameter in module.parameters():  # tied matrices appear once
        if parameter.dim() > 1:
            nn.init.xavier_uniform_(parameter)
    return module


def count_parameters(module: nn.Module) -> int:
    """Number of trainable values, each tied matrix counted once."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)
