"""Chapter 5: padding_mask without pad_id, a uint8 causal mask, and a bank for target_mask."""

import torch


def padding_zero(tokens):
    return (tokens != 0).unsqueeze(1)


def causal_uint8(size, device=None):
    return torch.tril(torch.ones(size, size, dtype=torch.uint8, device=device)).unsqueeze(0)


def _future(tokens):
    n = tokens.shape[1]
    return torch.tril(torch.ones(n, n, dtype=torch.bool, device=tokens.device))


def target_right_einsum_free(tokens, pad_id=0):
    keys = (tokens != pad_id)[:, None, :]
    return keys & _future(tokens)


def target_right_loops(tokens, pad_id=0):
    batch, n = tokens.shape
    mask = torch.zeros(batch, n, n, dtype=torch.bool)
    for b in range(batch):
        for i in range(n):
            for j in range(i + 1):
                mask[b, i, j] = bool(tokens[b, j] != pad_id)
    return mask


def target_right_arange(tokens, pad_id=0):
    pos = torch.arange(tokens.shape[1])
    return (pos[None, :] <= pos[:, None]) & tokens.ne(pad_id).unsqueeze(-2)


def target_causal_only(tokens, pad_id=0):
    return _future(tokens).expand(tokens.shape[0], -1, -1)


def target_padding_only(tokens, pad_id=0):
    n = tokens.shape[1]
    return (tokens != pad_id)[:, None, :].expand(-1, n, -1)


def target_padding_on_queries(tokens, pad_id=0):
    return (tokens != pad_id).unsqueeze(-1) & _future(tokens)


def target_padding_both_axes(tokens, pad_id=0):
    real = tokens != pad_id
    return real[:, :, None] & real[:, None, :] & _future(tokens)


def target_with_or(tokens, pad_id=0):
    return (tokens != pad_id)[:, None, :] | _future(tokens)


def target_blocked(tokens, pad_id=0):
    n = tokens.shape[1]
    future = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
    return future | (tokens == pad_id)[:, None, :]


def target_pad_zero(tokens):
    return (tokens != 0)[:, None, :] & _future(tokens)


def target_float(tokens, pad_id=0):
    return ((tokens != pad_id)[:, None, :] & _future(tokens)).float()


WRONG = [
    ("padding_mask", "pad_id_ignored", padding_zero),
    ("causal_mask", "not_boolean", causal_uint8),
    ("target_mask", "causal_only", target_causal_only),
    ("target_mask", "padding_only", target_padding_only),
    ("target_mask", "padding_on_queries", target_padding_on_queries),
    ("target_mask", "padding_queries_hidden_too", target_padding_both_axes),
    ("target_mask", "combined_with_or", target_with_or),
    ("target_mask", "blocked_convention", target_blocked),
    ("target_mask", "pad_id_ignored", target_pad_zero),
    ("target_mask", "not_boolean", target_float),
]
RIGHT = [
    ("target_mask", target_right_einsum_free),
    ("target_mask", target_right_loops),
    ("target_mask", target_right_arange),
]
