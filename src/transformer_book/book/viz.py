"""Charts used across the chapters. They read tensors and never feed back into the model.

Altair charts stay interactive in the static book (no kernel); matplotlib and
seaborn draw the static figures. Heatmaps send a compact long table (one row
per cell, values rounded) so pages stay small.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from importlib.util import find_spec
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..checks import check_positive, require_tensor, shape_of
from ..training import History

# The model needs none of the chart libraries; the charts need all four (matplotlib and
# seaborn only inside mask_plot, which imports them itself: seaborn takes about a second).
for _library in ("altair", "pandas", "matplotlib", "seaborn"):
    if find_spec(_library) is None:
        raise ImportError(
            f"transformer_book.book.viz needs the chart libraries ({_library} is missing): "
            'pip install "transformer-book[book]"'
        )

import altair as alt  # noqa: E402 - after the check, so that a missing library gets its message
import pandas as pd  # noqa: E402

if TYPE_CHECKING:
    import matplotlib.pyplot as plt


def _labels(labels: Sequence[str] | None, size: int) -> list[str]:
    if labels is None:
        return [str(i) for i in range(size)]
    if len(labels) != size:
        raise ValueError(f"expected {size} labels, got {len(labels)}")
    return [str(label) for label in labels]


def rounded_list(values: Tensor, decimals: int = 4) -> list:
    """``values`` of any shape as nested Python lists of floats rounded to ``decimals``.

    Rounds in float64, so a chart's JSON holds ``0.1234``, not the long tail of digits
    that a float32 turned into a Python float keeps (``0.12340000271``).
    """
    require_tensor(values, "values")
    return values.detach().double().cpu().round(decimals=decimals).tolist()


def matrix_frame(
    matrix: Tensor,
    row_labels: Sequence[str] | None = None,
    col_labels: Sequence[str] | None = None,
    decimals: int = 4,
) -> pd.DataFrame:
    """A 2-D tensor as a long table with columns ``row``, ``col``, ``row_index``, ``col_index``, ``value``."""
    require_tensor(matrix, "matrix")
    if matrix.dim() != 2:
        raise ValueError(
            f"matrix must be 2-D (rows, cols), got shape {shape_of(matrix)}"
        )
    rows, cols = matrix.shape
    row_names, col_names = _labels(row_labels, rows), _labels(col_labels, cols)
    values = rounded_list(matrix.flatten(), decimals)
    return pd.DataFrame(
        {
            "row": [row_names[r] for r in range(rows) for _ in range(cols)],
            "col": [col_names[c] for _ in range(rows) for c in range(cols)],
            "row_index": [r for r in range(rows) for _ in range(cols)],
            "col_index": [c for _ in range(rows) for c in range(cols)],
            "value": values,
        }
    )


def _cell_chart(
    data: pd.DataFrame,
    title: str,
    x_title: str,
    y_title: str,
    color: alt.Color,
    tooltip: list[alt.Tooltip],
    width: int,
    height: int,
) -> alt.Chart:
    """The cells of a :func:`matrix_frame` table as coloured rectangles, ``col`` across.

    Rows and columns keep their order of first appearance (tokens, not alphabetical).
    """
    return (
        alt.Chart(data, title=title)
        .mark_rect()
        .encode(
            x=alt.X("col:N", sort=list(dict.fromkeys(data["col"])), title=x_title),
            y=alt.Y("row:N", sort=list(dict.fromkeys(data["row"])), title=y_title),
            color=color,
            tooltip=tooltip,
        )
        .properties(width=width, height=height)
    )


def heatmap(
    matrix: Tensor,
    title: str,
    x_title: str,
    y_title: str,
    value_title: str = "value",
    row_labels: Sequence[str] | None = None,
    col_labels: Sequence[str] | None = None,
    scheme: str = "viridis",
    width: int = 360,
    height: int = 300,
) -> alt.Chart:
    """An interactive heatmap of ``matrix (rows, cols)`` with a tooltip per cell.

    Labelled axes keep the given order (tokens, not alphabetical); unlabelled
    ones are numeric indices.
    """
    color = alt.Color("value:Q", title=value_title, scale=alt.Scale(scheme=scheme))
    tooltip = [
        alt.Tooltip("row:N", title=y_title),
        alt.Tooltip("col:N", title=x_title),
        alt.Tooltip("value:Q", title=value_title, format=".4f"),
    ]
    data = matrix_frame(matrix, row_labels, col_labels)
    return _cell_chart(data, title, x_title, y_title, color, tooltip, width, height)


def attention_layers_chart(
    weights_by_layer: Sequence[Tensor],
    query_labels: Sequence[str] | None = None,
    key_labels: Sequence[str] | None = None,
    title: str = "Attention weights",
    y_title: str = "query (attending)",
    x_title: str = "key (attended to)",
    layer: int = 0,
    head: int = 0,
    width: int = 340,
    height: int = 300,
) -> alt.Chart:
    """One heatmap of attention weights per layer and head, picked with a layer menu and a head slider.

    ``weights_by_layer``: one tensor ``(heads, q_len, k_len)`` per layer; the menu appears
    when there are several (``[weights]``, a single layer, gets the head slider alone).
    Labels name the queries and keys; when given, the weights are cut to
    ``(heads, len(query_labels), len(key_labels))``, so padded positions can be left out.
    ``layer`` and ``head`` are the ones the chart opens on.
    """
    if len(weights_by_layer) == 0:
        raise ValueError("weights_by_layer must hold at least one layer's weights")
    frames = []
    for layer_index, weights in enumerate(weights_by_layer):
        require_tensor(weights, "weights")
        if weights.dim() != 3:
            raise ValueError(
                f"weights must be (heads, q_len, k_len), got shape {shape_of(weights)}"
            )
        rows = weights.shape[1] if query_labels is None else len(query_labels)
        cols = weights.shape[2] if key_labels is None else len(key_labels)
        for head_index in range(weights.shape[0]):
            frame = matrix_frame(
                weights[head_index, :rows, :cols], query_labels, key_labels, decimals=3
            )
            frames.append(frame.assign(layer=layer_index, head=head_index))
    data = pd.concat(frames, ignore_index=True)
    heads = int(data["head"].max()) + 1
    if not (0 <= layer < len(weights_by_layer) and 0 <= head < heads):
        raise ValueError(
            f"layer={layer}, head={head} out of range: {len(weights_by_layer)} layers, {heads} heads"
        )
    head_param = alt.param(
        name="head",
        value=head,
        bind=alt.binding_range(min=0, max=heads - 1, step=1, name="head "),
    )
    params, keep = [head_param], alt.datum.head == head_param
    if len(weights_by_layer) > 1:
        options = list(range(len(weights_by_layer)))
        layer_param = alt.param(
            name="layer",
            value=layer,
            bind=alt.binding_select(options=options, name="layer "),
        )
        params, keep = (
            [layer_param, head_param],
            (alt.datum.layer == layer_param) & keep,
        )
    color = alt.Color(
        "value:Q", title="weight", scale=alt.Scale(scheme="blues", domain=[0, 1])
    )
    tooltip = [
        alt.Tooltip("head:Q"),
        alt.Tooltip("row:N", title="query"),
        alt.Tooltip("col:N", title="key"),
        alt.Tooltip("value:Q", title="weight", format=".3f"),
    ]
    chart = _cell_chart(data, title, x_title, y_title, color, tooltip, width, height)
    return chart.add_params(*params).transform_filter(keep)


def mask_plot(
    mask: Tensor,
    title: str,
    query_labels: Sequence[str] | None = None,
    key_labels: Sequence[str] | None = None,
    ax: plt.Axes | None = None,
    x_title: str = "key position (attended to)",
    y_title: str = "query position (attending)",
) -> plt.Axes:
    """A static picture of a boolean mask ``(q_len, k_len)``: dark = may attend, light = hidden."""
    # Imported here: seaborn loads scipy.stats, about a second in every kernel that imports viz.
    import matplotlib.pyplot as plt
    import seaborn as sns

    require_tensor(mask, "mask")
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise ValueError(
            f"mask must be a 2-D boolean tensor, got {mask.dtype} {shape_of(mask)}"
        )
    if ax is None:
        _, ax = plt.subplots(
            figsize=(0.5 * mask.shape[1] + 1.5, 0.5 * mask.shape[0] + 1)
        )
    sns.heatmap(
        mask.cpu().int().numpy(),
        ax=ax,
        cmap=sns.color_palette(["#f0f0f0", "#2b6cb0"], as_cmap=True),
        vmin=0,
        vmax=1,
        cbar=False,
        linewidths=0.5,
        linecolor="white",
        annot=True,
        fmt="d",
        xticklabels=_labels(key_labels, mask.shape[1]),
        yticklabels=_labels(query_labels, mask.shape[0]),
    )
    ax.set_title(title)
    ax.set_xlabel(x_title)
    ax.set_ylabel(y_title)
    return ax


def formula_heatmap(
    steps: Mapping[str, str],
    rows: int,
    cols: int,
    title: str,
    width: int = 640,
    height: int = 250,
    x_title: str = "column (dimension)",
    y_title: str = "position",
    domain: tuple[float, float] = (-1.0, 1.0),
) -> alt.Chart:
    """A ``(rows, cols)`` heatmap whose cells the browser computes; no table is shipped.

    Each cell starts with fields ``p`` (its row, 0 on top) and ``c`` (its column);
    ``steps`` are Vega expressions, run in order, each adding the field it is named after
    (``{"angle": "datum.p * 0.5", "value": "sin(datum.angle)"}``). The last one must
    be ``value``, the colour, on a red-blue scale over ``domain``. An expression may
    name a chart parameter the caller adds with ``chart.add_params``.
    """
    check_positive(rows, "rows")
    check_positive(cols, "cols")
    if list(steps)[-1:] != ["value"]:
        raise ValueError(f"steps must end with the field 'value', got {list(steps)}")
    chart = alt.Chart(alt.sequence(0, rows * cols, as_="cell"), title=title)
    chart = chart.transform_calculate(
        p=f"floor(datum.cell / {cols})", c=f"datum.cell % {cols}"
    )
    for name, expression in steps.items():
        chart = chart.transform_calculate(**{name: expression})
    chart = chart.transform_calculate(p_end="datum.p + 1", c_end="datum.c + 1")
    return (
        chart.mark_rect()
        .encode(
            x=alt.X(
                "c:Q", title=x_title, scale=alt.Scale(domain=[0, cols], nice=False)
            ),
            x2="c_end:Q",
            y=alt.Y(
                "p:Q",
                title=y_title,
                scale=alt.Scale(domain=[0, rows], nice=False, reverse=True),
            ),
            y2="p_end:Q",
            color=alt.Color(
                "value:Q",
                title="value",
                scale=alt.Scale(scheme="redblue", domain=list(domain)),
            ),
            tooltip=[
                alt.Tooltip("p:Q", title=y_title),
                alt.Tooltip("c:Q", title=x_title),
                alt.Tooltip("value:Q", format=".4f"),
            ],
        )
        .properties(width=width, height=height)
    )


def training_curves(
    runs: Mapping[str, tuple[History, float]], held_out: int
) -> alt.VConcatChart:
    """Training runs: the loss at every step above, held-out exact match below.

    ``runs`` maps a task's name to its :class:`~transformer_book.training.History` and
    its loss floor (drawn dashed: label smoothing's least possible loss). The loss axis
    is logarithmic; clicking a task in the legend highlights its curves. ``held_out`` is
    the number of examples exact match was measured on (it goes in the title).
    """
    if not runs:
        raise ValueError("runs must hold at least one (History, loss floor) pair")
    curves = pd.DataFrame(
        [
            {"task": name, "step": s, "loss": round(loss, 4), "lr": float(f"{lr:.4g}")}
            for name, (history, _) in runs.items()
            for s, loss, lr in zip(history.step, history.loss, history.lr)
        ]
    )
    floors = pd.DataFrame(
        {"task": list(runs), "floor": [round(floor, 4) for _, floor in runs.values()]}
    )
    accuracy = pd.DataFrame(
        [
            {"task": name, "step": s, "exact match": metric}
            for name, (history, _) in runs.items()
            for s, metric in zip(history.eval_step, history.eval_metric)
        ]
    )
    highlight = alt.selection_point(fields=["task"], bind="legend")
    legend = alt.Legend(orient="bottom", titleLimit=300)
    color = alt.Color("task:N", title="task (click to highlight)", legend=legend)
    step_axis = alt.X(
        "step:Q",
        title="training step",
        scale=alt.Scale(domain=[0, int(curves["step"].max())]),
    )
    fade = alt.condition(highlight, alt.value(1.0), alt.value(0.15))
    log_scale = alt.Scale(type="log", domain=[0.5, 4], nice=False, clamp=True)
    loss_lines = (
        alt.Chart(curves, title="Training loss per step (label-smoothed cross-entropy)")
        .mark_line()
        .encode(
            x=step_axis,
            color=color,
            opacity=fade,
            y=alt.Y("loss:Q", title="loss (log scale)", scale=log_scale),
            tooltip=[
                "task:N",
                "step:Q",
                alt.Tooltip("loss:Q", format=".4f"),
                alt.Tooltip("lr:Q", title="learning rate", format=".2e"),
            ],
        )
        .add_params(highlight)
    )
    floor_tip = alt.Tooltip("floor:Q", title="loss floor H(q)", format=".4f")
    floor_rules = (
        alt.Chart(floors)
        .mark_rule(strokeDash=[5, 4])
        .encode(y="floor:Q", color=color, tooltip=["task:N", floor_tip])
    )
    accuracy_chart = (
        alt.Chart(accuracy, title=f"Exact match on the {held_out:,} held-out examples")
        .mark_line(point=True)
        .encode(
            x=step_axis,
            color=color,
            opacity=fade,
            y=alt.Y(
                "exact match:Q",
                title="exact match",
                axis=alt.Axis(format="%"),
                scale=alt.Scale(domain=[0, 1]),
            ),
            tooltip=["task:N", "step:Q", alt.Tooltip("exact match:Q", format=".1%")],
        )
    )
    return alt.vconcat(
        (loss_lines + floor_rules).properties(width=560, height=240),
        accuracy_chart.properties(width=560, height=140),
    )
