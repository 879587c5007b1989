"""``ds4-app`` (no subcommand): the terminal app.

The engine is built in the background once the window is open (``DS4App(engine_factory=...)``),
so a bad model file shows as a notification and the stored sessions stay usable. With
``--remote URL`` the app drives any OpenAI-compatible server through ``RemoteEngine`` instead.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from ..engine.api import EngineClient


def add_tui_arguments(p: argparse.ArgumentParser) -> None:
    """The TUI's own options (the top-level parser of cli.py already has --data-dir and --remote)."""
    p.add_argument("--data-dir", metavar="DIR",
                   help="where sessions, config.json and exports live (default: $DS4_APP_DATA_DIR, "
                        "else the platform's user data dir)")
    p.add_argument("--remote", metavar="URL", help="talk to an OpenAI-compatible server instead of a local model")
    p.add_argument("--print-data-dir", action="store_true", help="print the data directory and exit")


def register(sub: argparse._SubParsersAction) -> None:
    """``ds4-app tui``: the same app as plain ``ds4-app``, with its options listed in --help."""
    from ..cli import add_engine_arguments

    p = sub.add_parser("tui", help="the terminal app (the default)",
                       description="Chat sessions in tabs over one engine, with a live engine panel.")
    add_engine_arguments(p)
    add_tui_arguments(p)
    p.set_defaults(handler=run_tui)


def engine_factory(args: argparse.Namespace) -> Callable[[], "EngineClient"]:
    """What builds the engine for these options (run by the app in a background thread)."""
    remote = getattr(args, "remote", None)
    if remote:
        def open_remote() -> "EngineClient":
            from ..engine.remote import RemoteEngine

            return RemoteEngine(remote)

        return open_remote

    def open_local() -> "EngineClient":
        from ..engine.service import EngineService

        return EngineService.from_args(args)

    return open_local


def run_tui(args: argparse.Namespace) -> int:
    """Run the terminal app until the user quits; returns the exit status."""
    from ..cli import UserError
    from ..ui.locations import data_dir
    from ..ui.store import StoreError

    try:
        root = data_dir(getattr(args, "data_dir", None))
    except OSError as e:
        raise UserError(f"cannot use the data directory: {e}") from None
    if getattr(args, "print_data_dir", False):
        print(root)
        return 0

    from ..ui.app import DS4App

    try:
        app = DS4App(engine_factory=engine_factory(args), data_dir=root)
    except StoreError as e:
        raise UserError(str(e)) from None
    try:
        app.run()
    finally:
        engine = app.engine
        if engine is not None:
            engine.close()
    return app.return_code or 0

