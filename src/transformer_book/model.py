"""Chapter 7 (end): the whole encoder–decoder model, its configuration and initialisation."""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import Tensor, nn

from .checks import (
    check_embedding,
    check_encoding,
    check_mask,
    check_positive,
    check_sizes,
    check_target,
    check_tokens,
    require_instance,
)
from .decoder import Decoder, DecoderCache, DecoderLayer
from .embedding import TokenEmbedding
from .encoder import Encoder, EncoderLayer
from .masking import padding_mask, target_mask
from .positional import PositionalEncoding


@dataclass(frozen=True)
class ModelConfig:
    """Every size of the model in one place. The size defaults are the paper's base model
    (d_model 512, 8 heads, d_ff 2048, 6 layers, dropout 0.1); ``share_embeddings`` defaults to
    False (two vocabularies need two tables), and :meth:`base` ties them as the paper did."""

    src_vocab_size: int
    """Rows of the source embedding table."""
    tgt_vocab_size: int
    """Rows of the target embedding table, and the width of the logits."""
    d_model: int = 512
    """The width of every token's vector between the sublayers."""
    num_heads: int = 8
    """Heads in each attention block; they divide ``d_model`` between them."""
    d_ff: int = 2048
    """The inner width of each feed-forward network."""
    num_layers: int = 6
    """Encoder layers, and as many decoder layers."""
    dropout: float = 0.1
    """The rate of every dropout, on the embeddings plus positions, on the attention
    weights, inside the feed-forward networks and on each sublayer's output."""
    max_len: int = 5000
    """The longest source or target, the rows of the positional-encoding table."""
    norm_first: bool = False
    """LayerNorm before each sublayer (pre-norm) instead of after the residual sum."""
    share_embeddings: bool = False
    """One matrix for both embeddings and the output layer (needs one vocabulary)."""
    pad_id: int = 0
    """The padding token's id, which the masks the model derives hide."""

    def __post_init__(self) -> None:
        c = self
        check_embedding(c.src_vocab_size, c.d_model, c.pad_id, "pad_id")
        check_embedding(c.tgt_vocab_size, c.d_model, c.pad_id, "pad_id")
        check_encoding(c.max_len, c.d_model)  # even: a sine and a cosine per frequency
        check_sizes(c.d_model, c.num_heads, c.dropout)
        check_positive(c.d_ff, "d_ff")
        check_positive(c.num_layers, "num_layers")
        require_instance(c.norm_first, "norm_first", bool)
        require_instance(c.share_embeddings, "share_embeddings", bool)
        if c.share_embeddings and c.src_vocab_size != c.tgt_vocab_size:
            raise ValueError(
                "share_embeddings needs one vocabulary, got "
                f"src_vocab_size={c.src_vocab_size} and tgt_vocab_size={c.tgt_vocab_size}"
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
    def small(
        cls, src_vocab_size: int, tgt_vocab_size: int | None = None, **overrides
    ) -> ModelConfig:
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
        require_instance(config, "config", ModelConfig)
        c = config
        self.config = config
        self.src_embed = TokenEmbedding(c.src_vocab_size, c.d_model)
        self.tgt_embed = TokenEmbedding(c.tgt_vocab_size, c.d_model)
        self.positional = PositionalEncoding(c.d_model, c.max_len, c.dropout)
        self.encoder = Encoder(
            EncoderLayer(c.d_model, c.num_heads, c.d_ff, c.dropout, c.norm_first),
            c.num_layers,
        )
        self.decoder = Decoder(
            DecoderLayer(c.d_model, c.num_heads, c.d_ff, c.dropout, c.norm_first),
            c.num_layers,
        )
        self.generator = nn.Linear(c.d_model, c.tgt_vocab_size)
        if c.share_embeddings:
            # The paper ties three matrices: both embeddings and the pre-softmax projection.
            self.tgt_embed.lookup.weight = self.src_embed.lookup.weight
            self.generator.weight = self.src_embed.lookup.weight

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """``src (batch, src_len)`` → memory ``(batch, src_len, d_model)``."""
        c, device = self.config, self.src_embed.weight.device
        check_tokens(src, "src", c.src_vocab_size, c.max_len, device)
        if src_mask is None:
            src_mask = padding_mask(src, c.pad_id)
        check_mask(
            src_mask, "src_mask", (src.shape[0], src.shape[1], src.shape[1]), src.device
        )
        return self.encoder(self.positional(self.src_embed(src)), src_mask)

    def decode(
        self,
        memory: Tensor,
        tgt: Tensor,
        *,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        cache: DecoderCache | None = None,
    ) -> Tensor:
        """Decoder hidden states ``(batch, tgt_len, d_model)`` for target ids ``tgt (batch, tgt_len)``.

        The masks are keyword-only, so the source and target masks cannot be swapped silently.

        ``src_mask`` (broadcastable to ``(batch, 1, src_len)``) hides padding in the
        memory; ``None`` lets every memory position be seen. ``tgt_mask`` defaults to
        padding + causal. With ``cache`` (see :meth:`~transformer_book.decoder.Decoder.new_cache`),
        ``tgt`` holds only the positions not decoded yet: they are written into the cache
        at ``cache.position``, which then moves on, and ``tgt_mask`` defaults to the
        cache's causal mask over its slots.
        """
        c = self.config
        require_instance(cache, "cache", (DecoderCache, type(None)))
        check_target(
            tgt, memory, c.tgt_vocab_size, c.max_len, src_mask, tgt_mask, cache,
            c.num_layers,
        )  # fmt: skip
        if cache is None:
            offset = 0
            tgt_mask = target_mask(tgt, c.pad_id) if tgt_mask is None else tgt_mask
        else:  # the new positions only: keys and values of the others are cached
            offset = cache.position  # tgt_mask: None gives the decoder the cache's own
        x = self.positional(self.tgt_embed(tgt), offset=offset)
        hidden = self.decoder(
            x, memory, src_mask=src_mask, tgt_mask=tgt_mask, cache=cache
        )
        if cache is not None:
            cache.position += tgt.shape[1]  # on the device: the host never reads it
        return hidden

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
    ) -> Tensor:
        """Logits ``(batch, tgt_len, tgt_vocab_size)``; their softmax: the probabilities."""
        check_tokens(src, "src")  # its shape; encode() checks the ids
        if src_mask is None:  # derived once, used by both encoder and decoder
            src_mask = padding_mask(src, self.config.pad_id)
        memory = self.encode(src, src_mask)
        return self.generator(
            self.decode(memory, tgt, src_mask=src_mask, tgt_mask=tgt_mask)
        )


def make_model(config: ModelConfig) -> Transformer:
    """Build a :class:`Transformer` and initialise it with :func:`init_weights`."""
    return init_weights(Transformer(config))


def init_weights(module: nn.Module) -> nn.Module:
    """Initialise every matrix of ``module`` with Xavier (Glorot) uniform, in place; returns it.

    Vectors (biases, LayerNorm's gain and shift) keep PyTorch's defaults. Works on any
    part of the model (an :class:`~transformer_book.encoder.Encoder`, a layer), so a chapter
    can build and initialise just that part.
    """
    require_instance(module, "module", nn.Module)
    for parameter in module.parameters():  # tied matrices appear once
        if parameter.dim() > 1:
            nn.init.xavier_uniform_(parameter)
    return module


def count_parameters(module: nn.Module) -> int:
    """Number of trainable values, each tied matrix counted once."""
    require_instance(module, "module", nn.Module)
    return sum(p.numel() for p in module.parameters() if p.requires_grad)
