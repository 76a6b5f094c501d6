"""Chapter 5: masks say which keys each query may look at.

Convention (as in ``torch.nn.functional.scaled_dot_product_attention``): a
boolean tensor, True = may attend. ``nn.MultiheadAttention``'s ``attn_mask`` and
``key_padding_mask`` use the opposite (True = blocked); :func:`to_pytorch_mask`
converts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_positive, check_tokens, require_tensor, shape_of


def padding_mask(tokens: Tensor, pad_id: int = 0) -> Tensor:
    """Hide padding keys: ``tokens (batch, seq)`` → ``(batch, 1, seq)``, True if real.

    The middle axis of size 1 broadcasts over every query position.
    """
    check_tokens(tokens, "tokens")
    return (tokens != pad_id).unsqueeze(1)


def causal_mask(size: int, device: torch.device | str | None = None) -> Tensor:
    """Hide the future: ``(1, size, size)``, True on and below the diagonal.

    Row ``i`` (the query at position ``i``) may attend to keys ``0..i``.
    """
    check_positive(size, "size")
    return torch.ones(size, size, dtype=torch.bool, device=device).tril().unsqueeze(0)


def target_mask(tokens: Tensor, pad_id: int = 0) -> Tensor:
    """The decoder's self-attention mask, padding and causal: ``(batch, seq, seq)``."""
    return padding_mask(tokens, pad_id) & causal_mask(tokens.shape[1], tokens.device)


def to_pytorch_mask(mask: Tensor) -> Tensor:
    """Flip our convention (True = may attend) into ``nn.MultiheadAttention``'s (True = blocked)."""
    require_tensor(mask, "mask")
    if mask.dtype != torch.bool:
        raise ValueError(
            f"mask must be boolean, got dtype {mask.dtype} with shape {shape_of(mask)}"
        )
    return ~mask
