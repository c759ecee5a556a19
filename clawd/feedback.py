"""Explicit feedback from clients -> feedback rows.

Accepts clawd's own shape ({"turn_id", "rating": "up"|"down"} or {"turn_id",
"correction": "..."}), Open WebUI's rating payload (CONVENTIONS.md §2) and a JSON array of
them (Open WebUI's export file). Open WebUI's ids are its own: clawd/openwebui/ matches such a
rating to the turn that carried its message id, or by text when that names one turn only.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from clawd.errors import Conflict, InvalidRequest, NotFound
from clawd.openwebui import ingest
from clawd.openwebui.ratings import OpenWebUIFeedback, kind_of
from clawd.store import feedback as feedback_rows
from clawd.store import turns
from clawd.store.db import Database


class FeedbackRequest(BaseModel):
    """POST /clawd/feedback: a thumb, a correction, or both."""

    model_config = ConfigDict(extra="forbid")
    turn_id: str = Field(max_length=128, description="the X-Clawd-Turn-Id of the rated answer")
    rating: str | int | None = Field(None, description="up / down (or 1 / -1)")
    correction: str | None = Field(None, description="what the answer should have been, in the user's words")
    source: str = Field("api", max_length=64)

    @model_validator(mode="after")
    def _something(self):
        if self.rating is None and not (self.correction or "").strip():
            raise ValueError("send a rating (up/down) or a correction")
        return self


async def record(db: Database, req: FeedbackRequest, raw: Any = None) -> list[feedback_rows.Feedback]:
    if await turns.get_turn(db, req.turn_id) is None:
        raise NotFound(f"No turn {req.turn_id!r}: turn ids come from the X-Clawd-Turn-Id header.")
    out = []
    if req.rating is not None:
        out.append(await feedback_rows.add(db, req.turn_id, kind_of(req.rating), source=req.source, raw=raw))
    if (req.correction or "").strip():
        out.append(
            await feedback_rows.add(
                db, req.turn_id, "correction", text=req.correction.strip(), source=req.source, raw=raw
            )
        )
    return out


# ---- Open WebUI's rating payload (clawd/openwebui/) ----------------------------------------------


def _body_kind(body: Any) -> str:
    if isinstance(body, list):
        return "export"
    return "clawd" if isinstance(body, dict) and "turn_id" in body else "openwebui"


# POST /clawd/feedback's body: clawd's own shape when it names a turn_id, Open WebUI's rating,
# or a JSON array of Open WebUI's records (its export file: each applied on its own).
FeedbackBody = Annotated[
    Annotated[FeedbackRequest, Tag("clawd")]
    | Annotated[OpenWebUIFeedback, Tag("openwebui")]
    | Annotated[list[dict[str, Any]], Tag("export")],
    Discriminator(_body_kind),
]
BODY_TAGS = ("clawd", "openwebui", "export")  # the tags pydantic puts in a validation error's location


class AmbiguousMatch(Conflict):
    code = "ambiguous_match"


async def from_openwebui(db: Database, payload: OpenWebUIFeedback, reopen: ingest.Reopen | None) -> ingest.Applied:
    """Attach one Open WebUI rating to its turn, or say why not (404 / 409 / 400)."""
    applied = await ingest.apply(db, payload, reopen=reopen)
    if applied.outcome in ("attached", "unchanged"):
        return applied
    if applied.outcome == "ambiguous":
        raise AmbiguousMatch(applied.detail or "more than one turn matches", param="meta.message_id")
    if applied.no_text:
        raise InvalidRequest(
            "cannot find the rated message: the payload needs snapshot.chat with the message named by "
            "meta.message_id (or that message id sent to clawd as X-OpenWebUI-Message-Id)",
            param="snapshot",
        )
    raise NotFound(f"{applied.detail}; was it answered by this daemon?")


async def import_openwebui(db: Database, records: list[dict[str, Any]], reopen: ingest.Reopen | None) -> dict:
    """Open WebUI's export file: every record applied on its own, each outcome reported."""
    results = [await ingest.apply_record(db, r, reopen=reopen) for r in records]
    counts: dict[str, int] = {}
    for a in results:
        counts[a.outcome] = counts.get(a.outcome, 0) + 1
    return {"counts": counts, "results": [a.public() for a in results]}
