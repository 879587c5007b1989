"""Snapshot tests (pytest-textual-snapshot), grouped by feature.

Deterministic by construction: the fake engine holds replies mid-stream and reports frozen
numbers, the store's clock is fixed, the terminal size is fixed and the cursor does not blink.
Update the SVGs with ``pytest tests/ui/test_snapshots.py --snapshot-update`` after looking at them.
"""

from __future__ import annotations

from pathlib import Path

from textual.pilot import Pilot
from textual.widgets import Markdown, TextArea

from ds4_app.ui.screens.help import HelpScreen
from ds4_app.ui.screens.settings import SettingsScreen
from ds4_app.ui.session_settings import SessionSettings
from ds4_app.ui.widgets.chat_message import ChatMessage
from ds4_app.ui.widgets.lanes_table import LanesTable

from .fake_engine import FakeEngine
from .helpers import chat, make_app, send, wait_until

WIDE = (140, 40)


async def no_blink(pilot: Pilot) -> None:
    """Stop every cursor blinking, so the screenshot does not depend on timing."""
    for area in pilot.app.screen.query(TextArea):
        area.cursor_blink = False
    await pilot.pause()


def rendered(view) -> bool:
    """Every message's Markdown shows all the text that has arrived."""
    return all(m.query_one(".content", Markdown).source == m.content for m in view.query(ChatMessage))


class TestMainScreen:
    def test_two_sessions_streaming_with_the_panel(self, snap_compare, tmp_path: Path) -> None:
        """Two tabs, each with a reply held mid-stream: the panel shows two decode lanes."""
        engine = FakeEngine(pause_after=3)
        app = make_app(tmp_path, engine)

        async def run_before(pilot: Pilot) -> None:
            await send(pilot, "Explain paged attention in two sentences.")
            first = chat(pilot.app)
            await wait_until(pilot, lambda: first.busy and len(first.query(ChatMessage)) == 2
                             and first.query(ChatMessage).last().content == "You said: Explain ", what="tab 1")
            await pilot.press("ctrl+n")
            await send(pilot, "What is a *slot*?")
            second = chat(pilot.app)
            await wait_until(pilot, lambda: len(second.query(ChatMessage)) == 2
                             and second.query(ChatMessage).last().content == "You said: What ", what="tab 2")
            table = pilot.app.query_one(LanesTable)
            await wait_until(pilot, lambda: [str(table.get_cell(k, "state")) for k in table.keys] == ["decode"] * 2,
                             what="two decode lanes")
            await wait_until(pilot, lambda: rendered(second), what="the Markdown to catch up")
            await no_blink(pilot)

        assert snap_compare(app, terminal_size=WIDE, run_before=run_before)

    def test_narrow_terminal_hides_the_panel(self, snap_compare, tmp_path: Path) -> None:
        """Below 120 columns the chat gets the whole width; a finished reply shows its note."""
        app = make_app(tmp_path, FakeEngine())

        async def run_before(pilot: Pilot) -> None:
            await send(pilot, "Hello **there**")
            view = chat(pilot.app)
            await wait_until(pilot, lambda: not view.busy and len(view.history) == 2, what="the reply")
            await wait_until(pilot, lambda: rendered(view), what="the final render")
            await no_blink(pilot)

        assert snap_compare(app, terminal_size=(90, 24), run_before=run_before)


class TestScreens:
    def test_settings_screen(self, snap_compare, tmp_path: Path) -> None:
        """The per-session settings form, filled from the session's stored settings."""
        app = make_app(tmp_path, FakeEngine())

        async def run_before(pilot: Pilot) -> None:
            chat(pilot.app).apply_settings(SessionSettings(system_prompt="You are a careful assistant.",
                                                           temperature=0.6, top_p=0.95, top_k=40, seed=42,
                                                           thinking=True))
            await pilot.press("f4")
            await wait_until(pilot, lambda: isinstance(pilot.app.screen, SettingsScreen), what="the settings")
            await no_blink(pilot)

        assert snap_compare(app, terminal_size=(100, 36), run_before=run_before)

    def test_help_screen(self, snap_compare, tmp_path: Path, monkeypatch) -> None:
        """Every binding with its keys and id; a remapped key shows as remapped."""
        monkeypatch.setenv("HOME", str(tmp_path))  # the config path shows as ~/data/config.json
        app = make_app(tmp_path / "data", FakeEngine(), keymap={"chat.copy_last": "f8"})

        async def run_before(pilot: Pilot) -> None:
            await pilot.press("f1")
            await wait_until(pilot, lambda: isinstance(pilot.app.screen, HelpScreen), what="the help")
            await no_blink(pilot)

        assert snap_compare(app, terminal_size=(120, 44), run_before=run_before)
