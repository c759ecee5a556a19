"""Explicit feedback from clients -> feedback rows.

Accepts clawd's own shape ({"turn_id", "rating": "up"|"down"} or {"turn_id",
"correction": "..."}) and Open WebUI's rating payload (CONVENTIONS.md §2), whose ids are
Open WebUI's own: such a rating is matched to a clawd turn by the rated message's text.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from clawd.errors import InvalidRequest, NotFound
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


# ---- Open WebUI's rating payload -------------------------------------------------------------
# Only the fields clawd reads are typed; everything else Open WebUI sends is kept (extra="allow")
# and stored raw. A field clawd reads that has the wrong shape (a string where an object
# belongs) is the client's 400, never a crash.


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class OpenWebUIRating(_Loose):
    rating: int | str = Field(description="1 / -1 (or up / down)")
    reason: str | None = None
    comment: str | None = None


class OpenWebUIMeta(_Loose):
    message_id: str | None = Field(None, description="the rated assistant message's id in the snapshot")


class OpenWebUIHistory(_Loose):
    messages: dict[str, Any] = {}


class OpenWebUIChat(_Loose):
    history: OpenWebUIHistory | None = None
    messages: list[Any] | None = None
    chat: OpenWebUIChat | None = None  # exports nest the chat one level deeper


class OpenWebUISnapshot(_Loose):
    chat: OpenWebUIChat | None = None


class OpenWebUIFeedback(_Loose):
    """Open WebUI's `{"type": "rating", "data": {"rating": 1|-1, "reason", "comment"}, "meta":
    {"message_id"}, "snapshot": {"chat": ...}}` (CONVENTIONS.md §2)."""

    type: str = "rating"
    data: OpenWebUIRating
    meta: OpenWebUIMeta | None = None
    snapshot: OpenWebUISnapshot | None = None


def _body_kind(body: Any) -> str:
    return "clawd" if isinstance(body, dict) and "turn_id" in body else "openwebui"


# POST /clawd/feedback's body: clawd's own shape when it names a turn_id, else Open WebUI's.
FeedbackBody = Annotated[
    Annotated[FeedbackRequest, Tag("clawd")] | Annotated[OpenWebUIFeedback, Tag("openwebui")],
    Discriminator(_body_kind),
]
BODY_TAGS = ("clawd", "openwebui")  # the tags pydantic puts in a validation error's location


def _openwebui_message_text(payload: OpenWebUIFeedback) -> str | None:
    """The rated assistant message's text from an Open WebUI snapshot, if present."""
    wanted = payload.meta.message_id if payload.meta else None
    chat = payload.snapshot.chat if payload.snapshot else None
    if chat is None or wanted is None:
        return None
    chat = chat.chat or chat
    history = list(chat.history.messages.values()) if chat.history else []
    for m in history + list(chat.messages or []):
        if isinstance(m, dict) and m.get("id") == wanted and m.get("role") == "assistant":
            content = m.get("content")
            return content if isinstance(content, str) else None
    return None


async def from_openwebui(db: Database, payload: OpenWebUIFeedback) -> FeedbackRequest:
    """An Open WebUI rating -> a FeedbackRequest on the clawd turn whose response is the rated text."""
    if payload.type != "rating":
        raise InvalidRequest("an Open WebUI feedback payload needs type 'rating' and data.rating", param="type")
    text = _openwebui_message_text(payload)
    if not text:
        raise InvalidRequest(
            "cannot find the rated message: the payload needs snapshot.chat with the message named by meta.message_id",
            param="snapshot",
        )
    turn = await turns.find_by_response_text(db, text.strip())
    if turn is None:
        raise NotFound("no clawd turn has the rated message's text; was it answered by this daemon?")
    data = payload.data
    comment = " ".join((t or "").strip() for t in (data.reason, data.comment)).strip()
    kind = _kind(data.rating)
    return FeedbackRequest(
        turn_id=turn.id, rating=kind, correction=comment if (comment and kind == "down") else None, source="openwebui"
    )
