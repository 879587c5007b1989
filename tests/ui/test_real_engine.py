"""The TUI on the real embedded engine (the default model on the CPU): the same app, only the
engine argument differs."""

from __future__ import annotations

from pathlib import Path

import pytest

from ds4_app.engine.service import EngineService
from ds4_app.ui.app import DS4App
from ds4_app.ui.messages import PromptSubmitted
from ds4_app.ui.session_settings import SessionSettings
from ds4_app.ui.widgets.lanes_table import LanesTable

from .helpers import FIXED_TIME, chat, wait_until


@pytest.fixture(scope="module")
def engine():
    service = EngineService.open(max_slots=4, max_ctx=1024)
    yield service
    service.close()


async def test_two_sessions_on_the_real_engine(tmp_path: Path, engine: EngineService) -> None:
    app = DS4App(engine, data_dir=tmp_path, clock=lambda: FIXED_TIME)
    async with app.run_test(size=(140, 40)) as pilot:
        first = chat(app)
        await pilot.press("ctrl+n")
        second = chat(app)
        for view, seed in ((first, 1), (second, 2)):
            view.apply_settings(SessionSettings(temperature=0.8, seed=seed, max_tokens=48))
        # Both sends land within one UI tick, so the engine serves them side by side.
        first.post_message(PromptSubmitted("Tell me about pages."))
        second.post_message(PromptSubmitted("And about slots?"))
        await wait_until(pilot, lambda: len(first.history) == 2 and len(second.history) == 2
                         and not first.busy and not second.busy, timeout=60, what="both replies")
        for view in (first, second):
            reply = view.history[-1]
            assert reply.role == "assistant" and reply.content.strip()
            assert reply.meta["finish_reason"] in ("stop", "length")
            assert reply.meta["completion_tokens"] >= 1
            assert [m.content for m in app.store.messages(view.session.id)] == [m.content for m in view.history]
        # Both sessions stay resident in their slots, named by their tab titles in the panel.
        table = app.query_one(LanesTable)
        await wait_until(pilot, lambda: sorted((str(table.get_cell(k, "session")), str(table.get_cell(k, "state")))
                                               for k in table.keys)
                         == [("And about slo…", "resident"), ("Tell me about…", "resident")],
                         timeout=30, what="two resident lanes")
        assert {lane.session for lane in engine.stats().lanes} == {first.session.id, second.session.id}
        # The second turn of a session goes to the same engine session.
        first.post_message(PromptSubmitted("More, please."))
        await wait_until(pilot, lambda: len(first.history) == 4 and not first.busy, timeout=60, what="turn 2")


async def test_escape_cancels_on_the_real_engine_and_frees_the_lane(tmp_path: Path, tiny_model_path: str) -> None:
    """Tiny preset, two tabs streaming long replies at once: Esc in one cancels it, its lane
    leaves the panel's decode rows and its pages go back, while the other keeps streaming."""
    service = EngineService.open(tiny_model_path, max_slots=4, max_ctx=2048)
    try:
        app = DS4App(service, data_dir=tmp_path, clock=lambda: FIXED_TIME)
        async with app.run_test(size=(140, 40)) as pilot:
            first = chat(app)
            await pilot.press("ctrl+n")
            second = chat(app)
            for view in (first, second):
                view.apply_settings(SessionSettings(temperature=0.0, max_tokens=1500))
            first.post_message(PromptSubmitted("Write at length."))
            second.post_message(PromptSubmitted("And you, at length too."))
            decoding = lambda: sorted(lane.state for lane in service.stats().lanes if lane.state == "decode")
            await wait_until(pilot, lambda: decoding() == ["decode", "decode"], timeout=30, what="two decode lanes")
            table = app.query_one(LanesTable)
            await wait_until(pilot, lambda: sum(str(table.get_cell(k, "state")) == "decode" for k in table.keys) == 2,
                             timeout=10, what="the panel shows two decode lanes")
            await pilot.press("escape")  # the active tab is the second one
            await wait_until(pilot, lambda: not second.busy, timeout=10, what="the cancel")
            assert second.history[-1].meta["finish_reason"] == "cancelled"
            await wait_until(pilot, lambda: decoding() == ["decode"] or not first.busy, timeout=10,
                             what="one decode lane left")
            await wait_until(pilot, lambda: sum(str(table.get_cell(k, "state")) == "decode" for k in table.keys) <= 1,
                             timeout=10, what="the panel drops the cancelled lane")
            states = {lane.session: lane.state for lane in service.stats().lanes}
            assert states.get(second.session.id) in (None, "resident")
    finally:
        service.close()
