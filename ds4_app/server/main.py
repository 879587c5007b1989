"""Running the server: uvicorn, a model load in the background, signals and graceful shutdown.

``run_server`` starts answering at once (``/health`` is 503 "loading") and loads the engine in a
background thread, so a supervisor can tell "loading" from "dead". A load that fails ends the
process with status 1 after logging one line.

SIGINT / SIGTERM start a graceful shutdown: new generation requests get 503 (and ``/health``
503 "shutting_down"), requests in flight get ``shutdown_grace`` seconds to finish, the rest are
cancelled (their streams end with finish_reason "cancelled"), then uvicorn stops, the engine is
closed, and the process exits 0. A second SIGINT forces the exit.

Nothing here imports Textual (the package never does; a test checks it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from ds4_app.engine.api import EngineClient

from .app import ServerState, create_app
from .streaming import ABORT_EXTENSION, StreamLimits

log = logging.getLogger("ds4_app.server")


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """Everything ``run_server`` needs besides the engine, checked once."""

    model_name: str
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    max_queue: int = 64
    limits: StreamLimits = field(default_factory=StreamLimits)
    shutdown_grace: float = 30.0
    default_thinking: bool = False
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.shutdown_grace < 0:
            raise ValueError(f"shutdown grace must be >= 0 seconds, got {self.shutdown_grace}")


def run_server(options: ServeOptions, engine_factory: Callable[[], EngineClient], *,
               configure_app: Callable[[FastAPI], None] | None = None) -> int:
    """Serve until SIGINT/SIGTERM; returns the process exit status (0 after a clean shutdown,
    1 when the model failed to load or the port could not be bound).

    ``engine_factory`` loads the engine (in a background thread); ``configure_app`` may add
    routes to the app before it starts (tests use it).
    """
    _configure_logging(options.log_level)
    app = create_app(None, model_name=options.model_name, api_key=options.api_key,
                     cors_origins=options.cors_origins, max_queue=options.max_queue, limits=options.limits,
                     default_thinking=options.default_thinking)
    if configure_app is not None:
        configure_app(app)
    try:
        sock = _bind(options.host, options.port)
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", options.host, options.port, e.strerror or e)
        return 1
    runner = _Runner(app, app.state.ds4, options, engine_factory)
    return asyncio.run(runner.serve(sock))


class _Server(uvicorn.Server):
    """uvicorn's server with its signal capture turned off: ``_Runner`` owns the signals (uvicorn
    would re-raise them after serving, which ends the process with -SIGTERM instead of 0)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _Runner:
    """One server run: uvicorn, the loader thread, and the shutdown sequence."""

    def __init__(self, app: FastAPI, state: ServerState, options: ServeOptions,
                 engine_factory: Callable[[], EngineClient]) -> None:
        self.state = state
        self.options = options
        self.engine_factory = engine_factory
        # Let our drain finish first; this is only the backstop for connections that never end
        # (a stuck client after its request was cancelled).
        config = uvicorn.Config(_with_abort(app), log_level=options.log_level, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5, timeout_keep_alive=5)
        self.server = _Server(config)
        self.exit_code = 0
        self._shutdown: asyncio.Task | None = None
        self._signals = 0

    async def serve(self, sock: socket.socket) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        threading.Thread(target=self._load, args=(loop,), name="ds4-model-load", daemon=True).start()
        host, port = sock.getsockname()[:2]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        log.info("listening on %s (OpenAI base URL %s/v1)", url, url)
        try:
            await self.server.serve(sockets=[sock])
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        if self._shutdown is not None and not self._shutdown.done():
            self._shutdown.cancel()
        engine = self.state.engine
        if engine is not None:
            log.info("closing the engine")
            await asyncio.to_thread(engine.close)
        log.info("stopped")
        return self.exit_code

    # --- model load (background thread) ---
    def _load(self, loop: asyncio.AbstractEventLoop) -> None:
        log.info("loading model %s", self.options.model_name)
        try:
            engine = self.engine_factory()
        except Exception as e:  # noqa: BLE001 - any load failure becomes one line and exit 1
            log.debug("model load failed", exc_info=True)
            message = str(e) or type(e).__name__
            _call_soon(loop, self._load_failed, message)
            return
        if not _call_soon(loop, self._loaded, engine):
            engine.close()  # the server is already gone

    def _loaded(self, engine: EngineClient) -> None:
        if self.state.draining:  # shutdown began during the load
            self.state.attach(engine)  # so that serve() closes it
            return
        self.state.attach(engine)
        log.info("model loaded; serving %s", self.options.model_name)

    def _load_failed(self, message: str) -> None:
        log.error("model load failed: %s", message)
        self.state.fail(message)
        self.exit_code = 1
        self._begin_shutdown()

    # --- shutdown ---
    def _on_signal(self, sig: int) -> None:
        self._signals += 1
        if self._signals > 1 and sig == signal.SIGINT:
            log.warning("second interrupt: exiting now")
            self.server.force_exit = True
            self.server.should_exit = True
            return
        log.info("%s received: shutting down", signal.Signals(sig).name)
        self._begin_shutdown()

    def _begin_shutdown(self) -> None:
        if self._shutdown is None:
            self._shutdown = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        self.state.begin_drain()
        n = len(self.state.in_flight)
        if n:
            log.info("waiting up to %.0f s for %d request(s) in flight", self.options.shutdown_grace, n)
        cancelled = await self.state.drain(self.options.shutdown_grace)
        if cancelled:
            log.info("cancelled %d request(s) still running after the grace period", cancelled)
        self.server.should_exit = True


def _with_abort(app: ASGIApp) -> ASGIApp:
    """Wrap the app so that each HTTP scope carries a way to reset its connection.

    uvicorn hands the app its ``RequestResponseCycle.send``, whose cycle holds the connection's
    transport; ``streaming`` resets the connection of a client it drops (ASGI itself has no abort).
    Any other server simply leaves the extension out.
    """
    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        transport = getattr(getattr(send, "__self__", None), "transport", None)
        if scope["type"] == "http" and transport is not None and hasattr(transport, "abort"):
            scope.setdefault("extensions", {})[ABORT_EXTENSION] = transport.abort
        await app(scope, receive, send)

    return wrapped


def _bind(host: str, port: int) -> socket.socket:
    """Bind before serving so a busy port is one clear error (uvicorn would log and exit 1)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio turns Nagle off (TCP_NODELAY) only on sockets that do, and with
    # Nagle on, every small SSE write after the first waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> bool:
    """Run ``fn`` on the loop's thread; False when the loop has already closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:
        return False


def _configure_logging(level: str) -> None:
    """One-line log records on stderr, unless the embedding program configured logging already."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
