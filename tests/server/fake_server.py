"""``python -m tests.server.fake_server``: the real server (``run_server``) on the scripted engine.

Takes every ``--serve`` option of the real command (``add_serve_arguments``) plus a few for the
fake: ``--load-delay`` (seconds the "model load" takes), ``--fail-load MESSAGE``, ``--max-ctx``,
``--token-interval``. Adds ``GET /_test/state`` (requests submitted, ids cancelled, whether
Textual got imported) so tests can see what reached the engine.
"""

from __future__ import annotations

import argparse
import sys
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from ds4_app.commands.serve import add_serve_arguments, serve_options
from ds4_app.server.main import run_server

from .fake_engine import FakeEngine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fake_server")
    add_serve_arguments(p)
    p.add_argument("--load-delay", type=float, default=0.0)
    p.add_argument("--fail-load", metavar="MESSAGE")
    p.add_argument("--max-ctx", type=int, default=512)
    p.add_argument("--token-interval", type=float, default=0.01)
    args = p.parse_args(argv)
    engine: dict[str, FakeEngine] = {}

    def load() -> FakeEngine:
        time.sleep(args.load_delay)
        if args.fail_load:
            raise RuntimeError(args.fail_load)
        engine["e"] = FakeEngine(model_name="fake-ds4.gguf", max_slots=args.max_slots, max_ctx=args.max_ctx,
                                 token_interval=args.token_interval)
        return engine["e"]

    def configure(app: FastAPI) -> None:
        @app.get("/_test/state")
        async def state() -> JSONResponse:
            e = engine.get("e")
            return JSONResponse({
                "submitted": e.submitted if e else [], "cancelled": e.cancelled if e else [],
                "textual_loaded": any(m == "textual" or m.startswith("textual.") for m in sys.modules)})

    options = serve_options(args, args.served_model_name or "fake-ds4.gguf")
    return run_server(options, load, configure_app=configure)


if __name__ == "__main__":
    sys.exit(main())
