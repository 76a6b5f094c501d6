"""The chart helpers: the data they ship and the checks on their arguments."""

import math

import pytest
import torch

from transformer_book.book import viz
from transformer_book.training import History


def test_rounded_list_rounds_in_float64():
    values = torch.tensor([[0.1234567, -2.0], [1 / 3, 5.55555]], dtype=torch.float32)
    assert viz.rounded_list(values) == [[0.1235, -2.0], [0.3333, 5.5556]]
    # float32 0.1234 turned into a Python float keeps a tail of digits; rounding in float64 does not.
    assert viz.rounded_list(torch.tensor([0.1234]), 4) == [0.1234]
    assert float(torch.tensor(0.1234)) != 0.1234


def test_matrix_frame_is_long_and_rounded():
    frame = viz.matrix_frame(torch.tensor([[1.0, 2.0], [3.0, 1 / 3]]), ["a", "b"], ["x", "y"])
    assert list(frame["row"]) == ["a", "a", "b", "b"]
    assert list(frame["col"]) == ["x", "y", "x", "y"]
    assert list(frame["value"]) == [1.0, 2.0, 3.0, 0.3333]


def test_formula_heatmap_runs_the_steps_in_order():
    steps = {"angle": "datum.p * pow(2, datum.c)", "value": "sin(datum.angle)"}
    spec = viz.formula_heatmap(steps, 3, 4, "a title", x_title="column", y_title="row").to_dict()
    assert spec["title"] == "a title"
    assert spec["data"]["sequence"] == {"start": 0, "stop": 12, "as": "cell"}
    fields = [t["as"] for t in spec["transform"]]
    assert fields == ["p", "c", "angle", "value", "p_end", "c_end"]
    assert spec["transform"][2]["calculate"] == steps["angle"]
    assert spec["encoding"]["x"]["title"] == "column" and spec["encoding"]["y"]["title"] == "row"
    assert spec["encoding"]["x"]["scale"]["domain"] == [0, 4]
    assert spec["encoding"]["y"]["scale"] == {"domain": [0, 3], "nice": False, "reverse": True}


@pytest.mark.parametrize(
    ("steps", "rows", "message"),
    [({"value": "1"}, 0, "rows"), ({"value": "1", "angle": "2"}, 2, "value")],
)
def test_formula_heatmap_rejects_bad_arguments(steps, rows, message):
    with pytest.raises(ValueError, match=message):
        viz.formula_heatmap(steps, rows, 4, "title")


def test_heatmap_titles_and_tooltips():
    chart = viz.heatmap(torch.eye(2) * math.pi, "t", "x axis", "y axis").to_dict()
    assert chart["title"] == "t"
    assert chart["encoding"]["x"]["title"] == "x axis"
    assert chart["encoding"]["y"]["title"] == "y axis"
    assert {v["value"] for v in chart["datasets"][next(iter(chart["datasets"]))]} == {0.0, 3.1416}


def test_attention_layers_chart_menus_and_cropping():
    weights = torch.softmax(torch.randn(2, 3, 5), dim=-1)  # (heads, q_len, k_len)
    one = viz.attention_layers_chart([weights], ["a", "b", "c"], list("vwxyz")).to_dict()
    assert [p["name"] for p in one["params"]] == ["head"]
    assert len(one["datasets"][next(iter(one["datasets"]))]) == 2 * 3 * 5
    two = viz.attention_layers_chart(
        [weights, weights], ["a", "b"], ["v", "w", "x"], "t", "queries", "keys", layer=1, head=1
    ).to_dict()
    assert [p["name"] for p in two["params"]] == ["layer", "head"]
    assert [p["value"] for p in two["params"]] == [1, 1]
    assert len(two["datasets"][next(iter(two["datasets"]))]) == 2 * 2 * 2 * 3  # cut to the labels
    assert two["encoding"]["x"]["title"] == "keys" and two["encoding"]["y"]["title"] == "queries"
    with pytest.raises(ValueError, match="out of range"):
        viz.attention_layers_chart([weights], head=2)
    with pytest.raises(ValueError, match="heads, q_len, k_len"):
        viz.attention_layers_chart([weights[0]])


def test_training_curves_loss_floor_and_exact_match():
    history = History(step=[1, 2, 3], loss=[2.0, 1.0, 0.7], lr=[1e-4, 2e-4, 3e-4], eval_step=[3], eval_metric=[0.5])
    spec = viz.training_curves({"copy": (history, 0.6)}, held_out=1000).to_dict()
    loss_chart, accuracy_chart = spec["vconcat"]
    assert [layer["mark"]["type"] for layer in loss_chart["layer"]] == ["line", "rule"]
    assert accuracy_chart["title"] == "Exact match on the 1,000 held-out examples"
    assert accuracy_chart["encoding"]["x"]["scale"]["domain"] == [0, 3]
    datasets = list(spec["datasets"].values())
    assert [{"task": "copy", "floor": 0.6}] in datasets
    assert [{"task": "copy", "step": 3, "exact match": 0.5}] in datasets
    with pytest.raises(ValueError, match="at least one"):
        viz.training_curves({}, held_out=10)
