"""``ds4-app`` (TUI mode): options, the data dir, and which engine gets built."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from ds4_app.commands.tui import add_tui_arguments, engine_factory, run_tui
from ds4_app.ui.locations import ENV_DATA_DIR


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_tui_arguments(p)
    return p.parse_args(argv)


def test_print_data_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.delenv(ENV_DATA_DIR, raising=False)
    assert run_tui(parse("--data-dir", str(tmp_path / "d"), "--print-data-dir")) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "d")
    monkeypatch.setenv(ENV_DATA_DIR, str(tmp_path / "env"))
    assert run_tui(parse("--print-data-dir")) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "env")


def test_remote_url_builds_a_remote_engine() -> None:
    from ds4_app.engine.remote import RemoteEngine

    engine = engine_factory(parse("--remote", "http://127.0.0.1:9/v1"))()
    try:
        assert isinstance(engine, RemoteEngine) and engine.root == "http://127.0.0.1:9"
    finally:
        engine.close()


def test_a_newer_store_is_a_user_error(tmp_path: Path) -> None:
    import sqlite3

    from ds4_app.cli import UserError

    db = sqlite3.connect(tmp_path / "sessions.db")
    db.execute("PRAGMA user_version = 99")
    db.close()
    with pytest.raises(UserError, match="schema version 99"):
        run_tui(parse("--data-dir", str(tmp_path)))
