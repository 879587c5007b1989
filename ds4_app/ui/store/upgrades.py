"""Schema upgrades of the session store, one step per version.

The schema version lives in SQLite's ``PRAGMA user_version`` (0 for a new file). ``STEPS[i]``
takes a database from version ``i`` to ``i + 1``; each step runs in one transaction together
with the version bump, so a crash mid-upgrade leaves the file at the last complete version.
Steps use ``execute`` statement by statement (``executescript`` would commit the open
transaction). Never edit a released step: add the next one.
"""

from __future__ import annotations

import sqlite3
from typing import Callable


class StoreError(Exception):
    """The session store cannot be used (one line that says why and what to do)."""


def _v1(db: sqlite3.Connection) -> None:
    """Sessions (title, settings JSON, open in a tab or not) and their messages."""
    db.execute(
        """CREATE TABLE sessions (
            id       TEXT PRIMARY KEY,
            title    TEXT NOT NULL,
            settings TEXT NOT NULL,
            created  REAL NOT NULL,
            updated  REAL NOT NULL,
            is_open  INTEGER NOT NULL DEFAULT 1
        )""")
    db.execute(
        """CREATE TABLE messages (
            id         INTEGER PRIMARY KEY AUTOINCREMENT,
            session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
            role       TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
            content    TEXT NOT NULL,
            reasoning  TEXT NOT NULL DEFAULT '',
            meta       TEXT NOT NULL DEFAULT '{}',
            created    REAL NOT NULL
        )""")
    db.execute("CREATE INDEX messages_by_session ON messages (session_id, id)")


STEPS: tuple[Callable[[sqlite3.Connection], None], ...] = (_v1,)
SCHEMA_VERSION = len(STEPS)


def schema_version(db: sqlite3.Connection) -> int:
    """The version recorded in the file."""
    return int(db.execute("PRAGMA user_version").fetchone()[0])


def upgrade(db: sqlite3.Connection, name: str = "the session store") -> int:
    """Bring ``db`` (opened with ``isolation_level=None``) to ``SCHEMA_VERSION``.

    Returns the version it was at before. Raises StoreError for a file written by a newer
    ds4-app: we never guess at a schema we do not know.
    """
    start = schema_version(db)
    if start > SCHEMA_VERSION:
        raise StoreError(f"{name} has schema version {start}, newer than this ds4-app knows "
                         f"({SCHEMA_VERSION}); upgrade ds4-app or use another --data-dir")
    for version in range(start, SCHEMA_VERSION):
        db.execute("BEGIN IMMEDIATE")
        try:
            STEPS[version](db)
            db.execute(f"PRAGMA user_version = {version + 1}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
    return start
