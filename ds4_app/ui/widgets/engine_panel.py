"""The engine panel: lanes, the page pool, throughput and TTFT over the last minute, the
composition of the last step, and what the engine runs on.

It only draws snapshots it is handed (``show``), at most as often as the bridge polls (10 Hz);
each part updates in place and skips work when its numbers did not change.
"""

from __future__ import annotations

from typing import Mapping

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from ds4_app.engine.api import StatsSnapshot

from ..formatting import rate, seconds
from .engine_info import EngineInfo
from .lanes_table import LanesTable
from .rate_chart import RateChart
from .stacked_bar import Segment, StackedBar


class EnginePanel(VerticalScroll):
    """A side panel; hidden and shown by the App (toggle key, or terminal width)."""

    DEFAULT_CSS = """
    EnginePanel {
        width: 60;
        height: 1fr;
        border-left: vkey $primary 40%;
        padding: 0 1;
    }
    EnginePanel > .heading {
        text-style: bold;
        color: $primary;
        margin-top: 1;
    }
    EnginePanel > .heading.first {
        margin-top: 0;
    }
    """

    def compose(self) -> ComposeResult:
        yield Static("Engine", classes="heading first")
        yield EngineInfo(id="engine-info")
        yield Static("Lanes", classes="heading")
        yield LanesTable(id="lanes")
        yield Static("Page pool", classes="heading")
        yield StackedBar(id="pool")
        yield Static("Throughput (last minute)", classes="heading")
        yield RateChart("tok/s", id="tok-s")
        yield RateChart("TTFT", id="ttft")
        yield Static("Last step", classes="heading")
        yield StackedBar(id="step")

    def show(self, snapshot: StatsSnapshot, titles: Mapping[str, str]) -> None:
        """Draw ``snapshot``; ``titles`` maps session ids to tab titles for the lanes table."""
        self.query_one(EngineInfo).show(snapshot)
        self.query_one(LanesTable).show(snapshot.lanes, titles)
        pool = snapshot.pool
        self.query_one("#pool", StackedBar).set(
            [Segment(pool.used, "$error"), Segment(pool.reserved, "$warning")], pool.n_pages,
            f"used {pool.used} · reserved {pool.reserved} · free {pool.free} of {pool.n_pages} pages\n"
            f"evictions {pool.evictions} · preemptions {pool.preemptions}")
        self.query_one("#tok-s", RateChart).show(snapshot.tok_s_history, f"{rate(snapshot.agg_tok_s)} tok/s")
        ttft = snapshot.ttft_recent
        self.query_one("#ttft", RateChart).show(ttft, seconds(ttft[-1]) if ttft else "–")
        rows = snapshot.step_decode_rows + snapshot.step_prompt_rows
        self.query_one("#step", StackedBar).set(
            [Segment(snapshot.step_decode_rows, "$success"), Segment(snapshot.step_prompt_rows, "$warning")], rows,
            f"{snapshot.step_decode_rows} decode + {snapshot.step_prompt_rows} prompt rows (step {snapshot.steps})\n"
            f"running {snapshot.n_running} · queued {snapshot.queue_len}")

    def show_unavailable(self, reason: str) -> None:
        """No engine (loading, or failed): say why, and clear the lanes."""
        self.query_one(EngineInfo).show_text(reason)
        self.query_one(LanesTable).show((), {})
