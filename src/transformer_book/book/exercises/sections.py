"""The sections of the book that a check sends the reader back to."""

from __future__ import annotations

from .results import Section

_CH1 = Section(1, "01_embedding", "Why multiply by √d_model?")


_CH1_PAD = Section(1, "01_embedding", "The padding id")


_CH1_COPY = Section(1, "01_embedding", "The copy-task batch, embedded")


_CH2_FORMULA = Section(2, "02_positional_encoding", "2.2 The formula")


_CH2_WORKED = Section(
    2, "02_positional_encoding", "2.3 Worked examples: a single entry and a whole row"
)


_CH2_PICTURE = Section(
    2,
    "02_positional_encoding",
    "2.4 The picture, and a bug in the tutorial's plotting code",
)


_CH2_LAYOUT = Section(
    2,
    "02_positional_encoding",
    "2.6 Interleaved or concatenated: the same table, columns reordered",
)


_CH3_MATRIX = Section(3, "03_attention", "3.3 Every query at once: the matrix form")


_CH3_WHY = Section(3, "03_attention", "3.4 Why divide by √d_k?")


_CH3_SOFTMAX = Section(3, "03_attention", "Step 4: softmax")


_CH5_ENTERS = Section(5, "05_masking", "How a mask enters attention")


_CH5_EMPTY = Section(5, "05_masking", "`-inf` or `-1e9`? The row with nothing to read")


_CH5_CONVENTIONS = Section(
    5, "05_masking", "Two conventions: ours and `nn.MultiheadAttention`'s"
)


_CH4_SPLIT = Section(4, "04_multi_head_attention", "The split, one shape at a time")


_CH4_VIEW = Section(4, "04_multi_head_attention", "Why `view` needs the `transpose`")


_CH4_CONCAT = Section(4, "04_multi_head_attention", "Concatenation, then $W^O$")


_HEADS_COUNT = Section(
    "A",
    "appendix/a_errata",
    "The split is into $h$ heads, not into $N$ parts",
    "errata-heads-count",
)


_CH5_PADDING = Section(5, "05_masking", "The padding mask")


_CH5_BOTH = Section(5, "05_masking", "Both at once: the decoder's mask")
_CH5_CAUSAL = Section(5, "05_masking", "The causal (subsequent) mask")


_CH6_SUBLAYER = Section(6, "06_encoder", "The sublayer connection, two ways")


_CH6_LAYER = Section(6, "06_encoder", "One encoder layer, step by step, with shapes")


_CH7_LAYER = Section(7, "07_decoder", "7.2 One decoder layer, equation by equation")


_CH7_CROSS = Section(7, "07_decoder", "7.3 Cross-attention: four queries, three keys")


_CH7_MASKED = Section(7, "07_decoder", "7.4 Masked self-attention and teacher forcing")


_CH8_LOSS = Section(8, "08_training", "8.2 The loss, with label smoothing")


_CH8_FLOOR = Section(8, "08_training", "The floor of the loss")


_CH8_TORCH = Section(8, "08_training", "Checking against PyTorch")


_CH8_RATE = Section(8, "08_training", "8.3 The learning rate: warm up, then decay")


_CH9_LOOP = Section(9, "09_inference", "9.2 The decoding loop, one step at a time")


_CH9_STOP = Section(9, "09_inference", "When does decoding stop?")


_CH9_BEAM = Section(9, "09_inference", "9.5 Greedy decoding against beam search")
