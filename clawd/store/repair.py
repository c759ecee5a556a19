"""`clawd doctor --repair`: rescue what SQLite can still read from a damaged database.

The damaged file is never changed: it is renamed aside (with its WAL, which may hold the
newest commits) as `clawd.db.broken-YYYYmmdd-HHMMSS`, a fresh database with the current
schema takes its place, and every row that can still be read is copied over, table by
table in creation order (sessions before the turns that reference them).

Why row by row: the sqlite3 CLI's `.recover` is not installed everywhere, and a plain
`SELECT *` stops at the first damaged page, losing every row behind it. Here a read error
skips ahead by growing steps of rowid until the scan finds readable rows again, so one
bad page costs the rows on it, not the rest of the table. A row whose parent was lost
(a turn without its session) is dropped with the count, as foreign keys demand.
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from clawd.errors import ClawdError
from clawd.store.migrations import _migrate_sync

SIDE_FILES = ("-wal", "-shm")
MAX_ROWID = 2**63 - 1
BATCH = 256  # rows per read while the table reads cleanly


@dataclass(frozen=True)
class TableRescue:
    table: str
    rescued: int
    lost: int  # rows read but refused (a lost parent, a broken value), plus read errors met
    note: str = ""


@dataclass(frozen=True)
class RepairReport:
    kept_as: Path
    tables: list[TableRescue]
    integrity: str  # of the new file: "ok"


def repair(db: Path) -> RepairReport:
    """Move `db` aside and rebuild it from what can be read. Raises ClawdError with what
    to do when there is nothing to repair or the directory cannot be written."""
    db = Path(db)
    if not db.is_file():
        raise ClawdError(f"{db} does not exist: nothing to repair (`clawd serve` creates a new one)")
    aside = db.with_name(f"{db.name}.broken-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        db.rename(aside)
        for suffix in SIDE_FILES:
            side = db.with_name(db.name + suffix)
            if side.exists():
                side.rename(aside.with_name(aside.name + suffix))
    except OSError as e:
        raise ClawdError(f"cannot move {db} aside ({e.strerror}): check that {db.parent} is writable") from e

    new = sqlite3.connect(db, isolation_level=None)
    try:
        os.chmod(db, aside.stat().st_mode & 0o777)  # as private as the file it replaces
        new.execute("PRAGMA journal_mode = WAL")
        _migrate_sync(new)
        new.execute("PRAGMA foreign_keys = ON")
        tables = [
            r[0]
            for r in new.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
                "AND name != 'migrations' ORDER BY rowid"
            )
        ]
        try:
            old = _open_old(aside)
        except sqlite3.Error as e:
            return RepairReport(aside, [TableRescue(t, 0, 0, f"unreadable file: {e}") for t in tables], _check(new))
        try:
            results = [_copy_table(old, new, t) for t in tables]
        finally:
            old.close()
        return RepairReport(aside, results, _check(new))
    finally:
        new.close()


def _open_old(path: Path) -> sqlite3.Connection:
    """Read-only where SQLite can (the damaged file stays as it was); a WAL without its
    shared-memory file needs a writable open to be read at all."""
    try:
        conn = sqlite3.connect(f"file:{quote(str(path))}?mode=ro", uri=True)
        conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
        return conn
    except sqlite3.OperationalError:
        return sqlite3.connect(path)


def _check(conn: sqlite3.Connection) -> str:
    return "; ".join(str(r[0]) for r in conn.execute("PRAGMA integrity_check"))


def _copy_table(old: sqlite3.Connection, new: sqlite3.Connection, table: str) -> TableRescue:
    want = [r[1] for r in new.execute(f'PRAGMA table_info("{table}")')]
    try:
        have = {r[1] for r in old.execute(f'PRAGMA table_info("{table}")')}
    except sqlite3.Error as e:
        return TableRescue(table, 0, 0, f"schema unreadable: {e}")
    if not have:
        return TableRescue(table, 0, 0, "not in the damaged file")
    cols = [c for c in want if c in have]
    names = ", ".join(f'"{c}"' for c in cols)
    insert = f'INSERT OR IGNORE INTO "{table}" ({names}) VALUES ({", ".join("?" * len(cols))})'
    select = f'SELECT rowid, {names} FROM "{table}" WHERE rowid > ? ORDER BY rowid LIMIT ?'

    def read(after: int, n: int) -> list | None:
        try:
            return old.execute(select, (after, n)).fetchall()
        except sqlite3.Error:
            return None

    rescued = lost = 0
    after, batch = -(2**63), BATCH
    new.execute("BEGIN")
    while True:
        rows = read(after, batch)
        if rows is None:
            if batch > 1:  # somewhere in this batch: read one row at a time to find it
                batch = 1
                continue
            lost += 1
            after = _skip_damage(read, after)
            if after is None:
                break
            continue
        if not rows:
            break
        for row in rows:
            try:
                if new.execute(insert, row[1:]).rowcount:
                    rescued += 1
            except sqlite3.Error:  # a broken value, or its parent row was lost
                lost += 1
        after, batch = rows[-1][0], min(batch * 2, BATCH)
    new.execute("COMMIT")
    return TableRescue(table, rescued, lost)


def _skip_damage(read, after: int) -> int | None:
    """The smallest rowid bound past `after` from which the table reads again: growing
    steps find one, a bisection comes back to the first (so the rows just behind the
    damage are not skipped with it). None: nothing readable follows."""
    start = max(after, 0)
    bad, step = after, 1
    while read(start + step, 1) is None:
        bad = start + step
        step *= 2
        if start + step >= MAX_ROWID:
            return None
    good = start + step
    while good - bad > 1:
        mid = (good + bad) // 2
        if read(mid, 1) is None:
            bad = mid
        else:
            good = mid
    return good


def format_report(report: RepairReport) -> str:
    lines = [f"kept the damaged file as {report.kept_as}"]
    for t in report.tables:
        extra = f", {t.lost} unreadable or orphaned" if t.lost else ""
        lines.append(f"{t.table:<10} {t.rescued} rescued{extra}{f' ({t.note})' if t.note else ''}")
    lines.append(f"new database: integrity {report.integrity}")
    return "\n".join(lines)
