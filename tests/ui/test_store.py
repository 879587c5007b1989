"""The session store: schema versions, sessions, messages, and what survives reopening."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from ds4_app.ui.session_settings import SessionSettings
from ds4_app.ui.store import SCHEMA_VERSION, Store, StoreError
from ds4_app.ui.store.upgrades import STEPS, schema_version, upgrade


class Clock:
    """A clock that advances one second per reading."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        self.now += 1
        return self.now


def test_new_file_gets_the_current_schema(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    store.close()
    db = sqlite3.connect(tmp_path / "s.db")
    assert schema_version(db) == SCHEMA_VERSION == len(STEPS)
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"sessions", "messages"} <= tables


def test_upgrade_runs_each_missing_step_once(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "s.db", isolation_level=None)
    assert upgrade(db) == 0
    assert upgrade(db) == SCHEMA_VERSION  # already current: nothing runs (a rerun would fail on CREATE)
    assert schema_version(db) == SCHEMA_VERSION


def test_a_failed_step_leaves_the_previous_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(db: sqlite3.Connection) -> None:
        db.execute("CREATE TABLE half_done (x)")
        raise RuntimeError("disk full")

    db = sqlite3.connect(tmp_path / "s.db", isolation_level=None)
    upgrade(db)
    monkeypatch.setattr("ds4_app.ui.store.upgrades.STEPS", STEPS + (broken,))
    monkeypatch.setattr("ds4_app.ui.store.upgrades.SCHEMA_VERSION", SCHEMA_VERSION + 1)
    with pytest.raises(RuntimeError, match="disk full"):
        upgrade(db)
    assert schema_version(db) == SCHEMA_VERSION
    assert db.execute("SELECT name FROM sqlite_master WHERE name = 'half_done'").fetchone() is None


def test_a_newer_file_is_refused_with_one_line(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "s.db")
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 3}")
    db.close()
    with pytest.raises(StoreError, match=f"schema version {SCHEMA_VERSION + 3}, newer than this ds4-app"):
        Store(tmp_path / "s.db")


def test_a_file_that_is_not_sqlite_is_a_store_error(tmp_path: Path) -> None:
    (tmp_path / "s.db").write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match="cannot open the session store"):
        Store(tmp_path / "s.db")


def test_sessions_and_messages_round_trip(tmp_path: Path) -> None:
    clock = Clock()
    store = Store(tmp_path / "s.db", clock=clock)
    settings = SessionSettings(system_prompt="Be kind.", temperature=0.3, top_k=20, seed=0, thinking=True)
    a = store.create_session("Chat 1", settings)
    b = store.create_session("Chat 2", SessionSettings())
    assert (a.created, a.updated, b.created) == (1001.0, 1001.0, 1002.0)
    u = store.add_message(a.id, "user", "hello")
    r = store.add_message(a.id, "assistant", "hi!", "they greet me", {"finish_reason": "stop"})
    store.rename_session(a.id, "Greetings")
    store.set_open(b.id, False)
    store.close()

    store = Store(tmp_path / "s.db", clock=clock)
    got = store.session(a.id)
    assert (got.title, got.settings, got.created, got.is_open) == ("Greetings", settings, 1001.0, True)
    assert got.updated == 1005.0  # the rename is the last change
    assert [s.id for s in store.sessions()] == [a.id, b.id]
    assert [s.id for s in store.sessions(open_only=True)] == [a.id]
    msgs = store.messages(a.id)
    assert [(m.id, m.role, m.content, m.reasoning) for m in msgs] == [
        (u.id, "user", "hello", ""), (r.id, "assistant", "hi!", "they greet me")]
    assert msgs[1].meta == {"finish_reason": "stop"}
    assert msgs[1].as_message().reasoning == "they greet me"
    assert store.message_counts() == {a.id: 2}


def test_delete_message_and_session(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    a = store.create_session("A", SessionSettings())
    m1 = store.add_message(a.id, "user", "one")
    m2 = store.add_message(a.id, "assistant", "two")
    store.delete_message(m2.id)
    assert [m.id for m in store.messages(a.id)] == [m1.id]
    store.delete_session(a.id)
    assert store.sessions() == [] and store.messages(a.id) == []
    with pytest.raises(KeyError):
        store.session(a.id)
    with pytest.raises(KeyError):
        store.rename_session(a.id, "gone")


def test_bad_rows_are_refused_before_they_are_written(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    a = store.create_session("A", SessionSettings())
    with pytest.raises(ValueError, match="role"):
        store.add_message(a.id, "tool", "x")
    with pytest.raises(ValueError, match="only assistant messages carry reasoning"):
        store.add_message(a.id, "user", "x", "thoughts")
    with pytest.raises(sqlite3.IntegrityError):
        store.add_message("no-such-session", "user", "x")
    assert store.messages(a.id) == []


def test_unknown_and_corrupt_settings_still_load(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    a = store.create_session("A", SessionSettings(temperature=0.5))
    b = store.create_session("B", SessionSettings())
    db = sqlite3.connect(tmp_path / "s.db")
    db.execute("UPDATE sessions SET settings = ? WHERE id = ?",
               ('{"temperature": 0.5, "from_the_future": 1}', a.id))
    db.execute("UPDATE sessions SET settings = ? WHERE id = ?", ('{"temperature": -4}', b.id))
    db.commit()
    assert store.session(a.id).settings == SessionSettings(temperature=0.5)
    assert store.session(b.id).settings == SessionSettings()


def test_session_settings_checks_and_sampler() -> None:
    s = SessionSettings(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, max_tokens=256, seed=0)
    sampler = s.sampler()
    assert (sampler.temperature, sampler.top_p, sampler.top_k, sampler.min_p, sampler.max_tokens, sampler.seed) == (
        0.7, 0.9, 40, 0.05, 256, 0)
    assert SessionSettings.from_dict(s.to_dict()) == s
    with pytest.raises(ValueError, match="top_p"):
        SessionSettings(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SessionSettings(max_tokens=0)
    with pytest.raises(ValueError, match="thinking"):
        SessionSettings(thinking="yes")  # type: ignore[arg-type]
    assert "seed 0" in s.summary() and "random seed" in SessionSettings().summary()
