"""Explicit feedback from clients -> feedback rows.

Accepts clawd's own shape ({"turn_id", "rating": "up"|"down"} or {"turn_id",
"correction": "..."}) and Open WebUI's rating payload (CONVENTIONS.md §2), whose ids are
Open WebUI's own: such a rating is matched to a clawd turn by the rated message's text.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from clawd.errors import InvalidRequest, NotFound
from clawd.store import feedback as feedback_rows
from clawd.store import turns
from clawd.store.db import Database


class FeedbackRequest(BaseModel):
    """POST /clawd/feedback: a thumb, a correction, or both."""

    model_config = ConfigDict(extra="forbid")
    turn_id: str
    rating: str | int | None = Field(None, description="up / down (or 1 / -1)")
    correction: str | None = Field(None, description="what the answer should have been, in the user's words")
    source: str = "api"

    @model_validator(mode="after")
    def _something(self):
        if self.rating is None and not (self.correction or "").strip():
            raise ValueError("send a rating (up/down) or a correction")
        return self


def _kind(rating) -> str:
    value = str(rating).strip().lower()
    if value in ("up", "1", "+1", "good", "thumbs_up"):
        return "up"
    if value in ("down", "-1", "bad", "thumbs_down"):
        return "down"
    raise InvalidRequest(f"rating must be up or down (or 1 / -1), got {rating!r}", param="rating")


async def record(db: Database, req: FeedbackRequest, raw: Any = None) -> list[feedback_rows.Feedback]:
    if await turns.get_turn(db, req.turn_id) is None:
        raise NotFound(f"No turn {req.turn_id!r}: turn ids come from the X-Clawd-Turn-Id header.")
    out = []
    if req.rating is not None:
        out.append(await feedback_rows.add(db, req.turn_id, _kind(req.rating), source=req.source, raw=raw))
    if (req.correction or "").strip():
        out.append(
            await feedback_rows.add(
                db, req.turn_id, "correction", text=req.correction.strip(), source=req.source, raw=raw
            )
        )
    return out


def _openwebui_message_text(payload: dict) -> str | None:
    """The rated assistant message's text from an Open WebUI snapshot, if present."""
    meta = payload.get("meta") or {}
    chat = (payload.get("snapshot") or {}).get("chat") or {}
    chat = chat.get("chat", chat)  # exports nest the chat one level deeper
    wanted = meta.get("message_id")
    candidates = list((chat.get("history") or {}).get("messages", {}).values()) + list(chat.get("messages") or [])
    for m in candidates:
        if isinstance(m, dict) and m.get("id") == wanted and m.get("role") == "assistant":
            return str(m.get("content") or "")
    return None


async def from_openwebui(db: Database, payload: dict) -> FeedbackRequest:
    """Open WebUI `{"type": "rating", "data": {"rating": 1|-1, "comment"...}, "meta",
    "snapshot"}` -> a FeedbackRequest on the clawd turn whose response is that text."""
    data = payload.get("data") or {}
    if payload.get("type", "rating") != "rating" or "rating" not in data:
        raise InvalidRequest("an Open WebUI feedback payload needs type 'rating' and data.rating", param="data")
    text = _openwebui_message_text(payload)
    if not text:
        raise InvalidRequest(
            "cannot find the rated message: the payload needs snapshot.chat with the message named by meta.message_id",
            param="snapshot",
        )
    turn = await turns.find_by_response_text(db, text.strip())
    if turn is None:
        raise NotFound("no clawd turn has the rated message's text; was it answered by this daemon?")
    comment = " ".join(str(data.get(k) or "").strip() for k in ("reason", "comment")).strip()
    kind = _kind(data["rating"])
    return FeedbackRequest(
        turn_id=turn.id, rating=kind, correction=comment if (comment and kind == "down") else None, source="openwebui"
    )
