"""The store's published contract: schema via migrations, exact token storage, one
writer for turns, transactions that commit or roll back whole. (asyncio_mode = auto)"""

from __future__ import annotations

import asyncio
import sqlite3
from contextlib import closing

import aiosqlite
import numpy as np
import pytest

from clawd.errors import ClawdError
from clawd.store import blobs, migrations
from clawd.store.db import Database, DatabaseUnavailable
from clawd.store.migrations import SchemaError, SchemaTooNew, migrate
from clawd.store.turns import (
    TurnRecord,
    count_turns,
    ensure_session,
    find_by_continuation_hash,
    find_by_request_hash,
    get_turn,
    insert_turn,
    list_sessions,
    list_turns,
    mark_session_done,
)


def make_turn(i: int = 0, *, session_id: str = "s1", created_at: float | None = None, **kw) -> TurnRecord:
    rng = np.random.default_rng(i)
    n = 5 + i % 7
    fields = dict(
        id=f"chatcmpl-{i}",
        session_id=session_id,
        turn_type="main",
        request={"messages": [{"role": "user", "content": f"héllo {i} ✓"}], "tools": []},
        request_hash=f"req-{i}",
        continuation_hash=f"cont-{i}",
        prompt_text=f"<user>héllo {i}</user>",
        prompt_ids=[2, 0, 262143, 2**31 - 1, i],
        response_ids=rng.integers(0, 262144, size=n).tolist(),
        response_logprobs=-rng.exponential(size=n).astype(np.float32),
        response_text="hi there",
        finish_reason="stop",
        sampling={"temperature": 0.8, "top_p": 0.95, "seed": None, "max_tokens": 64},
        engine="fake",
        model="gemma3-270m",
        chat_format="gemma-base",
        timings={"prompt_ms": 1.5, "gen_ms": 20.25},
        adapter_id="a-001",
        client="test",
    )
    if created_at is not None:
        fields["created_at"] = created_at
    fields.update(kw)
    return TurnRecord(**fields)


def _query(path, sql, *params):
    """Run one statement on a separate plain sqlite3 connection and commit."""
    with closing(sqlite3.connect(path)) as c, c:
        return c.execute(sql, params).fetchall()


@pytest.fixture
async def db(tmp_path):
    d = await Database.open(tmp_path / "sub" / "clawd.db")
    yield d
    await d.close()


# --- opening and migrations ---------------------------------------------------------


def test_migrations_are_numbered_by_position():
    assert [migrations.migration_id(fn) for fn in migrations.MIGRATIONS] == list(
        range(1, len(migrations.MIGRATIONS) + 1)
    )


async def test_blank_database_migrates_to_latest(tmp_path):
    path = tmp_path / "a" / "b" / "clawd.db"  # parent dirs are created
    async with await Database.open(path) as db:
        rows = await db.conn.execute_fetchall("SELECT id, name FROM migrations ORDER BY id")
        assert [tuple(r) for r in rows] == [(migrations.migration_id(fn), fn.__name__) for fn in migrations.MIGRATIONS]
        tables = {r[0] for r in await db.conn.execute_fetchall("SELECT name FROM sqlite_master WHERE type='table'")}
        assert {"migrations", "sessions", "turns"} <= tables
        indexes = {r[0] for r in await db.conn.execute_fetchall("SELECT name FROM sqlite_master WHERE type='index'")}
        assert {"turns_session_created", "turns_request_hash", "turns_continuation_hash"} <= indexes


async def test_migrate_returns_applied_names_and_is_idempotent(tmp_path):
    path = tmp_path / "clawd.db"
    async with aiosqlite.connect(path, isolation_level=None) as conn:
        assert await migrate(conn) == [fn.__name__ for fn in migrations.MIGRATIONS]
        assert await migrate(conn) == []
    first = _query(path, "SELECT * FROM migrations")
    async with await Database.open(path):
        pass
    async with await Database.open(path):
        pass
    assert _query(path, "SELECT * FROM migrations") == first


async def test_failed_migration_leaves_nothing_behind(tmp_path, monkeypatch):
    def m002_breaks(conn: sqlite3.Connection) -> None:
        conn.execute("CREATE TABLE half_done (x)")
        raise RuntimeError("boom")

    path = tmp_path / "clawd.db"
    monkeypatch.setattr(migrations, "MIGRATIONS", [migrations.m001_initial, m002_breaks])
    with pytest.raises(RuntimeError, match="boom"):
        await Database.open(path)
    assert _query(path, "SELECT id FROM migrations") == [(1,)]
    assert not _query(path, "SELECT 1 FROM sqlite_master WHERE name = 'half_done'")


async def test_upgrade_applies_only_new_migrations(tmp_path, monkeypatch):
    """A database made by the first release (m001 only), with a turn in it, upgrades to
    the latest schema and keeps its rows."""
    path = tmp_path / "clawd.db"
    released = migrations.MIGRATIONS
    monkeypatch.setattr(migrations, "MIGRATIONS", released[:1])
    async with await Database.open(path):
        pass
    # The row as that release wrote it: only its columns (later migrations added others).
    from clawd.store import turns as turn_rows

    row = dict(zip(turn_rows._COLUMNS, turn_rows._to_row(make_turn(7))))
    for added in ("tool_calls_json", "response_seen", "client_key", "client_chat_id", "client_message_id"):
        row.pop(added)
    _query(path, "INSERT INTO sessions (id, created_at, updated_at, source) VALUES (?, 0, 0, 'new')", row["session_id"])
    _query(path, f"INSERT INTO turns ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", *row.values())
    monkeypatch.setattr(migrations, "MIGRATIONS", released)
    async with aiosqlite.connect(path, isolation_level=None) as conn:
        assert await migrate(conn) == [fn.__name__ for fn in released[1:]]
    async with await Database.open(path) as db:
        old = await get_turn(db, "chatcmpl-7")
        assert old.response_ids == make_turn(7).response_ids
        assert old.response_seen is None  # not counted then: jobs.received_ids derives it
        assert await db.integrity_check() == "ok"


async def test_database_from_newer_clawd_is_refused(tmp_path):
    path = tmp_path / "clawd.db"
    async with await Database.open(path):
        pass
    _query(path, "INSERT INTO migrations VALUES (999, 'm999_from_the_future', 0)")
    with pytest.raises(SchemaTooNew) as exc:
        await Database.open(path)
    msg = exc.value.message
    assert isinstance(exc.value, ClawdError)
    assert "newer clawd" in msg and "m999_from_the_future" in msg and str(path) in msg
    assert "\n" not in msg


async def test_garbage_file_gives_one_line_clawd_error(tmp_path):
    path = tmp_path / "clawd.db"
    path.write_bytes(b"this is not an sqlite database, just some bytes\n" * 200)
    with pytest.raises(ClawdError) as exc:
        await Database.open(path)
    assert isinstance(exc.value, DatabaseUnavailable)
    msg = exc.value.message
    assert "\n" not in msg
    assert "clawd doctor --repair" in msg and str(path) in msg
    assert path.read_bytes().startswith(b"this is not")  # never overwritten


async def test_directory_in_place_of_the_file_is_refused(tmp_path):
    (tmp_path / "clawd.db").mkdir()
    with pytest.raises(DatabaseUnavailable, match="is a directory"):
        await Database.open(tmp_path / "clawd.db")


async def test_another_programs_sqlite_file_is_refused(tmp_path):
    path = tmp_path / "clawd.db"
    _query(path, "CREATE TABLE sessions (x)")
    with pytest.raises(SchemaError, match="not a clawd database"):
        await Database.open(path)


async def test_pragmas_and_integrity(db):
    async def pragma(name):
        return (await db.conn.execute_fetchall(f"PRAGMA {name}"))[0][0]

    assert await pragma("journal_mode") == "wal"
    assert await pragma("foreign_keys") == 1
    assert await pragma("synchronous") == 1  # NORMAL
    assert await pragma("busy_timeout") == 5000
    assert await db.integrity_check() == "ok"


# --- turns and sessions -------------------------------------------------------------


async def test_insert_get_round_trip_is_exact(db):
    rec = make_turn(3)
    rec.response_logprobs[0] = np.float32(-1e-38)  # subnormal-adjacent values survive too
    await insert_turn(db, rec)
    got = await get_turn(db, rec.id)
    assert got == rec
    assert got.prompt_ids == [2, 0, 262143, 2**31 - 1, 3]
    assert got.response_logprobs.dtype == np.float32
    assert got.response_logprobs.tobytes() == rec.response_logprobs.tobytes()
    assert got.request["messages"][0]["content"] == "héllo 3 ✓"
    assert await get_turn(db, "chatcmpl-missing") is None


async def test_token_blobs_are_four_bytes_per_token(db):
    rec = make_turn(4)
    await insert_turn(db, rec)
    row = (
        await db.conn.execute_fetchall(
            "SELECT length(prompt_ids), length(response_ids), length(response_logprobs),"
            " typeof(prompt_ids) FROM turns WHERE id = ?",
            (rec.id,),
        )
    )[0]
    n = len(rec.response_ids)
    assert tuple(row) == (4 * len(rec.prompt_ids), 4 * n, 4 * n, "blob")


async def test_insert_is_committed_and_visible_to_other_connections(db):
    await insert_turn(db, make_turn(1), source="header")
    # A separate connection (another process, or the trainer) sees it at once.
    assert _query(db.path, "SELECT id FROM turns") == [("chatcmpl-1",)]
    assert _query(db.path, "SELECT source FROM sessions") == [("header",)]


async def test_misaligned_logprobs_are_rejected(db):
    rec = make_turn(2)
    rec.response_logprobs = rec.response_logprobs[:-1]
    with pytest.raises(ValueError, match="logprobs"):
        await insert_turn(db, rec)
    assert await count_turns(db) == 0


async def test_session_delete_cascades_and_requery_link_is_nulled(db):
    await insert_turn(db, make_turn(1, session_id="a", created_at=1.0))
    await insert_turn(db, make_turn(2, session_id="a", created_at=2.0))
    await insert_turn(db, make_turn(3, session_id="b", created_at=3.0, requery_of="chatcmpl-2"))
    async with db.transaction():
        await db.conn.execute("DELETE FROM sessions WHERE id = 'a'")
    assert [t.id for t in await list_turns(db)] == ["chatcmpl-3"]
    assert (await get_turn(db, "chatcmpl-3")).requery_of is None


async def test_unknown_requery_target_violates_foreign_key(db):
    with pytest.raises(sqlite3.IntegrityError):
        await insert_turn(db, make_turn(1, requery_of="chatcmpl-nope"))
    assert await count_turns(db) == 0
    assert await list_sessions(db) == []  # the session insert rolled back with it


async def test_sessions_are_created_touched_and_finished(db):
    assert await ensure_session(db, "s", source="new") is True
    assert await ensure_session(db, "s", source="prefix", title="First chat") is False
    await insert_turn(db, make_turn(1, session_id="s", created_at=4e9))
    [s] = await list_sessions(db)
    assert s["title"] == "First chat" and s["source"] == "new"
    assert s["turn_count"] == 1 and s["updated_at"] == 4e9 and s["done"] is False
    assert await mark_session_done(db, "s") is True
    assert await mark_session_done(db, "nope") is False
    assert (await list_sessions(db))[0]["done"] is True
    with pytest.raises(ValueError):
        await ensure_session(db, "t", source="guess")


async def test_listing_and_hash_lookups_return_newest(db):
    await insert_turn(db, make_turn(1, session_id="a", created_at=10.0, request_hash="R"))
    await insert_turn(db, make_turn(2, session_id="b", created_at=20.0, continuation_hash="C"))
    await insert_turn(db, make_turn(3, session_id="a", created_at=30.0, request_hash="R"))
    await insert_turn(db, make_turn(4, session_id="a", created_at=40.0, continuation_hash="C"))
    assert [t.id for t in await list_turns(db)] == [f"chatcmpl-{i}" for i in (4, 3, 2, 1)]
    assert [t.id for t in await list_turns(db, session_id="a", limit=2)] == ["chatcmpl-4", "chatcmpl-3"]
    assert [t.id for t in await list_turns(db, before=30.0)] == ["chatcmpl-2", "chatcmpl-1"]
    assert (await find_by_request_hash(db, "R")).id == "chatcmpl-3"
    assert (await find_by_continuation_hash(db, "C")).id == "chatcmpl-4"
    assert await find_by_request_hash(db, "nope") is None
    assert await count_turns(db) == 4
    sessions = await list_sessions(db)
    assert [(s["id"], s["turn_count"]) for s in sessions] == [("a", 3), ("b", 1)]


async def test_concurrent_inserts_from_many_tasks_all_land(db):
    recs = [make_turn(i, session_id=f"s{i % 5}") for i in range(60)]
    await asyncio.gather(*(insert_turn(db, r) for r in recs))
    assert await count_turns(db) == 60
    assert sorted(s["turn_count"] for s in await list_sessions(db)) == [12] * 5
    assert await db.integrity_check() == "ok"


# --- transactions -------------------------------------------------------------------


async def test_transaction_rolls_back_on_error_and_nests_as_savepoint(db):
    with pytest.raises(RuntimeError):
        async with db.transaction():
            await ensure_session(db, "gone", source="new")  # nested: savepoint
            raise RuntimeError
    assert await list_sessions(db) == []

    async with db.transaction():
        await ensure_session(db, "kept", source="new")
        with pytest.raises(RuntimeError):
            async with db.transaction():
                await ensure_session(db, "inner", source="new")
                raise RuntimeError
    assert [s["id"] for s in await list_sessions(db)] == ["kept"]
    assert not db.conn.in_transaction


async def test_cancelled_transaction_rolls_back(db):
    started = asyncio.Event()

    async def writer():
        async with db.transaction():
            await db.conn.execute("INSERT INTO sessions (id, created_at, updated_at, source) VALUES ('x', 0, 0, 'new')")
            started.set()
            await asyncio.sleep(10)

    task = asyncio.create_task(writer())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await list_sessions(db) == []
    assert not db.conn.in_transaction
    await ensure_session(db, "after", source="new")  # the lock was released


# --- blobs --------------------------------------------------------------------------


@pytest.mark.parametrize("ids", [[], [0], [1, 2, 3], [2**31 - 1, -(2**31), 262143]])
def test_ids_round_trip(ids):
    packed = blobs.pack_ids(ids)
    assert len(packed) == 4 * len(ids)
    assert blobs.unpack_ids(packed) == ids
    assert blobs.pack_ids(np.asarray(ids, dtype=np.int64)) == packed


def test_ids_are_little_endian_int32():
    assert blobs.pack_ids([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"


def test_bad_ids_are_rejected():
    with pytest.raises(ValueError):
        blobs.pack_ids(np.asarray([2**31], dtype=np.int64))
    with pytest.raises(ValueError):
        blobs.pack_ids([1.5])
    with pytest.raises(ValueError):
        blobs.unpack_ids(b"\x00\x00\x00")


def test_floats_round_trip_exactly():
    vals = np.array([0.0, -0.0, -1e-45, -3.4e38, -np.inf, -0.123456789], dtype=np.float32)
    out = blobs.unpack_floats(blobs.pack_floats(vals))
    assert out.dtype == np.float32 and out.tobytes() == vals.tobytes()
    out[0] = 1.0  # writable, not a view on the blob
    assert blobs.unpack_floats(blobs.pack_floats([])).shape == (0,)
    # float64 input is rounded to float32 once, then exact.
    assert blobs.unpack_floats(blobs.pack_floats([0.1]))[0] == np.float32(0.1)


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(12, dtype=np.int32).reshape(3, 4),
        np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32),
        np.zeros((0, 4), dtype=np.float32),
        np.arange(8, dtype=">i4").reshape(2, 4),  # big-endian input is normalised
    ],
)
def test_arrays_round_trip(arr):
    packed = blobs.pack_array(arr)
    assert len(packed) == arr.size * arr.dtype.itemsize
    out = blobs.unpack_array(packed, arr.dtype.newbyteorder("="), arr.shape)
    assert out.shape == arr.shape and np.array_equal(out, arr)
    with pytest.raises(ValueError):
        blobs.unpack_array(packed + packed[:4] if packed else b"\x00" * 4, arr.dtype, arr.shape)
