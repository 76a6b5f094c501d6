"""Chapter 6: an EncoderLayer with dropout left on, without norm_first, always pre-norm; a sublayer
connection missing dropout in one branch."""

import torch.nn.functional as F
from torch import nn

import transformer_book as tb


class Layer(nn.Module):
    def __init__(self, d_model, num_heads, d_ff, dropout=0.1, norm_first=False):
        super().__init__()
        self.p, self.norm_first = dropout, norm_first
        self.self_attn = tb.MultiHeadAttention(d_model, num_heads, dropout)
        self.feed_forward = tb.FeedForward(d_model, d_ff, dropout)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.drop = nn.Dropout(dropout)

    def attend(self, h, mask):
        return self.self_attn(h, h, h, mask)[0]

    def forward(self, x, mask=None):
        if self.norm_first:
            x = x + self.drop(self.attend(self.norm1(x), mask))
            return x + self.drop(self.feed_forward(self.norm2(x)))
        x = self.norm1(x + self.drop(self.attend(x, mask)))
        return self.norm2(x + self.drop(self.feed_forward(x)))


class LayerFunctionalDropout(Layer):
    def forward(self, x, mask=None):
        if self.norm_first:
            x = x + F.dropout(self.attend(self.norm1(x), mask), self.p)
            return x + F.dropout(self.feed_forward(self.norm2(x)), self.p)
        x = self.norm1(x + F.dropout(self.attend(x, mask), self.p))
        return self.norm2(x + F.dropout(self.feed_forward(x), self.p))


class LayerWithoutNormFirst(nn.Module):
    def __init__(self, d_model, num_heads, d_ff, dropout=0.1):
        super().__init__()
        self.self_attn = tb.MultiHeadAttention(d_model, num_heads, dropout)
        self.feed_forward = tb.FeedForward(d_model, d_ff, dropout)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        x = self.norm1(x + self.dropout(self.self_attn(x, x, x, mask)[0]))
        return self.norm2(x + self.dropout(self.feed_forward(x)))


class LayerAlwaysPreNorm(Layer):
    def forward(self, x, mask=None):
        x = x + self.drop(self.attend(self.norm1(x), mask))
        return x + self.drop(self.feed_forward(self.norm2(x)))


def sublayer_post_without_dropout(x, sublayer, norm, dropout, norm_first):
    if norm_first:
        return x + dropout(sublayer(norm(x)))
    return norm(x + sublayer(x))


def sublayer_pre_without_dropout(x, sublayer, norm, dropout, norm_first):
    if norm_first:
        return x + sublayer(norm(x))
    return norm(x + dropout(sublayer(x)))


WRONG = [
    ("EncoderLayer", "dropout_in_eval", LayerFunctionalDropout),
    ("EncoderLayer", "norm_first_ignored", LayerWithoutNormFirst),
    ("EncoderLayer", "always_pre_norm", LayerAlwaysPreNorm),
    ("sublayer_connection", "dropout_missing", sublayer_post_without_dropout),
    ("sublayer_connection", "dropout_missing", sublayer_pre_without_dropout),
]
RIGHT = [("EncoderLayer", Layer)]
