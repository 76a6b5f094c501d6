"""Appendix C: faster CPU kernels for ``nn.Linear`` and ``nn.Dropout``.

:class:`FastLinear` and :class:`FastDropout` are ``nn.Linear`` and ``nn.Dropout``: same
parameters, same ``state_dict``, same results to float rounding. Only the kernels differ, and only for
float32 tensors on a CPU; anywhere else (a GPU, float64, autocast, ``torch.compile``
or ``torch.export``, a PyTorch without oneDNN) they run PyTorch's own.

Why (``benchmarks/bench_kernels.py`` times each choice against PyTorch's default, and
appendix C shows its figures):

- **Matrix products.** PyTorch sends ``F.linear`` on a CPU to MKL's sgemm. oneDNN,
  the other matrix library PyTorch ships, was faster on this project's AMD EPYC machines
  for the many-row products of training, and faster still once a weight is reordered
  into its blocked layout. Reordering reads and writes the whole weight, so it pays only
  when the weight is then used many times unchanged: in ``torch.inference_mode``, where
  no optimiser can change it.
  There the few-row products of a decoding step go to :mod:`~transformer_book.fast.few_rows`,
  a kernel written for them, which streams the weights nearer the memory's speed (see
  :class:`PackedWeight` for the rules). In training the forward product and the input's
  gradient use oneDNN, the weight's gradient MKL, each the faster there for most of the
  model's shapes. A oneDNN call costs more before it computes anything than an MKL call,
  so in inference mode a product smaller than :data:`PACKED_MIN_MACS` stays with MKL (a
  decoding step of a small model is all such products). oneDNN computes in exact float32
  (its default math mode).
- **Dropout.** ``F.dropout`` draws one float per element with ``bernoulli_``, which on
  CPUs other than Intel's runs on a single thread, one 32-bit draw per element, then
  multiplies by the mask in another pass and keeps it for backward. :class:`FastDropout` and
  :func:`dropout` use :mod:`~transformer_book.fast.dropout_kernel`: 16 random bits per element,
  a hash of a seed drawn from PyTorch's seeded generator and the element's position,
  computed with the product in one vectorised pass on every thread, and recomputed in
  backward instead of stored. The drop probability is ``p`` rounded to a multiple of
  1/65536 (0.1 becomes 0.100006); kept values are scaled by ``1 / (1 - p)``, as
  ``nn.Dropout`` does. Attention's weights in training take the same dropout: the model's
  attention computes them explicitly then (on a CPU PyTorch's fused kernel does so too when
  it drops out). The feed-forward network's ReLU joins its dropout's pass
  (:func:`relu_dropout`), whose backward reads where both let an element through off the
  output: one pass each way instead of two, and neither ReLU's output nor a mask kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from . import dropout_kernel, few_rows

_ONEDNN: bool | None = (
    None  # oneDNN's linear ops present and working here? Decided on first use.
)
_USE_OWN = True  # False inside pytorch_kernels()

# Measured on an AMD EPYC with 8 rows: MKL was faster for a 256 × 256 weight (0.5 million
# multiply-adds), packed oneDNN for 768 × 256 (1.6 million). bench_kernels.py times what
# the rule saves on a decoding step of the small model.
#: In inference mode, a product of fewer multiply-adds (rows × in_features × out_features)
#: stays with MKL: there oneDNN's fixed cost per call outweighs its faster streaming of a
#: packed weight. (Training products are large: batch × length rows.)
PACKED_MIN_MACS = 1 << 20


@contextmanager
def pytorch_kernels() -> Iterator[None]:
    """Within the block the wing's modules run PyTorch's own kernels (``F.linear``,
    ``F.dropout``, the fused attention), to compare the two."""
    global _USE_OWN
    before, _USE_OWN = _USE_OWN, False
    try:
        yield
    finally:
        _USE_OWN = before


def dispatch_mode_active() -> bool:
    """Whether a dispatch mode (``FlopCounterMode``, the fake tensors of ``torch.export``) is
    entered: it sees every aten op and should keep seeing them. PyTorch has no public query;
    where its private one is missing, the answer is yes, so the wing stays out of the way."""
    length = getattr(torch._C, "_len_torch_dispatch_stack", None)
    return True if length is None else bool(length())


def global_hooks_registered() -> bool:
    """Whether a forward hook is registered for every module (``register_module_forward_hook``):
    the wing's shortcuts would skip it. Read through PyTorch's private registry; where it is
    missing, the answer is yes."""
    from torch.nn.modules import module

    hooks = getattr(module, "_global_forward_hooks", None)
    pre_hooks = getattr(module, "_global_forward_pre_hooks", None)
    return hooks is None or pre_hooks is None or bool(hooks or pre_hooks)


def _onednn_available() -> bool:
    """Whether this PyTorch has oneDNN's linear ops and they work here: tried once on a
    small product (builds for other CPUs may lack them or refuse the packed layout)."""
    global _ONEDNN
    if _ONEDNN is None:
        try:
            with torch.inference_mode():
                x, w = torch.arange(6.0).view(2, 3), torch.arange(12.0).view(4, 3)
                packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
                _ONEDNN = torch.backends.mkldnn.is_available() and all(
                    torch.equal(_onednn_linear(x, weight, None), x @ w.T)
                    for weight in (w, packed)
                )
        except (AttributeError, RuntimeError, NotImplementedError):
            _ONEDNN = False
    return _ONEDNN


def applies_to(*tensors: Tensor | None) -> bool:
    """Whether the package's kernels run for ``tensors``: eager float32 CPU tensors, outside
    :func:`pytorch_kernels`, autocast, compilers and dispatch modes. (A dispatch mode, such
    as ``FlopCounterMode`` or the fake tensors of ``torch.export``, sees every aten op and
    should keep seeing them.)"""
    if (
        not _USE_OWN
        or dispatch_mode_active()
        or torch.is_autocast_enabled("cpu")
        or torch.compiler.is_compiling()
        or torch.jit.is_tracing()
    ):
        return False
    # A loop, not all(<generator>): this runs before every product of a decoding step.
    for t in tensors:
        if t is not None and not (t.is_cpu and t.dtype == torch.float32):
            return False
    return True


def _onednn_eligible(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether oneDNN computes ``F.linear(x, weight, bias)``: it reads a bias as ``out_features``
    contiguous floats (a strided, broadcast or scalar one would be read wrongly), and only
    ``F.linear``'s usual shapes; anything else stays with PyTorch."""
    return (
        applies_to(x, weight, bias)
        and x.dim() >= 2
        and weight.dim() == 2
        and (bias is None or (bias.shape == weight.shape[:1] and bias.is_contiguous()))
        and _onednn_available()
    )


def _macs(x: Tensor, weight: Tensor) -> int:
    """Multiply-adds of ``x (..., in) @ weight.T``: rows × in × out."""
    return math.prod(x.shape[:-1]) * weight.numel()


def _onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def affine(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear``: ``x (..., in)``, ``weight (out, in)`` → ``(..., out)``, with oneDNN doing
    the products on a CPU (the weight's gradient stays with MKL, faster there)."""
    if not _onednn_eligible(x, weight, bias):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _TrainingLinear.apply(x, weight, bias)
    return _onednn_linear(x, weight, bias)


class _TrainingLinear(torch.autograd.Function):
    """``x @ weight.T + bias`` with oneDNN for the product and the input's gradient, MKL for the weight's."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn_linear(x, weight, bias)

    @staticmethod
    def backward(
        ctx, grad: Tensor
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_x = (
            _onednn_linear(grad, weight.t(), None) if ctx.needs_input_grad[0] else None
        )
        rows = grad.reshape(-1, grad.shape[-1])  # (positions, out)
        grad_weight = (
            rows.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        )
        grad_bias = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias


def weight_stamp(*tensors: Tensor | None) -> tuple | None:
    """What identifies the values of ``tensors`` now: storage, shape, dtype and version;
    ``None`` when one of them is an inference tensor, whose changes are not tracked.

    A parameter's ``_version`` counts its in-place changes (optimiser steps,
    ``load_state_dict``); a move to another device or dtype makes new storage.
    """
    stamp = []
    for t in tensors:
        if t is not None:
            if t.is_inference():
                return None
            stamp.append((t.data_ptr(), t.shape, t.dtype, t._version))
    return tuple(stamp)


class PackedWeight:
    """A weight matrix copied, in inference mode, into the layout its kernel reads.

    Two kernels read a packed copy: oneDNN (its blocked layout) for products of many rows,
    and :mod:`~transformer_book.fast.few_rows` (panels of a few outputs) for products of at
    most :data:`few_rows.MAX_ROWS <transformer_book.fast.few_rows.MAX_ROWS>` rows when it is
    available; a product under :data:`PACKED_MIN_MACS` stays with MKL. Each copy is made
    when first needed, again when the weight changes (see :func:`weight_stamp`), and never
    copied or saved: ``copy.deepcopy`` and pickling give an empty one.
    """

    def __init__(self) -> None:
        self._stamp: tuple | None = None
        self._onednn: Tensor | None = None  # oneDNN's layout
        self._panels: Tensor | None = None  # few_rows.pack's layout

    def apply(
        self, x: Tensor, weight: Tensor, bias: Tensor | None, stamp: tuple | None = None
    ) -> Tensor:
        """``F.linear(x, weight, bias)``: ``x (..., in)``, ``weight (out, in)`` → ``(..., out)``.

        ``stamp`` identifies ``weight``'s values when ``weight`` is itself derived (the
        stacked q/k/v matrix, an inference tensor, whose own version is not tracked);
        by default it is the weight's own :func:`weight_stamp`.
        """
        if not torch.is_inference_mode_enabled():
            return affine(x, weight, bias)
        if not applies_to(x) or x.dim() < 2 or x.shape[-1] != weight.shape[1]:
            return F.linear(x, weight, bias)
        kernel = self.kernel(weight, bias, x.numel() // x.shape[-1], stamp)
        return F.linear(x, weight, bias) if kernel is None else kernel(x)

    def kernel(
        self, weight: Tensor, bias: Tensor | None, rows: int, stamp: tuple | None = None
    ) -> Callable[[Tensor], Tensor] | None:
        """The product of ``rows`` rows by ``weight`` in inference mode, as a function bound to
        the packed copy it reads (packed now if needed); ``None`` where MKL's ``F.linear`` is
        the choice. A decoding plan calls this once and then the function at every step."""
        macs = rows * weight.numel()
        few = _few_rows_eligible(weight, bias, rows, macs)
        if not few and (
            macs < PACKED_MIN_MACS or not _onednn_eligible(weight, weight, bias)
        ):
            return None
        stamp = weight_stamp(weight) if stamp is None else stamp
        if (
            stamp is None
        ):  # an inference tensor: its changes are not tracked, so never pack it
            return None
        if self._stamp != stamp:
            self._stamp, self._onednn, self._panels = stamp, None, None
        if few:
            if self._panels is None:
                self._panels = few_rows.pack(weight)
            panels, out_features = self._panels, weight.shape[0]
            return lambda x: few_rows.product(x, panels, bias, out_features)
        if self._onednn is None:
            self._onednn = torch.ops.mkldnn._reorder_linear_weight(
                weight.detach(), None
            )
        onednn = self._onednn
        return lambda x: _onednn_linear(x, onednn, bias)

    def __deepcopy__(self, memo: dict) -> PackedWeight:
        return PackedWeight()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def __repr__(self) -> str:
        copies = [
            name
            for name, copy in (("oneDNN", self._onednn), ("few rows", self._panels))
            if copy is not None
        ]
        return f"PackedWeight({'packed for ' + ' and '.join(copies) if copies else 'empty'})"


def _few_rows_eligible(
    weight: Tensor, bias: Tensor | None, rows: int, macs: int
) -> bool:
    """Whether the few-row kernel computes a product of ``rows`` rows by ``weight`` in
    inference mode: at most ``few_rows.MAX_ROWS`` rows, at least ``few_rows.MIN_MACS`` multiply-adds."""
    return (
        rows <= few_rows.MAX_ROWS
        and macs >= few_rows.MIN_MACS
        and (bias is None or (bias.shape == weight.shape[:1] and bias.is_contiguous()))
        and applies_to(weight, bias)
        and few_rows.available()
    )


class FastLinear(nn.Linear):
    """``nn.Linear`` (same parameters, same ``state_dict``) on oneDNN's kernels on a CPU, and on
    packed weights in inference mode (see :class:`PackedWeight`). ``x (..., in_features)`` →
    ``(..., out_features)``. :func:`~transformer_book.fast.modules.accelerate` turns a model's
    ``nn.Linear`` modules into these."""

    packed: PackedWeight

    def forward(self, x: Tensor) -> Tensor:
        return self.packed.apply(x, self.weight, self.bias)

    def kernel(self, rows: int) -> Callable[[Tensor], Tensor]:
        """This layer, in inference mode, as a function of inputs of ``rows`` rows (a decoding plan's)."""
        kernel = self.packed.kernel(self.weight, self.bias, rows)
        weight, bias = self.weight, self.bias
        return kernel if kernel is not None else (lambda x: F.linear(x, weight, bias))


class _SeededDropout(torch.autograd.Function):
    """Dropout whose backward recomputes the forward's mask from its seed (nothing is stored)."""

    @staticmethod
    def forward(ctx, x: Tensor, p: float, seed: int) -> Tensor:
        ctx.p, ctx.seed = p, seed
        return dropout_kernel.apply(x, p, seed)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        return dropout_kernel.apply(grad, ctx.p, ctx.seed), None, None


class _SeededReLUDropout(torch.autograd.Function):
    """ReLU then dropout in one pass; backward reads where both let an element through off the
    output (positive there, zero elsewhere), which the next product keeps anyway."""

    @staticmethod
    def forward(ctx, x: Tensor, p: float, seed: int) -> Tensor:
        y = dropout_kernel.apply(x, p, seed, relu=True)
        ctx.p = p
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (y,) = ctx.saved_tensors
        return dropout_kernel.relu_backward(grad, y, ctx.p), None, None


def relu_dropout(x: Tensor, dropout_layer: nn.Dropout) -> Tensor:
    """``dropout_layer(x.relu())``: on float32 CPU tensors in training, when ``dropout_layer`` is
    a :class:`FastDropout` (not in place, no hooks), one pass with the very mask and
    numbers of the two steps, and one pass back instead of two."""
    fused = (
        type(dropout_layer) is FastDropout
        and dropout_layer.training
        and 0.0 < dropout_layer.p < 1.0
        and not dropout_layer.inplace
        and not (dropout_layer._forward_hooks or dropout_layer._forward_pre_hooks)
        and not global_hooks_registered()
        and applies_to(x)
    )
    if not fused:
        return dropout_layer(x.relu())
    return _SeededReLUDropout.apply(x, dropout_layer.p, dropout_kernel.draw_seed())


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """``F.dropout(x, p, training)``, with :mod:`~transformer_book.fast.dropout_kernel`'s masks on
    float32 CPU tensors: each element zeroed with probability ``p`` (to 1/65536), the rest
    scaled by ``1 / (1 - p)``; ``x`` itself when not ``training``. The mask's seed comes from
    PyTorch's default generator, so ``torch.manual_seed`` repeats it."""
    if not training or p == 0.0:
        return x
    if p == 1.0 or not applies_to(x):
        return F.dropout(x, p, training)
    return _SeededDropout.apply(x, p, dropout_kernel.draw_seed())


class FastDropout(nn.Dropout):
    """``nn.Dropout`` whose mask, on a CPU, costs a fraction of ``bernoulli_``'s draws.

    Same module, same meaning: in training each element is zeroed with probability
    ``p`` (to 1/65536) and the rest scaled by ``1 / (1 - p)``; in eval mode it is the
    identity. See the module's docstring for why.
    """

    def forward(self, x: Tensor) -> Tensor:
        if self.inplace:
            return F.dropout(x, self.p, self.training, inplace=True)
        return dropout(x, self.p, self.training)
