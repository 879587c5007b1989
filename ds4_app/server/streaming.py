"""Server-sent events that never let one client hold up another, or the engine.

A streamed answer runs three tasks:

- the *pump* drains the request's events from the engine as fast as the engine makes them and
  appends the encoded frames to this client's ``SendBuffer`` without ever waiting; if the buffer
  is over its byte bound (the client stopped reading), the client is dropped;
- the *sender* hands buffered frames to the server (coalescing whatever has piled up) and gives
  each hand-over ``send_timeout`` seconds: uvicorn's ``send`` waits while the socket's write
  buffer is full, so a reader that makes no progress for that long is dropped; when nothing has
  arrived for ``keepalive`` seconds (a long prefill) it sends a ``: keep-alive`` comment;
- the *watcher* waits for the ASGI ``http.disconnect`` message (as vLLM's ``with_cancellation``
  does), so a client that goes away is noticed at once, not at the next write.

When the stream is over, ``on_end(reason)`` is called exactly once: reason None when all was
sent, else "disconnect", "slow_client", "error" or "cancelled" (this task was cancelled, e.g. at shutdown);
the caller cancels the engine request there. A dropped client's connection is then reset (see
``ABORT_EXTENSION``). Only this request's own tasks ever wait, so other streams keep their pace.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)

DONE_FRAME = b"data: [DONE]\n\n"
KEEPALIVE_FRAME = b": keep-alive\n\n"

# ASGI has no way to abort a connection. Where the server offers it (``main`` puts uvicorn's
# ``transport.abort`` here), a dropped client's socket is reset at once, so its unsent bytes do
# not stay in memory until it reads them or goes away.
ABORT_EXTENSION = "ds4.abort_connection"


def sse_frame(obj: Mapping[str, Any]) -> bytes:
    """One ``data:`` event holding a JSON object."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """How much a slow client may hold up its own stream before it is dropped."""

    max_buffer_bytes: int = 1 << 20
    send_timeout: float = 30.0
    keepalive: float = 15.0

    def __post_init__(self) -> None:
        if self.max_buffer_bytes < 1024:
            raise ValueError(f"client buffer must be at least 1 KiB, got {self.max_buffer_bytes} bytes")
        if not self.send_timeout > 0 or not self.keepalive > 0:
            raise ValueError("send timeout and keep-alive interval must be > 0 seconds")


class SendBuffer:
    """A byte-bounded FIFO of frames between the pump and the sender; ``put`` never waits."""

    __slots__ = ("limit", "_frames", "_size", "_ready", "_closed")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._frames: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._ready = asyncio.Event()
        self._closed = False

    @property
    def size(self) -> int:
        """Bytes waiting to be sent."""
        return self._size

    def put(self, frame: bytes) -> bool:
        """Queue a frame; False (and nothing queued) when it would go over the bound. A frame
        bigger than the whole bound is taken into an empty buffer, so that one large delta does
        not drop a client that keeps up."""
        if self._frames and self._size + len(frame) > self.limit:
            return False
        self._frames.append(frame)
        self._size += len(frame)
        self._ready.set()
        return True

    def close(self) -> None:
        """No more frames will come; the sender ends once it has sent what is queued."""
        self._closed = True
        self._ready.set()

    async def take(self, timeout: float) -> bytes | None:
        """Everything queued, joined; b"" at the end of the stream; None after ``timeout`` idle seconds."""
        if not self._frames and not self._closed:
            try:
                # asyncio.timeout, not wait_for: 3.11's wait_for can hang a task cancelled just as
                # its inner task completes (the stream's cleanup would then never run).
                async with asyncio.timeout(timeout):
                    await self._ready.wait()
            except TimeoutError:
                return None
        data = b"".join(self._frames)
        self._frames.clear()
        self._size = 0
        self._ready.clear()
        if not data and self._closed:
            return b""
        return data


class _Drop(Exception):
    """Ends a stream early, with the reason passed to on_abort."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EventStreamResponse(Response):
    """A ``text/event-stream`` response fed by ``frames`` (encoded SSE events), with slow-client
    and disconnect handling as described in the module docstring."""

    media_type = "text/event-stream"

    def __init__(self, frames: AsyncIterator[bytes], *, limits: StreamLimits,
                 on_end: Callable[[str | None], None], headers: Mapping[str, str] | None = None) -> None:
        # Like StreamingResponse: no body attribute, so no Content-Length header.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self.frames = frames
        self.limits = limits
        self.on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        buf = SendBuffer(self.limits.max_buffer_bytes)
        tasks = [asyncio.create_task(self._pump(buf), name="sse-pump"),
                 asyncio.create_task(self._send_all(buf, send), name="sse-send"),
                 asyncio.create_task(self._watch(receive), name="sse-watch")]
        sender = tasks[1]
        # Until the loop below decides otherwise, an exit (e.g. this task being cancelled at
        # shutdown) abandons the request.
        reason: str | None = "cancelled"
        try:
            # The stream is over when everything is sent, or as soon as any task raises _Drop.
            pending = set(tasks)
            while True:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if sender in done and sender.exception() is None:
                    reason = None  # all sent; the watcher sees a "disconnect" once the response completes
                    break
                drop = None
                for t in done:
                    exc = t.exception()
                    if isinstance(exc, _Drop):
                        drop = exc.reason
                    elif exc is not None:
                        log.error("stream task %s failed", t.get_name(), exc_info=exc)
                        drop = "error"
                if drop is not None:
                    reason = drop
                    break
        finally:
            for t in tasks:
                t.cancel()
            # Before any await, so that the engine request is cancelled whatever happens below.
            # On a drop the server then closes the connection without the final chunk, so the
            # client sees a cut stream.
            self.on_end(reason)
            abort = scope.get("extensions", {}).get(ABORT_EXTENSION)
            if reason in ("slow_client", "error") and abort is not None:
                abort()
            await asyncio.wait(tasks, timeout=5.0)
            aclose = getattr(self.frames, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except RuntimeError:  # still running: the pump did not stop within the wait above
                    log.warning("stream source did not stop after its stream ended")

    async def _pump(self, buf: SendBuffer) -> None:
        n = 0
        async for frame in self.frames:
            if not buf.put(frame):
                # Full: give the sender a few turns. A client that keeps up takes the whole buffer
                # in them (a burst of queued events); one whose socket is stuck does not.
                for _ in range(4):
                    await asyncio.sleep(0)
                    if buf.put(frame):
                        break
                else:
                    raise _Drop("slow_client")
            n += 1
            if n % 64 == 0:
                await asyncio.sleep(0)  # a long backlog of events must not monopolise the loop
        buf.close()

    async def _send_all(self, buf: SendBuffer, send: Send) -> None:
        await self._send(send, {"type": "http.response.start", "status": self.status_code,
                                "headers": self.raw_headers})
        while True:
            data = await buf.take(self.limits.keepalive)
            if data == b"":
                await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})
                return
            await self._send(send, {"type": "http.response.body", "body": data if data is not None
                                    else KEEPALIVE_FRAME, "more_body": True})

    async def _send(self, send: Send, message: dict[str, Any]) -> None:
        try:
            async with asyncio.timeout(self.limits.send_timeout):
                await send(message)
        except TimeoutError:
            raise _Drop("slow_client") from None
        except OSError:  # the socket went away under the write
            raise _Drop("disconnect") from None

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Drop("disconnect")
