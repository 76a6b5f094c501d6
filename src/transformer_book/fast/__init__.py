"""Appendix C: the speed wing. ``accelerate(model)`` runs the same model on faster CPU kernels.

The model the chapters teach is plain PyTorch. This subpackage sits above it: it imports
the model, and the model never imports it. :func:`~transformer_book.fast.modules.accelerate`
swaps, in place, the classes of the model's modules for subclasses that compute the same
things on other kernels (same parameters, same ``state_dict``, same results to float
rounding, the same tokens from decoding); :func:`~transformer_book.fast.modules.plain`
swaps them back.
"""

from __future__ import annotations

from .modules import accelerate, is_accelerated, plain, status

__all__ = ["accelerate", "is_accelerated", "plain", "status"]
