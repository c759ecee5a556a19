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
