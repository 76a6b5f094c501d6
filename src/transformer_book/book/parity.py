"""Build PyTorch's own modules with this package's weights, to prove the two compute the same thing.

PyTorch packs the query, key and value projections of self-attention into one
``in_proj_weight`` of shape ``(3 * d_model, d_model)``; this package keeps three
``nn.Linear`` layers. Everything else maps one to one. Masks differ in meaning
(True = blocked in PyTorch's modules), see :func:`~transformer_book.masking.to_pytorch_mask`.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..attention import MultiHeadAttention
from ..decoder import Decoder, DecoderLayer
from ..encoder import Encoder, EncoderLayer
from ..model import Transformer


@torch.no_grad()
def _copy_attention(ours: MultiHeadAttention, theirs: nn.MultiheadAttention) -> None:
    theirs.in_proj_weight.copy_(
        torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight])
    )
    theirs.out_proj.weight.copy_(ours.out_proj.weight)
    if ours.q_proj.bias is not None:
        theirs.in_proj_bias.copy_(
            torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias])
        )
        theirs.out_proj.bias.copy_(ours.out_proj.bias)


@torch.no_grad()
def _copy_layer(ours: EncoderLayer | DecoderLayer, theirs: nn.Module) -> None:
    """Copy one encoder or decoder layer; PyTorch calls cross-attention ``multihead_attn``."""
    _copy_attention(ours.self_attn, theirs.self_attn)
    if isinstance(ours, DecoderLayer):
        _copy_attention(ours.cross_attn, theirs.multihead_attn)
    for name in ("linear1", "linear2"):
        getattr(theirs, name).load_state_dict(
            getattr(ours.feed_forward, name).state_dict()
        )
    for name in ("norm1", "norm2", "norm3"):
        if hasattr(ours, name):
            getattr(theirs, name).load_state_dict(getattr(ours, name).state_dict())


def _layer_kwargs(layer: EncoderLayer | DecoderLayer) -> dict:
    attention = layer.self_attn
    return dict(
        d_model=layer.d_model,
        nhead=attention.num_heads,
        dim_feedforward=layer.feed_forward.linear1.out_features,
        dropout=attention.dropout,
        batch_first=True,
        norm_first=layer.norm_first,
    )


def _final_norm(ours: Encoder | Decoder) -> nn.LayerNorm | None:
    if isinstance(ours.norm, nn.LayerNorm):
        norm = nn.LayerNorm(ours.norm.normalized_shape)
        norm.load_state_dict(ours.norm.state_dict())
        return norm
    return None


def to_pytorch(module: nn.Module) -> nn.Module:
    """PyTorch's counterpart of ``module``, holding a copy of its weights (``batch_first=True``).

    ``MultiHeadAttention`` → ``nn.MultiheadAttention``; ``EncoderLayer`` →
    ``nn.TransformerEncoderLayer``; ``DecoderLayer`` → ``nn.TransformerDecoderLayer``;
    ``Encoder``/``Decoder`` → ``nn.TransformerEncoder``/``nn.TransformerDecoder``;
    ``Transformer`` → ``nn.Transformer`` (the stacks only: PyTorch's has no
    embeddings and no output layer). The result is in the same train/eval mode.
    """
    if isinstance(module, MultiHeadAttention):
        theirs = nn.MultiheadAttention(
            module.d_model,
            module.num_heads,
            dropout=module.dropout,
            bias=module.q_proj.bias is not None,
            batch_first=True,
        )
        _copy_attention(module, theirs)
    elif isinstance(module, EncoderLayer):
        theirs = nn.TransformerEncoderLayer(**_layer_kwargs(module))
        _copy_layer(module, theirs)
    elif isinstance(module, DecoderLayer):
        theirs = nn.TransformerDecoderLayer(**_layer_kwargs(module))
        _copy_layer(module, theirs)
    elif isinstance(module, Encoder):
        layers = [to_pytorch(layer) for layer in module.layers]
        # enable_nested_tensor=False: the nested-tensor fast path writes zeros at padded positions.
        theirs = nn.TransformerEncoder(
            layers[0], len(layers), norm=_final_norm(module), enable_nested_tensor=False
        )
        theirs.layers = nn.ModuleList(layers)
    elif isinstance(module, Decoder):
        layers = [to_pytorch(layer) for layer in module.layers]
        theirs = nn.TransformerDecoder(layers[0], len(layers), norm=_final_norm(module))
        theirs.layers = nn.ModuleList(layers)
    elif isinstance(module, Transformer):
        c = module.config
        # Its default stacks, replaced below, warn about nested tensors.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            theirs = nn.Transformer(
                c.d_model,
                c.num_heads,
                c.num_layers,
                c.num_layers,
                c.d_ff,
                c.dropout,
                batch_first=True,
                norm_first=c.norm_first,
            )
        # Assigned after construction: nn.Transformer re-initialises every matrix it holds when built.
        # Our stacks also keep post-norm exact (PyTorch's default stacks always end in a LayerNorm).
        theirs.encoder = to_pytorch(module.encoder)
        theirs.decoder = to_pytorch(module.decoder)
    else:
        raise ValueError(
            "module must be one of this package's attention, layer, stack or Transformer classes, "
            f"got {type(module).__name__}"
        )
    # Built on the CPU in float32, like any new module: move it where ``module`` lives.
    weight = next(module.parameters())
    return theirs.to(weight.device, weight.dtype).train(module.training)
