"""Explicit feedback rows: thumbs and corrections on a turn.

Boundary: the ONLY module that writes the `feedback` table. Parsing the payloads that
clients send (clawd's own, Open WebUI's) is clawd/feedback.py's job.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from clawd.store.db import Database

KINDS = ("up", "down", "correction")


@dataclass(frozen=True)
class Feedback:
    id: int
    turn_id: str
    kind: str  # up | down | correction
    text: str | None
    source: str
    created_at: float


async def add(
    db: Database, turn_id: str, kind: str, *, text: str | None = None, source: str = "api", raw: object = None
) -> Feedback:
    if kind not in KINDS:
        raise ValueError(f"feedback kind must be one of {KINDS}, got {kind!r}")
    now = time.time()
    async with db.transaction():
        cur = await db.conn.execute(
            "INSERT INTO feedback (turn_id, kind, text, source, created_at, raw_json) VALUES (?, ?, ?, ?, ?, ?)",
            (turn_id, kind, text, source, now, json.dumps(raw) if raw is not None else None),
        )
        fid = cur.lastrowid
    return Feedback(fid, turn_id, kind, text, source, now)


async def for_turn(db: Database, turn_id: str) -> list[Feedback]:
    """Oldest first, so the newest thumb is the last one."""
    rows = await db.conn.execute_fetchall(
        "SELECT id, turn_id, kind, text, source, created_at FROM feedback WHERE turn_id = ? ORDER BY id", (turn_id,)
    )
    return [Feedback(*tuple(r)) for r in rows]


# ---- ratings made in another UI (Open WebUI), kept in step with it ------------------------------


@dataclass(frozen=True)
class ExternalState:
    """What clawd last did with one rating from another UI (`external_feedback`)."""

    external_id: str
    updated_at: float | None
    digest: str | None
    turn_id: str | None
    outcome: str  # attached | not_found | ambiguous | invalid
    detail: str | None


OUTCOMES = ("attached", "not_found", "ambiguous", "invalid")


@dataclass(frozen=True)
class NewRow:
    kind: str
    text: str | None = None


async def external_state(db: Database, source: str, external_id: str) -> ExternalState | None:
    rows = await db.conn.execute_fetchall(
        "SELECT external_id, updated_at, digest, turn_id, outcome, detail FROM external_feedback"
        " WHERE source = ? AND external_id = ?",
        (source, external_id),
    )
    return ExternalState(*tuple(rows[0])) if rows else None


async def external_states(db: Database, source: str) -> dict[str, ExternalState]:
    rows = await db.conn.execute_fetchall(
        "SELECT external_id, updated_at, digest, turn_id, outcome, detail FROM external_feedback WHERE source = ?",
        (source,),
    )
    return {r[0]: ExternalState(*tuple(r)) for r in rows}


async def replace_external(
    db: Database,
    source: str,
    external_id: str,
    *,
    updated_at: float | None,
    digest: str | None,
    turn_id: str | None,
    rows: list[NewRow],
    outcome: str,
    detail: str | None = None,
    raw: object = None,
) -> tuple[list[Feedback], set[str]]:
    """Make the feedback rows of one external rating exactly `rows` on `turn_id` (none when it
    did not attach, or was cleared), and remember `outcome`. One transaction: the old thumb and
    hint never coexist with the new ones. Returns the turns whose feedback changed (the old
    turn too, when the rating moved), which the miner must judge again."""
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
    if rows and turn_id is None:
        raise ValueError("feedback rows need a turn")
    for r in rows:
        if r.kind not in KINDS:
            raise ValueError(f"feedback kind must be one of {KINDS}, got {r.kind!r}")
    now = time.time()
    raw_json = json.dumps(raw) if raw is not None else None
    added: list[Feedback] = []
    async with db.transaction():
        old = await db.conn.execute_fetchall(
            "SELECT DISTINCT turn_id FROM feedback WHERE source = ? AND external_id = ?", (source, external_id)
        )
        await db.conn.execute("DELETE FROM feedback WHERE source = ? AND external_id = ?", (source, external_id))
        for r in rows:
            cur = await db.conn.execute(
                "INSERT INTO feedback (turn_id, kind, text, source, created_at, raw_json, external_id)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (turn_id, r.kind, r.text, source, now, raw_json, external_id),
            )
            added.append(Feedback(cur.lastrowid, turn_id, r.kind, r.text, source, now))
        await db.conn.execute(
            "INSERT INTO external_feedback (source, external_id, updated_at, digest, turn_id, outcome, detail, seen_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (source, external_id) DO UPDATE SET"
            " updated_at = excluded.updated_at, digest = excluded.digest, turn_id = excluded.turn_id,"
            " outcome = excluded.outcome, detail = excluded.detail, seen_at = excluded.seen_at",
            (source, external_id, updated_at, digest, turn_id, outcome, detail, now),
        )
    return added, {r[0] for r in old} | ({turn_id} if rows else set())


async def remove_external(db: Database, source: str, external_id: str) -> set[str]:
    """The rating was deleted in its UI: delete its rows and its record. Returns the turns
    whose feedback changed."""
    async with db.transaction():
        old = await db.conn.execute_fetchall(
            "SELECT DISTINCT turn_id FROM feedback WHERE source = ? AND external_id = ?", (source, external_id)
        )
        await db.conn.execute("DELETE FROM feedback WHERE source = ? AND external_id = ?", (source, external_id))
        await db.conn.execute(
            "DELETE FROM external_feedback WHERE source = ? AND external_id = ?", (source, external_id)
        )
    return {r[0] for r in old}


async def mark_pulled(db: Database, source: str, external_ids: list[str], scope: str) -> None:
    """These ratings were in the listing of `scope` (a url and a key's reach)."""
    async with db.transaction():
        await db.conn.executemany(
            "UPDATE external_feedback SET pulled_from = ? WHERE source = ? AND external_id = ?",
            [(scope, source, i) for i in external_ids],
        )


async def pulled_ids(db: Database, source: str, scope: str) -> set[str]:
    rows = await db.conn.execute_fetchall(
        "SELECT external_id FROM external_feedback WHERE source = ? AND pulled_from = ?", (source, scope)
    )
    return {r[0] for r in rows}


async def external_counts(db: Database, source: str) -> dict[str, int]:
    rows = await db.conn.execute_fetchall(
        "SELECT outcome, COUNT(*) FROM external_feedback WHERE source = ? GROUP BY outcome", (source,)
    )
    return {r[0]: r[1] for r in rows}
