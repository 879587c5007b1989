"""The lanes table: one row per engine slot (or queued request), drawn as one block of text.

It was a ``DataTable``. Measured with tests/ui/test_latency.py (six lanes decoding, stats at
10 Hz), redrawing its seven lines cost 7-14 ms per frame, half of an average frame, and one
redraw took 122 ms: the cells change every tick (position, tok/s), and DataTable renders each
cell through Rich with its caches dropped by ``update_cell``. The panel needs no cursor, no
scrolling and no sorting, so the table is now a widget that renders its rows as one ``Content``
with fixed column widths, and only when a row changed.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from textual.content import Content
from textual.widget import Widget

from ds4_app.engine.api import LaneStats

from ..formatting import rate

# (key, label, width): fixed widths, so the table does not jump as values change.
COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("slot", "slot", 4), ("session", "session", 14), ("state", "state", 8), ("pos", "pos/ctx", 9),
    ("pages", "pages", 5), ("tok_s", "tok/s", 5),
)
COLUMN_INDEX = {key: i for i, (key, _, _) in enumerate(COLUMNS)}
STATE_STYLES = {"decode": "$success", "prefill": "$warning", "queued": "$text-muted", "resident": "$accent"}
SESSION_CHARS = 14
MAX_ROWS = 13  # more lanes than this (a long queue) end in a "+N more" line
HEADER_STYLE = "bold $text-muted"
STRIPE_STYLE = "on $boost"  # every other row, as DataTable's zebra stripes were


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


def _line(cells: Sequence[Content]) -> Content:
    """Cells padded to their column widths, one space either side (as DataTable's padding)."""
    parts: list[Content] = []
    for cell, (_, _, width) in zip(cells, COLUMNS):
        text = cell if cell.cell_length <= width else cell.truncate(width, ellipsis=True)
        parts.append(Content(" ") + text.pad_right(width - text.cell_length) + Content(" "))
    return Content("").join(parts)


class LanesTable(Widget):
    """Rows in slot order, queued requests last; redrawn only when a row changes."""

    DEFAULT_CSS = """
    LanesTable {
        height: auto;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._rows: dict[str, tuple[Content, ...]] = {}

    def show(self, lanes: Sequence[LaneStats], titles: Mapping[str, str]) -> None:
        """Make the rows match ``lanes``."""
        rows = {lane_key(lane): lane_cells(lane, titles) for lane in
                sorted(lanes, key=lambda l: (l.slot is None, l.slot if l.slot is not None else 0))}
        if rows == self._rows and list(rows) == list(self._rows):
            return
        resize = len(rows) != len(self._rows)
        self._rows = rows
        self.refresh(layout=resize)

    @property
    def keys(self) -> list[str]:
        """Row keys in display order."""
        return list(self._rows)

    def get_cell(self, key: str, column: str) -> Content:
        """The cell of row ``key`` in ``column`` (a COLUMNS key); KeyError if there is none."""
        return self._rows[key][COLUMN_INDEX[column]]

    def _shown_rows(self) -> int:
        n = len(self._rows)
        return n if n <= MAX_ROWS else MAX_ROWS - 1

    def get_content_height(self, container, viewport, width: int) -> int:  # noqa: ANN001 - Textual's signature
        more = 1 if len(self._rows) > MAX_ROWS else 0
        return 1 + self._shown_rows() + more

    def render(self) -> Content:
        lines = [_line([Content.styled(label, HEADER_STYLE) for _, label, _ in COLUMNS])]
        for i, cells in enumerate(list(self._rows.values())[: self._shown_rows()]):
            line = _line(cells)
            lines.append(line.stylize(STRIPE_STYLE) if i % 2 else line)
        hidden = len(self._rows) - self._shown_rows()
        if hidden:
            lines.append(Content.styled(f" +{hidden} more", "$text-muted"))
        return Content("\n").join(lines)
