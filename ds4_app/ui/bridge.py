"""The engine → UI bridge: replies pumped to their chat views, stats polled for the panel.

The engine runs in its own thread (or another process, for a remote engine); the UI only ever
waits on it asynchronously:

- each running reply has a small reader task on the UI loop that moves the handle's events into
  the reply's own queue (appending to a deque, nothing else, so a fast engine costs the UI almost
  nothing per token);
- one pump, every ``interval`` seconds (40 ms), drains every queue and posts at most one
  ``ReplyChunk`` per reply with the text coalesced, so a chat view appends to its Markdown ~25
  times a second however fast tokens come, and several sessions stream side by side;
- a thread polls ``engine.stats()`` at most 1/``stats_interval`` times a second (10 Hz) and posts
  ``StatsUpdated`` (coalescing: an unhandled older snapshot is dropped). A thread, because a
  remote engine's stats() is an HTTP call that must not stall the UI loop.

Swapping engines (FakeEngine in tests, EngineService, RemoteEngine) changes nothing here.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ds4_app.engine.api import (Delta, EngineClient, EngineUnavailable, Event, Finished, GenerationRequest,
                                RequestHandle, ServiceError, StatsSnapshot, Usage)

from .messages import ReplyChunk, StatsUpdated

if TYPE_CHECKING:
    from textual.app import App
    from textual.message_pump import MessagePump


@dataclass(slots=True, eq=False)
class _Reply:
    """One running reply on the UI side: where its events wait and who gets them."""

    session_id: str
    request_id: str
    target: "MessagePump"
    pending: collections.deque[Event] = field(default_factory=collections.deque)
    cancel_sent: bool = False


class EngineBridge:
    """Owns the UI's view of one engine: submit, cancel, the reply pump and the stats poller."""

    def __init__(self, engine: EngineClient | None = None, *, interval: float = 0.04,
                 stats_interval: float = 0.1, unavailable: str = "the engine is still loading") -> None:
        self._engine = engine
        self._unavailable = unavailable
        self.interval = interval
        self.stats_interval = stats_interval
        self._replies: dict[str, _Reply] = {}
        self._app: App | None = None
        self._stop = threading.Event()

    # ------------------------------------------------------------------ engine
    @property
    def engine(self) -> EngineClient | None:
        """The engine, or None while it loads (or after it failed to)."""
        return self._engine

    def set_engine(self, engine: EngineClient) -> None:
        """Use ``engine`` from now on (after a background load)."""
        self._engine = engine

    def set_unavailable(self, reason: str) -> None:
        """Record why there is no engine; submit() raises EngineUnavailable with this reason."""
        self._unavailable = reason

    # ------------------------------------------------------------------ lifecycle
    def attach(self, app: "App", stats_target: "MessagePump", *, poll_stats: Callable[[], bool]) -> None:
        """Start the pump on ``app``'s loop and the stats thread (posting to ``stats_target``
        while ``poll_stats()`` is true, i.e. while someone shows the stats)."""
        self._app = app
        app.set_interval(self.interval, self._pump, name="reply-pump")
        app.run_worker(lambda: self._poll(stats_target, poll_stats), name="engine-stats", group="engine-stats",
                       exclusive=True, thread=True, exit_on_error=False)

    def close(self) -> None:
        """Stop polling and cancel every reply still running (the engine keeps running)."""
        self._stop.set()
        for request_id in list(self._replies):
            self.cancel(request_id)

    # ------------------------------------------------------------------ replies
    def submit(self, request: GenerationRequest, target: "MessagePump") -> str:
        """Submit ``request``; its events reach ``target`` as ReplyChunk messages. Returns the
        request id. Raises the engine's ServiceError (or EngineUnavailable) without side effects."""
        if self._app is None:
            raise RuntimeError("EngineBridge.attach() must run before submit()")
        if self._engine is None:
            raise EngineUnavailable(self._unavailable)
        handle = self._engine.submit(request)
        reply = _Reply(request.session or "", handle.request_id, target)
        self._replies[handle.request_id] = reply
        self._app.run_worker(self._read(handle, reply), name=f"reply {handle.request_id}", group="replies",
                             exit_on_error=False)
        return handle.request_id

    def cancel(self, request_id: str) -> None:
        """Ask the engine to stop a reply; its Finished("cancelled") still arrives as usual."""
        reply = self._replies.get(request_id)
        if self._engine is not None and reply is not None and not reply.cancel_sent:
            reply.cancel_sent = True
            self._engine.cancel(request_id)

    def running(self) -> list[str]:
        """Request ids whose Finished has not been delivered yet."""
        return list(self._replies)

    async def _read(self, handle: RequestHandle, reply: _Reply) -> None:
        # Only moves events; the pump decides when the UI sees them.
        try:
            async for event in handle:
                reply.pending.append(event)
                if isinstance(event, Finished):
                    return
            error = "the engine closed the reply without finishing it"
        except asyncio.CancelledError:
            raise
        except ServiceError as e:  # a remote engine refuses a request when its stream is first read
            error = str(e) or type(e).__name__
        except Exception as e:  # noqa: BLE001 - any failure of a remote stream ends this reply only
            error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        reply.pending.append(Finished("error", Usage(0, 0), error=error))

    def _pump(self) -> None:
        for request_id, reply in list(self._replies.items()):
            if not reply.pending:
                continue
            content: list[str] = []
            reasoning: list[str] = []
            finished: Finished | None = None
            while reply.pending:
                event = reply.pending.popleft()
                if isinstance(event, Delta):
                    (content if event.kind == "content" else reasoning).append(event.text)
                else:
                    finished = event
                    break
            if finished is not None:
                del self._replies[request_id]
            reply.target.post_message(ReplyChunk(reply.session_id, request_id, "".join(content),
                                                 "".join(reasoning), finished))

    # ------------------------------------------------------------------ stats
    def stats(self) -> StatsSnapshot | None:
        """The engine's current snapshot, or None without an engine."""
        return self._engine.stats() if self._engine is not None else None

    def _poll(self, target: "MessagePump", wanted: Callable[[], bool]) -> None:
        from textual.worker import get_current_worker

        worker = get_current_worker()
        last: StatsSnapshot | None = None
        # Ends on close() or when Textual cancels its workers at exit (the executor joins us).
        while not self._stop.wait(self.stats_interval) and not worker.is_cancelled:
            if not wanted() or self._engine is None:
                continue
            try:
                snapshot = self._engine.stats()
            except Exception:  # noqa: BLE001 - a remote without /v1/lanes, or a network blip: keep polling
                continue
            # Equal snapshots (an idle engine) cost the UI nothing: no message, no redraw.
            if snapshot is not last and snapshot != last:
                last = snapshot
                target.post_message(StatsUpdated(snapshot))
