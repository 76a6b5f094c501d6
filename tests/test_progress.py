"""transformer_book.progress: tqdm in a terminal, one output redrawn in place in a notebook.

The last test executes a small notebook in a real kernel (nbclient, as the book's build does)
and checks that the stored output is one line, however many times the bar was redrawn.
"""

from __future__ import annotations

import io
import re

import nbformat
import pytest
from book_helpers import PROGRESS_LINE

from transformer_book.progress import (
    ProgressBar,
    format_seconds,
    format_value,
    in_notebook_kernel,
)

# The page check's pattern for one drawing of a bar (tests/book_helpers.py), in Python's syntax.
BAR = re.compile(PROGRESS_LINE)
SUMMARY = re.compile(r"^training: 200/200 steps in \d+\.\d s, loss 0\.\d{3}, lr 0\.001$")


class FakeDisplay:
    """Stands in for IPython's ``display(..., display_id=True)``: records the first bundle and
    every update of it."""

    def __init__(self) -> None:
        self.bundles: list[dict[str, str]] = []

    def __call__(self, bundle: dict[str, str], raw: bool = False, display_id: bool = False):
        assert raw and display_id, "the bar must be displayed raw, with a display id to update"
        self.bundles.append(bundle)
        return self

    def update(self, bundle: dict[str, str], raw: bool = False) -> None:
        assert raw
        self.bundles.append(bundle)


def notebook_bar(total: int | None, interval: float, **kwargs) -> tuple[ProgressBar, FakeDisplay]:
    shown = FakeDisplay()
    bar = ProgressBar(total, "training", "step", mode="notebook", interval=interval, display=shown, **kwargs)
    return bar, shown


def test_values_and_times_read_well():
    assert format_value("0.412") == "0.412"
    assert format_value(0.41234) == "0.412"
    assert format_value(1e-3) == "0.001"
    assert format_value(2.5e-5) == "2.5e-05"
    assert format_value(12345.6) == "12,346"
    assert format_value(1000) == "1,000"
    assert format_value(True) == "True"
    assert format_seconds(12.34) == "12.3 s"
    assert format_seconds(512.4) == "512 s"
    assert format_seconds(725) == "12 min 5 s"


def test_line_is_tqdms_bar_and_summary_is_one_line():
    bar, _ = notebook_bar(1000, interval=3600)
    bar.update(450)
    bar.set_postfix(loss=0.41234, lr="1.00e-03")
    line = bar.line()
    assert line.startswith("training:  45%|") and "450/1000" in line and "loss=0.412, lr=1.00e-03" in line, line
    assert BAR.search(line), line
    bar.update(550)
    bar.close()
    summary = bar.summary()
    assert re.fullmatch(r"training: 1000/1000 steps in \d+\.\d s, loss 0\.412, lr 1\.00e-03", summary), summary
    assert "\n" not in summary and not BAR.search(summary), summary


def test_summary_of_a_run_stopped_early_and_of_an_unknown_total():
    bar, _ = notebook_bar(1000, interval=3600)
    bar.update(430)
    bar.set_postfix(metric=0.99)
    bar.close()
    assert re.fullmatch(r"training: 430/1000 steps in \d+\.\d s, metric 0\.99", bar.summary()), bar.summary()
    bar, _ = notebook_bar(None, interval=3600)
    bar.update(7)
    bar.close()
    assert re.fullmatch(r"training: 7 steps in \d+\.\d s", bar.summary()), bar.summary()


def test_notebook_bar_redraws_at_most_every_interval_and_ends_as_the_summary():
    bar, shown = notebook_bar(200, interval=3600)
    with bar:
        for step in range(200):
            bar.update(1)
            bar.set_postfix(loss=1 / (step + 1))
    # The first drawing, the one at 200/200 (the bar is full), and the summary at close.
    assert len(shown.bundles) == 3, [b["text/plain"] for b in shown.bundles]
    first, full, last = shown.bundles
    assert first["text/plain"].startswith("training:   0%|") and "<progress" in first["text/html"]
    assert "200/200" in full["text/plain"] and 'value="200" max="200"' in full["text/html"]
    assert set(last) == {"text/plain"}, "the closed bar is plain text: the built page shows it as printed output"
    assert re.fullmatch(r"training: 200/200 steps in \d+\.\d s, loss 0\.005", last["text/plain"]), last


def test_notebook_bar_with_no_interval_redraws_every_update():
    bar, shown = notebook_bar(50, interval=0.0)
    for _ in range(50):
        bar.update(1)
    bar.close()
    bar.close()  # a second close draws nothing more
    assert len(shown.bundles) == 1 + 50 + 1
    assert all(len(BAR.findall(b["text/plain"])) == 1 for b in shown.bundles[:-1])


def test_html_is_escaped():
    bar, shown = notebook_bar(10, interval=0.0)
    bar.set_postfix(note="<b>&</b>")
    bar.update(1)
    assert "&lt;b&gt;&amp;&lt;/b&gt;" in shown.bundles[-1]["text/html"]
    assert "<b>" not in shown.bundles[-1]["text/html"]


def test_terminal_bar_is_tqdm_on_the_given_file():
    out = io.StringIO()
    with ProgressBar(100, desc="training", unit="step", mode="terminal", file=out, interval=0) as bar:
        for _ in range(100):
            bar.update(1)
            bar.set_postfix(loss=0.25)
    text = out.getvalue()
    assert "training: 100%|" in text and "100/100" in text and "loss=0.25" in text, text
    assert "steps in" not in text, "the terminal keeps tqdm's own last drawing, no summary"


def test_terminal_bar_resumes_from_initial():
    out = io.StringIO()
    bar = ProgressBar(100, desc="dates", unit="step", initial=40, mode="terminal", file=out, interval=0)
    bar.update(60)
    bar.close()
    assert "100/100" in out.getvalue() and bar.n == 100


def test_write_goes_around_the_bar(capsys):
    bar = ProgressBar(10, mode="terminal", file=io.StringIO())
    bar.write('{"step": 5}')
    bar.close()
    nb, shown = notebook_bar(10, interval=3600)
    nb.write("a line")
    nb.close()
    assert capsys.readouterr().out == '{"step": 5}\na line\n'


def test_disabled_bar_shows_nothing(capsys):
    out = io.StringIO()
    for mode in ("terminal", "notebook", "auto"):
        with ProgressBar(10, enabled=False, mode=mode, file=out) as bar:
            bar.update(10)
            bar.set_postfix(loss=1.0)
    assert out.getvalue() == "" and capsys.readouterr() == ("", "")


def test_bad_arguments():
    with pytest.raises(ValueError, match="total"):
        ProgressBar(-1)
    with pytest.raises(ValueError, match="mode"):
        ProgressBar(10, mode="browser")


def test_outside_a_kernel_the_bar_is_tqdm():
    assert not in_notebook_kernel()
    bar = ProgressBar(3, file=io.StringIO())
    assert not bar.notebook
    bar.close()


LOOP_CELL = """\
import time
from transformer_book.progress import ProgressBar, in_notebook_kernel

assert in_notebook_kernel()
with ProgressBar(200, desc="training", unit="step", interval=0.0) as bar:
    for step in range(200):
        time.sleep(0.001)
        bar.update(1)
        bar.set_postfix(loss=0.5 - step / 1000, lr=1e-3)
print("done")
"""


def test_in_a_kernel_the_executed_notebook_keeps_one_line():
    """200 redraws in a real kernel (nbclient applies each update to the stored output): the
    executed notebook holds the summary alone, as the built page will."""
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("1 + 1"), nbformat.v4.new_code_cell(LOOP_CELL)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    outputs = nb.cells[1].outputs
    displays = [o for o in outputs if o.output_type in ("display_data", "execute_result")]
    streams = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert len(displays) == 1, outputs
    text = displays[0].data["text/plain"]
    assert set(displays[0].data) == {"text/plain"}, displays[0].data
    assert SUMMARY.fullmatch(text), text
    assert streams == "done\n", outputs
    assert not BAR.search(text) and not BAR.search(streams), outputs
