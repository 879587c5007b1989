"""The line at the top of a long chat: how many earlier messages are not drawn; click for more."""

from __future__ import annotations

from textual import events
from textual.widgets import Static

from ..messages import EarlierRequested


class EarlierLine(Static):
    """Hidden while every message is drawn. Clicking it (or scrolling the chat to the top) draws
    another batch of earlier messages."""

    DEFAULT_CSS = """
    EarlierLine {
        height: 1;
        margin: 0 0 1 0;
        color: $text-muted;
        text-style: italic;
    }
    """

    def __init__(self, count: int = 0) -> None:
        super().__init__("", markup=False)
        self.count = -1
        self.show_count(count)

    def show_count(self, count: int) -> None:
        """Say that ``count`` earlier messages are not drawn (0 hides the line)."""
        if count == self.count:
            return
        self.count = count
        self.display = count > 0
        plural = "message" if count == 1 else "messages"
        self.update(f"▲ {count} earlier {plural}: scroll up or click to show", layout=False)

    def on_click(self, event: events.Click) -> None:
        event.stop()
        self.post_message(EarlierRequested())
