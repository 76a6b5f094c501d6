"""The pages of the book that a check sends the reader back to.

A mistake names its section where it stands, by page and heading:
``section=MASKING["The padding mask"]``.
"""

from __future__ import annotations

from .results import Page, Section

EMBEDDING = Page("01_embedding")
POSITIONAL = Page("02_positional_encoding")
ATTENTION = Page("03_attention")
HEADS = Page("04_multi_head_attention")
MASKING = Page("05_masking")
ENCODER = Page("06_encoder")
DECODER = Page("07_decoder")
TRAINING = Page("08_training")
INFERENCE = Page("09_inference")
REAL_LANGUAGE = Page("11_real_language")

_HEADS_COUNT = Section(
    "appendix/a_errata",
    "The split is into $h$ heads, not into $N$ parts",
    "errata-heads-count",
)
