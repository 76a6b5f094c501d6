"""Graded parts: sublayer_connection, EncoderLayer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...encoder import EncoderLayer
from ...layers import sublayer_connection
from .engine import (
    Case,
    Part,
    _build_layer,
    _call,
    _display,
    _generator,
    _named,
    _random_state,
    run_function,
)
from .results import Mistake
from .sections import (
    _CH5_PADDING,
    _CH6_LAYER,
    _CH6_SUBLAYER,
)


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


def _sublayer_variant(
    post: Callable | None = None, pre: Callable | None = None, flip: bool = False
) -> Callable:
    """A sublayer connection with its post-norm and/or pre-norm branch replaced."""

    def connection(
        x: Tensor,
        sublayer: Callable,
        norm: Callable,
        dropout: Callable,
        norm_first: bool,
    ) -> Tensor:
        norm_first = norm_first != flip
        if norm_first:
            return (
                pre(x, sublayer, norm, dropout)
                if pre
                else x + dropout(sublayer(norm(x)))
            )
        return (
            post(x, sublayer, norm, dropout) if post else norm(x + dropout(sublayer(x)))
        )

    return connection


def _post(x: Tensor, f: Callable, norm: Callable, dropout: Callable) -> Tensor:
    return norm(x + dropout(f(x)))


def _pre(x: Tensor, f: Callable, norm: Callable, dropout: Callable) -> Tensor:
    return x + dropout(f(norm(x)))


_SUBLAYER_MISTAKES = (
    Mistake(
        "pre_post_swapped",
        "norm_first=False gives x + dropout(sublayer(norm(x))) and norm_first=True gives "
        "norm(x + dropout(sublayer(x))); post-norm (the paper's, norm_first=False) normalises after the sum",
        (_sublayer_variant(flip=True),),
        did="swapped the two branches of norm_first",
    ),
    Mistake(
        "norm_first_ignored",
        "the result is the same for norm_first=True and False: one of the two orders is used for both",
        (_sublayer_variant(pre=_post), _sublayer_variant(post=_pre)),
        did="wrote one order for both values of norm_first",
    ),
    Mistake(
        "missing_residual",
        "the input x is not added back: the connection returns the (normalised) sublayer output alone",
        (
            _sublayer_variant(
                post=lambda x, f, n, d: n(d(f(x))), pre=lambda x, f, n, d: d(f(n(x)))
            ),
            _sublayer_variant(post=lambda x, f, n, d: n(d(f(x)))),
            _sublayer_variant(pre=lambda x, f, n, d: d(f(n(x)))),
        ),
        did="returned the sublayer's output without adding x",
    ),
    Mistake(
        "dropout_after_residual",
        "dropout is applied to the residual sum; it belongs on the sublayer's output, before x is added",
        (
            _sublayer_variant(
                post=lambda x, f, n, d: n(d(x + f(x))),
                pre=lambda x, f, n, d: d(x + f(n(x))),
            ),
            _sublayer_variant(post=lambda x, f, n, d: n(d(x + f(x)))),
            _sublayer_variant(pre=lambda x, f, n, d: d(x + f(n(x)))),
        ),
        did="applied dropout to the sum",
    ),
    Mistake(
        "residual_added_after_norm",
        "post-norm computes x + norm(dropout(sublayer(x))); the paper's post-norm normalises the sum, "
        "norm(x + dropout(sublayer(x)))",
        (_sublayer_variant(post=lambda x, f, n, d: x + n(d(f(x)))),),
        did="added x after the norm in post-norm",
    ),
    Mistake(
        "normalised_residual",
        "pre-norm computes norm(x) + dropout(sublayer(norm(x))): the normalised input replaces x on the "
        "residual path, which pre-norm leaves untouched",
        (_sublayer_variant(pre=lambda x, f, n, d: n(x) + d(f(n(x)))),),
        errata=(40,),
        did="added norm(x) instead of x in pre-norm",
    ),
    Mistake(
        "dropout_missing",
        "dropout is never applied; the connection applies it to the sublayer's output",
        (
            _sublayer_variant(
                post=lambda x, f, n, d: n(x + f(x)), pre=lambda x, f, n, d: x + f(n(x))
            ),
            _sublayer_variant(post=lambda x, f, n, d: n(x + f(x))),
            _sublayer_variant(pre=lambda x, f, n, d: x + f(n(x))),
        ),
        did="left dropout out (in one branch or both)",
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
            x = (
                2.0 * torch.randn(*shape, 8, generator=g, dtype=torch.float64) + 0.5
            ).to(dtype)
            return dict(
                state=state,
                x=x,
                mask=mask() if mask else None,
                norm_first=norm_first,
                dtype=dtype,
                dropout=dropout,
            )

        return inputs

    def padding() -> Tensor:
        return torch.tensor([[[True, True, True, False]], [[True, True, True, True]]])

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


def _run_encoder(cls: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    module, missing = _build_layer(cls, (8, 2, 16), inputs)
    args = (inputs["x"],) + ((inputs["mask"],) if inputs["mask"] is not None else ())
    output = _named(
        _call(f"Your {_display(cls)}'s forward", module, *args), ("output",)
    )
    if inputs[
        "dropout"
    ]:  # in eval mode dropout is off: a second call gives the same numbers
        again = _named(
            _call(f"Your {_display(cls)}'s forward", module, *args), ("output",)
        )
        same = isinstance(again["output"], Tensor) and isinstance(
            output["output"], Tensor
        )
        same = same and torch.equal(again["output"], output["output"])
        output[_REPEAT] = "the same" if same else "different"
    return {"missing parameters": missing, **output}


def _encoder_variant(
    flip: bool = False,
    residual: str = "yes",
    swap_norms: bool = False,
    use_mask: bool = True,
    ffn_first: str = "",
    norm_first: bool | None = None,
    dropout_in_eval: bool = False,
) -> type:
    """An encoder layer with one thing changed (in eval mode, so without dropout, unless
    ``dropout_in_eval``); ``norm_first`` True or False forces one order whatever is asked."""

    class Variant(EncoderLayer):
        def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
            pre = (self.norm_first if norm_first is None else norm_first) != flip
            norm1, norm2 = (
                (self.norm2, self.norm1) if swap_norms else (self.norm1, self.norm2)
            )

            def attend(h: Tensor) -> Tensor:
                out = self.self_attn(h, h, h, mask if use_mask else None)[0]
                return F.dropout(out, 0.5, training=True) if dropout_in_eval else out

            steps = [(attend, norm1), (self.feed_forward, norm2)]
            if ffn_first == "with_norms":
                steps = steps[::-1]
            elif ffn_first == "in_place":
                steps = [(self.feed_forward, norm1), (attend, norm2)]
            for f, norm in steps:
                if residual == "no":
                    x = f(norm(x)) if pre else norm(f(x))
                elif residual == "normalised" and pre:
                    x = norm(x) + f(norm(x))
                else:
                    x = x + f(norm(x)) if pre else norm(x + f(x))
            return x

    return Variant


_ENCODER_MISTAKES = (
    Mistake(
        "pre_post_swapped",
        "norm_first=False normalises the sublayer's input and norm_first=True the sum; post-norm (the "
        "paper's, norm_first=False) is norm(x + sublayer(x))",
        (_encoder_variant(flip=True),),
        section=_CH6_SUBLAYER,
        did="swapped the two branches of norm_first",
    ),
    Mistake(
        "missing_residual",
        "the sublayers' inputs are not added back (no residual connections)",
        (_encoder_variant(residual="no"),),
        section=_CH6_SUBLAYER,
        did="left out the residual connections",
    ),
    Mistake(
        "norms_swapped",
        "norm2 is used around the attention and norm1 around the feed-forward network; norm1 belongs to "
        "the first sublayer (self-attention), norm2 to the second",
        (_encoder_variant(swap_norms=True),),
        section=_CH6_LAYER,
        did="used norm2 around the attention and norm1 around the feed-forward network",
    ),
    Mistake(
        "mask_ignored",
        "the mask is not passed to the self-attention, so every query also reads the padding",
        (_encoder_variant(use_mask=False),),
        section=_CH5_PADDING,
        did="called the self-attention without the mask",
    ),
    Mistake(
        "feed_forward_first",
        "the feed-forward network runs before the self-attention; a layer attends first, then transforms each position",
        (
            _encoder_variant(ffn_first="with_norms"),
            _encoder_variant(ffn_first="in_place"),
        ),
        section=_CH6_LAYER,
        did="ran the feed-forward network first",
    ),
    Mistake(
        "normalised_residual",
        "pre-norm computes norm(x) + sublayer(norm(x)): the normalised input replaces x on the residual path",
        (_encoder_variant(residual="normalised"),),
        section=_CH6_SUBLAYER,
        errata=(40,),
        did="added norm(x) instead of x in pre-norm",
    ),
    Mistake(
        "norm_first_ignored",
        "the layer is post-norm whatever norm_first says, so norm_first=True (pre-norm, "
        "x + sublayer(norm(x))) gives the post-norm result",
        (_encoder_variant(norm_first=False),),
        section=_CH6_SUBLAYER,
        did="took no norm_first (or never read it)",
    ),
    Mistake(
        "always_pre_norm",
        "the layer is pre-norm whatever norm_first says; norm_first=False, the default and the "
        "paper's, is post-norm, norm(x + sublayer(x))",
        (_encoder_variant(norm_first=True),),
        section=_CH6_SUBLAYER,
        did="wrote only the pre-norm order",
    ),
    Mistake(
        "dropout_in_eval",
        "dropout stays on in eval mode, so two calls on the same input give different outputs; "
        "F.dropout needs training=self.training (nn.Dropout follows model.eval() by itself)",
        (_encoder_variant(dropout_in_eval=True),),
        section=_CH6_SUBLAYER,
        did="called F.dropout(h, p) without training=self.training",
        outputs=(_REPEAT,),
    ),
)


PARTS = (
    Part(
        "sublayer_connection",
        "function",
        sublayer_connection,
        "(x, sublayer, norm, dropout, norm_first) → the residual connection around sublayer",
        _CH6_SUBLAYER,
        _sublayer_cases,
        run_function(("output",)),
        _SUBLAYER_MISTAKES,
        axes={"output": ("batch", "position", "feature")},
    ),
    Part(
        "EncoderLayer",
        "class",
        EncoderLayer,
        "class (d_model, num_heads, d_ff, dropout=0.1, norm_first=False) with self_attn, feed_forward, "
        "norm1, norm2; forward(x, mask=None)",
        _CH6_LAYER,
        _encoder_cases,
        _run_encoder,
        _ENCODER_MISTAKES,
        axes={"output": ("batch", "position", "feature")},
    ),
)
