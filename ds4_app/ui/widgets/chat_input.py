"""The message box: multi-line, enter sends, shift+enter (or ctrl+j) inserts a newline."""

from __future__ import annotations

from textual.widgets import TextArea

from ..bindings import bindings
from ..messages import PromptSubmitted
from .text_entry import InOrderKeys


class ChatInput(InOrderKeys, TextArea):
    """A TextArea whose send key posts ``PromptSubmitted`` instead of inserting a newline.

    The send and newline keys are priority bindings with ids (``chat.send``, ``chat.newline``), so
    they beat TextArea's own enter handling and can still be remapped. A priority binding runs
    when the App reads the key, which can be before this input has taken the keys typed just
    before it (a terminal delivers "text<Enter>" as one read): so the send and the newline are
    queued behind those keys on this widget's own queue, never done on the spot.

    Sending clears the box at once, so text typed after Enter starts the next message; the chat
    view puts a refused message back (``restore``).

    Its own editing keys run in typing order and alt chords are not typed (``InOrderKeys``):
    they bubble up to the App's bindings (alt+1..9 switch tabs, alt+c copies the last reply).
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
        """Send the text (blank text is ignored), after the keys typed before the send key."""
        self.call_later(self._send)

    def action_newline(self) -> None:
        """Insert a newline at the cursor (replacing any selection), after the keys typed before it."""
        self.call_later(self._newline)

    def restore(self, text: str) -> None:
        """Put back a message the chat did not take, ahead of anything typed since."""
        self.insert(text, (0, 0))

    def _send(self) -> None:
        text = self.text
        if text.strip():
            self.clear()
            self.post_message(PromptSubmitted(text))

    def _newline(self) -> None:
        self.replace("\n", *self.selection)
