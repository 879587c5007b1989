"""Widgets and the bridge, each in a small host app."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Iterator

from hypothesis import given
from hypothesis import strategies as st
from textual.app import App, ComposeResult
from textual.widgets import Collapsible, Markdown

from ds4_app.engine.api import (Delta, EngineUnavailable, Event, Finished, GenerationRequest, LaneStats, QueueFull,
                                StatsSnapshot, Usage)
from ds4_app.engine.chat import Message
from ds4_app.ui.bridge import EngineBridge
from ds4_app.ui.formatting import finish_meta, finish_note, size
from ds4_app.ui.messages import EarlierRequested, ReplyChunk
from ds4_app.ui.widgets.chat_message import ChatMessage
from ds4_app.ui.widgets.earlier_line import EarlierLine
from ds4_app.ui.widgets.engine_info import describe
from ds4_app.ui.widgets.lanes_table import LanesTable
from ds4_app.ui.widgets.stacked_bar import split_cells

from .helpers import wait_until


# ---------------------------------------------------------------- earlier line
class EarlierHost(App[None]):
    def __init__(self) -> None:
        super().__init__()
        self.requests = 0

    def compose(self) -> ComposeResult:
        yield EarlierLine(3)

    def on_earlier_requested(self, message: EarlierRequested) -> None:
        self.requests += 1


async def test_earlier_line_asks_for_more_when_clicked() -> None:
    app = EarlierHost()
    async with app.run_test() as pilot:
        line = app.query_one(EarlierLine)
        assert line.display and "3 earlier messages" in str(line.render())
        await pilot.click(EarlierLine)
        await wait_until(pilot, lambda: app.requests == 1, what="the request")
        line.show_count(1)
        assert "1 earlier message:" in str(line.render())
        line.show_count(0)
        assert not line.display


# ---------------------------------------------------------------- lanes table
class TableHost(App[None]):
    def compose(self) -> ComposeResult:
        yield LanesTable()


def lane(slot: int | None, state: str, pos: int, rid: str = "r", session: str | None = "s1") -> LaneStats:
    return LaneStats(slot=slot, request_id=rid, session=session, state=state,  # type: ignore[arg-type]
                     position=pos, context=pos, pages=1, tok_s=12.0)


async def test_lanes_table_redraws_only_on_change(monkeypatch) -> None:
    app = TableHost()
    async with app.run_test() as pilot:
        table = app.query_one(LanesTable)
        table.show([lane(1, "decode", 10), lane(0, "prefill", 5, "q", "s2"), lane(None, "queued", 7, "w", None)],
                   {"s1": "A rather long session title", "s2": "Two"})
        await pilot.pause()
        assert table.keys == ["slot-0", "slot-1", "queued-w"]
        assert str(table.get_cell("slot-1", "session")) == "A rather long…"
        assert str(table.get_cell("queued-w", "session")) == "—"
        assert str(table.get_cell("slot-0", "tok_s")) == "–"  # no rate while in prefill
        lines = [str(line) for line in table.render().split()]
        assert lines[0].split() == ["slot", "session", "state", "pos/ctx", "pages", "tok/s"]
        assert lines[2].split() == ["1", "A", "rather", "long…", "decode", "10/10", "1", "12.0"]
        assert len({len(line) for line in lines}) == 1 and table.size.height == 4  # header + 3 rows, aligned
        refreshes: list[bool] = []
        original = table.refresh
        monkeypatch.setattr(table, "refresh", lambda *a, **k: (refreshes.append(k.get("layout", False)),
                                                                original(*a, **k))[1])
        table.show([lane(1, "decode", 10), lane(0, "prefill", 5, "q", "s2"), lane(None, "queued", 7, "w", None)],
                   {"s1": "A rather long session title", "s2": "Two"})
        assert refreshes == []  # the same rows: no redraw
        table.show([lane(1, "decode", 11), lane(0, "decode", 6, "q", "s2"), lane(None, "queued", 7, "w", None)],
                   {"s1": "A", "s2": "Two"})
        assert refreshes == [False]  # a redraw, same height
        assert str(table.get_cell("slot-1", "pos")) == "11/11" and str(table.get_cell("slot-0", "state")) == "decode"
        table.show([lane(1, "decode", 11), lane(0, "decode", 6, "q", "s2")], {"s1": "A", "s2": "Two"})
        assert refreshes == [False, True] and table.keys == ["slot-0", "slot-1"]
        table.show([], {})
        assert table.keys == []
        many = [lane(None, "queued", 1, f"r{i}", None) for i in range(20)]
        table.show(many, {})
        await pilot.pause()
        rendered = str(table.render()).splitlines()
        assert len(rendered) == table.size.height == 14 and rendered[-1].strip() == "+8 more"


@given(st.lists(st.integers(0, 500), min_size=1, max_size=4), st.integers(0, 80), st.integers(0, 400))
def test_split_cells(counts: list[int], width: int, slack: int) -> None:
    total = sum(counts) + slack
    cells = split_cells(counts, total, width)
    assert len(cells) == len(counts) and all(c >= 0 for c in cells)
    if total == 0 or width == 0:
        assert sum(cells) == 0
        return
    assert sum(cells) <= width
    if slack == 0:
        assert sum(cells) == width  # a full pool fills the bar
    visible = [c > 0 for c in counts]
    if sum(visible) <= width:
        assert all(cell > 0 for cell, v in zip(cells, visible) if v)  # nothing in use disappears
    assert all(cell == 0 for cell, c in zip(cells, counts) if c == 0)


# ---------------------------------------------------------------- chat message
class MessageHost(App[None]):
    def compose(self) -> ComposeResult:
        yield ChatMessage("assistant", streaming=True)


async def test_chat_message_streams_by_appending() -> None:
    app = MessageHost()
    async with app.run_test() as pilot:
        msg = app.query_one(ChatMessage)
        assert not msg.query(Collapsible)  # no reasoning yet, so no folded section
        for piece in ["# Title\n\n", "Some ", "text ", "and ```py\nprint(1)", "\n```\n"]:
            await msg.append(content=piece)
        await msg.append(reasoning="hmm ")
        await msg.append(reasoning="ok")
        await pilot.pause()
        md = msg.query_one(".content", Markdown)
        assert md.source == "# Title\n\nSome text and ```py\nprint(1)\n```\n"
        assert msg.query_one(Collapsible).collapsed
        await msg.finish(msg.content, msg.reasoning, "done · 5 tokens")
        assert md.source == msg.content and msg.query_one(".reasoning", Markdown).source == "hmm ok"
        assert msg.query_one(Collapsible).title == "Thought (2 words)"
        assert "done · 5 tokens" in str(msg.query_one(".note").render())


# ---------------------------------------------------------------- bridge
class ScriptedHandle:
    """A handle that yields a fixed list of events (or raises partway)."""

    def __init__(self, request_id: str, events: list[Event], fail_after: int | None = None,
                 error: Exception | None = None) -> None:
        self.request_id = request_id
        self._events = events
        self._fail_after = fail_after
        self._error = error or ConnectionError("server went away")

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._gen()

    async def _gen(self) -> AsyncIterator[Event]:
        for i, ev in enumerate(self._events):
            if self._fail_after is not None and i == self._fail_after:
                raise self._error
            yield ev
            await asyncio.sleep(0)

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        yield from self._events


class ScriptedEngine:
    model_name = "scripted"

    def __init__(self, handle: ScriptedHandle) -> None:
        self.handle = handle
        self.cancelled: list[str] = []

    def submit(self, request: GenerationRequest) -> ScriptedHandle:
        return self.handle

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    def stats(self):
        raise NotImplementedError("this engine has no stats (like a remote without /v1/lanes)")

    def count_prompt_tokens(self, messages, prompt, thinking=False) -> int:
        return 0

    def close(self) -> None:
        pass


class BridgeHost(App[None]):
    def __init__(self, bridge: EngineBridge) -> None:
        super().__init__()
        self.bridge = bridge
        self.chunks: list[ReplyChunk] = []

    def on_mount(self) -> None:
        self.bridge.attach(self, self, poll_stats=lambda: True)

    def on_unmount(self) -> None:
        self.bridge.close()

    def on_reply_chunk(self, chunk: ReplyChunk) -> None:
        self.chunks.append(chunk)


REQUEST = GenerationRequest(messages=(Message("user", "hi"),), session="s1")


async def test_bridge_coalesces_events_per_tick() -> None:
    events: list[Event] = [Delta("reasoning", "r")] + [Delta("content", f"{i} ") for i in range(200)]
    events.append(Finished("stop", Usage(3, 200)))
    app = BridgeHost(EngineBridge(ScriptedEngine(ScriptedHandle("req-x", events)), interval=0.05))
    async with app.run_test() as pilot:
        assert app.bridge.submit(REQUEST, app) == "req-x"
        await wait_until(pilot, lambda: app.chunks and app.chunks[-1].finished is not None, what="the finish")
        # Far fewer messages than events, nothing lost, in order, one Finished at the end.
        assert len(app.chunks) < 20
        assert "".join(c.content for c in app.chunks) == "".join(f"{i} " for i in range(200))
        assert "".join(c.reasoning for c in app.chunks) == "r"
        assert [c.finished is not None for c in app.chunks].count(True) == 1
        assert {c.session_id for c in app.chunks} == {"s1"} and app.bridge.running() == []


async def test_bridge_turns_a_broken_stream_into_an_error_finish() -> None:
    events: list[Event] = [Delta("content", "a"), Delta("content", "b"), Finished("stop", Usage(1, 2))]
    engine = ScriptedEngine(ScriptedHandle("req-y", events, fail_after=2))
    app = BridgeHost(EngineBridge(engine))
    async with app.run_test() as pilot:
        app.bridge.submit(REQUEST, app)
        app.bridge.cancel("req-y")
        await wait_until(pilot, lambda: app.chunks and app.chunks[-1].finished is not None, what="the finish")
        final = app.chunks[-1].finished
        assert final.finish_reason == "error" and final.error == "ConnectionError: server went away"
        assert "".join(c.content for c in app.chunks) == "ab"
        assert engine.cancelled == ["req-y"]


async def test_bridge_shows_a_remote_refusal_as_its_message() -> None:
    handle = ScriptedHandle("req-z", [Delta("content", "x")], fail_after=0, error=QueueFull("server queue is full"))
    engine = ScriptedEngine(handle)
    app = BridgeHost(EngineBridge(engine))
    async with app.run_test() as pilot:
        app.bridge.submit(REQUEST, app)
        await wait_until(pilot, lambda: app.chunks and app.chunks[-1].finished is not None, what="the finish")
        assert app.chunks[-1].finished.error == "server queue is full"


async def test_bridge_without_an_engine_refuses_submit() -> None:
    app = BridgeHost(EngineBridge(None, unavailable="still loading"))
    async with app.run_test():
        try:
            app.bridge.submit(REQUEST, app)
        except EngineUnavailable as e:
            assert str(e) == "still loading"
        else:
            raise AssertionError("submit without an engine must raise")


# ---------------------------------------------------------------- formatting
def test_finish_note_and_sizes() -> None:
    meta = finish_meta(Finished("stop", Usage(12, 34, cached_tokens=8, ttft_s=0.21, decode_s=1.1)))
    assert finish_note(meta) == "done · 12 prompt (8 cached) → 34 tokens · TTFT 210 ms · 30.0 tok/s"
    assert finish_note(finish_meta(Finished("cancelled", Usage(0, 0)))) == "cancelled"
    assert finish_meta(Finished("error", Usage(0, 0), error="boom"))["error"] == "boom"
    assert finish_note({}) == ""
    assert [size(n) for n in (512, 3 * 2**20, 12_500 * 2**20)] == ["512 B", "3.00 MiB", "12.2 GiB"]


# ---------------------------------------------------------------- engine info
def test_engine_info_shows_the_step_limits_in_force() -> None:
    import dataclasses

    base = dataclasses.replace(StatsSnapshot.empty("cuda", "cuda (H200)", "m.gguf"), max_slots=8, max_ctx=4096)
    assert "step" not in describe(base)  # limits unknown (a remote engine): no line
    snap = dataclasses.replace(base, max_rows=512, max_seqs=8, rows_per_prompt=64, lone_prompt_rows=512)
    lines = describe(snap).splitlines()
    assert lines[3] == "step    512 rows · 8 seqs · prompt 64 rows, alone 512"
    assert all(len(line) <= 56 for line in lines)
