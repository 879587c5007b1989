"""Every user-facing action of the TUI, its default keys, and the user's keymap.

One table (``ACTIONS``) feeds the key bindings (each ``Binding`` carries the action's id, so
``App.set_keymap`` can remap it), the command palette (one entry per action) and the help screen.
Users remap keys in ``config.json`` in the data dir::

    {"keymap": {"session.new": "ctrl+t", "chat.copy_last": "f8,alt+c"}}

A bad config never stops the app: ``load_keymap`` returns the usable part and a list of problems
to show as notifications.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Mapping

from textual.binding import Binding

Scope = Literal["app", "input"]


@dataclass(frozen=True, slots=True)
class ActionSpec:
    """One action: binding id, the action string it runs, default keys and words for people.

    ``scope`` "app" binds on the App; "input" on the chat input (keys that only mean something
    while typing). ``priority`` bindings win over the focused widget's own keys (ctrl+w would
    otherwise delete a word in the input; enter would insert a newline) and run as soon as the
    App reads the key, before the keys typed after it are handed to a widget: the tab keys are
    priority so that type-ahead lands in the tab they open or show. Priority bindings fire over
    dialogs too; the App refuses the tab actions while one is open (``DS4App.check_action``).
    """

    id: str
    action: str
    keys: str
    description: str
    help: str
    show: bool = False
    priority: bool = False
    scope: Scope = "app"

    def binding(self) -> Binding:
        """The Textual binding (with ``id`` so keymaps can remap it)."""
        return Binding(self.keys, self.action, self.description, show=self.show, priority=self.priority,
                       id=self.id, tooltip=self.help)


ACTIONS: tuple[ActionSpec, ...] = (
    ActionSpec("chat.send", "submit", "enter", "Send", "Send the message",
               priority=True, scope="input"),
    ActionSpec("chat.newline", "newline", "shift+enter,ctrl+j", "Newline", "Insert a newline in the message",
               priority=True, scope="input"),
    ActionSpec("session.new", "new_session", "ctrl+n", "New", "Open a new chat session in a tab", show=True,
               priority=True),
    ActionSpec("session.close", "close_session", "ctrl+w", "Close",
               "Close this tab (the session is kept: reopen it from the session list)", show=True,
               priority=True),
    ActionSpec("session.next", "next_session", "ctrl+tab,ctrl+pagedown", "Next tab", "Switch to the next session",
               priority=True),
    ActionSpec("session.prev", "prev_session", "ctrl+shift+tab,ctrl+pageup", "Previous tab",
               "Switch to the previous session", priority=True),
    *(ActionSpec(f"session.goto_{n}", f"goto_session({n})", f"alt+{n}", f"Tab {n}", f"Switch to session tab {n}",
                 priority=True) for n in range(1, 10)),
    ActionSpec("session.rename", "rename_session", "f2", "Rename", "Rename this session", show=True),
    ActionSpec("session.settings", "session_settings", "f4", "Settings",
               "System prompt, sampling and thinking for this session", show=True),
    ActionSpec("session.list", "session_list", "ctrl+o", "Sessions", "Reopen or delete stored sessions", show=True),
    ActionSpec("chat.cancel", "cancel_reply", "escape", "Cancel", "Stop the reply being generated in this tab",
               show=True),
    ActionSpec("chat.regenerate", "regenerate", "ctrl+r", "Regenerate", "Replace the last reply with a new one",
               show=True),
    ActionSpec("chat.copy_last", "copy_last", "alt+c", "Copy reply", "Copy the last reply to the clipboard (OSC 52)"),
    ActionSpec("chat.thinking", "toggle_thinking", "ctrl+t", "Thinking",
               "Turn thinking mode on or off for this session"),
    ActionSpec("export.markdown", "export('markdown')", "ctrl+s", "Export .md",
               "Export this session as Markdown to the data dir's exports/"),
    ActionSpec("export.json", "export('json')", "alt+j", "Export .json",
               "Export this session as JSON to the data dir's exports/"),
    ActionSpec("export.to_path", "export_to", "alt+s", "Export to…", "Export this session to a file you name"),
    ActionSpec("panel.toggle", "toggle_panel", "f3", "Engine", "Show or hide the engine panel", show=True),
    ActionSpec("app.help", "help", "f1", "Help", "List the key bindings", show=True),
    ActionSpec("app.quit", "quit", "ctrl+q", "Quit", "Quit ds4-app", show=True, priority=True),
)

ACTIONS_BY_ID: dict[str, ActionSpec] = {a.id: a for a in ACTIONS}


def bindings(scope: Scope) -> list[Binding]:
    """The Binding list for the App (``"app"``) or the chat input (``"input"``)."""
    return [a.binding() for a in ACTIONS if a.scope == scope]


def effective_keys(spec: ActionSpec, keymap: Mapping[str, str]) -> str:
    """The keys an action answers to once ``keymap`` is applied."""
    return keymap.get(spec.id, spec.keys)


def load_keymap(path: Path) -> tuple[dict[str, str], list[str]]:
    """Read ``{"keymap": {...}}`` from ``path``; returns (valid entries, problems).

    A missing file is no problem; an unreadable one, bad JSON, unknown binding ids and values
    that are not key strings are each reported and skipped.
    """
    if not path.exists():
        return {}, []
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        return {}, [f"cannot read {path}: {e}"]
    except json.JSONDecodeError as e:
        return {}, [f"{path} is not valid JSON ({e.msg} at line {e.lineno}); using the default keys"]
    keymap = doc.get("keymap", {}) if isinstance(doc, dict) else None
    if not isinstance(keymap, dict):
        return {}, [f"{path}: \"keymap\" must be an object of binding id -> keys"]
    good: dict[str, str] = {}
    problems: list[str] = []
    for binding_id, keys in keymap.items():
        if binding_id not in ACTIONS_BY_ID:
            problems.append(f"{path}: unknown binding id {binding_id!r} (see the help screen, F1)")
        elif not isinstance(keys, str) or not keys.strip() or any(not k.strip() for k in keys.split(",")):
            problems.append(f"{path}: keys for {binding_id!r} must be a string like \"ctrl+t\" or \"f8,alt+c\"")
        else:
            good[binding_id] = ",".join(k.strip() for k in keys.split(","))
    return good, problems
