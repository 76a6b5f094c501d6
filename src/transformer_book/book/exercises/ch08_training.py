"""Graded parts: LabelSmoothingLoss, noam_rate."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ...training import LabelSmoothingLoss, noam_rate
from .engine import (
    Case,
    Part,
    _build,
    _call,
    _display,
    _forward,
    _generator,
    _ReaderProblem,
    _signature_of,
)
from .results import mistake_maker
from .sections import TRAINING


def _smoothing_cases() -> list[Case]:
    def make(
        offset: int,
        vocab: int,
        smoothing: float,
        pad_id: int,
        shape: tuple,
        pads: float,
        dtype=torch.float32,
    ):
        def inputs() -> dict[str, Any]:
            g = _generator(700 + offset)
            logits = (
                2.0 * torch.randn(*shape, vocab, generator=g, dtype=torch.float64)
            ).to(dtype)
            target = torch.randint(0, vocab, shape, generator=g)
            # padding only where the case puts it
            target[target == pad_id] = (pad_id + 1) % vocab
            if pads:
                target[torch.rand(shape, generator=g) < pads] = pad_id
                target.view(-1)[-1] = pad_id
            if pads < 1.0:
                target.view(-1)[0] = (pad_id + 2) % vocab
            else:  # every position is padding
                target.fill_(pad_id)
            return dict(
                vocab=vocab,
                smoothing=smoothing,
                pad_id=pad_id,
                logits=logits,
                target=target,
            )

        return inputs

    return [
        Case(
            "vocabulary 7, smoothing 0.1, logits (2, 5, 7), some padding",
            make(1, 7, 0.1, 0, (2, 5), 0.3),
        ),
        Case(
            "smoothing 0.3, logits (3, 4, 7), some padding",
            make(2, 7, 0.3, 0, (3, 4), 0.3),
        ),
        Case("no padding at all, logits (6, 7)", make(3, 7, 0.2, 0, (6,), 0.0)),
        Case("smoothing 0 (plain cross-entropy)", make(4, 7, 0.0, 0, (2, 4), 0.3)),
        Case("batch 1, length 1", make(5, 7, 0.1, 0, (1, 1), 0.0)),
        Case(
            "float64 logits, vocabulary 9",
            make(6, 9, 0.1, 0, (2, 3), 0.3, torch.float64),
        ),
        Case(
            "a batch that is all padding: the loss is 0, not 0/0",
            make(8, 7, 0.1, 0, (2, 3), 1.0),
            # other mistakes are named with or without a clamp
            only_for=("all_padding_nan",),
        ),
        Case(
            "pad_id=3, vocabulary 6",
            make(7, 6, 0.25, 3, (3, 4), 0.3),
            needs=("pad_id",),
        ),
    ]


def _run_smoothing(cls: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    module = _build(
        cls, (inputs["vocab"], inputs["smoothing"]), {"pad_id": inputs["pad_id"]}
    )
    return {"loss": _forward(cls, module, inputs["logits"], inputs["target"])}


def _smoothing_variant(
    others: str = "V-2",
    pad_column: bool = False,
    confidence: str = "1-eps",
    average: str = "real",
    kl: bool = False,
    fixed_pad: int | None = None,
) -> type:
    """A label-smoothed loss with one thing changed: how ``smoothing`` is shared, whether padding
    gets a share, the right token's mass, what the mean is over, or KL instead of cross-entropy."""

    class Variant(nn.Module):
        def __init__(
            self, vocab_size: int, smoothing: float = 0.1, pad_id: int = 0
        ) -> None:
            super().__init__()
            self.vocab_size, self.smoothing = vocab_size, smoothing
            self.pad_id = pad_id if fixed_pad is None else fixed_pad

        def forward(self, logits: Tensor, target: Tensor) -> Tensor:
            v, eps = self.vocab_size, self.smoothing
            log_probs = logits.double().log_softmax(-1)
            # PyTorch's label_smoothing: ε spread over all V classes
            if others == "uniform":
                dist = torch.full(log_probs.shape, eps / v, dtype=torch.float64)
                dist.scatter_(-1, target[..., None], 1 - eps + eps / v)
            else:
                share = eps / {"V-2": v - 2, "V-1": v - 1, "V": v}[others]
                dist = torch.full(log_probs.shape, share, dtype=torch.float64)
                dist.scatter_(
                    -1, target[..., None], 1.0 if confidence == "one" else 1 - eps
                )
                if not pad_column:
                    dist[..., self.pad_id] = 0.0
            per_position = -(dist * log_probs).sum(-1)
            if kl:  # KL(q ‖ p) = cross-entropy − entropy of q
                per_position += (dist * dist.clamp(min=1e-300).log()).sum(-1)
            real = target != self.pad_id
            total = {"real": (per_position * real).sum(), "all": per_position.sum()}
            if average == "sum":
                return total["real"].float()
            numerator = (
                total["all"]
                if average in ("pad_loss_all", "pad_loss_real")
                else total["real"]
            )
            denominator = (
                real.sum().clamp(min=1)
                if average in ("real", "pad_loss_real")
                else real.sum()
                if average == "real_unclamped"
                else target.numel()
            )
            return (numerator / denominator).float()

    return Variant


_smoothing_mistake = mistake_maker(_smoothing_variant)

_SMOOTHING_MISTAKES = (
    _smoothing_mistake(
        "mass_on_padding",
        "gave the padding column a share of the smoothing",
        "the padding column receives a share of the smoothing mass; padding is never a right answer, so the "
        "package gives it 0",
        {"pad_column": True},
        {"others": "V-1", "pad_column": True},
    ),
    _smoothing_mistake(
        "wrong_share",
        "shared the smoothing among V − 1 (or V) tokens",
        "each other token gets smoothing/(V − 1) (or smoothing/V); the package shares smoothing among the "
        "V − 2 tokens that are neither the right one nor padding",
        {"others": "V-1"},
        {"others": "V"},
    ),
    _smoothing_mistake(
        "pytorch_label_smoothing",
        "used PyTorch's label_smoothing= target",
        "the target is PyTorch's label_smoothing= target, (1 − ε)·one-hot + ε/V over all V classes, padding "
        "included; the package's gives the right token 1 − ε, padding 0 and ε/(V − 2) to each other token",
        others="uniform",
        section=TRAINING["Checking against PyTorch"],
    ),
    _smoothing_mistake(
        "padding_positions_counted",
        "averaged over every position",
        "the mean is taken over every position, padding included; the package averages over the positions "
        "whose target is not padding, and padding positions add nothing",
        *({"average": average} for average in ("all", "pad_loss_all", "pad_loss_real")),
    ),
    _smoothing_mistake(
        "confidence_not_one_minus_smoothing",
        "gave the right token the mass 1",
        "the right token keeps the mass 1 while the others receive the smoothing too, so the target sums to "
        "more than 1; the right token gets 1 − smoothing",
        confidence="one",
    ),
    _smoothing_mistake(
        "summed_not_averaged",
        "returned the sum over the positions",
        "the losses of the positions are added up; the package divides the sum by the number of positions "
        "that are not padding",
        average="sum",
    ),
    _smoothing_mistake(
        "kl_divergence",
        "computed the KL divergence instead of the cross-entropy",
        "the loss is the KL divergence, lower than the cross-entropy by the entropy of the smoothed target: "
        "the same gradients, a different number, and a floor of 0 instead of that entropy",
        kl=True,
        section=TRAINING["The floor of the loss"],
    ),
    _smoothing_mistake(
        "kl_divergence_summed",
        "summed the KL divergence (the Annotated Transformer's KLDivLoss(reduction='sum'))",
        "the loss is nn.KLDivLoss(reduction='sum') of the smoothed target, as in the Annotated "
        "Transformer: a sum over the positions, lower than the summed cross-entropy by the "
        "target's entropy; the package's is the cross-entropy averaged over the real positions",
        kl=True,
        average="sum",
        section=TRAINING["The floor of the loss"],
    ),
    _smoothing_mistake(
        "pad_id_ignored",
        "took 0 as the padding id",
        "the padding id is taken to be 0 whatever pad_id is given",
        fixed_pad=0,
    ),
    _smoothing_mistake(
        "all_padding_nan",
        "divided by the count of real targets without a clamp",
        "a batch whose every target is padding gives 0/0 = NaN: the count of real targets needs "
        ".clamp(min=1), and the loss of such a batch is 0",
        average="real_unclamped",
    ),
)


def _noam_cases() -> list[Case]:
    def make(
        steps: list[int], d_model: int, warmup: int, **kwargs: Any
    ) -> Callable[[], dict]:
        return lambda: dict(steps=steps, d_model=d_model, warmup=warmup, kwargs=kwargs)

    paper = [1, 2, 100, 3999, 4000, 4001, 20000, 100000]
    small = [1, 5, 9, 10, 11, 50]
    factor = [1, 20, 40]
    taper = [1, 20, 50, 99, 100, 101, 150]
    return [
        Case(
            "d_model 512, warmup 4000, steps " + ", ".join(map(str, paper)),
            make(paper, 512, 4000),
            ticks={"rate": (paper,)},
        ),
        Case(
            "d_model 64, warmup 10, steps " + ", ".join(map(str, small)),
            make(small, 64, 10),
            ticks={"rate": (small,)},
        ),
        Case(
            "factor=2.0, d_model 128, warmup 20",
            make(factor, 128, 20, factor=2.0),
            needs=("factor",),
            ticks={"rate": (factor,)},
        ),
        Case(
            "total_steps=100, d_model 128, warmup 20",
            make(taper, 128, 20, total_steps=100),
            needs=("total_steps",),
            ticks={"rate": (taper,)},
        ),
        Case(
            "step 0, d_model 16, warmup 5",
            make([0], 16, 5),
            ticks={"rate": ([0],)},
            on_error="The package counts step 0 as step 1 (its docstring says so).",
        ),
        Case(  # with a whole-number warmup, step · warmup^+1.5 never wins the min
            "warmup 0.25 (tells a wrong power's sign from no warm-up)",
            make([1, 4, 16], 16, 0.25),
            probe=True,
        ),
    ]


def _run_noam(fn: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    rates = []
    for step in inputs["steps"]:
        rate = _call(
            f"Your {_display(fn)}({step}, {inputs['d_model']}, {inputs['warmup']})",
            fn,
            step,
            inputs["d_model"],
            inputs["warmup"],
            **inputs["kwargs"],
        )
        try:
            rates.append(float(rate))
        except (TypeError, ValueError, RuntimeError):
            raise _ReaderProblem(
                f"Your {_display(fn)} returned {type(rate).__name__} for step={step}; the package returns a float"
            ) from None
    return {"rate": torch.tensor(rates, dtype=torch.float64)}


def _noam_variant(
    d_power: float = -0.5,
    warmup_power: float = -1.5,
    shift: int = 0,
    combine: Callable = min,
    warm_up: bool = True,
    use_factor: bool = True,
    use_total: bool = True,
    zero_at_zero: bool = False,
    clamp_taper: bool = True,
) -> Callable[..., float]:
    @_signature_of(noam_rate)
    def rate(
        step: int, d_model: int, warmup: int, factor: float, total_steps: int | None
    ):
        if zero_at_zero and step == 0:
            return 0.0
        s = max(step + shift, 1)
        schedule = combine(s**-0.5, s * warmup**warmup_power) if warm_up else s**-0.5
        value = (factor if use_factor else 1.0) * d_model**d_power * schedule
        if total_steps is None or not use_total:
            return value
        taper = 1 - s / total_steps
        return value * (max(0.0, taper) if clamp_taper else taper)

    return rate


_noam_mistake = mistake_maker(_noam_variant)

_NOAM_MISTAKES = (
    _noam_mistake(
        "missing_d_model_factor",
        "left out d_model ** -0.5",
        "the d_model^−0.5 factor is left out, so the rates are √d_model times too large",
        d_power=0.0,
    ),
    _noam_mistake(
        "wrong_warmup_power",
        "gave warmup another power than -1.5",
        "the warm-up term is not step · warmup^−1.5; with that power the two terms meet at step = warmup, "
        "where the rate peaks",
        *({"warmup_power": power} for power in (-0.5, -1.0, -2.0)),
    ),
    _noam_mistake(
        "step_off_by_one",
        "shifted the step by one",
        "the schedule is shifted by one step (the rate of step s is computed for s + 1 or s − 1)",
        {"shift": 1},
        {"shift": -1},
    ),
    _noam_mistake(
        "max_instead_of_min",
        "took the max of the two terms",
        "the two terms are combined with max, so the rate never stops growing; it is the smaller of "
        "step^−0.5 and step · warmup^−1.5",
        combine=max,
    ),
    _noam_mistake(
        "warmup_power_sign",
        "wrote warmup ** 1.5 where the paper has warmup ** -1.5",
        "the warm-up term is step · warmup^+1.5: so large that the min always picks step^−0.5, "
        "and the rate never warms up; the term is step · warmup^−1.5",
        warmup_power=1.5,
    ),
    _noam_mistake(
        "no_warmup",
        "left out the warm-up term",
        "the rate only decays as step^−0.5, with no linear warm-up",
        warm_up=False,
    ),
    _noam_mistake(
        "factor_ignored",
        "never multiplied by factor",
        "the factor argument does not multiply the rate",
        use_factor=False,
    ),
    _noam_mistake(
        "taper_ignored",
        "never used total_steps",
        "total_steps has no effect; the package multiplies the rate by 1 − step/total_steps",
        use_total=False,
    ),
    _noam_mistake(
        "zero_at_step_zero",
        "returned 0 for step 0",
        "step 0 gets the rate 0; the package counts step 0 as step 1",
        zero_at_zero=True,
    ),
    _noam_mistake(
        "taper_negative",
        "left out max(0, ·) around the taper",
        "after total_steps the taper 1 − step/total_steps turns negative, and a negative rate "
        "makes the optimiser climb the loss; the package keeps it at max(0, ·)",
        clamp_taper=False,
    ),
)


PARTS = (
    Part(
        "LabelSmoothingLoss",
        LabelSmoothingLoss,
        "class (vocab_size, smoothing=0.1, pad_id=0); forward(logits, target) → the mean loss",
        TRAINING["8.2 The loss, with label smoothing"],
        _smoothing_cases,
        _run_smoothing,
        _SMOOTHING_MISTAKES,
        strict_dtype=False,
    ),
    Part(
        "noam_rate",
        noam_rate,
        "(step, d_model, warmup, factor=1.0, total_steps=None) → the learning rate",
        TRAINING["8.3 The learning rate: warm up, then decay"],
        _noam_cases,
        _run_noam,
        _NOAM_MISTAKES,
        axes={"rate": ("step",)},
        tolerance={torch.float64: (1e-6, 1e-12)},
    ),
)
