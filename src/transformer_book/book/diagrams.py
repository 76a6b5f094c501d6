"""Explanatory diagrams (not data charts), drawn as inline SVG in one visual style.

Every function returns a :class:`Diagram`: an SVG document with a title and alt text
(``role="img"``, ``aria-label``, ``<title>``, ``<desc>``) that a notebook displays as
HTML. Colours live in one style sheet, with a second set of fills for the book's dark
mode (``html[data-theme=dark]``); lines and text use ``currentColor``, so they follow
the page's text colour. Where a diagram shows sizes, the caller passes the numbers of
the config it uses, so a picture can never disagree with the code next to it.

:func:`architecture_map` is the map at the top of every chapter: the whole
encoder–decoder, with the part that chapter builds highlighted.
"""

from __future__ import annotations

import hashlib
import html
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..checks import check_positive

# Fills per kind of block: (light mode, dark mode).
PALETTE: dict[str, tuple[str, str]] = {
    "emb": ("#fde2e4", "#6b2f38"),  # embeddings
    "pe": ("#fff1c1", "#5e5220"),  # positional encoding
    "att": ("#d7e9fb", "#22456b"),  # attention
    "norm": ("#eeeeee", "#44474d"),  # add & norm
    "ffn": ("#dff3e3", "#24543a"),  # feed-forward
    "out": ("#e9ddf7", "#4a3470"),  # output projection
    "rnn": ("#fde7d1", "#6b4423"),  # recurrent cells
    "off": ("#ffffff", "#1f2227"),  # an empty (masked) cell
}
ACCENT = "#e8590c"  # the highlight: the part a chapter builds

_FILLS = "".join(f".tbd .f-{k}{{fill:{light}}}" for k, (light, _) in PALETTE.items())
_DARK = "".join(
    f"html[data-theme=dark] .tbd .f-{k}{{fill:{dark}}}"
    for k, (_, dark) in PALETTE.items()
)
STYLE = (
    ".tbd{max-width:100%;height:auto;color:inherit;font-family:Helvetica,Arial,sans-serif;font-size:13px}"
    ".tbd text{fill:currentColor;dominant-baseline:middle;text-anchor:middle}"
    ".tbd .s{font-size:11px;opacity:.8}.tbd .l{text-anchor:start}.tbd .b{font-weight:bold}"
    ".tbd .box{stroke:currentColor;stroke-width:1.1}"
    ".tbd .edge{stroke:currentColor;stroke-width:1.3;fill:none}"
    ".tbd .head{fill:currentColor;stroke:none}"
    ".tbd .frame{fill:none;stroke:currentColor;stroke-dasharray:6 4;opacity:.6}"
    ".tbd .dim{opacity:.35}"
    f".tbd .hl{{stroke:{ACCENT};stroke-width:3}}.tbd .hlt{{fill:{ACCENT};font-weight:bold}}"
    ".tbd .edge.hl{stroke-dasharray:5 3}"
    + _FILLS
    + _DARK
    # In dark mode the book shows HTML outputs on a light panel; a diagram brings its own dark ground.
    + "html[data-theme=dark] .tbd{color:#ced6dd}"
    "html[data-theme=dark] .tbd-figure{background:#14181e;border-radius:6px;padding:6px}"
    "html[data-theme=dark] div.output:has(.tbd-figure){background:transparent}"
)


@dataclass(frozen=True)
class Diagram:
    """An SVG diagram with alt text; displays itself in a notebook (``_repr_html_``)."""

    svg: str
    alt: str

    def _repr_html_(self) -> str:
        return f'<figure class="tbd-figure" style="margin:0">{self.svg}</figure>'


class Canvas:
    """A list of SVG elements in the book's style, with the few shapes the diagrams need."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def box(
        self,
        x: float,
        y: float,
        w: float,
        h: float,
        kind: str,
        label: str = "",
        extra: str = "",
        rx: int = 5,
    ):
        self.parts.append(
            f'<rect class="box f-{kind} {extra}" x="{x}" y="{y}" width="{w}" height="{h}" rx="{rx}"/>'
        )
        if label:
            self.text(x + w / 2, y + h / 2, label)

    def text(self, x: float, y: float, label: str, cls: str = "") -> None:
        self.parts.append(
            f'<text class="{cls}" x="{x:.1f}" y="{y:.1f}">{html.escape(label)}</text>'
        )

    def arrow(
        self,
        x1: float,
        y1: float,
        x2: float,
        y2: float,
        extra: str = "",
        head: bool = True,
    ) -> None:
        self.parts.append(
            f'<line class="edge {extra}" x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}"/>'
        )
        if head:
            angle = math.atan2(y2 - y1, x2 - x1)
            points = [(x2, y2)] + [
                (
                    x2 - 8 * math.cos(angle + s * 0.42),
                    y2 - 8 * math.sin(angle + s * 0.42),
                )
                for s in (1, -1)
            ]
            self.parts.append(
                f'<polygon class="head" points="{" ".join(f"{px:.1f},{py:.1f}" for px, py in points)}"/>'
            )

    def path(self, d: str, extra: str = "") -> None:
        self.parts.append(f'<path class="edge {extra}" d="{d}"/>')

    def frame(self, x: float, y: float, w: float, h: float) -> None:
        self.parts.append(
            f'<rect class="frame" x="{x}" y="{y}" width="{w}" height="{h}" rx="10"/>'
        )

    def grid(
        self,
        x: float,
        y: float,
        cells: Sequence[Sequence[bool]],
        size: float,
        kind: str = "att",
    ) -> None:
        """A matrix of squares: a True cell is filled with ``kind``, a False one left empty."""
        for i, row in enumerate(cells):
            for j, on in enumerate(row):
                self.box(
                    x + j * size, y + i * size, size, size, kind if on else "off", rx=0
                )

    def render(self, width: float, height: float, title: str, alt: str) -> Diagram:
        key = hashlib.sha1((title + alt + "".join(self.parts)).encode()).hexdigest()[:8]
        body = "".join(self.parts)
        svg = (
            f'<svg xmlns="http://www.w3.org/2000/svg" class="tbd" viewBox="0 0 {width} {height}" '
            f'width="{width}" role="img" aria-label="{html.escape(alt)}" aria-describedby="tbd-{key}-d">'
            f'<title>{html.escape(title)}</title><desc id="tbd-{key}-d">{html.escape(alt)}</desc>'
            f"<style>{STYLE}</style>{body}</svg>"
        )
        return Diagram(svg, alt)


# --- the architecture map --------------------------------------------------------------------------

# Every block of the map: (id, column, row from the bottom, kind, label, chapter label).
_MAP_BLOCKS = [
    ("src_emb", 0, 0, "emb", "embedding × √d_model", "1"),
    ("src_pe", 0, 1, "pe", "+ positional encoding", "2"),
    ("enc_attn", 0, 2, "att", "self-attention", "3–5"),
    ("enc_norm1", 0, 3, "norm", "add & norm", "6"),
    ("enc_ffn", 0, 4, "ffn", "feed-forward", "6"),
    ("enc_norm2", 0, 5, "norm", "add & norm", "6"),
    ("tgt_emb", 1, 0, "emb", "embedding × √d_model", "1"),
    ("tgt_pe", 1, 1, "pe", "+ positional encoding", "2"),
    ("dec_self", 1, 2, "att", "masked self-attention", "3–5"),
    ("dec_norm1", 1, 3, "norm", "add & norm", "7"),
    ("dec_cross", 1, 4, "att", "cross-attention", "3–4, 7"),
    ("dec_norm2", 1, 5, "norm", "add & norm", "7"),
    ("dec_ffn", 1, 6, "ffn", "feed-forward", "6"),
    ("dec_norm3", 1, 7, "norm", "add & norm", "7"),
    ("out", 1, 8, "out", "linear + softmax", "7"),
]
_ATTENTION = ("enc_attn", "dec_self", "dec_cross")
_ENCODER = ("enc_attn", "enc_norm1", "enc_ffn", "enc_norm2")
_DECODER = ("dec_self", "dec_norm1", "dec_cross", "dec_norm2", "dec_ffn", "dec_norm3")
_DECODER += ("out",)  # and the output projection

#: What each chapter builds (the blocks its map highlights, and a sentence for the alt text).
CHAPTER_PARTS: dict[str, tuple[tuple[str, ...], str]] = {
    "why_attention": (
        _ATTENTION,
        "the three attention blocks, which replace recurrence",
    ),
    "embedding": (
        ("src_emb", "tgt_emb"),
        "the two embeddings that turn token ids into vectors",
    ),
    "positional": (
        ("src_pe", "tgt_pe"),
        "the positional encodings added to the embeddings",
    ),
    "attention": (
        _ATTENTION,
        "the scaled dot-product attention inside the three attention blocks",
    ),
    "multi_head": (
        _ATTENTION,
        "the multi-head attention of the three attention blocks",
    ),
    "masking": (
        ("enc_attn", "dec_self"),
        "the padding mask of the encoder and the causal mask of the decoder",
    ),
    "encoder": (
        _ENCODER,
        "the encoder layer: self-attention, feed-forward, residual connections and LayerNorm",
    ),
    "decoder": (_DECODER, "the decoder layer and the output projection"),
    "training": (
        ("out", "tgt_emb"),
        "the shifted target that goes in and the probabilities the loss compares",
    ),
    "inference": (
        ("out", "tgt_emb"),
        "the loop that feeds each predicted token back into the decoder",
    ),
    "real_language": (
        ("src_emb", "tgt_emb", "dec_cross"),
        "two real vocabularies and the cross-attention that reorders the words",
    ),
}
_FLOW = "Source ids go through embedding and positional encoding into N encoder layers (self-attention, then feed-forward, each followed by add and norm); their output, the memory, feeds the cross-attention of N decoder layers, which read the target shifted right through masked self-attention, cross-attention and feed-forward; a linear layer and softmax give next-token probabilities."  # noqa: E501


def architecture_map(highlight: str) -> Diagram:
    """The encoder–decoder Transformer with the blocks of one chapter highlighted.

    ``highlight`` is a key of :data:`CHAPTER_PARTS` (``"embedding"``, ``"attention"``, ...).
    """
    if highlight not in CHAPTER_PARTS:
        raise ValueError(
            f"highlight must be one of {sorted(CHAPTER_PARTS)}, got {highlight!r}"
        )
    lit, what = CHAPTER_PARTS[highlight]
    c = Canvas()
    col_x, w, h, gap, bottom = (30, 330), 210, 24, 8, 330

    def top_of(row: int) -> float:
        return (
            bottom - row * (h + gap) - (14 if row >= 2 else 0) - (20 if row >= 8 else 0)
        )

    for block, col, row, kind, label, chapter in _MAP_BLOCKS:
        x, y = col_x[col], top_of(row)
        on = block in lit
        c.box(x, y, w, h, kind, extra="hl" if on else "dim")
        c.text(x + w / 2 - 10, y + h / 2, label, "b" if on else "")
        c.text(x + w - 6, y + h / 2, f"ch {chapter}", "s " + ("hlt" if on else ""))
        c.parts[-1] = c.parts[-1].replace(
            'class="s', 'style="text-anchor:end" class="s'
        )
        below = bottom + h + 22 if row == 0 else top_of(row - 1)
        c.arrow(x + w / 2, below, x + w / 2, y + h)
    # the N× frames around the repeated layers
    c.frame(col_x[0] - 10, top_of(5) - 8, w + 20, top_of(2) - top_of(5) + h + 16)
    c.frame(col_x[1] - 10, top_of(7) - 8, w + 20, top_of(2) - top_of(7) + h + 16)
    c.text(col_x[0] - 4, top_of(5) - 18, "N× encoder layer", "s l")
    c.text(col_x[1] - 4, top_of(7) - 18, "N× decoder layer", "s l")
    # inputs, output and the memory
    c.text(col_x[0] + w / 2, bottom + h + 32, "source ids  (batch × n)", "s")
    shifted = "hlt" if highlight in ("training", "inference") else ""
    c.text(
        col_x[1] + w / 2,
        bottom + h + 32,
        "target ids, shifted right  (batch × m)",
        "s " + shifted,
    )
    c.text(
        col_x[1] + w / 2,
        top_of(8) - 22,
        "next-token probabilities  (batch × m × V)",
        "s",
    )
    c.arrow(col_x[1] + w / 2, top_of(8), col_x[1] + w / 2, top_of(8) - 14)
    mem_y = top_of(4) + h / 2
    c.path(
        f"M {col_x[0] + w / 2} {top_of(5)} V {top_of(6)} H {col_x[0] + w + 28} V {mem_y} H {col_x[1] - 2}"
    )
    c.arrow(col_x[1] - 12, mem_y, col_x[1], mem_y)
    c.text(col_x[0] + w + 30, top_of(6) - 10, "memory", "s")
    if highlight == "inference":  # the prediction goes back in as the next input
        x_loop = col_x[1] + w + 30
        c.path(
            f"M {col_x[1] + w} {top_of(8) + h / 2} H {x_loop} V {bottom + h / 2}", "hl"
        )
        c.arrow(x_loop, bottom + h / 2, col_x[1] + w + 2, bottom + h / 2, "hl")
        c.text(x_loop + 4, top_of(4), "next token", "s l hlt")
    width, height = 640, bottom + h + 44
    alt = f"Architecture map of the Transformer. {_FLOW} Highlighted: {what}."
    return c.render(width, height, "Where this chapter sits in the Transformer", alt)


# --- chapter diagrams ------------------------------------------------------------------------------


def recurrent_vs_attention(n: int = 5, steps: int = 3) -> Diagram:
    """Chapter 0: a recurrent encoder squeezes ``n`` inputs into one state; attention reads them all."""
    check_positive(n, "n")
    c = Canvas()
    cell, gap, y_enc, y_dec = 44, 18, 150, 40
    for panel, (x0, title) in enumerate(
        [(20, "without attention"), (390, "with attention")]
    ):
        c.text(x0 + 160, 14, f"Recurrent encoder–decoder {title}", "b")
        xs = [x0 + i * (cell + gap) for i in range(n)]
        for i, x in enumerate(xs):
            c.box(x, y_enc, cell, 30, "rnn", f"h{i + 1}")
            c.text(x + cell / 2, y_enc + 52, f"x{i + 1}", "s")
            c.arrow(x + cell / 2, y_enc + 44, x + cell / 2, y_enc + 30)
            if i:
                c.arrow(xs[i - 1] + cell, y_enc + 15, x, y_enc + 15)
        dx = [x0 + 40 + j * (cell + 40) for j in range(steps)]
        for j, x in enumerate(dx):
            c.box(x, y_dec, cell, 30, "rnn", f"s{j + 1}")
            if j:
                c.arrow(dx[j - 1] + cell, y_dec + 15, x, y_dec + 15)
        if panel == 0:  # one vector in between
            c.box(xs[-1] + 2, y_dec + 50, cell - 4, 22, "out", "c", "hl")
            c.arrow(xs[-1] + cell / 2, y_enc, xs[-1] + cell / 2, y_dec + 72)
            c.path(f"M {xs[-1] + 2} {y_dec + 61} H {dx[0] + cell / 2} V {y_dec + 30}")
            c.text(
                x0 + 150,
                y_enc + 78,
                f"all {n} inputs pass through one fixed-size vector c",
                "s",
            )
        else:  # every decoder step reads every encoder state
            for j, x in enumerate(dx):
                for xi in xs:
                    c.arrow(
                        xi + cell / 2,
                        y_enc,
                        x + cell / 2,
                        y_dec + 30,
                        "hl" if j == steps - 1 else "dim",
                    )
            c.text(
                x0 + 150,
                y_enc + 78,
                "each step takes a weighted average of all states",
                "s",
            )
    alt = (
        f"Two recurrent encoder-decoders side by side. Left: the encoder reads {n} inputs one after the other "
        "and only its final state, a single fixed-size vector c, reaches the decoder. Right: with attention, "
        "every decoder step is connected to every encoder state and takes a weighted average of them."
    )
    return c.render(
        760, 250, "Recurrent encoder-decoder without and with attention", alt
    )


def embedding_lookup(ids: Sequence[int], vocab_size: int, d_model: int) -> Diagram:
    """Chapter 1: token ids pick rows of the ``vocab_size × d_model`` table, then × √d_model.

    A table of up to 12 rows is drawn whole; a larger one shows row 0, the rows of ``ids``
    and the last row, with "…" where rows are left out. Each id's arrow ends at its own row.
    """
    if not ids:
        raise ValueError("ids must not be empty")
    if not all(0 <= token < vocab_size for token in ids):
        raise ValueError(f"ids must lie in 0..{vocab_size - 1}, got {list(ids)}")
    wanted = list(range(vocab_size))
    if vocab_size > 12:  # row 0, the rows of the ids and the last row
        wanted = sorted({0, *ids, vocab_size - 1})
    # The table's boxes, top to bottom: a row, or None for "…".
    slots: list[int | None] = []
    for previous, r in zip([-1, *wanted], wanted):
        slots += [None, r] if r > previous + 1 else [r]
    top = {r: 40 + k * 24 for k, r in enumerate(slots) if r is not None}
    c = Canvas()
    c.text(80, 14, "token ids", "b")
    c.text(300, 14, f"embedding table  {vocab_size} × {d_model}", "b")
    c.text(560, 14, f"vectors × √{d_model}", "b")
    for k, token in enumerate(ids):
        y = 40 + k * 30
        c.box(55, y, 50, 24, "emb", str(token))
        c.box(470, y, 180, 24, "emb", f"row {token} × {math.sqrt(d_model):.2f}")
        c.arrow(105, y + 12, 200, top[token] + 12, "dim")
        c.arrow(410, top[token] + 12, 470, y + 12)
    for k, r in enumerate(slots):
        kind = "emb" if r in ids else "off"
        label = "…" if r is None else f"row {r}"
        c.box(200, 40 + k * 24, 210, 24, kind, label, rx=0)
    height = max(60 + len(ids) * 30, 60 + len(slots) * 24)
    alt = (
        f"Each of the token ids {', '.join(map(str, ids))} selects one row of the {vocab_size} by {d_model} "
        "embedding table, the row with its own number; the selected rows, multiplied by the square root "
        f"of {d_model}, are the vectors that enter the model."
    )
    return c.render(680, height, "Token ids to vectors", alt)


def sinusoid_stack(
    d_model: int, positions: int = 48, pairs: Sequence[int] | None = None
) -> Diagram:
    """Chapter 2: the sine of a few dimension pairs ``i`` (dimension ``2i``), one line each.

    The wavelength ``2π · 10000^(2i/d_model)`` grows with ``i``; by default ``i`` = 0, d/32, d/16, d/8.
    """
    check_positive(d_model, "d_model")
    pairs = (
        pairs
        if pairs is not None
        else sorted({0, d_model // 32, d_model // 16, d_model // 8})
    )
    c = Canvas()
    width, lane = 520, 54
    for k, i in enumerate(pairs):
        y0 = 30 + k * lane + lane / 2
        wavelength = 2 * math.pi * 10000 ** (2 * i / d_model)
        points = " ".join(
            f"{90 + p * width / (positions - 1):.1f},{y0 - 18 * math.sin(2 * math.pi * p / wavelength):.1f}"
            for p in [q / 4 for q in range(4 * (positions - 1) + 1)]
        )
        c.parts.append(f'<polyline class="edge" points="{points}"/>')
        c.text(45, y0, f"dim {2 * i}", "s")
        c.text(90 + width + 50, y0, f"λ = {wavelength:.1f}", "s")
    c.text(
        90 + width / 2,
        30 + len(pairs) * lane + 10,
        f"position 0 … {positions - 1}",
        "s",
    )
    alt = (
        f"Sine waves of dimensions {', '.join(str(2 * i) for i in pairs)} of a {d_model}-wide positional "
        "encoding over positions 0 to "
        + f"{positions - 1}; each pair of dimensions has a longer wavelength "
        "than the one before, so together they give every position a distinct pattern."
    )
    return c.render(700, 30 + len(pairs) * lane + 24, "The sinusoid stack", alt)


def qkv_scores(n: int, d_model: int, d_k: int) -> Diagram:
    """Chapter 3: X projected to Q, K, V; the n × n score matrix; softmax; the weighted sum of values."""
    c = Canvas()
    c.box(20, 110, 90, 40, "emb", f"X  {n}×{d_model}")
    for name, y in [("Q", 30), ("K", 110), ("V", 190)]:
        c.arrow(110, 130, 170, y + 20)
        c.box(170, y, 100, 40, "att", f"{name} = X·W{name}")
        c.text(220, y + 52, f"{n}×{d_k}", "s")
    c.arrow(270, 50, 330, 90)
    c.arrow(270, 130, 330, 110)
    size = min(16, 96 / n)
    c.grid(330, 60, [[True] * n for _ in range(n)], size)
    c.text(330 + n * size / 2, 50, f"QKᵀ/√{d_k}   {n}×{n}", "s")
    c.arrow(330 + n * size + 6, 60 + n * size / 2, 470, 60 + n * size / 2)
    c.box(470, 45, 90, 40, "att", "softmax")
    c.text(515, 97, "rows sum to 1", "s")
    c.arrow(560, 65, 620, 125)
    c.arrow(270, 210, 620, 145)
    c.box(620, 115, 110, 40, "out", f"A·V  {n}×{d_k}")
    alt = (
        f"The {n} by {d_model} input X is multiplied by three weight matrices to give queries, keys and values, "
        f"each {n} by {d_k}. Queries times transposed keys, divided by the square root of {d_k}, give the {n} by "
        f"{n} score matrix; a softmax over each row turns it into weights that sum to one, and the weights "
        f"multiply the values to give the {n} by {d_k} output."
    )
    return c.render(750, 250, "Queries, keys, values and the score matrix", alt)


def split_heads(batch: int, n: int, d_model: int, num_heads: int) -> Diagram:
    """Chapter 4: (B, n, d_model) → view → (B, n, h, d_k) → transpose → (B, h, n, d_k) → attention → merge → W^O."""
    if d_model % num_heads:
        raise ValueError(
            f"d_model={d_model} must be divisible by num_heads={num_heads}"
        )
    d_k = d_model // num_heads
    c = Canvas()
    shown = min(num_heads, 8)
    x0, y_top, strip = 20, 40, 24
    steps = [
        (f"({batch}, {n}, {d_model})", "one vector per position"),
        (f"({batch}, {n}, {num_heads}, {d_k})", "view: cut into heads"),
        (f"({batch}, {num_heads}, {n}, {d_k})", "transpose: heads first"),
        (f"({batch}, {num_heads}, {n}, {d_k})", "attention in every head"),
        (f"({batch}, {n}, {d_model})", "merge, then W^O"),
    ]
    for k, (shape, label) in enumerate(steps):
        x = x0 + k * 150
        if k in (0, 4):
            c.box(x, y_top, 100, strip * 2, "emb" if k == 0 else "out")
        else:
            for h in range(shown):
                c.box(
                    x + h * (100 / shown),
                    y_top,
                    100 / shown,
                    strip * 2,
                    "att" if k == 3 else "pe",
                    rx=0,
                )
        c.text(x + 50, y_top + strip * 2 + 16, shape, "s b")
        c.text(x + 50, y_top + strip * 2 + 32, label, "s")
        if k:
            c.arrow(x - 45, y_top + strip, x - 5, y_top + strip)
    alt = (
        f"A tensor of shape {batch}, {n}, {d_model} is viewed as {num_heads} heads of width {d_k}, transposed so "
        f"that the head axis comes before the positions ({batch}, {num_heads}, {n}, {d_k}), attention runs in "
        f"every head at once, and the heads are merged back to {batch}, {n}, {d_model} and mixed by W^O."
    )
    return c.render(760, 140, "Splitting into heads and merging them", alt)


def mask_grids(lengths: Sequence[int], size: int) -> Diagram:
    """Chapter 5: padding masks for sentences of ``lengths``, the causal mask, and both at once (True filled)."""
    if not lengths or any(not 0 < n <= size for n in lengths):
        raise ValueError(f"lengths must be in 1..{size}, got {list(lengths)}")
    c = Canvas()
    cell = 18
    panels = []
    for n in lengths:
        panels.append(
            (
                f"padding, length {n}",
                [[j < n for j in range(size)] for _ in range(size)],
            )
        )
    panels.append(("causal", [[j <= i for j in range(size)] for i in range(size)]))
    n0 = lengths[-1]
    panels.append(
        (
            f"causal and padding ({n0})",
            [[j <= i and j < n0 for j in range(size)] for i in range(size)],
        )
    )
    for k, (title, cells) in enumerate(panels):
        x = 20 + k * (size * cell + 40)
        c.text(x + size * cell / 2, 16, title, "s b")
        c.grid(x, 30, cells, cell, "att")
    c.text(
        20,
        30 + size * cell + 16,
        "rows: queries · columns: keys · filled: may attend (True)",
        "s l",
    )
    alt = (
        f"Boolean masks on a {size} by {size} grid of queries and keys, filled where attention is allowed. "
        f"Padding masks for lengths {', '.join(map(str, lengths))} allow only the real key columns; the causal "
        "mask allows the lower triangle, so each position sees itself and the positions before it; the "
        "decoder's mask is both at once."
    )
    return c.render(
        20 + len(panels) * (size * cell + 40),
        30 + size * cell + 30,
        "Padding and causal masks",
        alt,
    )


def residual_sublayer() -> Diagram:
    """Chapter 6: the residual + LayerNorm sublayer, post-norm (the paper) and pre-norm side by side."""
    c = Canvas()
    for k, (title, order) in enumerate(
        [
            ("post-norm (the paper)", ["sublayer", "add", "LayerNorm"]),
            ("pre-norm", ["LayerNorm", "sublayer", "add"]),
        ]
    ):
        x = 40 + k * 320
        c.text(x + 90, 14, title, "b")
        ys = [200, 140, 80]
        c.text(x + 90, 262, "x", "s")
        c.arrow(x + 90, 252, x + 90, ys[0] + 30)
        for j, (step, y) in enumerate(zip(order, ys)):
            kind = {"sublayer": "att", "add": "norm", "LayerNorm": "norm"}[step]
            label = (
                "attention or FFN"
                if step == "sublayer"
                else ("+" if step == "add" else "LayerNorm")
            )
            c.box(x + 30, y, 120, 30, kind, label)
            if j:
                c.arrow(x + 90, ys[j - 1], x + 90, y + 30)
        add_y = ys[order.index("add")] + 15
        c.path(f"M {x + 90} 240 H {x + 175} V {add_y} H {x + 158}")
        c.arrow(x + 160, add_y, x + 150, add_y)
        c.text(x + 200, 160, "residual", "s")
        c.arrow(x + 90, ys[-1], x + 90, 40)
        c.text(x + 90, 32, "to the next sublayer", "s")
    alt = (
        "Two sublayer connections. Post-norm, as in the paper: the input goes through attention or the "
        "feed-forward block, is added to itself through the residual path, and the sum is normalised. "
        "Pre-norm: the input is normalised first, goes through the sublayer, and the result is added to the "
        "unnormalised input."
    )
    return c.render(680, 275, "The residual and LayerNorm sublayer", alt)


def three_attentions(n: int, m: int) -> Diagram:
    """Chapter 7: where queries, keys and values come from in the three attentions (source n, target m)."""
    c = Canvas()
    # (attention, queries from, keys and values from, weights (q_len, k_len), mask)
    rows = [
        ("encoder self-attention", "source", "source", (n, n), "padding mask"),
        ("decoder masked self-attention", "target", "target", (m, m), "causal mask"),
        (
            "cross-attention",
            "target",
            "memory (encoder output)",
            (m, n),
            "source padding mask",
        ),
    ]
    c.text(110, 14, "attention", "b")
    c.text(300, 14, "queries from", "b")
    c.text(470, 14, "keys and values from", "b")
    c.text(640, 14, "weights", "b")
    # The alt text reads the same rows as the picture, one sentence each.
    sentences = ["The three attentions of the model."]
    for k, (name, q, kv, (q_len, k_len), mask) in enumerate(rows):
        y = 30 + k * 50
        c.box(10, y, 200, 36, "att", name)
        c.box(240, y, 120, 36, "emb" if q == "source" else "out", q)
        kv_kind = "emb" if kv == "source" else ("out" if kv == "target" else "ffn")
        c.box(390, y, 160, 36, kv_kind, kv)
        c.text(640, y + 11, f"{q_len}×{k_len}", "s b")
        c.text(640, y + 26, mask, "s")
        inputs = (
            f"queries, keys and values from the {q}"
            if q == kv
            else f"queries from the {q}, keys and values from the {kv}"
        )
        sentences.append(
            f"{name.capitalize()}: {inputs}, weights {q_len} by {k_len}, {mask}."
        )
    return c.render(720, 185, "The three attentions", " ".join(sentences))


def shifted_target(tokens: Sequence[str]) -> Diagram:
    """Chapter 8: the decoder reads BOS + target and predicts target + EOS, one position later."""
    c = Canvas()
    inputs, outputs = ["<bos>", *tokens], [*tokens, "<eos>"]
    cell = 52
    c.text(60, 30, "decoder input", "s b")
    c.text(60, 110, "predicts", "s b")
    for k, (a, b) in enumerate(zip(inputs, outputs)):
        x = 120 + k * (cell + 6)
        c.box(x, 16, cell, 28, "emb", a)
        c.box(x, 96, cell, 28, "out", b)
        c.arrow(x + cell / 2, 44, x + cell / 2, 96)
        c.text(x + cell / 2, 138, f"t={k}", "s")
    alt = (
        f"Teacher forcing: the decoder reads the target shifted right ({' '.join(inputs)}) and at each position "
        f"t is trained to predict the next token ({' '.join(outputs)})."
    )
    return c.render(140 + len(inputs) * (cell + 6), 150, "The shifted target", alt)


def kv_cache_steps(steps: int) -> Diagram:
    """Chapter 9: the KV cache after each decoding step: one new key/value row per step, old rows reused."""
    check_positive(steps, "steps")
    c = Canvas()
    cell = 26
    for s in range(1, steps + 1):
        y = 20 + (s - 1) * (cell + 12)
        c.text(40, y + cell / 2, f"step {s}", "s b")
        for j in range(s):
            kind = "pe" if j == s - 1 else "att"
            c.box(
                90 + j * (cell + 4),
                y,
                cell,
                cell,
                kind,
                f"k{j}",
                "hl" if j == s - 1 else "",
            )
        c.text(
            90 + steps * (cell + 4) + 110,
            y + cell / 2,
            f"1 new row, {s - 1} reused",
            "s",
        )
    alt = (
        f"The key and value cache over {steps} decoding steps: at step s the cache holds s rows; only the newest "
        "row is computed, the rows of earlier steps are reused, so each step costs one position instead of all."
    )
    return c.render(
        90 + steps * (cell + 4) + 220,
        30 + steps * (cell + 12),
        "The KV cache growing",
        alt,
    )
