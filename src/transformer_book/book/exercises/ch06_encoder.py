"""Graded parts: sublayer_connection, EncoderLayer."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...encoder import EncoderLayer
from ...layers import sublayer_connection
from .engine import (
    Case,
    Part,
    _build_loaded,
    _forward,
    _generator,
    _key_padding,
    _random_state,
    _signature_of,
    run_function,
)
from .results import Mistake, mistake_maker
from .sections import ENCODER, MASKING


class _FixedDropout:
    """Dropout with a mask fixed by the shape of its input: where a reader applies dropout changes
    the result, and the same call always gives the same numbers."""

    def __call__(self, x: Tensor) -> Tensor:
        g = _generator(400 + x.numel())
        keep = torch.rand(x.shape, generator=g) > 0.4
        return x * keep.to(x.dtype) / 0.6


def _sublayer_cases() -> list[Case]:
    def make(
        offset: int, shape: tuple[int, ...], norm_first: bool, dtype=torch.float32
    ) -> Callable[[], tuple]:
        def inputs() -> tuple[tuple, dict]:
            g = _generator(500 + offset)
            d = shape[-1]
            linear, norm = nn.Linear(d, d), nn.LayerNorm(d)
            with torch.no_grad():
                for p in [*linear.parameters(), *norm.parameters()]:
                    p.copy_(
                        torch.randn(p.shape, generator=g) * 0.5
                        + (1.0 if p is norm.weight else 0.0)
                    )
            linear, norm = linear.to(dtype), norm.to(dtype)
            x = (3.0 * torch.randn(shape, generator=g, dtype=torch.float64) + 1.0).to(
                dtype
            )
            return (x, linear, norm, _FixedDropout(), norm_first), {}

        return inputs

    return [
        Case("post-norm (norm_first=False), x (2, 3, 8)", make(1, (2, 3, 8), False)),
        Case("pre-norm (norm_first=True), x (2, 3, 8)", make(2, (2, 3, 8), True)),
        Case("post-norm, batch 1, length 1", make(3, (1, 1, 8), False)),
        Case("pre-norm, batch 1, length 1", make(4, (1, 1, 8), True)),
        Case(
            "post-norm, float64, x (2, 4, 6)", make(5, (2, 4, 6), False, torch.float64)
        ),
        Case("pre-norm, float64, x (2, 4, 6)", make(6, (2, 4, 6), True, torch.float64)),
    ]


def _post(x: Tensor, f: Callable, norm: Callable, drop: Callable) -> Tensor:
    """The package's post-norm branch, ``norm(x + drop(f(x)))``."""
    return sublayer_connection(x, f, norm, drop, norm_first=False)


def _pre(x: Tensor, f: Callable, norm: Callable, drop: Callable) -> Tensor:
    """The package's pre-norm branch, ``x + drop(f(norm(x)))``."""
    return sublayer_connection(x, f, norm, drop, norm_first=True)


def _sublayer_variant(
    post: Callable = _post, pre: Callable = _pre, flip: bool = False
) -> Callable:
    """A sublayer connection with its post-norm and/or pre-norm branch replaced, or the two
    branches swapped (``flip``)."""

    @_signature_of(sublayer_connection)
    def connection(x, sublayer, norm, drop, norm_first):
        branch = pre if norm_first != flip else post
        return branch(x, sublayer, norm, drop)

    return connection


def _in_either_branch(post: Callable, pre: Callable) -> tuple[Callable, ...]:
    """The same slip made in both branches, in post-norm only, or in pre-norm only."""
    return (
        _sublayer_variant(post=post, pre=pre),
        _sublayer_variant(post=post),
        _sublayer_variant(pre=pre),
    )


_sublayer_mistake = mistake_maker(_sublayer_variant)

_SUBLAYER_MISTAKES = (
    _sublayer_mistake(
        "pre_post_swapped",
        "swapped the two branches of norm_first",
        "norm_first=False gives x + drop(sublayer(norm(x))) and norm_first=True gives "
        "norm(x + drop(sublayer(x))); post-norm (the paper's, norm_first=False) normalises after the sum",
        flip=True,
    ),
    _sublayer_mistake(
        "norm_first_ignored",
        "wrote one order for both values of norm_first",
        "the result is the same for norm_first=True and False: one of the two orders is used for both",
        {"pre": _post},
        {"post": _pre},
    ),
    _sublayer_mistake(
        "missing_residual",
        "returned the sublayer's output without adding x",
        "the input x is not added back: the connection returns the (normalised) sublayer output alone",
        *_in_either_branch(
            post=lambda x, f, n, d: n(d(f(x))), pre=lambda x, f, n, d: d(f(n(x)))
        ),
    ),
    _sublayer_mistake(
        "dropout_after_residual",
        "applied dropout to the sum",
        "dropout is applied to the residual sum; it belongs on the sublayer's output, before x is added",
        *_in_either_branch(
            post=lambda x, f, n, d: n(d(x + f(x))),
            pre=lambda x, f, n, d: d(x + f(n(x))),
        ),
    ),
    _sublayer_mistake(
        "residual_added_after_norm",
        "added x after the norm in post-norm",
        "post-norm computes x + norm(drop(sublayer(x))); the paper's post-norm normalises the sum, "
        "norm(x + drop(sublayer(x)))",
        post=lambda x, f, n, d: x + n(d(f(x))),
    ),
    _sublayer_mistake(
        "normalised_residual",
        "added norm(x) instead of x in pre-norm",
        "pre-norm computes norm(x) + drop(sublayer(norm(x))): the normalised input replaces x on the "
        "residual path, which pre-norm leaves untouched",
        pre=lambda x, f, n, d: n(x) + d(f(n(x))),
        errata=(40,),
    ),
    _sublayer_mistake(
        "dropout_missing",
        "left dropout out (in one branch or both)",
        "dropout is never applied; the connection applies it to the sublayer's output",
        *_in_either_branch(
            post=lambda x, f, n, d: n(x + f(x)), pre=lambda x, f, n, d: x + f(n(x))
        ),
    ),
)


def _encoder_cases() -> list[Case]:
    def make(
        offset: int,
        shape: tuple[int, int],
        norm_first: bool,
        mask=None,
        dtype=torch.float32,
        dropout: float = 0.0,
    ):
        def inputs() -> dict[str, Any]:
            g = _generator(600 + offset)
            state = _random_state(EncoderLayer(8, 2, 16, 0.0, norm_first), g)
            x = 2.0 * torch.randn(*shape, 8, generator=g, dtype=torch.float64) + 0.5
            args = (x.to(dtype),) + ((mask(),) if mask else ())
            return dict(
                state=state,
                args=args,
                norm_first=norm_first,
                dtype=dtype,
                dropout=dropout,
            )

        return inputs

    padding = partial(_key_padding, [3, 4], 4)

    return [
        Case(
            "post-norm, d_model 8, 2 heads, d_ff 16, x (2, 4, 8)",
            make(1, (2, 4), False),
        ),
        Case("post-norm, a padding mask (2, 1, 4)", make(2, (2, 4), False, padding)),
        Case("post-norm, batch 1, length 1", make(3, (1, 1), False)),
        Case("post-norm, float64", make(4, (2, 3), False, None, torch.float64)),
        Case(
            "pre-norm (norm_first=True), a padding mask (2, 1, 4)",
            make(5, (2, 4), True, padding),
        ),
        Case("pre-norm, float64", make(6, (2, 3), True, None, torch.float64)),
        Case(
            "dropout=0.5 in eval mode (model.eval()), called twice: dropout must be off",
            make(7, (2, 4), False, padding, dropout=0.5),
        ),
    ]


_REPEAT = "the output of a second call in eval mode"


def _run_layer(cls: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """Build the reader's layer like the package's (d_model 8, 2 heads, d_ff 16, the case's
    dropout and norm_first) with its weights, in eval mode, and call it on ``inputs["args"]``
    (and the keywords ``inputs["masks"]``); with a dropout, call it twice: in eval mode
    dropout is off, and both calls give the same numbers."""
    wanted = {"dropout": inputs.get("dropout", 0.0)}
    wanted |= {"norm_first": True} if inputs["norm_first"] else {}
    module, missing = _build_loaded(cls, (8, 2, 16), inputs, **wanted)
    args, masks = inputs["args"], inputs.get("masks", {})
    output = _forward(cls, module, *args, **masks)
    outputs = {"missing parameters": missing, "output": output}
    if inputs.get("dropout"):
        again = _forward(cls, module, *args, **masks)
        same = isinstance(output, Tensor) and isinstance(again, Tensor)
        outputs[_REPEAT] = (
            "the same" if same and torch.equal(again, output) else "different"
        )
    return outputs


def _pre_norm(order: str, norm_first: bool) -> bool:
    """Whether a variant layer normalises first: as ``norm_first`` asks, the other way round
    ("swapped"), or always "post" or "pre" whatever is asked."""
    return {"asked": norm_first, "swapped": not norm_first, "post": False, "pre": True}[
        order
    ]


def _connected(
    x: Tensor, steps: list[tuple[Callable, Callable]], pre: bool, residual: str
) -> Tensor:
    """``x`` through each ``(sublayer, norm)`` of ``steps`` in turn, as ``sublayer(h, norm)``,
    pre-norm or post-norm, with the residual connections ``residual`` says: "yes", "no", or
    "normalised" (pre-norm adds norm(x) where it should add x)."""
    for f, norm in steps:
        h = norm(x) if pre else x
        out = f(h, norm)
        if residual == "no":
            x = out if pre else norm(out)
        elif residual == "normalised" and pre:
            x = h + out
        else:
            x = x + out if pre else norm(x + out)
    return x


def _encoder_variant(
    order: str = "asked",
    residual: str = "yes",
    swap_norms: bool = False,
    use_mask: bool = True,
    ffn_first: str = "",
    dropout_in_eval: bool = False,
) -> type:
    """An encoder layer with one thing changed (in eval mode, so without dropout, unless
    ``dropout_in_eval``): the order of norm and sublayer (see :func:`_pre_norm`), the residual
    connections, the norms or the sublayers swapped, or the mask left out."""

    class Variant(EncoderLayer):
        def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
            norm1, norm2 = (self.norm1, self.norm2)[:: -1 if swap_norms else 1]

            def attend(h: Tensor, norm: Callable) -> Tensor:
                out = self.self_attn(h, h, h, mask if use_mask else None)[0]
                return F.dropout(out, 0.5, training=True) if dropout_in_eval else out

            def feed_forward(h: Tensor, norm: Callable) -> Tensor:
                return self.feed_forward(h)

            steps = [(attend, norm1), (feed_forward, norm2)]
            if ffn_first == "with_norms":
                steps = steps[::-1]
            elif ffn_first == "in_place":
                steps = [(feed_forward, norm1), (attend, norm2)]
            return _connected(x, steps, _pre_norm(order, self.norm_first), residual)

    return Variant


def _layer_mistakes(mistake: Callable[..., Mistake]) -> tuple[Mistake, ...]:
    """The first two mistakes of EncoderLayer and DecoderLayer, made with the part's ``mistake``."""
    return (
        mistake(
            "pre_post_swapped",
            "swapped the two branches of norm_first",
            "norm_first=False normalises each sublayer's input and norm_first=True the sum; post-norm (the "
            "paper's, norm_first=False) is norm(x + sublayer(x))",
            order="swapped",
        ),
        mistake(
            "missing_residual",
            "left out the residual connections",
            "the sublayers' inputs are not added back (no residual connections)",
            residual="no",
        ),
    )


_encoder_mistake = mistake_maker(
    _encoder_variant, ENCODER["The sublayer connection, two ways"]
)

_ENCODER_MISTAKES = (
    *_layer_mistakes(_encoder_mistake),
    _encoder_mistake(
        "norms_swapped",
        "used norm2 around the attention and norm1 around the feed-forward network",
        "norm2 is used around the attention and norm1 around the feed-forward network; norm1 belongs to "
        "the first sublayer (self-attention), norm2 to the second",
        swap_norms=True,
        section=ENCODER["One encoder layer, step by step, with shapes"],
    ),
    _encoder_mistake(
        "mask_ignored",
        "called the self-attention without the mask",
        "the mask is not passed to the self-attention, so every query also reads the padding",
        use_mask=False,
        section=MASKING["The padding mask"],
    ),
    _encoder_mistake(
        "feed_forward_first",
        "ran the feed-forward network first",
        "the feed-forward network runs before the self-attention; a layer attends first, then transforms each position",
        {"ffn_first": "with_norms"},
        {"ffn_first": "in_place"},
        section=ENCODER["One encoder layer, step by step, with shapes"],
    ),
    _encoder_mistake(
        "normalised_residual",
        "added norm(x) instead of x in pre-norm",
        "pre-norm computes norm(x) + sublayer(norm(x)): the normalised input replaces x on the residual path",
        residual="normalised",
        errata=(40,),
    ),
    _encoder_mistake(
        "norm_first_ignored",
        "took no norm_first (or never read it)",
        "the layer is post-norm whatever norm_first says, so norm_first=True (pre-norm, "
        "x + sublayer(norm(x))) gives the post-norm result",
        order="post",
    ),
    _encoder_mistake(
        "always_pre_norm",
        "wrote only the pre-norm order",
        "the layer is pre-norm whatever norm_first says; norm_first=False, the default and the "
        "paper's, is post-norm, norm(x + sublayer(x))",
        order="pre",
    ),
    _encoder_mistake(
        "dropout_in_eval",
        "called F.dropout(h, p) without training=self.training",
        "dropout stays on in eval mode, so two calls on the same input give different outputs; "
        "F.dropout needs training=self.training (nn.Dropout follows model.eval() by itself)",
        dropout_in_eval=True,
        outputs=(_REPEAT,),
    ),
)


PARTS = (
    Part(
        "sublayer_connection",
        sublayer_connection,
        "(x, sublayer, norm, drop, norm_first) → the residual connection around sublayer",
        ENCODER["The sublayer connection, two ways"],
        _sublayer_cases,
        run_function(("output",)),
        _SUBLAYER_MISTAKES,
        axes={"output": ("batch", "position", "feature")},
    ),
    Part(
        "EncoderLayer",
        EncoderLayer,
        "class (d_model, num_heads, d_ff, dropout=0.1, norm_first=False) with self_attn, feed_forward, "
        "norm1, norm2; forward(x, mask=None)",
        ENCODER["One encoder layer, step by step, with shapes"],
        _encoder_cases,
        _run_layer,
        _ENCODER_MISTAKES,
        axes={"output": ("batch", "position", "feature")},
    ),
)
