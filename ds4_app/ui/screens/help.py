"""The help screen: every key binding with what it does and its id (for config.json)."""

from __future__ import annotations

from typing import Mapping

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static

from ..bindings import ACTIONS, effective_keys


class HelpScreen(ModalScreen[None]):
    """Lists the actions with their current keys (after the user's keymap)."""

    BINDINGS = [Binding("escape,f1,q", "close", "Close", id="help.close")]

    DEFAULT_CSS = """
    HelpScreen {
        align: center middle;
    }
    HelpScreen > Vertical {
        width: 118;
        max-width: 100%;
        height: 90%;
        border: round $primary;
        background: $surface;
        padding: 0 1;
    }
    HelpScreen .title {
        text-style: bold;
    }
    HelpScreen .hint {
        color: $text-muted;
    }
    HelpScreen DataTable {
        height: 1fr;
    }
    """

    def __init__(self, keymap: Mapping[str, str], config_file: str) -> None:
        super().__init__()
        self._keymap = dict(keymap)
        self._config_file = config_file

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static("Key bindings", classes="title")
            yield Static(f'Remap in {self._config_file}: {{"keymap": {{"<binding id>": "<keys>"}}}} · '
                         "ctrl+p: command palette · esc: close", classes="hint", markup=False)
            yield DataTable(cursor_type="row", zebra_stripes=True)

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("keys", "action", "binding id")
        for spec in ACTIONS:
            keys = effective_keys(spec, self._keymap)
            shown = ", ".join(self.app.get_key_display(Binding(k.strip(), "")) for k in keys.split(","))
            table.add_row(shown, spec.help, spec.id, key=spec.id)
        table.focus()

    def action_close(self) -> None:
        """Close the help."""
        self.dismiss(None)
