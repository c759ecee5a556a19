"""Apply Open WebUI ratings to clawd's feedback, and keep them in step with Open WebUI.

A rating with Open WebUI's id replaces whatever that id put on clawd before (a 👎 changed to
👍 loses its thumb and its hint together) and is remembered with its updated_at, so the
connector skips it until it changes again, and deletes its rows when it disappears from Open
WebUI. A rating without an id (an old-style POST) just adds its rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from clawd.errors import InvalidRequest
from clawd.openwebui.matcher import find_turn
from clawd.openwebui.ratings import OpenWebUIFeedback, Rating, rating_from
from clawd.store import feedback as feedback_rows
from clawd.store.db import Database

SOURCE = "openwebui"
Reopen = Callable[[str], Awaitable[None]]  # the miner's on_feedback: judge this turn again


@dataclass
class Applied:
    external_id: str | None
    outcome: str  # attached | unchanged | not_found | ambiguous | invalid | removed
    turn_id: str | None = None
    how: str = ""  # message_id | text
    detail: str | None = None
    rows: list[feedback_rows.Feedback] = field(default_factory=list)
    no_text: bool = False  # unmatched, and the rating carried no snapshot text to match by

    def public(self) -> dict:
        return {
            "id": self.external_id,
            "outcome": self.outcome,
            "turn_id": self.turn_id,
            "matched_by": self.how or None,
            "detail": self.detail,
            "recorded": [{"id": f.id, "kind": f.kind, "text": f.text} for f in self.rows],
        }


async def apply(db: Database, payload: OpenWebUIFeedback, *, reopen: Reopen | None = None) -> Applied:
    """Attach one rating (InvalidRequest when it is no thumb). Ratings that attach nowhere are
    remembered too (with the reason) when they have an id, and change nothing else."""
    rating = rating_from(payload)
    ext = rating.external_id
    digest = _digest(rating)
    if ext is not None:
        seen = await feedback_rows.external_state(db, SOURCE, ext)
        if seen is not None and seen.digest == digest and seen.outcome == "attached":
            return Applied(ext, "unchanged", seen.turn_id, detail=seen.detail)
    match = await find_turn(db, rating)
    rows = []
    if match.turn_id:
        rows = [feedback_rows.NewRow(rating.kind)]
        if rating.hint:
            rows.append(feedback_rows.NewRow("correction", rating.hint))
    raw = payload.model_dump(mode="json", exclude_unset=True)
    if ext is not None:
        added, changed = await feedback_rows.replace_external(
            db,
            SOURCE,
            ext,
            updated_at=rating.updated_at,
            digest=digest,
            turn_id=match.turn_id,
            rows=rows,
            outcome=match.outcome,
            detail=match.detail,
            raw=raw,
        )
    else:
        added = [await feedback_rows.add(db, match.turn_id, r.kind, text=r.text, source=SOURCE, raw=raw) for r in rows]
        changed = {match.turn_id} if rows else set()
    await _reopen(reopen, changed)
    no_text = match.turn_id is None and not rating.text
    return Applied(ext, match.outcome, match.turn_id, match.how, match.detail, added, no_text)


async def apply_record(db: Database, record: Any, *, reopen: Reopen | None = None) -> Applied:
    """One record of an export file or of the API, whatever it holds: a record that is not a
    rating clawd can read is reported `invalid`, and the rest still apply."""
    ext = record.get("id") if isinstance(record, dict) and isinstance(record.get("id"), str) else None
    if isinstance(record, dict) and record.get("type", "rating") != "rating":
        return Applied(ext, "invalid", detail=f"type {str(record.get('type'))[:40]!r} is not a rating")
    try:
        return await apply(db, OpenWebUIFeedback.model_validate(record), reopen=reopen)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        return Applied(ext, "invalid", detail=f"{where}: {err.get('msg')}" if where else err.get("msg"))
    except InvalidRequest as e:
        return Applied(ext, "invalid", detail=e.message)


async def remove(db: Database, external_id: str, *, reopen: Reopen | None = None) -> Applied:
    """The rating was deleted in Open WebUI: so are its thumb and hint here."""
    changed = await feedback_rows.remove_external(db, SOURCE, external_id)
    await _reopen(reopen, changed)
    return Applied(external_id, "removed", next(iter(changed), None))


def _digest(rating: Rating) -> str:
    """What clawd reads from a rating: the same digest means nothing to do. (Open WebUI's
    updated_at counts whole seconds, so it alone misses a change made within the second.)"""
    fields = dataclasses.asdict(rating)
    fields.pop("updated_at")
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


async def _reopen(reopen: Reopen | None, turn_ids: set[str]) -> None:
    if reopen is not None:
        for turn_id in sorted(turn_ids):
            await reopen(turn_id)
