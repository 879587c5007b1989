"""``ds4-app --serve``: the server's command-line options, and starting it on the embedded engine.

``cli.build_parser`` calls ``add_serve_arguments(parser)`` (after ``add_engine_arguments``, which
supplies ``--model``, ``--backend``, ``--max-slots``, ...), and ``cli.main`` calls
``run_serve(args)`` when ``--serve`` is given. Importing this module is cheap: the server stack
(FastAPI, uvicorn) and the engine load only in ``run_serve``.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..server.main import ServeOptions


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the server options (an option the parser already has, e.g. ``--max-slots`` from the
    engine options, is left as it is)."""
    g = parser.add_argument_group("server (--serve)")
    _add(g, "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    _add(g, "--port", type=int, default=8080, help="port to listen on (default 8080)")
    _add(g, "--api-key", metavar="KEY", default=os.environ.get("DS4_APP_API_KEY"),
         help="require 'Authorization: Bearer KEY' on every route but /health and /v1/models "
              "(default: $DS4_APP_API_KEY; none)")
    _add(g, "--max-slots", type=int, default=6, metavar="N", help="concurrent sequences (default 6)")
    _add(g, "--max-queue", type=int, default=64, metavar="N",
         help="requests that may wait for a slot; beyond that 503 + Retry-After (default 64)")
    # Comma-separated and repeatable rather than nargs="+", which would swallow a subcommand.
    _add(g, "--cors-origins", action="append", default=[], metavar="ORIGIN[,ORIGIN...]",
         help="allow browser requests from these origins, e.g. http://localhost:3000 (default: CORS off)")
    _add(g, "--served-model-name", metavar="NAME", help="model id in /v1/models and responses "
                                                        "(default: the model file's name)")
    _add(g, "--default-thinking", action="store_true",
         help="thinking mode for chat requests that do not choose (default: chat mode)")
    _add(g, "--send-timeout", type=float, default=30.0, metavar="S",
         help="drop a streaming client that accepts no data for S seconds (default 30)")
    _add(g, "--client-buffer-kib", type=int, default=1024, metavar="N",
         help="drop a streaming client with more than N KiB waiting to be sent (default 1024)")
    _add(g, "--keepalive", type=float, default=15.0, metavar="S",
         help="send an SSE keep-alive comment after S silent seconds, e.g. during a long prefill (default 15)")
    _add(g, "--shutdown-grace", type=float, default=30.0, metavar="S",
         help="on SIGINT/SIGTERM, let requests in flight finish for up to S seconds (default 30)")
    _add(g, "--log-level", default="info", choices=["debug", "info", "warning", "error"],
         help="server log level (default info)")


def serve_options(args: argparse.Namespace, model_name: str) -> "ServeOptions":
    """The ``ServeOptions`` the parsed arguments describe (a UserError when they are wrong)."""
    from ..cli import UserError
    from ..server.main import ServeOptions
    from ..server.streaming import StreamLimits

    origins: list[str] = []
    for item in args.cors_origins or ():
        origins += [o.strip() for o in item.split(",") if o.strip()]
    try:
        limits = StreamLimits(max_buffer_bytes=args.client_buffer_kib * 1024, send_timeout=args.send_timeout,
                              keepalive=args.keepalive)
        return ServeOptions(model_name=model_name, host=args.host, port=args.port, api_key=args.api_key or None,
                            cors_origins=tuple(origins), max_queue=args.max_queue, limits=limits,
                            shutdown_grace=args.shutdown_grace, default_thinking=args.default_thinking,
                            log_level=args.log_level)
    except ValueError as e:
        raise UserError(str(e)) from None


def run_serve(args: argparse.Namespace) -> int:
    """Serve the model named by the engine options until SIGINT/SIGTERM; the exit status."""
    from ..engine.default_model import resolve_model
    from ..server.main import run_server

    if args.max_queue < 0:
        from ..cli import UserError

        raise UserError(f"--max-queue must be >= 0, got {args.max_queue}")
    model_name = args.served_model_name or os.path.basename(resolve_model(args.model))
    options = serve_options(args, model_name)

    def load():
        from ..engine.service import EngineService

        return EngineService.from_args(args, max_queue=args.max_queue)

    return run_server(options, load)


def _add(group, *flags: str, **kwargs) -> None:
    try:
        group.add_argument(*flags, **kwargs)
    except argparse.ArgumentError:  # the parser already has this option (conflict_handler="error")
        pass
