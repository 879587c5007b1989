"""The session store: chats and their messages in one SQLite file.

One connection, used from the UI thread only (writes are a row or two and take well under a
millisecond, so they need no thread of their own). Autocommit mode; every public call is one
statement or one explicit transaction. Timestamps are Unix seconds from an injectable clock so
tests get fixed values.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from ds4_app.engine.chat import Message

from ..session_settings import SessionSettings
from .upgrades import StoreError, upgrade


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """One chat session as stored. ``is_open``: shown as a tab (closed ones can be reopened)."""

    id: str
    title: str
    settings: SessionSettings
    created: float
    updated: float
    is_open: bool = True


@dataclass(frozen=True, slots=True, eq=False)
class MessageRecord:
    """One stored turn. ``meta`` holds a reply's finish reason and usage (JSON)."""

    id: int
    session_id: str
    role: str
    content: str
    reasoning: str
    created: float
    meta: Mapping[str, Any] = field(default_factory=dict)

    def as_message(self) -> Message:
        """The engine's form of this turn."""
        return Message(self.role, self.content, self.reasoning)


def new_session_id() -> str:
    """A random, URL- and CSS-id-safe session id (``s`` + 12 hex digits)."""
    return "s" + uuid.uuid4().hex[:12]


class Store:
    """Sessions and messages in SQLite, schema-versioned (see ``upgrades.py``)."""

    def __init__(self, path: str | Path, *, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self._clock = clock
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None)
            self._db.execute("PRAGMA foreign_keys = ON")
            self._db.execute("PRAGMA journal_mode = WAL")
            upgrade(self._db, name=str(self.path))
        except sqlite3.DatabaseError as e:
            raise StoreError(f"cannot open the session store {self.path}: {e} "
                             "(move the file away or use another --data-dir)") from None

    def close(self) -> None:
        """Close the connection (the store is unusable afterwards)."""
        self._db.close()

    # ---------------------------------------------------------------- sessions
    def create_session(self, title: str, settings: SessionSettings, *,
                       session_id: str | None = None) -> SessionRecord:
        """Add an open session and return it."""
        now = self._clock()
        rec = SessionRecord(session_id or new_session_id(), title, settings, now, now, True)
        self._db.execute("INSERT INTO sessions (id, title, settings, created, updated, is_open) "
                         "VALUES (?, ?, ?, ?, ?, 1)",
                         (rec.id, rec.title, json.dumps(settings.to_dict()), now, now))
        return rec

    def session(self, session_id: str) -> SessionRecord:
        """One session; KeyError if there is none with that id."""
        row = self._db.execute("SELECT id, title, settings, created, updated, is_open FROM sessions "
                               "WHERE id = ?", (session_id,)).fetchone()
        if row is None:
            raise KeyError(session_id)
        return _session(row)

    def sessions(self, *, open_only: bool = False) -> list[SessionRecord]:
        """All sessions (or only those open as tabs), oldest first."""
        where = "WHERE is_open = 1 " if open_only else ""
        rows = self._db.execute("SELECT id, title, settings, created, updated, is_open FROM sessions "
                                f"{where}ORDER BY created, rowid").fetchall()
        return [_session(r) for r in rows]

    def rename_session(self, session_id: str, title: str) -> None:
        """Set a session's title."""
        self._update(session_id, "title = ?", title)

    def set_settings(self, session_id: str, settings: SessionSettings) -> None:
        """Replace a session's settings."""
        self._update(session_id, "settings = ?", json.dumps(settings.to_dict()))

    def set_open(self, session_id: str, is_open: bool) -> None:
        """Mark a session as shown in a tab (True) or closed (False)."""
        self._update(session_id, "is_open = ?", int(is_open))

    def delete_session(self, session_id: str) -> None:
        """Remove a session and all its messages."""
        self._db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))

    def message_counts(self) -> dict[str, int]:
        """Number of messages per session id (sessions without messages are absent)."""
        rows = self._db.execute("SELECT session_id, COUNT(*) FROM messages GROUP BY session_id")
        return {sid: n for sid, n in rows}

    # ---------------------------------------------------------------- messages
    def add_message(self, session_id: str, role: str, content: str, reasoning: str = "",
                    meta: Mapping[str, Any] | None = None) -> MessageRecord:
        """Append a turn to a session (and touch the session's updated time)."""
        Message(role, content, reasoning)  # the engine's own checks on role and reasoning
        now = self._clock()
        meta = dict(meta or {})
        self._db.execute("BEGIN")
        try:
            cur = self._db.execute("INSERT INTO messages (session_id, role, content, reasoning, meta, created) "
                                   "VALUES (?, ?, ?, ?, ?, ?)",
                                   (session_id, role, content, reasoning, json.dumps(meta), now))
            self._db.execute("UPDATE sessions SET updated = ? WHERE id = ?", (now, session_id))
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return MessageRecord(int(cur.lastrowid), session_id, role, content, reasoning, now, meta)

    def messages(self, session_id: str) -> list[MessageRecord]:
        """A session's turns in order."""
        rows = self._db.execute("SELECT id, session_id, role, content, reasoning, created, meta "
                                "FROM messages WHERE session_id = ? ORDER BY id", (session_id,))
        return [MessageRecord(i, s, role, c, r, t, json.loads(m)) for i, s, role, c, r, t, m in rows]

    def delete_message(self, message_id: int) -> None:
        """Remove one turn (regenerate drops the reply it replaces)."""
        self._db.execute("DELETE FROM messages WHERE id = ?", (message_id,))

    # ---------------------------------------------------------------- internals
    def _update(self, session_id: str, assignment: str, value: object) -> None:
        cur = self._db.execute(f"UPDATE sessions SET {assignment}, updated = ? WHERE id = ?",
                               (value, self._clock(), session_id))
        if cur.rowcount == 0:
            raise KeyError(session_id)


def _session(row: tuple) -> SessionRecord:
    sid, title, settings, created, updated, is_open = row
    try:
        parsed = SessionSettings.from_dict(json.loads(settings))
    except (ValueError, TypeError):
        # A hand-edited or corrupt settings cell must not make the whole store unreadable.
        parsed = SessionSettings()
    return SessionRecord(sid, title, parsed, created, updated, bool(is_open))
