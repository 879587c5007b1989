"""The message box: multi-line, enter sends, shift+enter (or ctrl+j) inserts a newline."""

from __future__ import annotations

from textual.widgets import TextArea

from ..bindings import bindings
from ..messages import PromptSubmitted


class ChatInput(TextArea):
    """A TextArea whose send key posts ``PromptSubmitted`` instead of inserting a newline.

    The send and newline keys are priority bindings with ids (``chat.send``, ``chat.newline``), so
    they beat TextArea's own enter handling and can still be remapped. The text stays in the box
    until the chat view accepts it (a refused send keeps it for editing).
    """

    BINDINGS = bindings("input")

    DEFAULT_CSS = """
    ChatInput {
        height: auto;
        min-height: 3;
        max-height: 10;
        border: round $primary 50%;
    }
    ChatInput:focus {
        border: round $primary;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(soft_wrap=True, tab_behavior="focus", show_line_numbers=False,
                         highlight_cursor_line=False, id=id,
                         placeholder="Message  (enter sends · shift+enter or ctrl+j: newline)")

    def action_submit(self) -> None:
        """Send the text (blank text is ignored)."""
        if self.text.strip():
            self.post_message(PromptSubmitted(self.text))

    def action_newline(self) -> None:
        """Insert a newline at the cursor (replacing any selection)."""
        self.replace("\n", *self.selection)
