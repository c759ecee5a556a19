"""Numbered schema migrations for the clawd database.

Boundary: this module owns the schema (DDL) and the `migrations` bookkeeping table, and
nothing else; rows are written by the table-family modules (turns.py, ...).

Convention (after simonw/llm's migrations.py): each migration is a plain function
`mNNN_name(conn: sqlite3.Connection)` appended to MIGRATIONS. A released migration is
never edited or reordered: a schema change is a new function at the end. Each runs in
its own transaction together with its row in `migrations`, so a crash leaves the
database at a whole migration boundary.

Migration functions must not call `executescript` (it commits the open transaction
first) and cannot toggle `PRAGMA foreign_keys` (a no-op inside a transaction); a future
table rebuild that needs foreign keys off must be handled in `_apply` explicitly.
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Callable

import aiosqlite

from clawd.errors import ClawdError

Migration = Callable[[sqlite3.Connection], None]


class SchemaError(ClawdError):
    """The file is an SQLite database, but not one this clawd can use."""

    code = "schema_mismatch"


class SchemaTooNew(SchemaError):
    """The database records migrations this version of clawd does not know."""

    code = "schema_too_new"


def m001_initial(conn: sqlite3.Connection) -> None:
    conn.execute(
        """
        CREATE TABLE sessions (
            id          TEXT PRIMARY KEY,
            created_at  REAL NOT NULL,
            updated_at  REAL NOT NULL,
            source      TEXT NOT NULL,          -- 'header' | 'body' | 'prefix' | 'new'
            title       TEXT,
            done        INTEGER NOT NULL DEFAULT 0
        )
        """
    )
    conn.execute(
        """
        CREATE TABLE turns (
            id                 TEXT PRIMARY KEY,   -- 'chatcmpl-...', the completion id
            session_id         TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
            turn_type          TEXT NOT NULL CHECK (turn_type IN ('main', 'side')),
            created_at         REAL NOT NULL,
            request_json       TEXT NOT NULL,      -- full request messages (+ tools) as JSON
            request_hash       TEXT NOT NULL,
            continuation_hash  TEXT NOT NULL,
            prompt_text        TEXT NOT NULL,
            prompt_ids         BLOB NOT NULL,      -- int32 LE, see blobs.py
            response_ids       BLOB NOT NULL,      -- int32 LE, the sampled tokens
            response_logprobs  BLOB NOT NULL,      -- float32 LE, one per response token
            response_text      TEXT NOT NULL,
            finish_reason      TEXT NOT NULL,
            sampling_json      TEXT NOT NULL,
            engine             TEXT NOT NULL,
            model              TEXT NOT NULL,
            adapter_id         TEXT,
            chat_format        TEXT NOT NULL,
            timings_json       TEXT NOT NULL,
            requery_of         TEXT REFERENCES turns(id) ON DELETE SET NULL,
            client             TEXT
        )
        """
    )
    conn.execute("CREATE INDEX turns_session_created ON turns(session_id, created_at)")
    conn.execute("CREATE INDEX turns_request_hash ON turns(request_hash)")
    conn.execute("CREATE INDEX turns_continuation_hash ON turns(continuation_hash)")
    # requery_of is an FK target of ON DELETE SET NULL: without an index every turn
    # delete would scan the whole table.
    conn.execute("CREATE INDEX turns_requery_of ON turns(requery_of)")


def m002_feedback_and_signals(conn: sqlite3.Connection) -> None:
    conn.execute(
        """
        CREATE TABLE feedback (
            id          INTEGER PRIMARY KEY,
            turn_id     TEXT NOT NULL REFERENCES turns(id) ON DELETE CASCADE,
            kind        TEXT NOT NULL CHECK (kind IN ('up', 'down', 'correction')),
            text        TEXT,                   -- the correction, or a rating's comment
            source      TEXT NOT NULL,          -- 'api' | 'tui' | 'openwebui' | ...
            created_at  REAL NOT NULL,
            raw_json    TEXT                    -- the payload as received
        )
        """
    )
    conn.execute("CREATE INDEX feedback_turn ON feedback(turn_id, created_at)")
    conn.execute(
        """
        CREATE TABLE signals (
            turn_id        TEXT PRIMARY KEY REFERENCES turns(id) ON DELETE CASCADE,
            session_id     TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
            status         TEXT NOT NULL,       -- waiting | pending | ready | empty
            next_turn_id   TEXT REFERENCES turns(id) ON DELETE SET NULL,
            next_state     TEXT,                -- newest message of the next main request
            next_role      TEXT,
            reward         INTEGER,             -- +1 | -1 | 0
            reward_source  TEXT,                -- feedback | requery | rules | self | gguf | openai | none
            votes_json     TEXT,
            hints_json     TEXT,                -- [{"text", "source", "overlap"}], shortest first
            hint           TEXT,                -- the selected hint (overlap-guided)
            top_k          INTEGER,
            student_top_ids       BLOB,         -- int32 (n, k): pi_old's top-k per response position
            student_top_logprobs  BLOB,         -- float32 (n, k)
            teacher_logprobs      BLOB,         -- float32 (n,): teacher at the sampled tokens
            teacher_top_logprobs  BLOB,         -- float32 (n, k): teacher at the student's top-k
            vetoed         INTEGER NOT NULL DEFAULT 0,
            attempts       INTEGER NOT NULL DEFAULT 0,
            error          TEXT,
            retry_at       REAL NOT NULL DEFAULT 0,
            created_at     REAL NOT NULL,
            updated_at     REAL NOT NULL
        )
        """
    )
    conn.execute("CREATE INDEX signals_status ON signals(status, retry_at)")
    conn.execute("CREATE INDEX signals_session ON signals(session_id)")
    conn.execute("CREATE INDEX signals_next_turn ON signals(next_turn_id)")
    # What `clawd forget` removed, so adapters trained on it can be retired later.
    conn.execute(
        """
        CREATE TABLE forgotten (
            turn_id       TEXT PRIMARY KEY,
            session_id    TEXT NOT NULL,
            forgotten_at  REAL NOT NULL
        )
        """
    )


def m003_adapters(conn: sqlite3.Connection) -> None:
    # The adapter registry (clawd/adapters.py decides, store/adapters.py writes). At most one
    # row is active; the partial unique index makes a second one a constraint error, so a
    # crash mid-promotion can never leave two.
    conn.execute(
        """
        CREATE TABLE adapters (
            id             TEXT PRIMARY KEY,
            parent_id      TEXT,                -- the adapter it continued training from; NULL = base
            previous_id    TEXT,                -- what was active when this one was activated (rollback target)
            created_at     REAL NOT NULL,
            updated_at     REAL NOT NULL,
            status         TEXT NOT NULL CHECK (status IN ('candidate', 'active', 'retired', 'rejected')),
            path           TEXT NOT NULL,       -- adapters/<id>/ (mlx-lm files + adapter.gguf + meta.json)
            model          TEXT NOT NULL,       -- the base model it was trained for
            signals_json   TEXT NOT NULL,       -- turn ids trained on
            holdout_json   TEXT NOT NULL,       -- turn ids held out for the gate
            metrics_json   TEXT NOT NULL,       -- training metrics (loss terms, reward mean, clip fractions)
            gate_json      TEXT NOT NULL,       -- eval-gate metrics and verdict
            note           TEXT,                -- why rejected / retired
            forgotten      INTEGER NOT NULL DEFAULT 0  -- trained on a forgotten session: never activate
        )
        """
    )
    conn.execute("CREATE UNIQUE INDEX adapters_one_active ON adapters(status) WHERE status = 'active'")


def m004_turn_tool_calls(conn: sqlite3.Connection) -> None:
    # The tool calls parsed out of a turn's reply ([{id, type, function: {name, arguments}}],
    # as the client got them); the reply's raw text stays in response_text. NULL: no calls.
    conn.execute("ALTER TABLE turns ADD COLUMN tool_calls_json TEXT")


def m005_turn_boundary_and_client(conn: sqlite3.Connection) -> None:
    # response_seen: how many sampled tokens the user received (the stop string's are not);
    # samples train on those only. NULL for older turns: clawd/jobs.py derives it from the text.
    conn.execute("ALTER TABLE turns ADD COLUMN response_seen INTEGER")
    # client_key: a hash of (token, User-Agent, remote address), so an identical request from
    # another client is never read as this client's regenerate (clawd/sessions.py).
    conn.execute("ALTER TABLE turns ADD COLUMN client_key TEXT")
    conn.execute("CREATE INDEX turns_request_hash_client ON turns(request_hash, client_key)")


def m006_client_ids_and_external_feedback(conn: sqlite3.Connection) -> None:
    # The chat and message ids a chat UI sent with the request (Open WebUI's X-OpenWebUI-Chat-Id /
    # X-OpenWebUI-Message-Id): a rating made in that UI names the message it rates by that id, so
    # it lands on this exact turn and not on another with the same text (clawd/openwebui/).
    conn.execute("ALTER TABLE turns ADD COLUMN client_chat_id TEXT")
    conn.execute("ALTER TABLE turns ADD COLUMN client_message_id TEXT")
    conn.execute("CREATE INDEX turns_client_message ON turns(client_message_id) WHERE client_message_id IS NOT NULL")
    # external_id: the id of the rating in the UI it came from; its rows are replaced (or
    # deleted) when that rating changes (or is removed) there.
    conn.execute("ALTER TABLE feedback ADD COLUMN external_id TEXT")
    conn.execute("CREATE INDEX feedback_external ON feedback(source, external_id) WHERE external_id IS NOT NULL")
    # Every rating seen from another UI, attached or not: what it was when last applied
    # (updated_at), so an unchanged one is skipped and a removed one is noticed, and why one
    # did not attach (outcome, detail) for `clawd status`.
    conn.execute(
        """
        CREATE TABLE external_feedback (
            source       TEXT NOT NULL,          -- 'openwebui'
            external_id  TEXT NOT NULL,
            updated_at   REAL,                   -- the UI's own updated_at of the rating
            digest       TEXT,                   -- of what clawd read from it: a change within one second shows
            turn_id      TEXT REFERENCES turns(id) ON DELETE SET NULL,
            outcome      TEXT NOT NULL,          -- attached | not_found | ambiguous | invalid
            detail       TEXT,
            seen_at      REAL NOT NULL,
            PRIMARY KEY (source, external_id)
        )
        """
    )


def m007_external_feedback_pulled_from(conn: sqlite3.Connection) -> None:
    # Which Open WebUI listing (its url and the key's scope) last showed a rating: a pull removes
    # only ratings its own listing used to show. An imported or posted rating (NULL), or one from
    # another instance or a key that sees less (a user's own ratings), is never taken for deleted.
    conn.execute("ALTER TABLE external_feedback ADD COLUMN pulled_from TEXT")


# Append only. The number in each name is its id and must equal its 1-based position.
MIGRATIONS: list[Migration] = [
    m001_initial,
    m002_feedback_and_signals,
    m003_adapters,
    m004_turn_tool_calls,
    m005_turn_boundary_and_client,
    m006_client_ids_and_external_feedback,
    m007_external_feedback_pulled_from,
]

_NAME = re.compile(r"^m(\d{3})_\w+$")


def migration_id(fn: Migration) -> int:
    m = _NAME.match(fn.__name__)
    if m is None:
        raise ValueError(f"migration {fn.__name__!r} is not named mNNN_description")
    return int(m.group(1))


def latest_id() -> int:
    return migration_id(MIGRATIONS[-1]) if MIGRATIONS else 0


async def migrate(conn: aiosqlite.Connection) -> list[str]:
    """Apply pending migrations in order, each in its own transaction.

    Returns:
        The names of the migrations applied now (empty when already up to date).
    Raises:
        SchemaTooNew: the database was written by a newer clawd.
        SchemaError: the file is another program's SQLite database.
        sqlite3.DatabaseError: the file is not a readable database (db.py converts it).
    """
    # aiosqlite has no public "run this callable on the connection thread";
    # _execute is that, and keeps migrations plain synchronous functions.
    return await conn._execute(_migrate_sync, conn._conn)


def _migrate_sync(conn: sqlite3.Connection) -> list[str]:
    _check_is_ours(conn)
    conn.execute(
        "CREATE TABLE IF NOT EXISTS migrations ( id INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at REAL NOT NULL)"
    )
    known = {migration_id(fn): fn.__name__ for fn in MIGRATIONS}
    applied_now: list[str] = []
    for fn in MIGRATIONS:
        if _apply(conn, fn, known):
            applied_now.append(fn.__name__)
    return applied_now


def _apply(conn: sqlite3.Connection, fn: Migration, known: dict[int, str]) -> bool:
    # BEGIN IMMEDIATE takes the write lock before reading what is applied, so two
    # processes opening the same file at once cannot both apply a migration.
    conn.execute("BEGIN IMMEDIATE")
    try:
        _check_not_newer(conn, known)
        mid = migration_id(fn)
        if conn.execute("SELECT 1 FROM migrations WHERE id = ?", (mid,)).fetchone():
            conn.rollback()
            return False
        fn(conn)
        conn.execute(
            "INSERT INTO migrations (id, name, applied_at) VALUES (?, ?, ?)",
            (mid, fn.__name__, time.time()),
        )
    except BaseException:
        conn.rollback()
        raise
    conn.commit()
    return True


def _check_is_ours(conn: sqlite3.Connection) -> None:
    # Tables but no `migrations` table: another program's database. Migrating it would
    # fail half-way on a name clash or silently mix clawd's tables into it.
    tables = [
        r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")
    ]
    if tables and "migrations" not in tables:
        raise SchemaError(
            "This SQLite file is not a clawd database (it has tables "
            f"{', '.join(sorted(tables)[:5])} but no clawd migrations). "
            "Move it aside or point CLAWD_HOME elsewhere."
        )


def _check_not_newer(conn: sqlite3.Connection, known: dict[int, str]) -> None:
    rows = conn.execute("SELECT id, name FROM migrations ORDER BY id").fetchall()
    unknown = [(mid, name) for mid, name in rows if mid not in known]
    if unknown:
        mid, name = unknown[-1]
        raise SchemaTooNew(
            f"This database was written by a newer clawd (schema migration {mid} `{name}`; "
            f"this clawd knows up to {latest_id()}). Upgrade clawd, or move the database "
            "file aside to start a fresh one."
        )
