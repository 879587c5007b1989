"""The ``ds4-app`` command line: one entry point, a module per subcommand.

``ds4-app``                 the terminal app (TUI) on the embedded default model or ``--model``
``ds4-app --serve``         the headless OpenAI-compatible server (imports no Textual)
``ds4-app generate``        run prompts through the engine and print the replies
``ds4-app model synth``     write a synthetic DS4 GGUF; ``model inspect`` describes one
``ds4-app bench``           the benchmark harness

Imports are lazy so each mode loads only what it needs. User errors print one line on stderr
(``ds4-app: error: ...``) and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Options every engine-backed mode shares (TUI, server, generate, bench)."""
    p.add_argument("--model", metavar="FILE", help="DS4 GGUF file (default: the embedded model)")
    p.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "hip", "reference"],
                   help="engine backend (default: cpu)")
    p.add_argument("--max-slots", type=int, default=6, metavar="N", help="concurrent sequences (default 6)")
    p.add_argument("--max-ctx", type=int, default=4096, metavar="N", help="context per sequence (default 4096)")
    p.add_argument("--kv-pool-tokens", type=int, default=None, metavar="N",
                   help="page pool size in tokens (default: max-ctx x max-slots)")
    p.add_argument("--max-rows", type=int, default=None, metavar="N",
                   help="rows one engine step carries (prompt rows plus decoders; default 16 on cpu, "
                        "512 on cuda/hip)")
    p.add_argument("--threads", type=int, default=0, metavar="N", help="CPU threads (default: physical cores)")
    p.add_argument("--qat-numerics", action=argparse.BooleanOptionalAction, default=None,
                   help="FP8/FP4 quantization round trips of the official model (default: from the file)")


# The engine options argparse can only type-check, with the least each may be (None: not given).
_ENGINE_MINIMA = (("max_slots", 1), ("max_ctx", 1), ("kv_pool_tokens", 1), ("max_rows", 1), ("threads", 0))


def check_engine_arguments(args: argparse.Namespace) -> None:
    """UserError, one line, for an engine option out of range (before any model is loaded)."""
    for dest, least in _ENGINE_MINIMA:
        value = getattr(args, dest, None)
        if value is not None and value < least:
            raise UserError(f"--{dest.replace('_', '-')} must be at least {least}, got {value}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds4-app", description="A local assistant for DeepSeek-V4 models.")
    add_engine_arguments(parser)
    parser.add_argument("--serve", action="store_true", help="run the OpenAI-compatible server instead of the TUI")
    parser.add_argument("--data-dir", metavar="DIR", help="where sessions are kept (TUI)")
    parser.add_argument("--remote", metavar="URL", help="talk to an OpenAI-compatible server instead (TUI)")
    from .commands import serve as serve_cmd

    serve_cmd.add_serve_arguments(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from .commands import bench as bench_cmd
    from .commands import generate as generate_cmd
    from .commands import model as model_cmd

    generate_cmd.register(sub)
    model_cmd.register(sub)
    bench_cmd.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_engine_arguments(args)
        if args.command is not None:
            return int(args.handler(args) or 0)
        if args.serve:
            from .commands.serve import run_serve

            return run_serve(args)
        from .commands.tui import run_tui

        return run_tui(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - only the user-facing kinds are turned into one line
        if not isinstance(e, _user_errors()):
            raise
        print(f"ds4-app: error: {e}", file=sys.stderr)
        return 2


class UserError(Exception):
    """An error the user can act on, printed as one line."""


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean "the user asked for something wrong", shown without a traceback."""
    from .engine.api import ServiceError
    from .engine.config import ConfigError
    from .engine.default_model import NoModelError
    from .engine.gguf_file import ModelFileError

    return (UserError, ModelFileError, ConfigError, ServiceError, NoModelError)
