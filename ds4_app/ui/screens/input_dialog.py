"""A one-line question in a modal (rename a session, name an export file)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label

from ..widgets.text_entry import LineInput


class InputDialog(ModalScreen[str | None]):
    """Asks for one line of text; enter returns it (stripped), escape returns None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="dialog.cancel")]

    DEFAULT_CSS = """
    InputDialog {
        align: center middle;
    }
    InputDialog > Vertical {
        width: 64;
        height: auto;
        border: round $primary;
        background: $surface;
        padding: 1 2;
    }
    InputDialog .hint {
        color: $text-muted;
    }
    """

    def __init__(self, title: str, value: str = "", *, placeholder: str = "", hint: str = "") -> None:
        super().__init__()
        self._title = title
        self._value = value
        self._placeholder = placeholder
        self._hint = hint

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self._title, markup=False)
            yield LineInput(self._value, placeholder=self._placeholder, select_on_focus=True)
            yield Label(self._hint or "enter: OK · esc: cancel", classes="hint", markup=False)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        value = event.value.strip()
        if value:
            self.dismiss(value)
        else:
            self.notify("Type something, or press Esc to cancel.", severity="warning")

    def action_cancel(self) -> None:
        """Close without an answer."""
        self.dismiss(None)
