"""The daemon's one SQLite connection: open, configure, migrate, transact, close.

Boundary: connection lifecycle and transactions only. No table is written here; each
table family has its own writer module (turns.py, ...), and they write only inside
`async with db.transaction():`. Readers may use `db.conn` directly.

Low-level sqlite3 errors met while opening are converted here into one-line
ClawdErrors that say what to do.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiosqlite

from clawd.errors import ClawdError, StorageFull, StorageUnavailable
from clawd.store.migrations import SchemaError, migrate

log = logging.getLogger(__name__)
BUSY_TIMEOUT_MS = 5000
PROBE_ROW_ID, PROBE_BYTES = -1, 64 * 1024  # see Database.probe_write
REPAIR_HINT = "stop clawd and run `clawd doctor --repair` (it keeps the damaged file aside and rescues what it can)"

# sqlite3 primary result codes (sqlite_errorcode & 0xFF)
_PERM, _BUSY, _LOCKED, _READONLY, _IOERR, _CORRUPT, _FULL, _CANTOPEN, _NOTADB = (
    3,
    5,
    6,
    8,
    10,
    11,
    13,
    14,
    26,
)


class DatabaseUnavailable(ClawdError):
    """The database file cannot be opened or used as clawd's database."""

    code = "database_unavailable"


@dataclass
class WriteHealth:
    """Whether the last write reached the disk. A failed write makes the daemon `degraded`
    (health and status say why); the next write that commits, a turn's or the periodic
    probe's, makes it ok again: nothing needs a restart when space returns."""

    reason: str | None = None  # None = ok; "disk full" | "read-only" | "other"
    detail: str | None = None
    since: float | None = None

    @property
    def degraded(self) -> bool:
        return self.reason is not None

    def failed(self, reason: str, detail: str) -> None:
        if self.reason is None:
            log.error("database writes are failing (%s): %s; clawd keeps serving and retries", reason, detail)
            self.since = time.time()
        self.reason, self.detail = reason, detail

    def succeeded(self) -> None:
        if self.reason is not None:
            log.warning("database writes work again (were failing: %s)", self.reason)
        self.reason = self.detail = self.since = None

    def public(self) -> dict:
        return {
            "status": "degraded" if self.degraded else "ok",
            "reason": self.reason,
            "detail": self.detail,
            "since": self.since,
        }


def storage_fault(e: BaseException) -> ClawdError | None:
    """The ClawdError for a write that failed because of the disk, None for anything else
    (a constraint, a busy lock, a bug): only the disk's faults make the daemon degraded."""
    if not isinstance(e, sqlite3.Error):
        return None
    code = (getattr(e, "sqlite_errorcode", 0) or 0) & 0xFF
    if code == _FULL:
        return StorageFull(
            f"The disk is full: this turn could not be logged ({e}). Free some space; clawd recovers by itself."
        )
    if code == _READONLY:
        return StorageUnavailable(
            f"The database is read-only: this turn could not be logged ({e}). Make it writable; clawd recovers by itself.",
            code="storage_read_only",
        )
    if code in (_IOERR, _CANTOPEN, _PERM, _CORRUPT, _NOTADB):
        return StorageUnavailable(f"The database cannot be written: this turn could not be logged ({e}).")
    return None


def _fault_reason(fault: ClawdError) -> str:
    if isinstance(fault, StorageFull):
        return "disk full"
    return "read-only" if fault.code == "storage_read_only" else "other"


class Database:
    """One aiosqlite connection shared by the whole daemon.

    Writes are serialised by an asyncio lock around `transaction()`: a single
    connection has a single transaction, so two tasks writing at once would otherwise
    interleave inside each other's transaction.
    """

    def __init__(self, conn: aiosqlite.Connection, path: Path):
        self.conn = conn
        self.path = path
        self._write_lock = asyncio.Lock()
        self._tx_owner: asyncio.Task | None = None
        self._savepoints = 0
        self.health = WriteHealth()

    @classmethod
    async def open(cls, path: Path) -> Database:
        """Open (creating if missing) and migrate the database at `path`.

        Raises:
            DatabaseUnavailable: the file is corrupt, not SQLite, locked or unwritable.
            SchemaTooNew / SchemaError: written by a newer clawd or another program.
        """
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DatabaseUnavailable(
                f"Cannot create the directory {path.parent} ({e.strerror}). Point CLAWD_HOME at a writable directory."
            ) from e
        if path.is_dir():
            raise DatabaseUnavailable(f"{path} is a directory, not a database file. Move it aside.")
        # isolation_level=None: sqlite3 must not open transactions behind our back;
        # transaction() issues BEGIN IMMEDIATE itself.
        conn = aiosqlite.connect(path, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
        try:
            await conn
        except sqlite3.Error as e:
            # On a failed connect aiosqlite stops its worker thread without waiting; if
            # the loop closes first (CLI exit) the thread dumps a traceback. Wait for it.
            thread = getattr(conn, "_thread", None)
            if thread is not None:
                await asyncio.to_thread(thread.join, 5)
            raise _explain(path, e) from e
        try:
            await _configure(conn, path)
            await _quick_check(conn, path)
            await migrate(conn)
        except BaseException as e:
            await conn.close()
            if isinstance(e, sqlite3.Error):
                raise _explain(path, e) from e
            if isinstance(e, SchemaError):
                # migrations.py does not know the path; the user needs it to act.
                raise type(e)(f"{path}: {e.message}") from e
            raise
        return cls(conn, path)

    async def close(self) -> None:
        try:
            # Cheap; keeps query plans good for long-lived databases.
            await self.conn.execute("PRAGMA optimize")
        finally:
            await self.conn.close()

    async def __aenter__(self) -> Database:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def integrity_check(self) -> str:
        """'ok' when the file is sound, else SQLite's description of the damage."""
        try:
            rows = await self.conn.execute_fetchall("PRAGMA integrity_check")
        except sqlite3.DatabaseError as e:
            return f"error: {e}"
        return "\n".join(str(r[0]) for r in rows)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[aiosqlite.Connection]:
        """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK if the block raises (or is cancelled).

        Re-entrant within one task (inner blocks become savepoints), so a writer can
        call another writer's helper. Not shareable across tasks: a task spawned inside
        the block that opens its own transaction waits until this one ends.
        """
        task = asyncio.current_task()
        if task is not None and self._tx_owner is task:
            async with self._savepoint():
                yield self.conn
            return
        async with self._write_lock:
            self._tx_owner = task
            try:
                try:
                    # IMMEDIATE takes the write lock now, so a concurrent writer in another
                    # process waits on busy_timeout here rather than failing at COMMIT.
                    # Inside the try: a task cancelled while awaiting it still has it run
                    # on aiosqlite's thread, and must roll it back, or the connection stays
                    # inside a transaction and every later write fails.
                    await self.conn.execute("BEGIN IMMEDIATE")
                    yield self.conn
                    await self.conn.commit()
                except BaseException as e:
                    # sqlite3's rollback() is a no-op when SQLite already ended the
                    # transaction, and it runs in queue order after anything pending.
                    try:
                        await self.conn.rollback()
                    except sqlite3.Error as again:  # a sick disk: the first error is the news
                        log.warning("rollback failed too: %s", again)
                    fault = storage_fault(e)
                    if fault is None:
                        raise
                    self.health.failed(_fault_reason(fault), str(e))
                    raise fault from e
                self.health.succeeded()
            finally:
                self._tx_owner = None

    async def probe_write(self) -> bool:
        """One real write of about a turn's size, to learn whether the disk takes writes again
        while nothing else writes. Updates `health`; True when it committed.

        A row inserted and deleted in one transaction: nobody ever sees it, but its pages are
        allocated and committed to the WAL, so a disk without room for a turn fails it (an
        in-place update would fit in pages the file already has, and pass on a full disk)."""
        try:
            async with self.transaction() as conn:
                await conn.execute(
                    "INSERT INTO migrations (id, name, applied_at) VALUES (?, zeroblob(?), 0)",
                    (PROBE_ROW_ID, PROBE_BYTES),
                )
                await conn.execute("DELETE FROM migrations WHERE id = ?", (PROBE_ROW_ID,))
        except (StorageFull, StorageUnavailable):
            return False
        return True

    async def watch_health(self, interval_s: float) -> None:
        """While degraded, probe every `interval_s` so health turns ok once space returns."""
        while True:
            await asyncio.sleep(interval_s)
            if self.health.degraded:
                await self.probe_write()

    @asynccontextmanager
    async def _savepoint(self) -> AsyncIterator[None]:
        self._savepoints += 1
        name = f"sp{self._savepoints}"
        try:
            await self.conn.execute(f"SAVEPOINT {name}")
            try:
                yield
            except BaseException:
                await self.conn.execute(f"ROLLBACK TO {name}")
                await self.conn.execute(f"RELEASE {name}")
                raise
            await self.conn.execute(f"RELEASE {name}")
        finally:
            self._savepoints -= 1


async def _configure(conn: aiosqlite.Connection, path: Path) -> None:
    await conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    # The first real read of the file: a non-SQLite file fails here (SQLITE_NOTADB).
    async with conn.execute("PRAGMA journal_mode = WAL") as cur:
        row = await cur.fetchone()
    if row is None or str(row[0]).lower() != "wal":
        # e.g. some network filesystems; concurrent readers and durability assume WAL.
        raise DatabaseUnavailable(
            f"SQLite could not put {path} in WAL mode (got {row[0] if row else None!r}). "
            "Keep CLAWD_HOME on a local disk."
        )
    # NORMAL in WAL mode: a commit survives a process crash; only an OS crash or power
    # loss can drop the last few commits, never corrupt the file.
    await conn.execute("PRAGMA synchronous = NORMAL")
    await conn.execute("PRAGMA foreign_keys = ON")
    conn.row_factory = sqlite3.Row


async def _quick_check(conn: aiosqlite.Connection, path: Path) -> None:
    """Refuse a damaged file at start-up rather than write into it (a write to a malformed
    b-tree can spread the damage). quick_check reads every page but skips index checks:
    well under a second for a year of turns."""
    rows = await conn.execute_fetchall("PRAGMA quick_check")
    found = [str(r[0]) for r in rows]
    if found != ["ok"]:
        # SQLite's report is many lines under a "*** in database main ***" header: the first finding says enough.
        lines = [ln for r in found for ln in r.splitlines() if ln.strip() and not ln.startswith("***")]
        raise DatabaseCorrupt(f"{path} is damaged ({lines[0] if lines else 'quick_check failed'}): {REPAIR_HINT}.")


class DatabaseCorrupt(DatabaseUnavailable):
    code = "database_corrupt"


def _explain(path: Path, e: sqlite3.Error) -> DatabaseUnavailable:
    code = (getattr(e, "sqlite_errorcode", 0) or 0) & 0xFF
    if code in (_CORRUPT, _NOTADB):
        return DatabaseCorrupt(f"{path} is not a readable clawd database ({e}): {REPAIR_HINT}.")
    if code in (_BUSY, _LOCKED):
        msg = (
            f"{path} is locked by another process ({e}). Stop the other clawd (`clawd status` shows it) and try again."
        )
    elif code in (_PERM, _READONLY, _CANTOPEN, _IOERR, _FULL):
        msg = (
            f"Cannot open or write {path} ({e}). Check that the file and its directory "
            "are writable and the disk is not full."
        )
    else:
        msg = f"SQLite error on {path} ({e}). If it persists, move the file aside and restart."
    return DatabaseUnavailable(msg)
