"""Keys as a terminal really sends them, delivered the way the terminal driver delivers them.

``pilot.press("alt+1")`` hands the app a ready-made key and waits for it to settle before the
next one. A terminal does neither: tmux sends alt+1 as ESC "1", and a burst of typing (or
``tmux send-keys "text" Enter``) arrives as one read whose keys all sit in the App's queue at
once. These tests run bytes through the parser the app's terminal driver uses and post every key
of a burst before the app handles any of them, which is what found the hand-test bugs: ESC+digit
parsed as "™", Enter overtaking the text typed just before it, type-ahead after ctrl+n going to
the old tab, backspace and ctrl+u acting after the characters typed behind them.
"""

from __future__ import annotations

from pathlib import Path

from textual import events
from textual.drivers.linux_driver import LinuxDriver
from textual.pilot import Pilot

from ds4_app.ui.app import DS4App
from ds4_app.ui.screens.help import HelpScreen
from ds4_app.ui.screens.input_dialog import InputDialog
from ds4_app.ui.screens.settings import SettingsScreen
from ds4_app.ui.terminal import KeyParser, TerminalDriver

from .fake_engine import FakeEngine
from .helpers import chat, make_app, messages, send, wait_until

SIZE = (140, 40)

# What tmux 3.3 sends for these keys (read off a raw tty under `tmux send-keys`).
ALT = {n: f"\x1b{n}" for n in range(10)}
CTRL_N, CTRL_W, CTRL_R, CTRL_J = "\x0e", "\x17", "\x12", "\n"
CTRL_PAGEUP, CTRL_PAGEDOWN = "\x1b[5;5~", "\x1b[6;5~"
F1, F2, F3, F4 = "\x1bOP", "\x1bOQ", "\x1bOR", "\x1bOS"
ALT_C, ESC, ENTER = "\x1bc", "\x1b", "\r"
BACKSPACE, LEFT, CTRL_U, CTRL_S = "\x7f", "\x1b[D", "\x15", "\x13"


def terminal_keys(data: str) -> list[events.Key]:
    """The key events the app's terminal driver makes of ``data`` read in one go (the end of
    input flushes a trailing ESC, as the driver's escape-delay timeout would)."""
    parser = KeyParser()
    parsed = [*parser.feed(data), *parser.feed("")]
    return [event for event in parsed if isinstance(event, events.Key)]


async def type_burst(pilot: Pilot, data: str) -> None:
    """Deliver ``data`` as one terminal read: every key is queued before the app handles the
    first (pilot.press would let each key settle first and hide ordering bugs)."""
    for key in terminal_keys(data):
        key.set_sender(pilot.app)
        pilot.app.post_message(key)
    await pilot.pause()


def session_ids(app: DS4App) -> list[str]:
    return [v.session.id for v in app.tabs.chats()]


# ---------------------------------------------------------------- parsing
def test_escape_digit_is_alt_digit() -> None:
    assert [(k.key, k.character) for k in terminal_keys(ALT[2])] == [("alt+2", "2")]
    assert [k.key for k in terminal_keys(ALT[1] + "hi" + ALT[9])] == ["alt+1", "h", "i", "alt+9"]
    # The characters themselves still type (a Spanish keyboard's ¡, a UK keyboard's £).
    assert [(k.key, k.character) for k in terminal_keys("¡£™")] == [
        ("inverted_exclamation_mark", "¡"), ("pound_sign", "£"), ("trade_mark_sign", "™")]
    assert [k.key for k in terminal_keys(CTRL_PAGEUP + F2 + ALT_C)] == ["ctrl+pageup", "f2", "alt+c"]
    assert [k.key for k in terminal_keys(ESC)] == ["escape"]


def test_the_app_reads_the_terminal_through_key_parser(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    assert app.driver_class is TerminalDriver and issubclass(TerminalDriver, LinuxDriver)
    # TerminalDriver reuses LinuxDriver's input loop with the parser swapped: that only works while
    # the loop builds its parser by the name XTermParser (a Textual upgrade that changes it fails here).
    assert "XTermParser" in LinuxDriver.run_input_thread.__code__.co_names
    assert TerminalDriver.run_input_thread.__globals__["XTermParser"] is KeyParser


# ---------------------------------------------------------------- app keys from the input
async def test_alt_digits_switch_tabs_while_typing(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+n", "ctrl+n")
        ids = session_ids(app)
        await wait_until(pilot, lambda: app.focused is chat(app).input, what="the input focused")
        await type_burst(pilot, ALT[1])
        await wait_until(pilot, lambda: chat(app).session.id == ids[0], what="tab 1")
        await type_burst(pilot, ALT[3])
        await wait_until(pilot, lambda: chat(app).session.id == ids[2], what="tab 3")
        await type_burst(pilot, ALT[9])  # no tab 9: nothing happens, nothing is typed
        await pilot.pause()
        assert chat(app).session.id == ids[2]
        assert [v.input.text for v in app.tabs.chats()] == ["", "", ""]
        assert app.focused is chat(app).input


async def test_app_keys_work_from_a_half_typed_message(tmp_path: Path) -> None:
    engine = FakeEngine(pause_after=2)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        view = chat(app)
        await send(pilot, "hello")
        await wait_until(pilot, lambda: view.busy and messages(view)[-1][1] == "You said: ", what="streaming")
        await type_burst(pilot, "draft")
        assert view.input.text == "draft"
        for key, screen in ((F2, InputDialog), (F4, SettingsScreen), (F1, HelpScreen)):
            await type_burst(pilot, key)
            await wait_until(pilot, lambda: isinstance(app.screen, screen), what=screen.__name__)
            await type_burst(pilot, ESC)
            await wait_until(pilot, lambda: app.screen is app.screen_stack[0], what=f"{screen.__name__} closed")
            assert app.focused is view.input
        shown = app.panel.display
        await type_burst(pilot, F3)
        await wait_until(pilot, lambda: app.panel.display != shown, what="the panel toggled")
        await type_burst(pilot, ESC)  # cancel the streaming reply
        await wait_until(pilot, lambda: not view.busy, what="the cancel")
        assert engine.cancelled and view.history[-1].meta["finish_reason"] == "cancelled"
        await type_burst(pilot, ALT_C)
        await wait_until(pilot, lambda: app.clipboard == "You said: ", what="the copy")
        engine.resume()
        await type_burst(pilot, CTRL_R)
        await wait_until(pilot, lambda: len(engine.submitted) == 2 and not view.busy, what="the regenerate")
        assert view.history[-1].content == "You said: hello"
        # None of those keys typed anything.
        assert view.input.text == "draft" and app.focused is view.input


async def test_tab_keys_from_the_input(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await type_burst(pilot, CTRL_N)
        await type_burst(pilot, CTRL_N)
        await wait_until(pilot, lambda: len(app.tabs.chats()) == 3, what="three tabs")
        ids = session_ids(app)
        await type_burst(pilot, CTRL_PAGEUP)
        await wait_until(pilot, lambda: chat(app).session.id == ids[1], what="tab 2")
        await type_burst(pilot, CTRL_PAGEDOWN + CTRL_PAGEDOWN)
        await wait_until(pilot, lambda: chat(app).session.id == ids[0], what="wrapped to tab 1")
        await type_burst(pilot, CTRL_W)
        await wait_until(pilot, lambda: session_ids(app) == ids[1:], what="tab 1 closed")
        assert app.focused is chat(app).input
        # Behind a dialog the tab keys do nothing (they are priority bindings, which fire over
        # modal screens unless the App refuses them), and ctrl+w is the dialog input's again.
        await type_burst(pilot, F2)
        await wait_until(pilot, lambda: isinstance(app.screen, InputDialog), what="the rename dialog")
        title = app.screen.query_one("Input")
        assert title.value == chat(app).session.title != ""
        await type_burst(pilot, CTRL_N + ALT[1] + CTRL_PAGEDOWN + CTRL_W)
        await pilot.pause()
        assert isinstance(app.screen, InputDialog) and session_ids(app) == ids[1:] and chat(app).session.id == ids[1]
        assert title.value == ""  # ctrl+w deleted the (selected) title in the dialog


# ---------------------------------------------------------------- type-ahead
async def test_text_and_enter_in_one_read_sends_the_text(tmp_path: Path, engine: FakeEngine) -> None:
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        view = chat(app)
        await type_burst(pilot, "Where is the king?" + ENTER + "next")
        await wait_until(pilot, lambda: len(view.history) == 2, what="the reply")
        # What was typed after Enter is the start of the next message, not part of this one.
        assert view.history[0].content == "Where is the king?" and view.input.text == "next"
        view.input.clear()
        await type_burst(pilot, "one" + CTRL_J + "two" + ENTER)
        await wait_until(pilot, lambda: len(view.history) == 4, what="the second reply")
        assert view.history[2].content == "one\ntwo"


async def test_type_ahead_after_a_new_tab_goes_to_the_new_tab(tmp_path: Path, engine: FakeEngine) -> None:
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        first = chat(app)
        await type_burst(pilot, CTRL_N + "Where is the king?" + ENTER)
        await wait_until(pilot, lambda: len(app.tabs.chats()) == 2 and len(chat(app).history) == 2,
                         what="the reply in the new tab")
        second = chat(app)
        assert second is not first and second.history[0].content == "Where is the king?"
        assert first.input.text == "" and first.history == [] and second.input.text == ""


async def test_type_ahead_after_a_tab_switch_goes_to_that_tab(tmp_path: Path, engine: FakeEngine) -> None:
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        first = chat(app)
        await type_burst(pilot, CTRL_N + "to two" + ENTER + ALT[1] + "to one" + ENTER + CTRL_PAGEDOWN + "again")
        second = app.tabs.chats()[1]
        await wait_until(pilot, lambda: len(first.history) == 2 and len(second.history) == 2, what="two replies")
        assert first.history[0].content == "to one" and second.history[0].content == "to two"
        assert chat(app) is second and second.input.text == "again" and first.input.text == ""


async def test_editing_keys_in_one_read_apply_in_order(tmp_path: Path, engine: FakeEngine) -> None:
    # The widget's own bindings (backspace, arrows, ctrl+u) used to run only once the key had
    # bubbled up to the App, after the characters typed behind them.
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        view = chat(app)
        await type_burst(pilot, "abc" + BACKSPACE + "d" + LEFT + "x")
        assert view.input.text == "abxd"
        await type_burst(pilot, CTRL_U + "fresh" + ENTER)  # ctrl+u: delete to the start of the line
        await wait_until(pilot, lambda: len(view.history) == 2, what="the reply")
        assert view.history[0].content == "freshd"


async def test_dialogs_take_a_burst_in_order(tmp_path: Path, engine: FakeEngine) -> None:
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        view = chat(app)
        await type_burst(pilot, F2)
        await wait_until(pilot, lambda: isinstance(app.screen, InputDialog), what="the rename dialog")
        await type_burst(pilot, CTRL_U + "King hunt" + ENTER)
        await wait_until(pilot, lambda: view.session.title == "King hunt", what="the rename")
        await type_burst(pilot, F4)
        await wait_until(pilot, lambda: isinstance(app.screen, SettingsScreen), what="the settings")
        await type_burst(pilot, "Be terse" + BACKSPACE * 5 + "brief." + CTRL_S)
        await wait_until(pilot, lambda: not isinstance(app.screen, SettingsScreen), what="the save")
        assert view.session.settings.system_prompt == "Be brief."
