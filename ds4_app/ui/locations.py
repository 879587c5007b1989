"""Where the TUI keeps its files: one data directory, resolved in one place.

Order: the ``--data-dir`` option, then the ``DS4_APP_DATA_DIR`` environment variable, then the
platform's user data directory (``platformdirs``; ``$XDG_DATA_HOME/ds4-app`` on Linux). Inside it:
``sessions.db`` (SQLite), ``config.json`` (keymap) and ``exports/``.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "ds4-app"
ENV_DATA_DIR = "DS4_APP_DATA_DIR"


def data_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The data directory (created if missing): ``override``, else the env var, else platformdirs."""
    chosen = override or os.environ.get(ENV_DATA_DIR) or platformdirs.user_data_dir(APP_NAME, appauthor=False)
    path = Path(chosen).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def store_path(root: Path) -> Path:
    """The SQLite file with sessions and messages."""
    return root / "sessions.db"


def config_path(root: Path) -> Path:
    """The user's ``config.json`` (``{"keymap": {binding_id: keys}}``)."""
    return root / "config.json"


def exports_dir(root: Path) -> Path:
    """Default folder for exported sessions (created on first use by the exporter)."""
    return root / "exports"
