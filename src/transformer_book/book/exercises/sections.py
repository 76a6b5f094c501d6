"""The sections of the book that a check sends the reader back to."""

from __future__ import annotations

from .results import Section, page_sections

_CH1, _CH1_PAD, _CH1_COPY = page_sections(
    "01_embedding",
    "Why multiply by √d_model?",
    "The padding id",
    "The copy-task batch, embedded",
)
_CH2_FORMULA, _CH2_WORKED, _CH2_PICTURE, _CH2_LAYOUT = page_sections(
    "02_positional_encoding",
    "2.2 The formula",
    "2.3 Worked examples: a single entry and a whole row",
    "2.4 The picture, and a bug in the tutorial's plotting code",
    "2.6 Interleaved or concatenated: the same table, columns reordered",
)
_CH3_MATRIX, _CH3_WHY, _CH3_SOFTMAX = page_sections(
    "03_attention",
    "3.3 Every query at once: the matrix form",
    "3.4 Why divide by √d_k?",
    "Step 4: softmax",
)
_CH4_SPLIT, _CH4_VIEW, _CH4_CONCAT = page_sections(
    "04_multi_head_attention",
    "The split, one shape at a time",
    "Why `view` needs the `transpose`",
    "Concatenation, then $W^O$",
)
_HEADS_COUNT = Section(
    "appendix/a_errata",
    "The split is into $h$ heads, not into $N$ parts",
    "errata-heads-count",
)
_CH5_ENTERS, _CH5_EMPTY, _CH5_CONVENTIONS, _CH5_PADDING, _CH5_BOTH, _CH5_CAUSAL = (
    page_sections(
        "05_masking",
        "How a mask enters attention",
        "`-inf` or `-1e9`? The row with nothing to read",
        "Two conventions: ours and `nn.MultiheadAttention`'s",
        "The padding mask",
        "Both at once: the decoder's mask",
        "The causal (subsequent) mask",
    )
)
_CH6_SUBLAYER, _CH6_LAYER = page_sections(
    "06_encoder",
    "The sublayer connection, two ways",
    "One encoder layer, step by step, with shapes",
)
_CH7_LAYER, _CH7_CROSS, _CH7_MASKED = page_sections(
    "07_decoder",
    "7.2 One decoder layer, equation by equation",
    "7.3 Cross-attention: four queries, three keys",
    "7.4 Masked self-attention and teacher forcing",
)
_CH8_LOSS, _CH8_FLOOR, _CH8_TORCH, _CH8_RATE = page_sections(
    "08_training",
    "8.2 The loss, with label smoothing",
    "The floor of the loss",
    "Checking against PyTorch",
    "8.3 The learning rate: warm up, then decay",
)
_CH9_LOOP, _CH9_STOP, _CH9_BEAM = page_sections(
    "09_inference",
    "9.2 The decoding loop, one step at a time",
    "When does decoding stop?",
    "9.5 Greedy decoding against beam search",
)
