"""Chapter 8: a loss without the clamp, the Annotated Transformer's KL + sum; noam_rate with
warmup**+1.5 and with a taper that turns negative."""

import torch
from torch import nn


class Smoothed(nn.Module):
    def __init__(self, vocab_size, smoothing=0.1, pad_id=0):
        super().__init__()
        self.vocab_size, self.smoothing, self.pad_id = vocab_size, smoothing, pad_id

    def true_dist(self, target):
        dist = torch.full((*target.shape, self.vocab_size), self.smoothing / (self.vocab_size - 2))
        dist.scatter_(-1, target.unsqueeze(-1), 1.0 - self.smoothing)
        dist[..., self.pad_id] = 0.0
        return dist

    def forward(self, logits, target):
        log_p = torch.log_softmax(logits.float(), dim=-1)
        real = target != self.pad_id
        loss = -(self.true_dist(target) * log_p).sum(-1)[real].sum()
        return loss / real.sum().clamp(min=1)


class SmoothedNoClamp(Smoothed):
    def forward(self, logits, target):
        log_p = torch.log_softmax(logits.float(), dim=-1)
        real = target != self.pad_id
        return -(self.true_dist(target) * log_p).sum(-1)[real].sum() / real.sum()


class AnnotatedLabelSmoothing(Smoothed):
    """The Annotated Transformer's: KLDivLoss(reduction="sum"), padding rows zeroed."""

    def __init__(self, vocab_size, smoothing=0.1, pad_id=0):
        super().__init__(vocab_size, smoothing, pad_id)
        self.criterion = nn.KLDivLoss(reduction="sum")

    def forward(self, logits, target):
        dist = self.true_dist(target)
        dist[target == self.pad_id] = 0.0
        return self.criterion(torch.log_softmax(logits.float(), dim=-1), dist)


def rate_positive_power(step, d_model, warmup, factor=1.0, total_steps=None):
    step = max(step, 1)
    rate = factor * d_model**-0.5 * min(step**-0.5, step * warmup**1.5)
    return rate if total_steps is None else rate * max(0.0, 1 - step / total_steps)


def rate_negative_taper(step, d_model, warmup, factor=1.0, total_steps=None):
    step = max(step, 1)
    rate = factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
    return rate if total_steps is None else rate * (1 - step / total_steps)


WRONG = [
    ("LabelSmoothingLoss", "all_padding_nan", SmoothedNoClamp),
    ("LabelSmoothingLoss", "kl_divergence_summed", AnnotatedLabelSmoothing),
    ("noam_rate", "warmup_power_sign", rate_positive_power),
    ("noam_rate", "taper_negative", rate_negative_taper),
]
RIGHT = [("LabelSmoothingLoss", Smoothed)]
