"""Pilot tests of the whole app on the scripted fake engine."""

from __future__ import annotations

import json
from pathlib import Path

from textual.command import CommandList, CommandPalette
from textual.widgets import Collapsible, Input, Markdown

from ds4_app.engine.api import QueueFull
from ds4_app.ui.app import DS4App
from ds4_app.ui.export import to_json, to_markdown
from ds4_app.ui.locations import config_path, exports_dir, store_path
from ds4_app.ui.messages import SessionBusyChanged, SessionTitleChanged, StatsUpdated
from ds4_app.ui.screens.input_dialog import InputDialog
from ds4_app.ui.screens.settings import SettingsScreen
from ds4_app.ui.store import Store
from ds4_app.ui.session_settings import SessionSettings
from ds4_app.ui.widgets.chat_message import ChatMessage
from ds4_app.ui.widgets.earlier_line import EarlierLine
from ds4_app.ui.widgets.lanes_table import LanesTable
from ds4_app.ui.widgets.session_tabs import pane_id

from .fake_engine import FakeEngine
from .helpers import chat, make_app, messages, send, wait_until

SIZE = (140, 40)


def notes(app: DS4App, severity: str | None = None) -> list[str]:
    """Messages of the notifications the app has shown."""
    return [n.message for n in app._notifications if severity is None or n.severity == severity]


def lane_states(app: DS4App) -> dict[str, str]:
    """Row key -> state, as the panel's lanes table shows it."""
    table = app.query_one(LanesTable)
    return {key: str(table.get_cell(key, "state")) for key in table.keys}


def idle(app: DS4App) -> bool:
    return all(not v.busy for v in app.tabs.chats())


async def test_two_tabs_stream_at_once(tmp_path: Path) -> None:
    engine = FakeEngine(pause_after=2)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "first question here")
        first = chat(app)
        await wait_until(pilot, lambda: first.busy and messages(first)[-1][1] == "You said: ", what="tab 1 streaming")
        await pilot.press("ctrl+n")
        second = chat(app)
        assert second is not first
        await send(pilot, "second question")
        await wait_until(pilot, lambda: messages(second)[-1][1] == "You said: ", what="tab 2 streaming")
        # Both replies are held mid-stream by the engine at the same time, and the panel shows both.
        assert first.busy and second.busy
        await wait_until(pilot, lambda: sorted(lane_states(app).values()) == ["decode", "decode"],
                         what="two decode lanes in the panel")
        assert [r.session for r in engine.submitted] == [first.session.id, second.session.id]
        engine.resume()
        await wait_until(pilot, lambda: idle(app), what="both replies finished")
        assert messages(first)[-1] == ("assistant", "You said: first question here")
        assert messages(second)[-1] == ("assistant", "You said: second question")
        # Each finished session stays resident in its slot.
        await wait_until(pilot, lambda: sorted(lane_states(app).values()) == ["resident", "resident"],
                         what="resident lanes")
        stored = Store(store_path(tmp_path))
        assert [(m.role, m.content) for m in stored.messages(first.session.id)] == [
            ("user", "first question here"), ("assistant", "You said: first question here")]
        assert stored.messages(second.session.id)[-1].meta["finish_reason"] == "stop"
        stored.close()


async def test_escape_cancels_and_the_lane_goes(tmp_path: Path) -> None:
    engine = FakeEngine(pause_after=2)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "tell me a long story")
        view = chat(app)
        await wait_until(pilot, lambda: list(lane_states(app).values()) == ["decode"], what="a decode lane")
        request_id = view.request_id
        await pilot.press("escape")
        await wait_until(pilot, lambda: not view.busy, what="the reply to end")
        assert engine.cancelled == [request_id]
        await wait_until(pilot, lambda: lane_states(app) == {}, what="the lane to disappear")
        # What was said before the cancel is kept, marked as cancelled.
        reply = view.history[-1]
        assert (reply.role, reply.content, reply.meta["finish_reason"]) == ("assistant", "You said: ", "cancelled")
        assert "cancelled" in str(view.query(ChatMessage).last().query_one(".note").render())
        # Esc with nothing running says so and changes nothing.
        await pilot.press("escape")
        assert engine.cancelled == [request_id]


async def test_a_second_escape_ends_a_reply_the_engine_does_not_stop(tmp_path: Path) -> None:
    engine = FakeEngine(pause_after=2)
    engine.cancel = lambda request_id: None  # type: ignore[method-assign]  # a wedged engine
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "are you stuck")
        view = chat(app)
        await wait_until(pilot, lambda: view.busy and messages(view)[-1][1] == "You said: ", what="streaming")
        await pilot.press("escape")
        await pilot.pause(0.1)
        assert view.busy
        await pilot.press("escape")
        await wait_until(pilot, lambda: not view.busy, what="the forced end")
        assert view.history[-1].meta["finish_reason"] == "cancelled"
        await send(pilot, "next")  # the session is usable again
        await wait_until(pilot, lambda: len(engine.submitted) == 2, what="the next request")


async def test_quitting_keeps_a_streaming_reply(tmp_path: Path) -> None:
    engine = FakeEngine(pause_after=2)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "long answer please")
        view = chat(app)
        await wait_until(pilot, lambda: messages(view)[-1][1] == "You said: ", what="streaming")
        session_id, request_id = view.session.id, view.request_id
        await pilot.press("ctrl+q")
    assert engine.cancelled == [request_id]
    store = Store(store_path(tmp_path))
    kept = store.messages(session_id)
    assert [(m.role, m.content) for m in kept] == [("user", "long answer please"), ("assistant", "You said: ")]
    assert kept[-1].meta["finish_reason"] == "cancelled"
    store.close()


async def test_regenerate_replaces_the_last_reply(tmp_path: Path, engine: FakeEngine) -> None:
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "hi")
        view = chat(app)
        await wait_until(pilot, lambda: len(view.history) == 2, what="the first reply")
        old_reply = view.history[-1]
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: len(engine.submitted) == 2 and not view.busy and len(view.history) == 2
                         and view.history[-1].id != old_reply.id, what="the new reply")
        # The regenerate request ends at the user turn: the old reply is not sent back.
        assert [(m.role, m.content) for m in engine.submitted[1].messages] == [("user", "hi")]
        assert messages(view) == [("user", "hi"), ("assistant", "You said: hi")]
        assert [m.id for m in app.store.messages(view.session.id)] == [view.history[0].id, view.history[1].id]


async def test_regenerate_with_nothing_to_redo_warns(tmp_path: Path, engine: FakeEngine) -> None:
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: any("Nothing to regenerate" in n for n in notes(app)), what="a warning")
        assert engine.submitted == []


async def test_rename_through_the_dialog(tmp_path: Path, engine: FakeEngine) -> None:
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        view = chat(app)
        await pilot.press("f2")
        await wait_until(pilot, lambda: isinstance(app.screen, InputDialog), what="the rename dialog")
        await pilot.press(*"Plans [draft]")  # brackets must not be read as markup
        await pilot.press("enter")
        await wait_until(pilot, lambda: view.session.title == "Plans [draft]", what="the rename")
        assert str(app.tabs.get_tab(pane_id(view.session.id)).label) == "Plans [draft]"
        assert app.store.session(view.session.id).title == "Plans [draft]"


async def test_sessions_survive_a_restart(tmp_path: Path, engine: FakeEngine) -> None:
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "remember me")
        first = chat(app)
        await wait_until(pilot, lambda: not first.busy and len(first.history) == 2, what="reply 1")
        await pilot.press("ctrl+n")
        await send(pilot, "and me")
        second = chat(app)
        await wait_until(pilot, lambda: not second.busy and len(second.history) == 2, what="reply 2")
        second.apply_settings(second.session.settings.from_dict({"temperature": 0.0, "seed": 7, "thinking": True}))
        ids = [first.session.id, second.session.id]

    engine2 = FakeEngine()
    app2 = make_app(tmp_path, engine2)
    async with app2.run_test(size=SIZE) as pilot:
        views = app2.tabs.chats()
        assert [v.session.id for v in views] == ids
        assert [v.session.title for v in views] == ["remember me", "and me"]
        assert messages(views[0]) == [("user", "remember me"), ("assistant", "You said: remember me")]
        assert views[1].session.settings.seed == 7 and views[1].session.settings.thinking
        # The restored conversation is what the next request carries.
        app2.tabs.activate(ids[0])
        await wait_until(pilot, lambda: chat(app2).session.id == ids[0], what="tab 1")
        await send(pilot, "again")
        await wait_until(pilot, lambda: len(engine2.submitted) == 1, what="a request")
        assert [m.content for m in engine2.submitted[0].messages] == ["remember me", "You said: remember me", "again"]
        assert engine2.submitted[0].session == ids[0]


async def test_exports_match_the_conversation(tmp_path: Path) -> None:
    engine = FakeEngine()
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        view = chat(app)
        view.apply_settings(view.session.settings.from_dict({"thinking": True, "system_prompt": "Be brief."}))
        await send(pilot, "export this")
        await wait_until(pilot, lambda: not view.busy and len(view.history) == 2, what="the reply")
        await pilot.press("ctrl+s")
        await pilot.press("alt+j")
        await wait_until(pilot, lambda: len(list(exports_dir(tmp_path).glob("*"))) == 2, what="two exports")
        session, records = app.store.session(view.session.id), app.store.messages(view.session.id)
        md = next(exports_dir(tmp_path).glob("*.md")).read_text(encoding="utf-8")
        assert md == to_markdown(session, records)
        assert "## User\n\nexport this" in md and "You said: export this" in md
        assert "<summary>Thinking</summary>" in md and "Be brief." in md
        doc = json.loads(next(exports_dir(tmp_path).glob("*.json")).read_text(encoding="utf-8"))
        assert doc == json.loads(to_json(session, records))
        assert [(m["role"], m["content"]) for m in doc["messages"]] == [
            ("user", "export this"), ("assistant", "You said: export this")]
        assert doc["messages"][1]["reasoning_content"] == "The user wants an echo."
        assert doc["settings"]["system_prompt"] == "Be brief."
        # To a path the user types: .json there means JSON.
        target = tmp_path / "out" / "chat.json"
        await pilot.press("alt+s")
        await wait_until(pilot, lambda: isinstance(app.screen, InputDialog), what="the export dialog")
        app.screen.query_one("Input").value = str(target)
        await pilot.press("enter")
        await wait_until(pilot, target.exists, what="the typed export")
        assert json.loads(target.read_text(encoding="utf-8"))["messages"] == doc["messages"]


async def test_submit_error_is_a_notification_and_the_app_goes_on(tmp_path: Path, engine: FakeEngine) -> None:
    engine.submit_errors.append(QueueFull("12 requests are waiting [queue 12]; retry later"))
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        view = chat(app)
        await send(pilot, "will fail")
        await wait_until(pilot, lambda: notes(app, "error"), what="an error notification")
        assert notes(app, "error") == ["12 requests are waiting [queue 12]; retry later"]
        assert view.input.text == "will fail" and messages(view) == [] and not view.busy
        await pilot.press("enter")  # the same text, now accepted
        await wait_until(pilot, lambda: len(view.history) == 2, what="the retried reply")
        assert view.input.text == ""


async def test_failed_reply_is_a_notification(tmp_path: Path) -> None:
    engine = FakeEngine(finish_reason="error", error="kernel failed on lane 3")
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        view = chat(app)
        await send(pilot, "break please")
        await wait_until(pilot, lambda: notes(app, "error"), what="an error notification")
        assert notes(app, "error") == ["kernel failed on lane 3"]
        await wait_until(pilot, lambda: not view.busy, what="the reply to end")
        assert view.history[-1].meta["finish_reason"] == "error"
        engine.finish_reason = "stop"
        await send(pilot, "again")
        await wait_until(pilot, lambda: len(view.history) == 4, what="the next reply")


async def test_engine_factory_failure_keeps_the_app_running(tmp_path: Path) -> None:
    def broken() -> FakeEngine:
        raise ValueError("model file truncated at tensor blk.3.ffn_up_exps: expected 12 MiB more")

    app = DS4App(engine_factory=broken, data_dir=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: notes(app, "error"), what="the load error")
        assert "truncated at tensor blk.3" in notes(app, "error")[0]
        await send(pilot, "anyone there?")
        await wait_until(pilot, lambda: len(notes(app, "error")) == 2, what="the refusal")
        assert notes(app, "error")[1].startswith("no engine: model file truncated")
        assert app.store.sessions()  # sessions still work


async def test_engine_factory_loads_in_the_background(tmp_path: Path) -> None:
    engine = FakeEngine()
    app = DS4App(engine_factory=lambda: engine, data_dir=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.engine is engine, what="the engine")
        await send(pilot, "hello")
        await wait_until(pilot, lambda: len(chat(app).history) == 2, what="the reply")


async def test_keymap_from_config_json(tmp_path: Path, engine: FakeEngine) -> None:
    config_path(tmp_path).write_text(json.dumps({"keymap": {"session.new": "f9", "chat.send": "f10",
                                                            "nope.nothing": "f10"}}))
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        assert len(app.tabs.chats()) == 1
        view = chat(app)
        await pilot.press("a", "enter", "b")  # enter is a plain newline now
        assert view.input.text == "a\nb" and engine.submitted == []
        await pilot.press("f10")
        await wait_until(pilot, lambda: len(view.history) == 2, what="a send from f10")
        assert view.history[0].content == "a\nb"
        await pilot.press("ctrl+n")  # no longer bound
        await pilot.pause()
        assert len(app.tabs.chats()) == 1
        await pilot.press("f9")
        await wait_until(pilot, lambda: len(app.tabs.chats()) == 2, what="a new tab from f9")
        assert any("unknown binding id 'nope.nothing'" in n for n in notes(app, "warning"))


async def test_bad_config_json_is_a_warning(tmp_path: Path, engine: FakeEngine) -> None:
    config_path(tmp_path).write_text("{not json")
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: notes(app, "warning"), what="a warning")
        assert "is not valid JSON" in notes(app, "warning")[0]
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: len(app.tabs.chats()) == 2, what="default keys still work")


async def test_tab_keys_switch_sessions(tmp_path: Path, engine: FakeEngine) -> None:
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+n", "ctrl+n")
        await pilot.pause()
        ids = [v.session.id for v in app.tabs.chats()]
        assert chat(app).session.id == ids[2]
        await pilot.press("alt+1")
        await wait_until(pilot, lambda: chat(app).session.id == ids[0], what="tab 1")
        await pilot.press("ctrl+pagedown")
        await wait_until(pilot, lambda: chat(app).session.id == ids[1], what="tab 2")
        await pilot.press("ctrl+tab")
        await wait_until(pilot, lambda: chat(app).session.id == ids[2], what="tab 3")
        await pilot.press("ctrl+tab")
        await wait_until(pilot, lambda: chat(app).session.id == ids[0], what="wrap to tab 1")
        await pilot.press("ctrl+shift+tab")
        await wait_until(pilot, lambda: chat(app).session.id == ids[2], what="back to tab 3")
        assert app.focused is chat(app).input


async def test_close_and_reopen_a_session(tmp_path: Path, engine: FakeEngine) -> None:
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "keep me")
        first = chat(app)
        await wait_until(pilot, lambda: len(first.history) == 2, what="the reply")
        sid = first.session.id
        await pilot.press("ctrl+n")
        await pilot.pause()
        app.tabs.activate(sid)
        await pilot.pause()
        await pilot.press("ctrl+w")
        await wait_until(pilot, lambda: app.tabs.chat(sid) is None, what="the tab to close")
        assert not app.store.session(sid).is_open
        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: app.screen.query("OptionList"), what="the session list")
        options = app.screen.query_one("OptionList")
        index = next(i for i in range(options.option_count) if options.get_option_at_index(i).id == sid)
        options.highlighted = index
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.tabs.chat(sid) is not None, what="the reopened tab")
        assert messages(app.tabs.chat(sid)) == [("user", "keep me"), ("assistant", "You said: keep me")]
        assert app.store.session(sid).is_open


async def test_delete_a_session_needs_two_presses(tmp_path: Path, engine: FakeEngine) -> None:
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+n")
        await pilot.pause()
        doomed = chat(app).session.id
        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: app.screen.query("OptionList"), what="the session list")
        options = app.screen.query_one("OptionList")
        options.highlighted = next(i for i in range(options.option_count)
                                   if options.get_option_at_index(i).id == doomed)
        await pilot.press("delete")
        await pilot.pause()
        assert [s.id for s in app.store.sessions()].count(doomed) == 1
        await pilot.press("delete")
        await wait_until(pilot, lambda: doomed not in [s.id for s in app.store.sessions()], what="the delete")
        assert app.tabs.chat(doomed) is None and len(app.tabs.chats()) == 1


async def test_copy_last_reply(tmp_path: Path, engine: FakeEngine) -> None:
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "copy that")
        await wait_until(pilot, lambda: len(chat(app).history) == 2, what="the reply")
        await pilot.press("alt+c")
        await wait_until(pilot, lambda: app.clipboard == "You said: copy that", what="the clipboard")


async def test_settings_screen_changes_the_next_request(tmp_path: Path, engine: FakeEngine) -> None:
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        view = chat(app)
        await pilot.press("f4")
        await wait_until(pilot, lambda: isinstance(app.screen, SettingsScreen), what="the settings")
        screen = app.screen
        screen.query_one("#temperature").value = "-1"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert isinstance(app.screen, SettingsScreen)  # refused, with the reason shown
        assert "temperature must be >= 0" in str(screen.query_one("#error").render())
        screen.query_one("#temperature").value = "0.25"
        screen.query_one("#top_k").value = "40"
        screen.query_one("#seed").value = "11"
        screen.query_one("#system").text = "You are terse."
        screen.query_one("#thinking").value = True
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: not isinstance(app.screen, SettingsScreen), what="the screen to close")
        s = view.session.settings
        assert (s.temperature, s.top_k, s.seed, s.system_prompt, s.thinking) == (0.25, 40, 11, "You are terse.", True)
        assert app.store.session(view.session.id).settings == s
        await send(pilot, "go")
        await wait_until(pilot, lambda: len(view.history) == 2, what="the reply")
        request = engine.submitted[0]
        assert request.messages[0].role == "system" and request.messages[0].content == "You are terse."
        assert (request.sampling.temperature, request.sampling.top_k, request.sampling.seed) == (0.25, 40, 11)
        assert request.thinking
        # Reasoning is shown folded.
        folded = view.query(ChatMessage).last().query_one(Collapsible)
        assert folded.display and folded.collapsed


async def test_panel_follows_width_until_toggled(tmp_path: Path, engine: FakeEngine) -> None:
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(100, 30)) as pilot:
        assert not app.panel.display
        await pilot.resize_terminal(130, 30)
        await wait_until(pilot, lambda: app.panel.display, what="the panel on a wide terminal")
        await pilot.press("f3")
        await pilot.pause()
        assert not app.panel.display
        await pilot.resize_terminal(150, 30)
        await pilot.pause()
        assert not app.panel.display  # the user's choice wins over the width


async def test_shift_enter_inserts_a_newline(tmp_path: Path, engine: FakeEngine) -> None:
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        view = chat(app)
        view.input.insert("line one")
        await pilot.press("shift+enter")
        view.input.insert("line two")
        await pilot.press("ctrl+j", "x")
        assert view.input.text == "line one\nline two\nx"
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(view.history) == 2, what="the reply")
        assert view.history[0].content == "line one\nline two\nx"


async def test_palette_offers_every_action(tmp_path: Path, engine: FakeEngine) -> None:
    from ds4_app.ui.bindings import ACTIONS
    from ds4_app.ui.commands import ActionCommands

    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        provider = ActionCommands(app.screen)
        hits = [hit async for hit in provider.discover()]
        assert sorted(h.text for h in hits) == sorted(a.help for a in ACTIONS if a.scope == "app")
        await pilot.press("ctrl+p")
        await wait_until(pilot, lambda: isinstance(app.screen, CommandPalette), what="the palette")
        app.screen.query_one(Input).value = "open a new chat"
        await wait_until(pilot, lambda: app.screen.query_one(CommandList).option_count > 0, what="palette results")
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.tabs.chats()) == 2, what="the palette to open a tab")


async def test_a_hidden_tab_draws_its_reply_when_shown(tmp_path: Path) -> None:
    # Parsing Markdown for replies nobody sees cost the UI loop more than the one on screen: a
    # chat in a hidden tab keeps the text and draws it once when its tab is shown.
    engine = FakeEngine(pause_after=2)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "one two three four five six")
        first = chat(app)
        await wait_until(pilot, lambda: messages(first)[-1][1] == "You said: ", what="tab 1 streaming")
        reply = first.query(ChatMessage).last()
        drawn = lambda: reply.query_one(".content", Markdown).source  # noqa: E731
        await wait_until(pilot, lambda: drawn() == "You said: ", what="the start drawn")
        await pilot.press("ctrl+n")
        assert not first.shown and chat(app).shown
        engine.resume()
        await wait_until(pilot, lambda: not first.busy, what="the reply to finish while hidden")
        assert reply.content == "You said: one two three four five six" and drawn() == "You said: "
        assert first.history[-1].content == reply.content  # stored all the same
        await pilot.press("alt+1")
        await wait_until(pilot, lambda: drawn() == reply.content, what="the reply drawn")
        assert "done" in str(reply.query_one(".note").render())


async def test_a_long_chat_draws_its_last_messages_and_earlier_ones_on_demand(tmp_path: Path) -> None:
    store = Store(store_path(tmp_path))
    session = store.create_session("long", SessionSettings())
    for i in range(20):
        store.add_message(session.id, "user", f"question {i}")
        store.add_message(session.id, "assistant", f"answer {i} " + "word " * 200, "", {"finish_reason": "stop"})
    store.close()
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        view = chat(app)
        assert len(view.history) == 40
        drawn = lambda: [m.content for m in view.query(ChatMessage)]  # noqa: E731
        first_window = view.drawn_from
        assert 0 < first_window < 38 and drawn() == [m.content for m in view.history[first_window:]]
        earlier = view.query_one(EarlierLine)
        assert earlier.display and f"{first_window} earlier messages" in str(earlier.render())
        view.show_earlier()
        await wait_until(pilot, lambda: view.drawn_from < first_window, what="a batch drawn")
        assert drawn() == [m.content for m in view.history[view.drawn_from:]]
        # The batch went in above what was on screen, which stays where it was.
        log = view.query_one("#log")
        await pilot.pause()
        assert log.scroll_y > 0
        # Scrolling to the top draws the next batch, until everything is drawn.
        for _ in range(10):
            if view.drawn_from == 0:
                break
            before = view.drawn_from
            log.scroll_home(animate=False)
            await wait_until(pilot, lambda: view.drawn_from < before, what="a batch drawn by scrolling up")
        assert view.drawn_from == 0 and not earlier.display
        assert drawn() == [m.content for m in view.history]


async def test_a_chat_growing_past_its_window_stops_drawing_the_oldest(tmp_path: Path, engine: FakeEngine) -> None:
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        view = chat(app)
        for i in range(6):
            await send(pilot, f"message {i} " + "long " * 500)
            await wait_until(pilot, lambda: len(view.history) == 2 * (i + 1) and not view.busy, what=f"reply {i}")
        assert view.drawn_from > 0  # the oldest turns are no longer drawn...
        assert len(view.query(ChatMessage)) == 12 - view.drawn_from
        assert len(app.store.messages(view.session.id)) == 12  # ...but stored, and sent as context
        await send(pilot, "and again")
        await wait_until(pilot, lambda: len(engine.submitted) == 7, what="the next request")
        assert len(engine.submitted[-1].messages) == 13


async def test_messages_after_the_widgets_are_gone_are_dropped(tmp_path: Path, engine: FakeEngine) -> None:
    # At exit the stats thread and ending replies still post to the App after its widgets went;
    # handling them used to raise NoMatches (seen as a traceback at the end of a test run).
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        view = chat(app)
        await app.query_one("#main").remove()
        app.post_message(StatsUpdated(engine.stats()))
        app.post_message(SessionBusyChanged(view.session.id, False))
        app.post_message(SessionTitleChanged(view.session.id, "gone"))
        await pilot.pause()
        assert app._exception is None
