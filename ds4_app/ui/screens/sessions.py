"""The session list: every stored session, open or closed; reopen one, or delete one."""

from __future__ import annotations

import datetime as _dt
from typing import Literal, Mapping, Sequence

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from ..store import SessionRecord

Choice = tuple[Literal["open", "delete"], str]


class SessionsScreen(ModalScreen[Choice | None]):
    """Dismisses with ("open", id), ("delete", id) once confirmed by a second press, or None."""

    BINDINGS = [
        Binding("escape", "cancel", "Close", id="sessions.cancel"),
        Binding("delete,ctrl+d", "delete", "Delete", id="sessions.delete"),
    ]

    DEFAULT_CSS = """
    SessionsScreen {
        align: center middle;
    }
    SessionsScreen > Vertical {
        width: 90;
        max-width: 100%;
        height: 80%;
        border: round $primary;
        background: $surface;
        padding: 0 1;
    }
    SessionsScreen .title {
        text-style: bold;
    }
    SessionsScreen .hint {
        color: $text-muted;
    }
    SessionsScreen OptionList {
        height: 1fr;
    }
    """

    def __init__(self, sessions: Sequence[SessionRecord], counts: Mapping[str, int]) -> None:
        super().__init__()
        self._sessions = sorted(sessions, key=lambda s: s.updated, reverse=True)
        self._counts = dict(counts)
        self._armed: str | None = None  # session id awaiting a second delete press

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static("Sessions", classes="title")
            yield Static("enter: open · delete (twice): delete for good · esc: close", classes="hint")
            yield OptionList(*(Option(self._label(s), id=s.id) for s in self._sessions))

    def _label(self, s: SessionRecord) -> Content:
        when = _dt.datetime.fromtimestamp(s.updated).strftime("%Y-%m-%d %H:%M")
        state = "open  " if s.is_open else "closed"
        return Content(f"{state}  {when}  {self._counts.get(s.id, 0):4d} msgs  {s.title}")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if event.option.id is not None:
            self.dismiss(("open", event.option.id))

    def action_delete(self) -> None:
        """First press arms, a second press on the same session deletes it."""
        options = self.query_one(OptionList)
        if options.highlighted is None:
            return
        session_id = options.get_option_at_index(options.highlighted).id
        if session_id is None:
            return
        if self._armed == session_id:
            self.dismiss(("delete", session_id))
            return
        self._armed = session_id
        title = next(s.title for s in self._sessions if s.id == session_id)
        self.notify(f"Press delete again to delete “{title}” and its messages for good.", severity="warning")

    def action_cancel(self) -> None:
        """Close without a choice."""
        self.dismiss(None)
