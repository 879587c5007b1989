"""Text entry that takes keys in the order they were typed, and never types alt chords.

Textual types a character when the focused widget handles its key, but runs the widget's own
key bindings (backspace, arrows, ctrl+u, enter in an Input) only once the key has bubbled back up
to the App. When several keys arrive together (one terminal read: a fast typist, keys over SSH,
``tmux send-keys``, or a backlog while the UI loop was busy drawing six streams), the App has
already handed the later characters to the widget by then: "abc<backspace>d" came out "abcd", and
"<ctrl+u>King" in the rename dialog came out empty. ``InOrderKeys`` runs the widget's own bindings
when the widget handles the key, in line with the characters.

It also refuses alt chords: a terminal sends alt+c as ESC "c", which Textual reads as the key
"alt+c" with the character "c", and a text widget would type that "c". Characters typed with
AltGr or Option arrive as themselves, without an alt key name, so refusing alt chords costs no
text; the chords bubble up to the App's bindings (alt+1..9 switch tabs, alt+c copies).
"""

from __future__ import annotations

from textual import events
from textual.widgets import Input, TextArea


def is_chord(key: str) -> bool:
    """True for an alt chord ("alt+1", "alt+c", "alt+shift+x"): a command, never text."""
    return "alt" in key.split("+")[:-1]


class InOrderKeys:
    """Mixin for a text widget (list it before the widget class): own bindings run in typing
    order; alt chords bubble instead of being typed. Priority bindings are left to the App."""

    async def _on_key(self, event: events.Key) -> None:
        # Runs before the widget class's own _on_key (MRO); prevent_default skips that one.
        # _bindings is the widget's merged BindingsMap (Textual has no public accessor); a keymap
        # only remaps bindings with ids, and the widgets using this mixin have none of their own
        # that are not priority.
        for binding in self._bindings.key_to_bindings.get(event.key, ()):  # type: ignore[attr-defined]
            # App.run_action says whether the action ran (Widget.run_action does not); a
            # SkipAction or a refused check_action leaves the key to Textual's usual path.
            if not binding.priority and await self.app.run_action(binding.action, self):  # type: ignore[attr-defined]
                event.stop()
                event.prevent_default()
                return
        if is_chord(event.key):
            event.prevent_default()  # not typed; still bubbles to the App's bindings


class LineInput(InOrderKeys, Input):
    """A one-line ``Input`` that keeps typing order (dialogs, the settings fields)."""


class TextBox(InOrderKeys, TextArea):
    """A multi-line ``TextArea`` that keeps typing order (the settings' system prompt)."""
