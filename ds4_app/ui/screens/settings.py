"""Per-session settings: system prompt, sampling and thinking, edited in a form."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Input, Label, Static, TextArea

from ..session_settings import SessionSettings
from ..widgets.text_entry import LineInput, TextBox

# (field, label, kind, hint); kind "float" / "int" / "int?" (blank = None).
NUMBER_FIELDS: tuple[tuple[str, str, str, str], ...] = (
    ("temperature", "Temperature", "float", "0 = greedy"),
    ("top_p", "Top-p", "float", "1 = off"),
    ("top_k", "Top-k", "int", "0 = off"),
    ("min_p", "Min-p", "float", "0 = off"),
    ("max_tokens", "Max tokens", "int", "per reply"),
    ("seed", "Seed", "int?", "blank = random"),
)


class SettingsScreen(ModalScreen[SessionSettings | None]):
    """Edit one session's settings; dismisses with the new settings, or None when cancelled."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel", id="settings.cancel"),
        Binding("ctrl+s", "save", "Save", id="settings.save", priority=True),
    ]

    DEFAULT_CSS = """
    SettingsScreen {
        align: center middle;
    }
    SettingsScreen > Vertical {
        width: 72;
        height: auto;
        max-height: 100%;
        border: round $primary;
        background: $surface;
        padding: 0 2;
    }
    SettingsScreen .title {
        text-style: bold;
        margin-bottom: 1;
    }
    SettingsScreen #system {
        height: 5;
    }
    SettingsScreen Grid {
        grid-size: 3;
        grid-columns: 14 14 1fr;
        grid-rows: 1;
        grid-gutter: 1 1;
        height: auto;
        margin: 1 0;
    }
    SettingsScreen Grid .hint {
        color: $text-muted;
    }
    SettingsScreen #error {
        color: $error;
        height: auto;
        margin-top: 1;
    }
    SettingsScreen #buttons {
        height: auto;
        margin-top: 1;
        align-horizontal: right;
    }
    SettingsScreen #buttons Button {
        margin-left: 2;
    }
    """

    def __init__(self, title: str, settings: SessionSettings) -> None:
        super().__init__()
        self._title = title
        self._settings = settings

    def compose(self) -> ComposeResult:
        s = self._settings
        with Vertical():
            yield Static(f"Settings · {self._title}", classes="title", markup=False)
            yield Label("System prompt")
            yield TextBox(s.system_prompt, id="system", soft_wrap=True)
            with Grid():
                for name, label, kind, hint in NUMBER_FIELDS:
                    value = getattr(s, name)
                    yield Label(label)
                    yield LineInput("" if value is None else f"{value:g}" if kind == "float" else str(value),
                                    id=name, type="number" if kind == "float" else "text", compact=True)
                    yield Label(hint, classes="hint")
            yield Checkbox("Thinking (reasoning before the answer, shown folded)", s.thinking, id="thinking",
                           compact=True)
            yield Static("", id="error", markup=False)
            with Horizontal(id="buttons"):
                yield Button("Cancel", id="cancel", compact=True)
                yield Button("Save (ctrl+s)", id="save", variant="primary", compact=True)

    def on_mount(self) -> None:
        self.query_one("#system", TextArea).focus()

    def read_form(self) -> SessionSettings:
        """The settings the form describes; ValueError with a message a person can act on."""
        values: dict[str, object] = {"system_prompt": self.query_one("#system", TextArea).text,
                                     "thinking": self.query_one("#thinking", Checkbox).value}
        for name, label, kind, _ in NUMBER_FIELDS:
            text = self.query_one(f"#{name}", Input).value.strip()
            try:
                if kind == "int?" and not text:
                    values[name] = None
                elif kind == "float":
                    values[name] = float(text)
                else:
                    values[name] = int(text)
            except ValueError:
                wanted = "a number" if kind == "float" else "a whole number"
                raise ValueError(f"{label}: {text!r} is not {wanted}") from None
        return SessionSettings(**values)  # type: ignore[arg-type]

    def action_save(self) -> None:
        """Check the form and close with the new settings (or show what is wrong)."""
        # ctrl+s is a priority binding, run when the App reads the key, perhaps before the field
        # with the focus has taken the keys typed just before it: save behind those keys.
        (self.focused or self).call_later(self._save)

    def _save(self) -> None:
        try:
            settings = self.read_form()
        except ValueError as e:
            self.query_one("#error", Static).update(str(e).removeprefix("sampler: "))
            return
        self.dismiss(settings)

    def action_cancel(self) -> None:
        """Close without changes."""
        self.dismiss(None)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "save":
            self.action_save()
        else:
            self.action_cancel()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_save()
