"""Persistence of chat sessions (SQLite, schema-versioned)."""

from .store import MessageRecord, SessionRecord, Store, new_session_id
from .upgrades import SCHEMA_VERSION, StoreError

__all__ = ["MessageRecord", "SCHEMA_VERSION", "SessionRecord", "Store", "StoreError", "new_session_id"]
