"""Appendix C: faster CPU kernels behind the model's ``Linear`` and ``Dropout``.

Both classes are ``nn.Linear`` and ``nn.Dropout``: same parameters, same
``state_dict``, same results to float rounding. Only the kernels differ, and only for
float32 tensors on a CPU; anywhere else (a GPU, float64, autocast, ``torch.compile``
or ``torch.export``, a PyTorch without oneDNN) they run PyTorch's own.

Why (``benchmarks/bench_kernels.py`` times each choice against PyTorch's default, and
appendix C shows its figures):

- **Matrix products.** PyTorch sends ``F.linear`` on a CPU to MKL's sgemm. oneDNN,
  the other matrix library PyTorch ships, was faster on this project's AMD EPYC machines
  for the many-row products of training, and faster still once a weight is reordered
  into its blocked layout. Reordering reads and writes the whole weight, so it pays only
  when the weight is then used many times unchanged: in ``torch.inference_mode``, where
  no optimiser can change it (the step ``torch.compile`` takes for a frozen CPU model).
  There the few-row products of a decoding step go to :mod:`~transformer_book.few_rows`,
  a kernel written for them, which streams the weights nearer the memory's speed (see
  :class:`PackedWeight` for the rules). In training the forward product and the input's
  gradient use oneDNN, the weight's gradient MKL, each the faster there for most of the
  model's shapes. A oneDNN call costs more before it computes anything than an MKL call,
  so in inference mode a product smaller than :data:`PACKED_MIN_MACS` stays with MKL (a
  decoding step of a small model is all such products). oneDNN computes in exact float32
  (its default math mode).
- **Dropout.** ``F.dropout`` draws one float per element with ``bernoulli_``, which on
  CPUs other than Intel's runs on a single thread, one 32-bit draw per element, then
  multiplies by the mask in another pass and keeps it for backward. :class:`Dropout` and
  :func:`dropout` use :mod:`~transformer_book.dropout_kernel`: 16 random bits per element,
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

_ONEDNN: bool | None = None  # oneDNN's linear ops present and working here? Decided on first use.
_USE_OWN = True  # False inside pytorch_kernels()
_frozen_block = 0  # the innermost frozen_weights() block's number; 0 outside every block
_blocks_opened = 0

# Measured on an AMD EPYC with 8 rows: MKL was faster for a 256 × 256 weight (0.5 million
# multiply-adds), packed oneDNN for 768 × 256 (1.6 million). bench_kernels.py times what
# the rule saves on a decoding step of the small model.
#: In inference mode, a product of fewer multiply-adds (rows × in_features × out_features)
#: stays with MKL: there oneDNN's fixed cost per call outweighs its faster streaming of a
#: packed weight. (Training products are large: batch × length rows.)
PACKED_MIN_MACS = 1 << 20


@contextmanager
def pytorch_kernels() -> Iterator[None]:
    """Within the block, :class:`Linear`, :class:`Dropout` and :func:`linear` run PyTorch's
    own kernels (``F.linear``, ``F.dropout``), to compare the two."""
    global _USE_OWN, _frozen_block
    before, _USE_OWN = _USE_OWN, False
    block, _frozen_block = _frozen_block, 0  # and no shortcut to a packed weight
    try:
        yield
    finally:
        _USE_OWN, _frozen_block = before, block


@contextmanager
def frozen_weights() -> Iterator[None]:
    """Within the block no weight changes: a decoding loop, which runs the model many times
    and owns it while it runs. A :class:`PackedWeight` that has checked its weight once in
    the block skips that check (its stamp) for the rest of it, as a frozen graph would;
    the products and their results are the same. It still checks that inference mode is on
    and that no dispatch mode has been entered since; enter no autocast inside the block."""
    global _frozen_block, _blocks_opened
    _blocks_opened += 1
    before, _frozen_block = _frozen_block, _blocks_opened
    try:
        yield
    finally:
        _frozen_block = before


def frozen_block() -> int:
    """The number of the innermost :func:`frozen_weights` block now running; 0 outside every
    block. Something prepared from the weights inside a block holds while this stays the same."""
    return _frozen_block


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
                    torch.equal(_onednn_linear(x, weight, None), x @ w.T) for weight in (w, packed)
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
        or torch._C._len_torch_dispatch_stack()
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
    return applies_to(x, weight, bias) and x.dim() >= 2 and _onednn_available()


def _macs(x: Tensor, weight: Tensor) -> int:
    """Multiply-adds of ``x (..., in) @ weight.T``: rows × in × out."""
    return math.prod(x.shape[:-1]) * weight.numel()


def _onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
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
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_x = _onednn_linear(grad, weight.t(), None) if ctx.needs_input_grad[0] else None
        rows = grad.reshape(-1, grad.shape[-1])  # (positions, out)
        grad_weight = rows.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
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
    """A weight matrix copied, on first use in inference mode, into the layout its kernel reads.

    Two kernels read a packed copy: oneDNN (its blocked layout) for products of many rows,
    and :mod:`~transformer_book.few_rows` (panels of a few outputs) for products of at most
    :data:`few_rows.MAX_ROWS <transformer_book.few_rows.MAX_ROWS>` rows when it is
    available; a product under :data:`PACKED_MIN_MACS` stays with MKL. Each copy is made
    when first needed, again when the weight changes (see :func:`weight_stamp`), and never
    copied or saved: ``copy.deepcopy`` and pickling give an empty one, so a module holding
    it copies, saves and loads like any other.
    """

    def __init__(self) -> None:
        self._stamp: tuple | None = None
        self._packed: Tensor | None = None  # oneDNN's layout
        self._panels: Tensor | None = None  # few_rows.pack's layout
        self._panels_out = 0  # the weight's out_features (the panels are padded)
        # In the frozen_weights() block numbered _checked_in, inputs of at least _few_min_numel
        # and fewer than _few_numel elements (enough rows for few_rows.MIN_MACS, at most
        # few_rows.MAX_ROWS) go straight to the few-row kernel, other inputs of at least
        # _min_numel (enough rows for PACKED_MIN_MACS) to oneDNN: see _route.
        self._checked_in = 0
        self._few_min_numel = 0
        self._few_numel = 0
        self._min_numel = 0

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None, stamp: tuple | None = None) -> Tensor:
        """``F.linear(x, weight, bias)``: ``x (..., in)``, ``weight (out, in)`` → ``(..., out)``.

        ``stamp`` identifies ``weight``'s values when ``weight`` is itself derived (the
        packed q/k/v matrix, an inference tensor, whose own version is not tracked);
        by default it is the weight's own :func:`weight_stamp`.
        """
        route = self._route(x.numel())
        if (
            route is not None
            and torch.is_inference_mode_enabled()  # not left for autograd
            and not torch._C._len_torch_dispatch_stack()  # no dispatch mode entered since
        ):  # the weight was checked earlier in this block
            if route is _FEW_ROWS:
                return few_rows.product(x, self._panels, bias, self._panels_out)
            return _onednn_linear(x, self._packed, bias)
        if not torch.is_inference_mode_enabled():
            return linear(x, weight, bias)
        macs = _macs(x, weight)
        few = _few_rows_eligible(x, weight, bias, macs)
        if not few and (macs < PACKED_MIN_MACS or not _onednn_eligible(x, weight, bias)):
            return F.linear(x, weight, bias)  # the size first: it is the cheaper test
        stamp = weight_stamp(weight) if stamp is None else stamp
        if stamp is None:  # a weight made in inference mode: its changes are not tracked, so never pack it
            return _onednn_linear(x, weight, bias) if _onednn_eligible(x, weight, bias) else F.linear(x, weight, bias)
        if self._stamp != stamp:
            self._packed = self._panels = None
            self._stamp = stamp
        if few and self._panels is None:
            self._panels, self._panels_out = few_rows.pack(weight), weight.shape[0]
        if not few and self._packed is None:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        if _frozen_block:  # checked: for the rest of the block, inputs big enough skip to a kernel
            self._checked_in = _frozen_block
            # the size rules as input sizes, read once per block (changed rules count from the next)
            in_features, weights = weight.shape[1], max(weight.numel(), 1)
            self._few_min_numel = -(-few_rows.MIN_MACS // weights) * in_features  # rows * in
            self._few_numel = (few_rows.MAX_ROWS + 1) * in_features if few_rows.available() else 0
            self._min_numel = -(-PACKED_MIN_MACS // weights) * in_features
        if few:
            return few_rows.product(x, self._panels, bias, self._panels_out)
        return _onednn_linear(x, self._packed, bias)

    def bind(
        self, weight: Tensor, bias: Tensor | None, numel: int, stamp: tuple | None = None
    ) -> Callable[[Tensor], Tensor]:
        """``x ↦ self.linear(x, weight, bias, stamp)`` for inputs ``x`` of ``numel`` elements, in
        the :func:`frozen_weights` block now running (a decoding step's plan, valid for the rest
        of the block). When ``linear`` has checked the weight in this block and sends such inputs
        straight to a kernel, the function calls that kernel directly: the same kernel on the
        same numbers, with nothing in between."""
        route = self._route(numel)
        if route is _FEW_ROWS:
            panels, out_features = self._panels, self._panels_out
            return lambda x: few_rows.product(x, panels, bias, out_features)
        if route is _ONEDNN:
            packed = self._packed
            return lambda x: _onednn_linear(x, packed, bias)
        return lambda x: self.linear(x, weight, bias, stamp)

    def _route(self, numel: int) -> object | None:
        """The kernel an input of ``numel`` elements goes straight to (``_FEW_ROWS`` or
        ``_ONEDNN``): the weight was checked in this block, its copy for that kernel exists,
        and the size rules (precomputed as input sizes) send it there. ``None``: check first."""
        if not self.checked_in_this_block():
            return None
        if self._few_min_numel <= numel < self._few_numel:
            return _FEW_ROWS if self._panels is not None else None
        if numel >= self._min_numel:
            return _ONEDNN if self._packed is not None else None
        return None

    def checked_in_this_block(self) -> bool:
        """Whether this weight was checked in the current :func:`frozen_weights` block."""
        return _frozen_block != 0 and self._checked_in == _frozen_block

    def __deepcopy__(self, memo: dict) -> PackedWeight:
        return PackedWeight()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def __repr__(self) -> str:
        copies = [name for name, copy in (("oneDNN", self._packed), ("few rows", self._panels)) if copy is not None]
        return f"PackedWeight({'packed for ' + ' and '.join(copies) if copies else 'empty'})"


_FEW_ROWS, _ONEDNN = object(), object()  # PackedWeight._route's answers


def _few_rows_eligible(x: Tensor, weight: Tensor, bias: Tensor | None, macs: int) -> bool:
    """Whether the few-row kernel computes ``F.linear(x, weight, bias)`` in inference mode:
    at most ``few_rows.MAX_ROWS`` rows, at least ``few_rows.MIN_MACS`` multiply-adds."""
    rows = macs // max(weight.numel(), 1)
    return (
        rows <= few_rows.MAX_ROWS
        and macs >= few_rows.MIN_MACS
        and x.shape[-1] == weight.shape[1]
        and (bias is None or (bias.shape == weight.shape[:1] and bias.is_contiguous()))
        and applies_to(x, weight, bias)
        and few_rows.available()
    )


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same ``state_dict``) on oneDNN's kernels on a CPU.

    ``x (..., in_features)`` → ``(..., out_features)``. In inference mode the weight is
    packed once (see :class:`PackedWeight`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.packed = PackedWeight()

    def forward(self, x: Tensor) -> Tensor:
        return self.packed.linear(x, self.weight, self.bias)

    def bind(self, numel: int) -> Callable[[Tensor], Tensor]:
        """This layer as a function of inputs of ``numel`` elements, for the rest of the
        :func:`frozen_weights` block (see :meth:`PackedWeight.bind`)."""
        return self.packed.bind(self.weight, self.bias, numel)


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
    this module's :class:`Dropout` (not in place, no hooks), one pass with the very mask and
    numbers of the two steps, and one pass back instead of two."""
    fused = (
        type(dropout_layer) is Dropout
        and dropout_layer.training
        and 0.0 < dropout_layer.p < 1.0
        and not dropout_layer.inplace
        and not (dropout_layer._forward_hooks or dropout_layer._forward_pre_hooks)
        and not (nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)
        and applies_to(x)
    )
    if not fused:
        return dropout_layer(x.relu())
    return _SeededReLUDropout.apply(x, dropout_layer.p, dropout_kernel.draw_seed())


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """``F.dropout(x, p, training)``, with :mod:`~transformer_book.dropout_kernel`'s masks on
    float32 CPU tensors: each element zeroed with probability ``p`` (to 1/65536), the rest
    scaled by ``1 / (1 - p)``; ``x`` itself when not ``training``. The mask's seed comes from
    PyTorch's default generator, so ``torch.manual_seed`` repeats it."""
    if not training or p == 0.0:
        return x
    if p == 1.0 or not applies_to(x):
        return F.dropout(x, p, training)
    return _SeededDropout.apply(x, p, dropout_kernel.draw_seed())


class Dropout(nn.Dropout):
    """``nn.Dropout`` whose mask, on a CPU, costs a fraction of ``bernoulli_``'s draws.

    Same module, same meaning: in training each element is zeroed with probability
    ``p`` (to 1/65536) and the rest scaled by ``1 / (1 - p)``; in eval mode it is the
    identity. See the module's docstring for why.
    """

    def forward(self, x: Tensor) -> Tensor:
        if self.inplace:
            return F.dropout(x, self.p, self.training, inplace=True)
        return dropout(x, self.p, self.training)
