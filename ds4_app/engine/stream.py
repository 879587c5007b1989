"""EventStream: one request's events, pushed by an engine thread, read by async or blocking code.

Both engines hand these out from ``submit``: the embedded ``EngineService`` (its step loop
pushes) and ``RemoteEngine`` (its HTTP thread pushes). The producer never blocks: the buffer is
bounded by ``max_buffered`` events, and a consumer that falls that far behind is reported once
through ``on_overflow`` (the service then cancels the request) and its further deltas are
dropped; the final ``Finished`` event is always delivered. ``fail`` makes the consumer's next
read raise an error instead (a remote server refused the request).
"""

from __future__ import annotations

import asyncio
import collections
import threading
from typing import AsyncIterator, Callable, Iterable, Iterator

from .api import Event, Finished, ServiceError


class EventStream:
    """The handle of one request: ``async for ev in stream`` or ``for ev in stream.events()``."""

    def __init__(self, request_id: str, *, max_buffered: int | None = None,
                 on_overflow: Callable[[str], None] | None = None) -> None:
        self.request_id = request_id
        self._buf: collections.deque[Event] = collections.deque()
        self._cond = threading.Condition(threading.Lock())  # never taken re-entrantly
        self._max = max_buffered
        self._on_overflow = on_overflow
        self._overflowed = False
        self._done = False
        self._error: ServiceError | None = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    # --- producer side (never blocks) ---
    def push(self, ev: Event, *, wake: bool = True) -> None:
        """Queue an event; after a Finished, later pushes are ignored.

        ``wake=False`` leaves the consumer asleep until the producer calls ``wake``: the service
        queues a whole step's events first and wakes their consumers together just before it
        releases the GIL for the next native step, so that they do not take the GIL from it
        (and make it wait for them) in the middle of its own Python work.
        """
        overflow = False
        with self._cond:
            if self._done:
                return
            final = isinstance(ev, Finished)
            if not final and self._max is not None and len(self._buf) >= self._max:
                overflow, self._overflowed = not self._overflowed, True
            else:
                self._buf.append(ev)
                self._done = final
            if wake:  # under the lock the append took (this runs once per token per request)
                self._cond.notify_all()
                waiters = list(self._waiters) if self._waiters else ()
        if overflow and self._on_overflow is not None:
            self._on_overflow(self.request_id)
        if wake:
            self._wake_async(waiters)

    def wake(self) -> None:
        """Wake the consumer for the events pushed with ``wake=False``."""
        with self._cond:
            self._cond.notify_all()
            waiters = list(self._waiters) if self._waiters else ()
        self._wake_async(waiters)

    def fail(self, error: ServiceError) -> None:
        """The request was refused: the consumer's next read raises ``error``."""
        with self._cond:
            self._error = error
            self._cond.notify_all()
            waiters = list(self._waiters)
        self._wake_async(waiters)

    @staticmethod
    def _wake_async(waiters: Iterable[tuple[asyncio.AbstractEventLoop, asyncio.Event]]) -> None:
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the consumer's loop has closed
                pass

    # --- consumer side ---
    def _pop(self) -> Event | None:
        """The next event, or None; raises the refusal once the buffer is drained. Holds _cond."""
        if self._buf:
            return self._buf.popleft()
        if self._error is not None:
            raise self._error
        return None

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Blocking iteration until the Finished event (TimeoutError after ``timeout`` s idle)."""
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: self._buf or self._error is not None, timeout):
                    raise TimeoutError(f"no event from {self.request_id} for {timeout} s")
                ev = self._pop()
            yield ev
            if isinstance(ev, Finished):
                return

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[Event]:
        loop, event = asyncio.get_running_loop(), asyncio.Event()
        with self._cond:
            self._waiters.append((loop, event))
        try:
            while True:
                with self._cond:
                    ev = self._pop()
                    if ev is None:
                        event.clear()  # under the lock: a push after this sets it again
                if ev is None:
                    await event.wait()
                    continue
                yield ev
                if isinstance(ev, Finished):
                    return
        finally:
            with self._cond:
                self._waiters.remove((loop, event))
