"""Chapter 4: one more wrong split and merge, each written another way."""


def split_with_view(x, num_heads):
    batch, length, d_model = x.shape
    return x.contiguous().view(batch, num_heads, length, d_model // num_heads)


def merge_with_view(x, num_heads):
    batch, heads, length, d_head = x.shape
    return x.contiguous().view(batch, length, heads * d_head)


WRONG = [
    ("split_heads", "split_without_transpose", split_with_view),
    ("merge_heads", "merge_without_transpose", merge_with_view),
]
