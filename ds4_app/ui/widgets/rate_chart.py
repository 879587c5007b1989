"""A labelled sparkline with the current value beside it (aggregate tok/s, TTFT)."""

from __future__ import annotations

from typing import Sequence

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Sparkline, Static


class RateChart(Horizontal):
    """``label  ▁▂▅▇▆▃  value``: one sparkline over the last minute (one bar per bucket)."""

    DEFAULT_CSS = """
    RateChart {
        height: 1;
    }
    RateChart > .label {
        width: 7;
        color: $text-muted;
    }
    RateChart > Sparkline {
        width: 1fr;
        height: 1;
    }
    RateChart > .value {
        width: 11;
        text-align: right;
    }
    """

    def __init__(self, label: str, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._label = label
        self._value = "–"

    def compose(self) -> ComposeResult:
        yield Static(self._label, classes="label")
        yield Sparkline([], summary_function=max)
        yield Static("–", classes="value", markup=False)

    def show(self, data: Sequence[float], value: str) -> None:
        """Plot ``data`` (oldest first) and print ``value``; no-op when nothing changed."""
        spark = self.query_one(Sparkline)
        points = list(data)
        if list(spark.data or []) != points:
            spark.data = points
        if value != self._value:
            # A fixed-size cell: a repaint, not a layout pass of the whole screen (Static.update's
            # default), at every stats tick.
            self._value = value
            self.query_one(".value", Static).update(value, layout=False)
