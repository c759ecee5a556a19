"""Training signals mined from turns, one row per main turn, and the forget log.

Boundary: the ONLY module that writes the `signals` and `forgotten` tables. The miner
decides what goes in a row; this module stores it. A row moves through
waiting (no next state yet) -> pending (evidence in, to judge) -> ready | empty.
Teacher arrays are float32 / int32 BLOBs (blobs.py) of shape (n,) or (n, top_k).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from clawd.store.blobs import pack_array, unpack_array
from clawd.store.db import Database

STATUSES = ("waiting", "pending", "ready", "empty")


@dataclass
class Signal:
    turn_id: str
    session_id: str
    status: str
    next_turn_id: str | None = None
    next_state: str | None = None
    next_role: str | None = None
    reward: int | None = None
    reward_source: str | None = None
    votes: list = field(default_factory=list)
    hints: list[dict] = field(default_factory=list)  # [{"text", "source", "overlap"}]
    hint: str | None = None
    top_k: int | None = None
    student_top_ids: np.ndarray | None = None  # int32 (n, k)
    student_top_logprobs: np.ndarray | None = None  # float32 (n, k)
    teacher_logprobs: np.ndarray | None = None  # float32 (n,)
    teacher_top_logprobs: np.ndarray | None = None  # float32 (n, k)
    vetoed: bool = False
    attempts: int = 0
    error: str | None = None
    retry_at: float = 0.0
    created_at: float = 0.0
    updated_at: float = 0.0

    def public(self) -> dict[str, Any]:
        """JSON-safe summary (arrays reduced to their shapes)."""
        d = {k: v for k, v in self.__dict__.items() if not isinstance(v, np.ndarray)}
        d["teacher_arrays"] = self.teacher_logprobs is not None
        return d


def _blob(a: np.ndarray | None) -> bytes | None:
    return None if a is None else pack_array(np.ascontiguousarray(a))


def from_row(r) -> Signal:
    """A `signals` row (sqlite3.Row or any name-indexed mapping) as a Signal; also used by
    read-only readers outside the daemon (clawd/signal_datasets.py)."""
    n_k = None
    if r["student_top_ids"] is not None:
        k = r["top_k"]
        n = len(r["student_top_ids"]) // 4 // k
        n_k = (n, k)
    return Signal(
        turn_id=r["turn_id"],
        session_id=r["session_id"],
        status=r["status"],
        next_turn_id=r["next_turn_id"],
        next_state=r["next_state"],
        next_role=r["next_role"],
        reward=r["reward"],
        reward_source=r["reward_source"],
        votes=json.loads(r["votes_json"] or "[]"),
        hints=json.loads(r["hints_json"] or "[]"),
        hint=r["hint"],
        top_k=r["top_k"],
        student_top_ids=unpack_array(r["student_top_ids"], np.int32, n_k) if n_k else None,
        student_top_logprobs=unpack_array(r["student_top_logprobs"], np.float32, n_k) if n_k else None,
        teacher_logprobs=unpack_array(r["teacher_logprobs"], np.float32, (n_k[0],)) if n_k else None,
        teacher_top_logprobs=unpack_array(r["teacher_top_logprobs"], np.float32, n_k) if n_k else None,
        vetoed=bool(r["vetoed"]),
        attempts=r["attempts"],
        error=r["error"],
        retry_at=r["retry_at"],
        created_at=r["created_at"],
        updated_at=r["updated_at"],
    )


async def create_missing(db: Database) -> int:
    """A 'waiting' row for every trainable turn that has none (idempotent; catches up
    after restarts). Failed turns are not trainable. A cancelled turn (the user stopped it) is
    trainable once it has explicit feedback: the user saw its tokens and said how they did.
    Side turns never get a row: heartbeats and memory jobs, and every raw /v1/completions
    turn (chat.py `start_raw`), whose prompt has no conversation to take a next state from
    and no user message to append a teacher's hint to."""
    now = time.time()
    async with db.transaction():
        cur = await db.conn.execute(
            "INSERT INTO signals (turn_id, session_id, status, created_at, updated_at)"
            " SELECT t.id, t.session_id, 'waiting', ?, ? FROM turns t"
            " LEFT JOIN signals s ON s.turn_id = t.id"
            " WHERE s.turn_id IS NULL AND t.turn_type = 'main' AND (t.finish_reason IN ('stop', 'length')"
            " OR (t.finish_reason = 'cancelled' AND EXISTS (SELECT 1 FROM feedback f WHERE f.turn_id = t.id)))",
            (now, now),
        )
        return cur.rowcount


async def get(db: Database, turn_id: str) -> Signal | None:
    rows = await db.conn.execute_fetchall("SELECT * FROM signals WHERE turn_id = ?", (turn_id,))
    return from_row(rows[0]) if rows else None


async def list_signals(
    db: Database, *, status: str | None = None, session_id: str | None = None, limit: int = 100
) -> list[Signal]:
    where, args = [], []
    if status:
        where.append("status = ?")
        args.append(status)
    if session_id:
        where.append("session_id = ?")
        args.append(session_id)
    sql = "SELECT * FROM signals" + (" WHERE " + " AND ".join(where) if where else "")
    rows = await db.conn.execute_fetchall(sql + " ORDER BY created_at DESC, rowid DESC LIMIT ?", (*args, limit))
    return [from_row(r) for r in rows]


async def due(db: Database, status: str, *, limit: int = 50, now: float | None = None) -> list[str]:
    """Turn ids in `status` whose retry time has come, oldest first."""
    rows = await db.conn.execute_fetchall(
        "SELECT turn_id FROM signals WHERE status = ? AND retry_at <= ? ORDER BY created_at, rowid LIMIT ?",
        (status, time.time() if now is None else now, limit),
    )
    return [r[0] for r in rows]


async def counts(db: Database) -> dict[str, int]:
    rows = await db.conn.execute_fetchall(
        "SELECT status, COUNT(*) FROM signals GROUP BY status UNION ALL"
        " SELECT 'vetoed', COUNT(*) FROM signals WHERE vetoed = 1"
    )
    out = {s: 0 for s in (*STATUSES, "vetoed")}
    out.update({r[0]: r[1] for r in rows})
    return out


async def save(db: Database, sig: Signal, *, if_updated_at: float | None = None) -> bool:
    """Write every mined field of the row (the miner's single write per step).

    With `if_updated_at`, write only if the row has not changed since it was read at that
    time (feedback may re-open a turn while it is being mined; that must win). Returns
    whether the row was written."""
    if sig.status not in STATUSES:
        raise ValueError(f"signal status must be one of {STATUSES}, got {sig.status!r}")
    guard, guard_args = ("", ()) if if_updated_at is None else (" AND updated_at=?", (if_updated_at,))
    sig.updated_at = time.time()
    async with db.transaction():
        cur = await db.conn.execute(
            "UPDATE signals SET status=?, next_turn_id=?, next_state=?, next_role=?, reward=?,"
            " reward_source=?, votes_json=?, hints_json=?, hint=?, top_k=?, student_top_ids=?,"
            " student_top_logprobs=?, teacher_logprobs=?, teacher_top_logprobs=?, attempts=?, error=?,"
            " retry_at=?, updated_at=? WHERE turn_id=?" + guard,
            (
                sig.status,
                sig.next_turn_id,
                sig.next_state,
                sig.next_role,
                sig.reward,
                sig.reward_source,
                json.dumps(sig.votes),
                json.dumps(sig.hints),
                sig.hint,
                sig.top_k,
                _blob(sig.student_top_ids),
                _blob(sig.student_top_logprobs),
                _blob(sig.teacher_logprobs),
                _blob(sig.teacher_top_logprobs),
                sig.attempts,
                sig.error,
                sig.retry_at,
                sig.updated_at,
                sig.turn_id,
                *guard_args,
            ),
        )
        return cur.rowcount == 1


async def reopen(db: Database, turn_id: str) -> None:
    """New evidence (feedback) arrived: judge this turn again."""
    async with db.transaction():
        await db.conn.execute(
            "UPDATE signals SET status = 'pending', retry_at = 0, updated_at = ? WHERE turn_id = ?",
            (time.time(), turn_id),
        )


async def set_vetoed(db: Database, turn_id: str, vetoed: bool) -> bool:
    async with db.transaction():
        cur = await db.conn.execute(
            "UPDATE signals SET vetoed = ?, updated_at = ? WHERE turn_id = ?", (int(vetoed), time.time(), turn_id)
        )
        return cur.rowcount == 1


async def record_forgotten(db: Database, session_id: str, turn_ids: list[str]) -> None:
    now = time.time()
    async with db.transaction():
        await db.conn.executemany(
            "INSERT OR REPLACE INTO forgotten (turn_id, session_id, forgotten_at) VALUES (?, ?, ?)",
            [(t, session_id, now) for t in turn_ids],
        )


async def forgotten_turns(db: Database) -> set[str]:
    rows = await db.conn.execute_fetchall("SELECT turn_id FROM forgotten")
    return {r[0] for r in rows}


async def vetoed_turns(db: Database) -> set[str]:
    rows = await db.conn.execute_fetchall("SELECT turn_id FROM signals WHERE vetoed = 1")
    return {r[0] for r in rows}


# What the trainer may learn from, oldest first; dataset export reads the same rows.
TRAINABLE_WHERE = "status = 'ready' AND vetoed = 0"
TRAINABLE_SQL = f"SELECT * FROM signals WHERE {TRAINABLE_WHERE} ORDER BY created_at, rowid LIMIT ?"


async def trainable_ids(db: Database, *, model: str | None = None, exclude: Iterable[str] = ()) -> list[str]:
    """Turn ids of what the trainer may learn from, oldest first: ready, not vetoed (forgotten
    turns are gone), answered by `model` (another model's token ids mean nothing to this one),
    minus the `exclude` turns (already learned). Ids only, so a long history stays cheap."""
    rows = await db.conn.execute_fetchall(
        f"SELECT turn_id FROM signals WHERE {TRAINABLE_WHERE} "
        "AND turn_id NOT IN (SELECT value FROM json_each(?)) "
        "AND (? IS NULL OR turn_id IN (SELECT id FROM turns WHERE model = ?)) "
        "ORDER BY created_at, rowid",
        (json.dumps(sorted(exclude)), model, model),
    )
    return [r[0] for r in rows]


async def get_many(db: Database, turn_ids: Sequence[str]) -> list[Signal]:
    """The signals of `turn_ids`, in that order (ids without a signal are skipped)."""
    rows = await db.conn.execute_fetchall(
        "SELECT * FROM signals WHERE turn_id IN (SELECT value FROM json_each(?))", (json.dumps(list(turn_ids)),)
    )
    by_id = {r["turn_id"]: from_row(r) for r in rows}
    return [by_id[t] for t in turn_ids if t in by_id]
