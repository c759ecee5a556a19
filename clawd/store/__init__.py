"""The store: clawd's SQLite database (db.py), its schema (migrations.py), compact
token blobs (blobs.py) and one writer module per table family (turns.py, ...)."""

from __future__ import annotations

from clawd.store.db import Database, DatabaseUnavailable
from clawd.store.migrations import SchemaError, SchemaTooNew

__all__ = ["Database", "DatabaseUnavailable", "SchemaError", "SchemaTooNew"]
