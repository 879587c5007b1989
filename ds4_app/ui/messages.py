"""The TUI's own messages (dataclasses), posted between the bridge, widgets and the App."""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message

from ds4_app.engine.api import EngineClient, Finished, StatsSnapshot


@dataclass
class ReplyChunk(Message):
    """What one session's reply gained since the last pump tick: coalesced text of each channel,
    and the Finished event when the reply ended in this tick."""

    session_id: str
    request_id: str
    content: str
    reasoning: str
    finished: Finished | None = None


@dataclass
class StatsUpdated(Message):
    """A fresh engine stats snapshot. Only the newest one pending matters, so an older one still
    in the queue is replaced rather than handled."""

    snapshot: StatsSnapshot

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, StatsUpdated)


@dataclass
class PromptSubmitted(Message):
    """The chat input's text, sent with the send key."""

    text: str


@dataclass
class EarlierRequested(Message):
    """The user asked a chat to draw earlier messages (clicked the line at its top)."""


@dataclass
class SessionTitleChanged(Message):
    """A session got a new title (renamed, or named after its first message)."""

    session_id: str
    title: str


@dataclass
class SessionBusyChanged(Message):
    """A session started (busy=True) or stopped streaming a reply."""

    session_id: str
    busy: bool


@dataclass
class EngineReady(Message):
    """The engine finished loading in the background and takes requests now. ``model_name`` was
    read in the loading thread (a remote engine may ask its server for it)."""

    engine: EngineClient
    model_name: str


@dataclass
class EngineFailed(Message):
    """The engine could not be loaded; ``error`` is one line for the user."""

    error: str
