"""Shared helpers for the UI tests: wait_until, fixed clock, and shortcuts into the app."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Callable

from textual.pilot import Pilot

from ds4_app.ui.app import DS4App
from ds4_app.ui.widgets.chat_message import ChatMessage
from ds4_app.ui.widgets.chat_view import ChatView

from .fake_engine import FakeEngine

FIXED_TIME = 1_767_225_600.0  # 2026-01-01 00:00:00 UTC


async def wait_until(pilot: Pilot, predicate: Callable[[], bool], *, timeout: float = 10.0,
                     what: str = "condition") -> None:
    """Let the app run until ``predicate()`` holds (one pause() is not enough for work done by
    workers and timers); fails the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await pilot.pause(0.02)
        await asyncio.sleep(0)


def make_app(data_dir: Path, engine: FakeEngine | None = None, **kwargs) -> DS4App:
    """A DS4App on a fake engine, with a fixed clock."""
    clock = kwargs.pop("clock", lambda: FIXED_TIME)
    return DS4App(engine if engine is not None else FakeEngine(), data_dir=data_dir, clock=clock, **kwargs)


def chat(app: DS4App) -> ChatView:
    """The active chat view."""
    view = app.current_chat()
    assert view is not None
    return view


def messages(view: ChatView) -> list[tuple[str, str]]:
    """(role, text) of every message widget in a chat view, streaming or not."""
    return [(m.role, m.content) for m in view.query(ChatMessage)]


async def send(pilot: Pilot, text: str) -> None:
    """Type ``text`` into the active chat's input and press enter."""
    view = chat(pilot.app)  # type: ignore[arg-type]
    view.input.focus()
    view.input.insert(text)
    await pilot.press("enter")
