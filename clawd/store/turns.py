"""Sessions and turns: one row per model response, with everything training needs.

Boundary: the ONLY module that writes the `sessions` and `turns` tables. It stores and
fetches; it does not compute hashes, infer sessions or detect re-queries (sessions.py
decides those and passes the results in).

A turn keeps the sampled response token ids and their log-probs exactly as the engine
produced them (METHOD.md §1: never re-tokenize the response text), packed as int32 /
float32 BLOBs (blobs.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from clawd.store.blobs import pack_floats, pack_ids, unpack_floats, unpack_ids
from clawd.store.db import Database

TURN_TYPES = ("main", "side")
# How the session id was obtained: X-Session-Id header, body field, message-prefix
# match, or a fresh session.
SESSION_SOURCES = ("header", "body", "prefix", "regenerate", "retry", "new")


@dataclass(eq=False)
class TurnRecord:
    """One assistant response to one request, as stored in `turns`."""

    id: str  # 'chatcmpl-...', also the completion id the client sees
    session_id: str
    turn_type: str  # 'main' (trainable) | 'side'
    request: Any  # the request messages (+ tools) as parsed JSON
    request_hash: str
    continuation_hash: str
    prompt_text: str
    prompt_ids: list[int]
    response_ids: list[int]  # the sampled tokens, exactly (a stop string's tokens included)
    response_logprobs: np.ndarray  # float32, one per response token
    response_text: str
    finish_reason: str
    sampling: dict
    engine: str
    model: str
    chat_format: str
    timings: dict
    adapter_id: str | None = None  # the adapter active when the response was sampled
    requery_of: str | None = None  # the turn this one regenerates, if any
    client: str | None = None
    created_at: float = field(default_factory=time.time)
    tool_calls: list[dict] = field(default_factory=list)  # parsed from response_text; [] = none
    # How many of response_ids the user received (sessions/chat: stops.tokens_received): samples
    # train on these only. None = a turn recorded before clawd counted them (jobs derives it).
    response_seen: int | None = None
    client_key: str | None = None  # who asked (sessions.client_key): a regenerate is the same client's
    # The chat UI's own ids for the conversation and for this reply (Open WebUI sends them as
    # headers when set up to): its ratings name the message they rate by that id.
    client_chat_id: str | None = None
    client_message_id: str | None = None

    def __post_init__(self) -> None:
        # Normalise so a record compares equal to itself after a round trip.
        self.prompt_ids = _as_int_list(self.prompt_ids)
        self.response_ids = _as_int_list(self.response_ids)
        self.response_logprobs = np.asarray(self.response_logprobs, dtype=np.float32)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TurnRecord):
            return NotImplemented
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            same = np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
            if not same:
                return False
        return True


def _as_int_list(ids: Any) -> list[int]:
    return ids.tolist() if isinstance(ids, np.ndarray) else [int(i) for i in ids]


_COLUMNS = (
    "id",
    "session_id",
    "turn_type",
    "created_at",
    "request_json",
    "request_hash",
    "continuation_hash",
    "prompt_text",
    "prompt_ids",
    "response_ids",
    "response_logprobs",
    "response_text",
    "finish_reason",
    "sampling_json",
    "engine",
    "model",
    "adapter_id",
    "chat_format",
    "timings_json",
    "requery_of",
    "client",
    "tool_calls_json",
    "response_seen",
    "client_key",
    "client_chat_id",
    "client_message_id",
)
_SELECT = f"SELECT {', '.join(_COLUMNS)} FROM turns"
_INSERT = f"INSERT INTO turns ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"
_NEWEST = "ORDER BY created_at DESC, rowid DESC"


def _dumps(obj: Any) -> str:
    # ensure_ascii=False keeps the stored text readable in the sqlite3 shell.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _to_row(rec: TurnRecord) -> tuple:
    if rec.turn_type not in TURN_TYPES:
        raise ValueError(f"turn_type must be one of {TURN_TYPES}, got {rec.turn_type!r}")
    if len(rec.response_logprobs) != len(rec.response_ids):
        # Training aligns them position by position; a mismatch is an engine bug.
        raise ValueError(
            f"turn {rec.id}: {len(rec.response_ids)} response ids but {len(rec.response_logprobs)} logprobs"
        )
    values = {
        "id": rec.id,
        "session_id": rec.session_id,
        "turn_type": rec.turn_type,
        "created_at": rec.created_at,
        "request_json": _dumps(rec.request),
        "request_hash": rec.request_hash,
        "continuation_hash": rec.continuation_hash,
        "prompt_text": rec.prompt_text,
        "prompt_ids": pack_ids(rec.prompt_ids),
        "response_ids": pack_ids(rec.response_ids),
        "response_logprobs": pack_floats(rec.response_logprobs),
        "response_text": rec.response_text,
        "finish_reason": rec.finish_reason,
        "sampling_json": _dumps(rec.sampling),
        "engine": rec.engine,
        "model": rec.model,
        "adapter_id": rec.adapter_id,
        "chat_format": rec.chat_format,
        "timings_json": _dumps(rec.timings),
        "requery_of": rec.requery_of,
        "client": rec.client,
        "tool_calls_json": _dumps(rec.tool_calls) if rec.tool_calls else None,
        "response_seen": rec.response_seen,
        "client_key": rec.client_key,
        "client_chat_id": rec.client_chat_id,
        "client_message_id": rec.client_message_id,
    }
    return tuple(values[c] for c in _COLUMNS)


def from_row(r: Any) -> TurnRecord:
    """A `turns` row (sqlite3.Row or any name-indexed mapping) as a TurnRecord; also used by
    read-only readers outside the daemon (clawd/signal_datasets.py)."""
    return TurnRecord(
        id=r["id"],
        session_id=r["session_id"],
        turn_type=r["turn_type"],
        created_at=r["created_at"],
        request=json.loads(r["request_json"]),
        request_hash=r["request_hash"],
        continuation_hash=r["continuation_hash"],
        prompt_text=r["prompt_text"],
        prompt_ids=unpack_ids(r["prompt_ids"]),
        response_ids=unpack_ids(r["response_ids"]),
        response_logprobs=unpack_floats(r["response_logprobs"]),
        response_text=r["response_text"],
        finish_reason=r["finish_reason"],
        sampling=json.loads(r["sampling_json"]),
        engine=r["engine"],
        model=r["model"],
        adapter_id=r["adapter_id"],
        chat_format=r["chat_format"],
        timings=json.loads(r["timings_json"]),
        requery_of=r["requery_of"],
        client=r["client"],
        tool_calls=json.loads(r["tool_calls_json"] or "[]") if "tool_calls_json" in r.keys() else [],
        response_seen=_optional(r, "response_seen"),
        client_key=_optional(r, "client_key"),
        client_chat_id=_optional(r, "client_chat_id"),
        client_message_id=_optional(r, "client_message_id"),
    )


def _optional(r: Any, key: str) -> Any:
    """A column added by a later migration: absent from a reader's older copy of the database."""
    return r[key] if key in r.keys() else None


# --- writes -------------------------------------------------------------------------


async def ensure_session(db: Database, session_id: str, *, source: str, title: str | None = None) -> bool:
    """Create the session if missing, else touch its updated_at (and fill a missing title).

    Returns:
        True when the session was created now.
    """
    async with db.transaction():
        return await _ensure_session(db, session_id, source=source, title=title, now=time.time())


async def _ensure_session(db: Database, session_id: str, *, source: str, title: str | None, now: float) -> bool:
    if source not in SESSION_SOURCES:
        raise ValueError(f"session source must be one of {SESSION_SOURCES}, got {source!r}")
    async with db.conn.execute(
        "INSERT INTO sessions (id, created_at, updated_at, source, title) VALUES (?, ?, ?, ?, ?)"
        " ON CONFLICT (id) DO NOTHING",
        (session_id, now, now, source, title),
    ) as cur:
        if cur.rowcount == 1:
            return True
    await db.conn.execute(
        "UPDATE sessions SET updated_at = MAX(updated_at, ?), title = COALESCE(title, ?) WHERE id = ?",
        (now, title, session_id),
    )
    return False


async def mark_session_done(db: Database, session_id: str) -> bool:
    """Mark a session finished (its last turn will get no next state). False if unknown."""
    async with db.transaction():
        async with db.conn.execute(
            "UPDATE sessions SET done = 1, updated_at = MAX(updated_at, ?) WHERE id = ?",
            (time.time(), session_id),
        ) as cur:
            return cur.rowcount == 1


async def insert_turn(db: Database, rec: TurnRecord, *, source: str = "new", title: str | None = None) -> None:
    """Store one turn, creating its session (with `source`) if it does not exist yet.

    One transaction: the turn and its session are visible together, and both are on
    disk when this returns.

    Raises:
        ValueError: turn_type is not main/side, or ids and logprobs differ in length.
        sqlite3.IntegrityError: a turn with this id exists, or requery_of is unknown.
    """
    row = await asyncio.to_thread(_to_row, rec)  # packed outside the write lock, off the event loop
    async with db.transaction():
        await _ensure_session(db, rec.session_id, source=source, title=title, now=rec.created_at)
        await db.conn.execute(_INSERT, row)


# --- reads --------------------------------------------------------------------------


async def get_turn(db: Database, turn_id: str) -> TurnRecord | None:
    return await _one(db, f"{_SELECT} WHERE id = ?", (turn_id,))


async def list_turns(
    db: Database,
    *,
    session_id: str | None = None,
    limit: int = 100,
    before: float | None = None,
) -> list[TurnRecord]:
    """Turns newest first; `before` (a created_at timestamp, exclusive) pages back."""
    where, params = [], []
    if session_id is not None:
        where.append("session_id = ?")
        params.append(session_id)
    if before is not None:
        where.append("created_at < ?")
        params.append(before)
    sql = _SELECT + (f" WHERE {' AND '.join(where)}" if where else "") + f" {_NEWEST} LIMIT ?"
    rows = await db.conn.execute_fetchall(sql, (*params, limit))
    return [from_row(r) for r in rows]


async def list_sessions(db: Database, limit: int = 100) -> list[dict]:
    """Sessions most recently active first, with their turn counts."""
    rows = await db.conn.execute_fetchall(
        "SELECT s.id, s.created_at, s.updated_at, s.source, s.title, s.done,"
        " (SELECT COUNT(*) FROM turns t WHERE t.session_id = s.id) AS turn_count"
        " FROM sessions s ORDER BY s.updated_at DESC, s.rowid DESC LIMIT ?",
        (limit,),
    )
    return [
        {
            "id": r["id"],
            "created_at": r["created_at"],
            "updated_at": r["updated_at"],
            "source": r["source"],
            "title": r["title"],
            "turn_count": r["turn_count"],
            "done": bool(r["done"]),
        }
        for r in rows
    ]


async def count_turns(db: Database) -> int:
    rows = await db.conn.execute_fetchall("SELECT COUNT(*) FROM turns")
    return int(rows[0][0])


async def count_sessions(db: Database) -> int:
    rows = await db.conn.execute_fetchall("SELECT COUNT(*) FROM sessions")
    return int(rows[0][0])


async def find_by_continuation_hash(db: Database, h: str) -> TurnRecord | None:
    """Newest turn whose (request messages + response) hash is `h`: the turn a new
    request continues, for prefix session inference."""
    return await _one(db, f"{_SELECT} WHERE continuation_hash = ? {_NEWEST} LIMIT 1", (h,))


async def find_repeat(
    db: Database, h: str, *, since: float, session_id: str | None, client_key: str | None
) -> TurnRecord | None:
    """The newest turn since `since` whose request hash is `h`, in the same conversation: in
    session `session_id` when the client names one, else from the same client (`client_key`;
    NULL matches NULL, a turn recorded before clients were told apart) in a session it did not
    name either."""
    if session_id is not None:
        where, args = "session_id = ?", (session_id,)
    else:
        where = "client_key IS ? AND session_id IN (SELECT id FROM sessions WHERE source NOT IN ('header', 'body'))"
        args = (client_key,)
    return await _one(
        db, f"{_SELECT} WHERE request_hash = ? AND created_at >= ? AND {where} {_NEWEST} LIMIT 1", (h, since, *args)
    )


async def find_by_request_hash(db: Database, h: str) -> TurnRecord | None:
    """Newest turn whose request hash is `h`: an identical earlier request (regenerate)."""
    return await _one(db, f"{_SELECT} WHERE request_hash = ? {_NEWEST} LIMIT 1", (h,))


async def _one(db: Database, sql: str, params: tuple) -> TurnRecord | None:
    async with db.conn.execute(sql, params) as cur:
        row = await cur.fetchone()
    return from_row(row) if row is not None else None


async def delete_session(db: Database, session_id: str) -> list[str]:
    """Delete a session with its turns (and, by cascade, their feedback and signals).

    Returns:
        The ids of the deleted turns (empty when the session is unknown).
    """
    async with db.transaction():
        rows = await db.conn.execute_fetchall("SELECT id FROM turns WHERE session_id = ?", (session_id,))
        await db.conn.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
    return [r[0] for r in rows]


async def _adjacent_main_turn(db: Database, turn: TurnRecord, *, after: bool) -> TurnRecord | None:
    """The session's nearest main turn after (or before) `turn`, in recording order."""
    cmp, order = (">", "") if after else ("<", " DESC")
    return await _one(
        db,
        "SELECT * FROM turns WHERE session_id = ? AND turn_type = 'main' AND id != ?"
        f" AND (created_at {cmp} ? OR (created_at = ? AND rowid {cmp} (SELECT rowid FROM turns WHERE id = ?)))"
        f" ORDER BY created_at{order}, rowid{order} LIMIT 1",
        (turn.session_id, turn.id, turn.created_at, turn.created_at, turn.id),
    )


async def next_main_turn(db: Database, turn: TurnRecord) -> TurnRecord | None:
    """The session's first main turn after `turn`: its request carries `turn`'s next state."""
    return await _adjacent_main_turn(db, turn, after=True)


async def previous_main_turn(db: Database, turn: TurnRecord) -> TurnRecord | None:
    """The session's last main turn before `turn` (the turn whose next state `turn` carries)."""
    return await _adjacent_main_turn(db, turn, after=False)


async def find_requery_of(db: Database, turn_id: str) -> TurnRecord | None:
    """The newest turn that regenerates `turn_id`, if any."""
    return await _one(db, f"SELECT * FROM turns WHERE requery_of = ? {_NEWEST} LIMIT 1", (turn_id,))


async def session_done(db: Database, session_id: str) -> bool:
    rows = await db.conn.execute_fetchall("SELECT done FROM sessions WHERE id = ?", (session_id,))
    return bool(rows and rows[0][0])


async def main_turn_ids_by_client_message(db: Database, message_id: str) -> list[str]:
    """Main turns that answered the chat UI's message `message_id`, newest first (several only
    when the UI sent the same id again, e.g. its Continue button)."""
    rows = await db.conn.execute_fetchall(
        f"SELECT id FROM turns WHERE client_message_id = ? AND turn_type = 'main' {_NEWEST}", (message_id,)
    )
    return [r[0] for r in rows]


async def main_turn_ids_by_response_text(db: Database, text: str, *, limit: int = 50) -> list[tuple[str, str | None]]:
    """(turn id, client_chat_id) of the main turns that answered exactly `text` (whitespace
    around it aside), newest first: the candidates for a rating that names no known message."""
    rows = await db.conn.execute_fetchall(
        f"SELECT id, client_chat_id FROM turns WHERE trim(response_text, char(32, 9, 10, 13)) = ? AND turn_type = 'main' {_NEWEST} LIMIT ?",
        (text, limit),
    )
    return [(r[0], r[1]) for r in rows]
