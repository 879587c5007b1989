"""The HTTP app: OpenAI-compatible routes over any ``EngineClient``.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed as SSE or whole),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus), ``GET /v1/lanes`` (the
engine's ``StatsSnapshot`` as JSON, what the TUI's panel shows) and ``POST /tokenize``.

Life of a generation request: the body is checked (``schemas``), then admitted: refused with 503
+ Retry-After while the model loads, while the server drains for shutdown, or when the requests
in flight reach ``max_slots + max_queue``; then ``engine.submit``, in a worker thread because it
tokenizes (its ``ServiceError``s map to their status). Headers go out only after admission, so every refusal has a proper status. A
streamed answer runs through ``streaming.EventStreamResponse`` (slow clients dropped, disconnects
noticed at once); a whole answer also watches for the client going away. Either way a request
the client abandons is cancelled in the engine right away.

The app can start before the engine exists (``engine=None``): ``/health`` answers 503 "loading"
until ``ServerState.attach`` is called, so a supervisor can watch a long model load.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from ds4_app.engine.api import Delta, EngineClient, Finished, RequestHandle, ServiceError, StatsSnapshot

from .errors import ApiError, error_body, from_service_error, unavailable
from .metrics import CONTENT_TYPE, RequestTimer, ServerMetrics
from .responses import ResponseBuilder
from .schemas import ParsedRequest, parse_chat, parse_completion, parse_json
from .streaming import DONE_FRAME, EventStreamResponse, StreamLimits, sse_frame

log = logging.getLogger(__name__)

# Paths that stay open when an API key is set (as llama-server and vLLM do): monitors and
# clients discover the server and its model without the key.
PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/v1/models"})


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The app's settings, checked once."""

    model_name: str
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    max_queue: int = 64
    limits: StreamLimits = field(default_factory=StreamLimits)
    default_thinking: bool = False

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("the server needs a model name")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key is empty")


class ServerState:
    """What the routes share: the engine (once loaded), the requests in flight, and draining.

    Touched only from the event loop's thread, except ``attach``/``fail``, which the loader
    thread calls through ``loop.call_soon_threadsafe`` (see ``main``).
    """

    def __init__(self, config: ServerConfig, engine: EngineClient | None) -> None:
        self.config = config
        self.engine = engine
        self.load_error: str | None = None
        self.draining = False
        self.started = int(time.time())
        self.in_flight: dict[str, asyncio.Event] = {}  # request id -> set when its answer ends
        self.metrics = ServerMetrics(config.model_name, self.snapshot, lambda: len(self.in_flight))

    # --- lifecycle ---
    def attach(self, engine: EngineClient) -> None:
        """The model is loaded: start answering."""
        self.engine = engine

    def fail(self, message: str) -> None:
        """The model could not be loaded; /health says why."""
        self.load_error = message

    def begin_drain(self) -> None:
        """Stop admitting: new generation requests get 503 from now on."""
        self.draining = True

    async def drain(self, grace: float) -> int:
        """Wait up to ``grace`` seconds for the requests in flight, then cancel the rest and wait
        (briefly) for their answers to end. Returns how many were cancelled."""
        waits = [e.wait() for e in self.in_flight.values()]
        if waits:
            await asyncio.wait([asyncio.ensure_future(w) for w in waits], timeout=grace)
        left = list(self.in_flight.items())
        for rid, _ in left:
            log.warning("shutdown: cancelling %s after the %.0f s grace period", rid, grace)
            self.metrics.aborted_request("shutdown")
            if self.engine is not None:
                self.engine.cancel(rid)
        if left:
            await asyncio.wait([asyncio.ensure_future(e.wait()) for _, e in left], timeout=5.0)
        return len(left)

    # --- queries ---
    def snapshot(self) -> StatsSnapshot | None:
        """The engine's stats, or None while loading."""
        return self.engine.stats() if self.engine is not None else None

    def model_names(self) -> set[str]:
        """Names a request's ``model`` may use: the served name, its stem, the engine's own."""
        names = {self.config.model_name, os.path.splitext(self.config.model_name)[0]}
        if self.engine is not None and getattr(self.engine, "model_name", None):
            names.add(self.engine.model_name)
        return names

    # --- admission ---
    def admit(self) -> EngineClient:
        """The engine, if a new request may go to it now; else a 503 that says why."""
        if self.draining:
            raise unavailable("the server is shutting down; retry against another instance", "shutting_down")
        if self.engine is None:
            if self.load_error:
                raise ApiError(503, f"the model failed to load: {self.load_error}", type="unavailable_error",
                               code="model_load_failed")
            raise unavailable("the model is still loading; retry shortly", "loading")
        slots = self.engine.stats().max_slots
        if slots > 0 and len(self.in_flight) >= slots + self.config.max_queue:
            raise unavailable(f"{len(self.in_flight)} requests in flight ({slots} slots + a queue of "
                              f"{self.config.max_queue}); retry later", "queue_full")
        return self.engine

    def track(self, request_id: str) -> None:
        """Count a submitted request as in flight until ``release``."""
        self.in_flight[request_id] = asyncio.Event()

    def release(self, request_id: str) -> None:
        """The request's answer has ended (idempotent)."""
        ev = self.in_flight.pop(request_id, None)
        if ev is not None:
            ev.set()


def create_app(engine: EngineClient | None, *, model_name: str, api_key: str | None = None,
               cors_origins: Iterable[str] = (), max_queue: int = 64,
               limits: StreamLimits | None = None, default_thinking: bool = False) -> FastAPI:
    """Build the app over ``engine`` (None: still loading; call ``app.state.ds4.attach`` later).

    ``max_queue`` bounds the requests waiting beyond the engine's slots; ``limits`` sets the
    slow-client bounds (buffer, send timeout) and the keep-alive interval of streams.
    """
    config = ServerConfig(model_name=model_name, api_key=api_key, cors_origins=tuple(cors_origins),
                          max_queue=max_queue, limits=limits or StreamLimits(), default_thinking=default_thinking)
    state = ServerState(config, engine)
    app = FastAPI(title="ds4-app", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ds4 = state
    _install_error_handlers(app, state)
    _install_routes(app, state)
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key,
                           on_reject=lambda: state.metrics.error_answer("authentication_error"))
    if config.cors_origins:
        # Added last, so it is outermost: preflight requests are answered before the key check.
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["Retry-After", "X-Request-Id"])
    return app


# --- auth -----------------------------------------------------------------------------------


class ApiKeyMiddleware:
    """Bearer-token check on every HTTP path but ``PUBLIC_PATHS`` (a pure ASGI middleware, so
    streaming and disconnect detection pass through untouched)."""

    def __init__(self, app: ASGIApp, api_key: str, on_reject: Callable[[], None] | None = None) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected):
            return await self.app(scope, receive, send)
        message = ("missing API key: send it as 'Authorization: Bearer <key>'" if not given
                   else "invalid API key")
        if self._on_reject is not None:
            self._on_reject()
        response = JSONResponse(error_body(message, "authentication_error", "invalid_api_key"), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


# --- errors ---------------------------------------------------------------------------------


def _install_error_handlers(app: FastAPI, state: ServerState) -> None:
    async def api_error(request: Request, e: ApiError) -> Response:
        state.metrics.error_answer(e.type)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        kinds = {404: ("not_found_error", f"no route {request.method} {request.url.path}"),
                 405: ("invalid_request_error", f"method {request.method} is not allowed on {request.url.path}")}
        etype, message = kinds.get(e.status_code, ("invalid_request_error", str(e.detail)))
        state.metrics.error_answer(etype)
        return JSONResponse(error_body(message, etype), status_code=e.status_code, headers=e.headers)

    async def unexpected(request: Request, e: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        state.metrics.error_answer("server_error")
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), status_code=500)

    app.add_exception_handler(ApiError, api_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, unexpected)


# --- routes ---------------------------------------------------------------------------------


def _install_routes(app: FastAPI, state: ServerState) -> None:
    cfg = state.config

    @app.get("/health")
    @app.get("/v1/health")
    async def health() -> Response:
        if state.draining:
            return JSONResponse({"status": "shutting_down", **error_body("the server is shutting down",
                                                                         "unavailable_error")}, status_code=503)
        if state.engine is None:
            status, message = ("error", f"model failed to load: {state.load_error}") if state.load_error \
                else ("loading", "loading model")
            return JSONResponse({"status": status, **error_body(message, "unavailable_error")}, status_code=503,
                                headers={"Retry-After": "1"})
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [_model_card(state)]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        if model not in state.model_names():
            raise ApiError(404, f"model {model!r} is not served here", type="not_found_error",
                           code="model_not_found", param="model")
        return JSONResponse(_model_card(state))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/lanes")
    async def lanes() -> Response:
        s = state.snapshot()
        if s is None:
            raise unavailable("the model is still loading", "loading")
        return JSONResponse(snapshot_json(s))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = parse_json(await request.body())
        engine = state.admit()
        if "messages" in body:
            parsed = parse_chat(body, models=state.model_names(), model_name=cfg.model_name,
                                default_thinking=cfg.default_thinking)
        else:
            parsed = parse_completion(body, models=state.model_names(), model_name=cfg.model_name)
        g = parsed.generation
        try:
            n = engine.count_prompt_tokens(g.messages, g.prompt, g.thinking)
        except ServiceError as e:
            raise from_service_error(e) from None
        return JSONResponse({"count": n, "max_model_len": engine.stats().max_ctx})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = parse_json(await request.body())
        parsed = parse_chat(body, models=state.model_names(), model_name=cfg.model_name,
                            default_thinking=cfg.default_thinking)
        return await _generate(state, request, parsed)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse_json(await request.body())
        parsed = parse_completion(body, models=state.model_names(), model_name=cfg.model_name)
        return await _generate(state, request, parsed)


def _model_card(state: ServerState) -> dict[str, Any]:
    card: dict[str, Any] = {"id": state.config.model_name, "object": "model", "created": state.started,
                            "owned_by": "ds4-app"}
    s = state.snapshot()
    if s is not None and s.max_ctx:
        card["max_model_len"] = s.max_ctx
    return card


def snapshot_json(s: StatsSnapshot) -> dict[str, Any]:
    """The snapshot as JSON: every field of ``StatsSnapshot``, plus ``kv_cache_usage_perc``."""
    body = dataclasses.asdict(s)
    body["kv_cache_usage_perc"] = s.pool.used / s.pool.n_pages if s.pool.n_pages else 0.0
    return {"object": "ds4.lanes", **body}


# --- generation -----------------------------------------------------------------------------


async def _generate(state: ServerState, request: Request, parsed: ParsedRequest) -> Response:
    engine = state.admit()
    g = parsed.generation
    rid = g.request_id
    state.track(rid)  # before the await below, so concurrent admissions count this one
    try:
        # In a worker thread: submit tokenizes the prompt, which for a long prompt would stall
        # every other stream on this loop.
        handle = await asyncio.to_thread(engine.submit, g)
    except ServiceError as e:
        state.release(rid)
        raise from_service_error(e) from None
    except BaseException:
        state.release(rid)
        raise
    builder = ResponseBuilder(parsed)
    timer = state.metrics.request_timer()
    headers = {"X-Request-Id": rid}

    def abandon(reason: str) -> None:
        log.info("%s: %s; cancelling it", rid, {"disconnect": "client disconnected",
                                                 "slow_client": "client too slow, dropped",
                                                 "error": "stream failed",
                                                 "cancelled": "answer interrupted"}.get(reason, reason))
        state.metrics.aborted_request(reason)
        engine.cancel(rid)

    if parsed.stream:
        async def frames() -> AsyncIterator[bytes]:
            try:
                first = builder.first_chunk()
                if first is not None:
                    yield sse_frame(first)
                async for ev in handle:
                    if isinstance(ev, Delta):
                        timer.delta()
                        yield sse_frame(builder.delta_chunk(ev.kind, ev.text))
                        continue
                    timer.finished(ev)
                    if ev.finish_reason == "error":
                        # The status line is long gone; the error travels as an event, as vLLM does.
                        yield sse_frame(error_body(ev.error or "generation failed", "server_error"))
                    else:
                        for chunk in builder.final_chunks(ev):
                            yield sse_frame(chunk)
                    yield DONE_FRAME
                    return
            finally:
                state.release(rid)

        def on_end(reason: str | None) -> None:
            state.release(rid)
            if reason is not None:
                abandon(reason)

        return EventStreamResponse(frames(), limits=state.config.limits, on_end=on_end, headers=headers)

    try:
        fin, content, reasoning = await _collect_unless_gone(handle, request, timer)
    except asyncio.CancelledError:  # this task was cancelled (uvicorn's shutdown timeout)
        abandon("cancelled")
        raise
    finally:
        state.release(rid)
    if fin is None:
        abandon("disconnect")
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
    if fin.finish_reason == "error":
        raise ApiError(500, fin.error or "generation failed", type="server_error")
    return JSONResponse(builder.complete(content, reasoning, fin), headers=headers)


async def _collect_unless_gone(handle: RequestHandle, request: Request,
                               timer: RequestTimer) -> tuple[Finished | None, str, str]:
    """Collect a whole answer while watching for the client to disconnect (then: ``None``)."""
    parts: dict[str, list[str]] = {"content": [], "reasoning": []}

    async def collect() -> Finished:
        async for ev in handle:
            if isinstance(ev, Delta):
                timer.delta()
                parts[ev.kind].append(ev.text)
            else:
                timer.finished(ev)
                return ev
        raise RuntimeError("the engine ended a request without a Finished event")

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.create_task(collect()), asyncio.create_task(gone())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (work, watch):
            if not t.done():
                t.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if work.cancelled():  # the client went away first
        return None, "", ""
    return work.result(), "".join(parts["content"]), "".join(parts["reasoning"])  # re-raises a failure


__all__ = ["ApiKeyMiddleware", "PUBLIC_PATHS", "ServerConfig", "ServerState", "create_app", "snapshot_json"]
