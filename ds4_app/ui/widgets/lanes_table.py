"""The lanes table: one row per engine slot (or queued request), updated cell by cell."""

from __future__ import annotations

from typing import Mapping, Sequence

from textual.content import Content
from textual.widgets import DataTable

from ds4_app.engine.api import LaneStats

from ..formatting import rate

# (key, label, width): fixed widths, so the table does not jump as values change.
COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("slot", "slot", 4), ("session", "session", 14), ("state", "state", 8), ("pos", "pos/ctx", 9),
    ("pages", "pages", 5), ("tok_s", "tok/s", 5),
)
STATE_STYLES = {"decode": "$success", "prefill": "$warning", "queued": "$text-muted", "resident": "$accent"}
SESSION_CHARS = 14


def lane_key(lane: LaneStats) -> str:
    """A stable row key: the slot while it has one, else the queued request."""
    return f"slot-{lane.slot}" if lane.slot is not None else f"queued-{lane.request_id}"


def lane_cells(lane: LaneStats, titles: Mapping[str, str]) -> tuple[Content, ...]:
    """The row of one lane: slot, session title, state, position/context, pages, tok/s."""
    session = titles.get(lane.session, lane.session) if lane.session else "—"
    if len(session) > SESSION_CHARS:
        session = session[: SESSION_CHARS - 1] + "…"
    return (
        Content("–" if lane.slot is None else str(lane.slot)),
        Content(session),
        Content.styled(lane.state, STATE_STYLES.get(lane.state, "")),
        Content(f"{lane.position}/{lane.context}"),
        Content(str(lane.pages)),
        Content(rate(lane.tok_s) if lane.state == "decode" else "–"),
    )


class LanesTable(DataTable):
    """Rows are added, updated in place and removed as lanes come and go; never rebuilt per tick
    (a rebuild would reset scrolling and re-measure every cell 10 times a second)."""

    DEFAULT_CSS = """
    LanesTable {
        height: auto;
        max-height: 14;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="none", zebra_stripes=True, show_cursor=False)
        self._shown: dict[str, tuple[Content, ...]] = {}

    def on_mount(self) -> None:
        for key, label, width in COLUMNS:
            self.add_column(label, key=key, width=width)

    def show(self, lanes: Sequence[LaneStats], titles: Mapping[str, str]) -> None:
        """Make the rows match ``lanes`` (in slot order, queued requests last)."""
        wanted = {lane_key(lane): lane_cells(lane, titles) for lane in
                  sorted(lanes, key=lambda l: (l.slot is None, l.slot if l.slot is not None else 0))}
        for key in [k for k in self._shown if k not in wanted]:
            self.remove_row(key)
            del self._shown[key]
        for key, cells in wanted.items():
            old = self._shown.get(key)
            if old is None:
                self.add_row(*cells, key=key)
            elif old != cells:
                for (column, _, _), new_cell, old_cell in zip(COLUMNS, cells, old):
                    if new_cell != old_cell:
                        self.update_cell(key, column, new_cell)
            self._shown[key] = cells

    @property
    def keys(self) -> list[str]:
        """Row keys in display order (for tests and the panel)."""
        return [str(row.key.value) for row in self.ordered_rows]
