"""Adapter registry rows.

Boundary: the ONLY module that writes the `adapters` table. What may be promoted, and the
engine side of a swap, is clawd/adapters.py's job; this module keeps the invariant that
at most one adapter is active and that every status change is one transaction.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from clawd.store.db import Database

STATUSES = ("candidate", "active", "retired", "rejected")


@dataclass
class AdapterRecord:
    id: str
    path: str
    model: str
    status: str = "candidate"
    parent_id: str | None = None
    previous_id: str | None = None
    signals: list[str] = field(default_factory=list)
    holdout: list[str] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    gate: dict = field(default_factory=dict)
    note: str | None = None
    forgotten: bool = False
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)

    def public(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _from_row(r) -> AdapterRecord:
    return AdapterRecord(
        id=r["id"],
        path=r["path"],
        model=r["model"],
        status=r["status"],
        parent_id=r["parent_id"],
        previous_id=r["previous_id"],
        signals=json.loads(r["signals_json"]),
        holdout=json.loads(r["holdout_json"]),
        metrics=json.loads(r["metrics_json"]),
        gate=json.loads(r["gate_json"]),
        note=r["note"],
        forgotten=bool(r["forgotten"]),
        created_at=r["created_at"],
        updated_at=r["updated_at"],
    )


async def insert(db: Database, rec: AdapterRecord) -> None:
    """Register a finished adapter (as candidate, or rejected by its gate)."""
    if rec.status not in ("candidate", "rejected"):
        raise ValueError("a new adapter is a candidate or rejected; activate it with activate()")
    async with db.transaction():
        await db.conn.execute(
            "INSERT INTO adapters (id, parent_id, previous_id, created_at, updated_at, status, path, model,"
            " signals_json, holdout_json, metrics_json, gate_json, note, forgotten)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                rec.id,
                rec.parent_id,
                rec.previous_id,
                rec.created_at,
                rec.updated_at,
                rec.status,
                rec.path,
                rec.model,
                json.dumps(rec.signals),
                json.dumps(rec.holdout),
                json.dumps(rec.metrics),
                json.dumps(rec.gate),
                rec.note,
                int(rec.forgotten),
            ),
        )


async def get(db: Database, adapter_id: str) -> AdapterRecord | None:
    rows = await db.conn.execute_fetchall("SELECT * FROM adapters WHERE id = ?", (adapter_id,))
    return _from_row(rows[0]) if rows else None


async def active(db: Database) -> AdapterRecord | None:
    rows = await db.conn.execute_fetchall("SELECT * FROM adapters WHERE status = 'active'")
    return _from_row(rows[0]) if rows else None


async def list_all(db: Database, *, model: str | None = None) -> list[AdapterRecord]:
    sql, args = "SELECT * FROM adapters", ()
    if model is not None:
        sql, args = sql + " WHERE model = ?", (model,)
    rows = await db.conn.execute_fetchall(sql + " ORDER BY created_at DESC, rowid DESC", args)
    return [_from_row(r) for r in rows]


async def activate(db: Database, adapter_id: str | None, *, previous_id: str | None, note: str | None = None) -> None:
    """Make `adapter_id` the active adapter (None = the base model), in one transaction.

    The adapter that was active becomes 'retired' (kept on disk, re-activatable) with `note`;
    `previous_id` is recorded on the new one as its rollback target.
    """
    now = time.time()
    async with db.transaction():
        await db.conn.execute(
            "UPDATE adapters SET status = 'retired', note = COALESCE(?, note), updated_at = ? WHERE status = 'active'",
            (note, now),
        )
        if adapter_id is not None:
            cur = await db.conn.execute(
                "UPDATE adapters SET status = 'active', previous_id = ?, note = NULL, updated_at = ? WHERE id = ?",
                (previous_id, now, adapter_id),
            )
            if cur.rowcount != 1:
                raise KeyError(adapter_id)


async def set_status(db: Database, adapter_id: str, status: str, note: str | None = None) -> None:
    if status not in STATUSES or status == "active":
        raise ValueError(f"use activate() to activate; status must be one of {STATUSES}")
    async with db.transaction():
        await db.conn.execute(
            "UPDATE adapters SET status = ?, note = ?, updated_at = ? WHERE id = ?",
            (status, note, time.time(), adapter_id),
        )


async def set_gate(db: Database, adapter_id: str, gate: dict) -> None:
    async with db.transaction():
        await db.conn.execute(
            "UPDATE adapters SET gate_json = ?, updated_at = ? WHERE id = ?",
            (json.dumps(gate), time.time(), adapter_id),
        )


async def mark_forgotten(db: Database, adapter_ids: list[str], note: str) -> None:
    """Retire adapters trained (directly or through a parent) on forgotten turns, for good."""
    async with db.transaction():
        await db.conn.executemany(
            "UPDATE adapters SET status = 'retired', forgotten = 1, note = ?, updated_at = ? WHERE id = ?",
            [(note, time.time(), a) for a in adapter_ids],
        )


async def trained_turns(db: Database) -> set[str]:
    """Turn ids already used by an adapter that was not rejected (rejected runs free theirs)."""
    rows = await db.conn.execute_fetchall(
        "SELECT signals_json FROM adapters WHERE status != 'rejected' AND forgotten = 0"
    )
    return {t for r in rows for t in json.loads(r[0])}
