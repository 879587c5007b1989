"""RemoteEngine: the ``EngineClient`` interface over any OpenAI-compatible HTTP server.

The TUI and the bench drive ``ds4-app --serve`` elsewhere, llama-server, vLLM or SGLang through
this, without importing the server package. Requests stream from ``/v1/chat/completions``
(messages) or ``/v1/completions`` (raw prompt); ``reasoning_content`` deltas become
``Delta("reasoning")``. Only sampling fields that differ from their neutral value are sent, so a
server that does not know ``top_k`` or ``min_p`` is not bothered with them. Thinking is asked
for with ``chat_template_kwargs`` (``thinking`` and ``enable_thinking``, the names DS4/DeepSeek
and Qwen templates read).

HTTP runs on a private event loop in one daemon thread, so ``submit`` never blocks and the
handles serve both async and blocking consumers, as the embedded service's do. One difference
from the embedded engine: an admission error (400, 503 queue full, ...) is only known once the
server answers, so it is raised by the first iteration of the handle, not by ``submit``.
``cancel`` closes the request's connection; a server that cancels on disconnect (ours, vLLM)
stops generating at once.

``stats`` reads ``GET /v1/lanes`` where the server has it (ours); elsewhere it returns a snapshot
of what this client knows: its own requests in flight, their TTFTs, tokens and rates.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import threading
import time
from typing import Any, Sequence

import httpx

from .api import (ContextLengthExceeded, Delta, EngineUnavailable, ExceedsPool, Finished,
                  GenerationRequest, InvalidRequest, LaneStats, PoolStats, QueueFull, ServiceError,
                  StatsSnapshot, Usage)
from .chat import Message
from .sampling import SamplerConfig
from .stream import EventStream

_NEUTRAL = SamplerConfig()


class RemoteError(ServiceError):
    """An error answer from the server that matches none of the engine's own kinds."""

    def __init__(self, message: str, status: int, error_type: str) -> None:
        super().__init__(message)
        self.http_status = status
        self.error_type = error_type


@dataclasses.dataclass(slots=True, eq=False)
class _Flight:
    """This client's record of one request in flight (touched on the client's loop thread)."""

    request_id: str
    handle: EventStream
    t_submit: float
    task: asyncio.Task | None = None
    started: bool = False
    done: bool = False
    t_first: float = 0.0
    deltas: int = 0


class RemoteEngine:
    """``EngineClient`` over an OpenAI-compatible server at ``base_url`` (with or without ``/v1``).

    ``model`` is sent with each request (default: the first model the server lists); ``api_key``
    goes out as a Bearer token. ``transport`` replaces httpx's network transport (tests).
    """

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None, *,
                 timeout: float = 600.0, transport: httpx.AsyncBaseTransport | None = None,
                 sync_transport: httpx.BaseTransport | None = None) -> None:
        root = base_url.rstrip("/")
        self.root = root[: -len("/v1")] if root.endswith("/v1") else root
        self._model = model
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = httpx.Timeout(timeout, connect=10.0)
        self._transport = transport
        self._sync = httpx.Client(base_url=self.root, headers=self._headers, timeout=httpx.Timeout(5.0),
                                  transport=sync_transport)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: httpx.AsyncClient | None = None
        self._flights: dict[str, _Flight] = {}
        self._has_lanes: bool | None = None  # unknown until the first stats()
        self._closed = False
        # What this client knows, for servers without /v1/lanes.
        self._finished = 0
        self._prompt_total = 0
        self._gen_total = 0
        self._ttfts: collections.deque[float] = collections.deque(maxlen=60)
        self._token_times: collections.deque[float] = collections.deque(maxlen=4096)

    # --- EngineClient ---
    @property
    def model_name(self) -> str:
        """The model requests ask for; the server's first listed model unless one was given."""
        if self._model is None:
            try:
                r = self._sync.get("/v1/models")
                r.raise_for_status()
                data = r.json().get("data") or []
                if data and isinstance(data[0].get("id"), str):
                    self._model = data[0]["id"]
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
        return self._model or self.root  # unknown yet: name the server itself

    def submit(self, request: GenerationRequest) -> EventStream:
        """Start the request (never blocks); a refusal surfaces when the handle is first read."""
        handle = EventStream(request.request_id)
        loop = self._ensure_loop()
        body, path = self._body(request)
        flight = _Flight(request.request_id, handle, time.monotonic())
        with self._lock:
            if self._closed:
                raise EngineUnavailable(f"the client for {self.root} is closed")
            self._flights[request.request_id] = flight
        loop.call_soon_threadsafe(self._start, flight, path, body)
        return handle

    def cancel(self, request_id: str) -> None:
        """Close the request's connection; its handle ends with finish_reason "cancelled"."""
        with self._lock:
            flight = self._flights.get(request_id)
            loop = self._loop
        if flight is not None and loop is not None:
            try:
                loop.call_soon_threadsafe(self._cancel, flight)
            except RuntimeError:  # closed meanwhile
                pass

    def stats(self) -> StatsSnapshot:
        """The server's ``/v1/lanes`` snapshot if it has one, else what this client knows."""
        if self._has_lanes is not False:
            try:
                r = self._sync.get("/v1/lanes")
                if r.status_code in (404, 405, 501):
                    self._has_lanes = False
                elif r.status_code == 200:
                    self._has_lanes = True
                    return snapshot_from_json(r.json())
            except (httpx.HTTPError, ValueError, TypeError, KeyError):
                pass
        return self._own_snapshot()

    def count_prompt_tokens(self, messages: Sequence[Message] | None, prompt: str | None,
                            thinking: bool = False) -> int:
        """Ask the server's ``/tokenize`` (ours and vLLM's answer ``count``; llama.cpp's ``tokens``)."""
        body: dict[str, Any] = {"model": self.model_name}
        if messages is not None:
            body["messages"] = [_message_json(m) for m in messages]
            body["chat_template_kwargs"] = {"thinking": thinking, "enable_thinking": thinking}
        else:
            body["prompt"] = prompt or ""
            body["content"] = prompt or ""  # llama.cpp's field name
        try:
            r = self._sync.post("/tokenize", json=body)
            if r.status_code == 200:
                out = r.json()
                if isinstance(out.get("count"), int):
                    return out["count"]
                if isinstance(out.get("tokens"), list):
                    return len(out["tokens"])
            elif r.status_code < 500 and r.status_code not in (404, 405):
                raise _error_from(r.status_code, r.content)
        except httpx.HTTPError as e:
            raise EngineUnavailable(f"cannot reach {self.root}: {e}") from None
        raise EngineUnavailable(f"{self.root} cannot count tokens (no usable /tokenize endpoint)")

    def close(self) -> None:
        """Cancel what is in flight and stop the client's thread."""
        with self._lock:
            self._closed = True
            flights = list(self._flights.values())
            loop = self._loop
        if loop is not None:
            async def shutdown() -> None:
                for f in flights:
                    self._cancel(f)
                await asyncio.sleep(0)  # let the cancelled streams unwind and send Finished
                tasks = [f.task for f in flights if f.task is not None]
                await asyncio.gather(*tasks, return_exceptions=True)
                if self._client is not None:
                    await self._client.aclose()

            try:
                asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=5)
            except (concurrent.futures.TimeoutError, RuntimeError):
                pass
            loop.call_soon_threadsafe(loop.stop)
        self._sync.close()

    # --- internals ---
    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="ds4-remote", daemon=True).start()
                self._loop = loop
            return self._loop

    def _body(self, req: GenerationRequest) -> tuple[dict[str, Any], str]:
        body: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}}
        model = self._model or self.model_name
        if model != self.root:
            body["model"] = model
        s = req.sampling
        body["temperature"] = s.temperature
        for name in ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if getattr(s, name) != getattr(_NEUTRAL, name):
                body[name] = getattr(s, name)
        if s.penalty_last_n != _NEUTRAL.penalty_last_n:
            body["repeat_last_n"] = s.penalty_last_n
        if s.seed is not None:
            body["seed"] = s.seed
        if s.max_tokens is not None:
            body["max_tokens"] = s.max_tokens
        if s.stop:
            body["stop"] = list(s.stop)
        if s.ignore_eos:
            body["ignore_eos"] = True
        if req.messages is not None:
            body["messages"] = [_message_json(m) for m in req.messages]
            if req.session:
                body["session_id"] = req.session  # ds4-app servers keep the slot resident; others ignore it
            body["chat_template_kwargs"] = {"thinking": req.thinking, "enable_thinking": req.thinking}
            return body, "/v1/chat/completions"
        body["prompt"] = req.prompt
        return body, "/v1/completions"

    # The loop thread owns each flight from here on: _start, _cancel, _run and _finish run on it.
    def _start(self, flight: _Flight, path: str, body: dict[str, Any]) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(base_url=self.root, headers=self._headers, timeout=self._timeout,
                                             transport=self._transport)
        flight.task = asyncio.get_running_loop().create_task(self._run(flight, path, body))

    def _cancel(self, flight: _Flight) -> None:
        if flight.done or flight.task is None:
            return
        flight.task.cancel()
        if not flight.started:  # a task cancelled before its first step never runs its body
            self._finish(flight, "cancelled", None, None)

    async def _run(self, flight: _Flight, path: str, body: dict[str, Any]) -> None:
        flight.started = True
        handle = flight.handle
        reason, usage_json, error = "stop", None, None
        assert self._client is not None
        try:
            async with self._client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    flight.done = True
                    with self._lock:
                        self._flights.pop(flight.request_id, None)
                    handle.fail(_error_from(r.status_code, await r.aread()))
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators and ": keep-alive" comments
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        err = obj["error"]
                        reason, error = "error", err.get("message") if isinstance(err, dict) else str(err)
                        continue
                    if obj.get("usage"):
                        usage_json = obj["usage"]
                    for choice in obj.get("choices") or ():
                        delta = choice.get("delta") or {}
                        for kind, text in (("reasoning", delta.get("reasoning_content") or
                                            choice.get("reasoning_content")),
                                           ("content", delta.get("content") if "delta" in choice
                                            else choice.get("text"))):
                            if text:
                                self._on_delta(flight)
                                handle.push(Delta(kind, text))  # type: ignore[arg-type]
                        if choice.get("finish_reason"):
                            reason = _finish_reason(choice["finish_reason"])
        except asyncio.CancelledError:
            reason = "cancelled"
        except (httpx.HTTPError, ValueError) as e:  # connection lost, bad JSON from the server
            reason, error = "error", f"{self.root}: {type(e).__name__}: {e}"
        self._finish(flight, reason, usage_json, error)

    def _finish(self, flight: _Flight, reason: str, usage_json: dict[str, Any] | None, error: str | None) -> None:
        if flight.done:
            return
        flight.done = True
        usage = self._usage(flight, usage_json)
        with self._lock:
            self._flights.pop(flight.request_id, None)
            self._finished += 1
            self._prompt_total += usage.prompt_tokens
            self._gen_total += usage.completion_tokens
        flight.handle.push(Finished(finish_reason=reason, usage=usage, error=error))  # type: ignore[arg-type]

    def _on_delta(self, flight: _Flight) -> None:
        now = time.monotonic()
        with self._lock:  # stats() reads these from other threads
            if flight.deltas == 0:
                flight.t_first = now
                self._ttfts.append(now - flight.t_submit)
            flight.deltas += 1
            self._token_times.append(now)

    def _usage(self, flight: _Flight, u: dict[str, Any] | None) -> Usage:
        """The server's usage (and our timings when it gives them), else local measurements."""
        now = time.monotonic()
        first = flight.t_first or now
        local = dict(ttft_s=first - flight.t_submit, prefill_s=first - flight.t_submit, decode_s=now - first,
                     total_s=now - flight.t_submit)
        if not u:
            return Usage(prompt_tokens=0, completion_tokens=flight.deltas, **local)
        t = u.get("timings") or {}
        if "ttft_ms" in t:
            local = dict(queue_s=t.get("queue_ms", 0) / 1e3, ttft_s=t["ttft_ms"] / 1e3,
                         prefill_s=t.get("prefill_ms", 0) / 1e3, decode_s=t.get("decode_ms", 0) / 1e3,
                         total_s=t.get("total_ms", 0) / 1e3)
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return Usage(prompt_tokens=int(u.get("prompt_tokens") or 0),
                     completion_tokens=int(u.get("completion_tokens") or 0), cached_tokens=int(cached), **local)

    def _own_snapshot(self) -> StatsSnapshot:
        now = time.monotonic()
        with self._lock:
            flights = list(self._flights.values())
            recent = [t for t in self._token_times if t >= now - 5.0]
            lanes = tuple(LaneStats(slot=None, request_id=f.request_id, session=None,
                                    state="decode" if f.deltas else "prefill", position=0, context=f.deltas,
                                    pages=0, tok_s=0.0) for f in flights)
            return dataclasses.replace(
                StatsSnapshot.empty(backend="remote", device=self.root, model=self._model or ""),
                lanes=lanes, n_running=len(flights), agg_tok_s=len(recent) / 5.0,
                ttft_recent=tuple(self._ttfts), prompt_tokens_total=self._prompt_total,
                generation_tokens_total=self._gen_total, requests_finished=self._finished)


def snapshot_from_json(obj: dict[str, Any]) -> StatsSnapshot:
    """A ``StatsSnapshot`` from ``GET /v1/lanes`` JSON (fields this version does not know are
    ignored; arrays become tuples)."""
    def build(cls, d: dict[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: _tuples(v) for k, v in d.items() if k in names})  # type: ignore[call-arg]

    lanes = tuple(build(LaneStats, x) for x in obj.get("lanes") or ())
    pool = build(PoolStats, obj.get("pool") or {"n_pages": 0, "used": 0, "reserved": 0, "free": 0})
    return build(StatsSnapshot, {**obj, "lanes": lanes, "pool": pool})


def _tuples(v: Any) -> Any:
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def _message_json(m: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.reasoning:
        out["reasoning_content"] = m.reasoning
    return out


def _finish_reason(r: str) -> str:
    if r in ("stop", "length", "cancelled", "error"):
        return r
    return "cancelled" if r == "abort" else "stop"


def _error_from(status: int, raw: bytes) -> ServiceError:
    """The engine error class that matches an error answer (OpenAI envelope or plain text)."""
    message, etype, code = raw.decode("utf-8", "replace").strip() or f"HTTP {status}", "", ""
    try:
        err = json.loads(raw).get("error")
        if isinstance(err, dict):
            message = str(err.get("message") or message)
            etype, code = str(err.get("type") or ""), str(err.get("code") or "")
        elif isinstance(err, str):
            message = err
    except (ValueError, AttributeError):
        pass
    if etype == "exceed_context_size_error" or code == "context_length_exceeded":
        return ContextLengthExceeded(message)
    if etype == "exceed_pool_error":
        return ExceedsPool(message)
    if status == 503:
        return QueueFull(message) if code == "queue_full" else EngineUnavailable(message)
    if status == 400:
        return InvalidRequest(message)
    return RemoteError(f"{message} (HTTP {status})", status, etype or "server_error")
