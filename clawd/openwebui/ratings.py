"""Open WebUI's feedback record -> a Rating clawd can attach.

One shape arrives three ways: its API (/api/v1/evaluations/feedback/{id}, pulled by
connector.py), its export file (a JSON array of them, `clawd import openwebui FILE`) and
POST /clawd/feedback (CONVENTIONS.md §2):

    {"id", "type": "rating", "data": {"rating": 1|-1, "reason", "comment", "model_id", ...},
     "meta": {"chat_id", "message_id", "message_index", ...}, "snapshot": {"chat": {...}},
     "created_at", "updated_at"}              (open_webui/models/feedbacks.py FeedbackModel)

Only the fields clawd reads are typed; everything else is kept (extra="allow") and stored
raw. A field clawd reads that has the wrong shape is the client's 400, never a crash.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from clawd.errors import InvalidRequest


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class OpenWebUIRating(_Loose):
    rating: int | str = Field(description="1 / -1 (or up / down)")
    reason: str | None = None
    comment: str | None = None


class OpenWebUIMeta(_Loose):
    message_id: str | None = Field(None, description="the rated assistant message's id (X-OpenWebUI-Message-Id)")
    chat_id: str | None = Field(None, description="the chat's id (X-OpenWebUI-Chat-Id)")


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
    {"chat_id", "message_id"}, "snapshot": {"chat": ...}}` (CONVENTIONS.md §2); `id` and
    `updated_at` when it comes from Open WebUI's API or export."""

    id: str | None = Field(None, max_length=128, description="Open WebUI's id of this rating")
    updated_at: float | None = Field(None, description="when it was last changed in Open WebUI (epoch seconds)")
    type: str = "rating"
    data: OpenWebUIRating
    meta: OpenWebUIMeta | None = None
    snapshot: OpenWebUISnapshot | None = None


@dataclass(frozen=True)
class Rating:
    """One Open WebUI rating, as clawd uses it."""

    external_id: str | None  # Open WebUI's id: a later change or removal of it is applied here
    updated_at: float | None
    chat_id: str | None
    message_id: str | None
    text: str | None  # the rated message's text from the snapshot, for the fallback match
    kind: str  # up | down
    hint: str | None  # a thumbs down's reason and comment: what the answer should have done


def kind_of(rating: Any) -> str:
    value = str(rating).strip().lower()
    if value in ("up", "1", "+1", "good", "thumbs_up"):
        return "up"
    if value in ("down", "-1", "bad", "thumbs_down"):
        return "down"
    raise InvalidRequest(f"rating must be up or down (or 1 / -1), got {rating!r}", param="rating")


def rating_from(payload: OpenWebUIFeedback) -> Rating:
    """Raises InvalidRequest (400) when it is no thumb."""
    if payload.type != "rating":
        raise InvalidRequest("an Open WebUI feedback payload needs type 'rating' and data.rating", param="type")
    kind = kind_of(payload.data.rating)
    meta = payload.meta or OpenWebUIMeta()
    chat = _chat(payload)
    outer = payload.snapshot.chat if payload.snapshot else None
    snapshot_id = (outer.model_extra or {}).get("id") if outer is not None else None
    words = " ".join((t or "").strip() for t in (payload.data.reason, payload.data.comment)).strip()
    return Rating(
        external_id=payload.id,
        updated_at=payload.updated_at,
        chat_id=meta.chat_id or (snapshot_id if isinstance(snapshot_id, str) else None),
        message_id=meta.message_id,
        text=_message_text(chat, meta.message_id),
        kind=kind,
        # A thumbs up's comment is praise, not an instruction: only a thumbs down gets a hint.
        hint=words if (words and kind == "down") else None,
    )


def _chat(payload: OpenWebUIFeedback) -> OpenWebUIChat | None:
    chat = payload.snapshot.chat if payload.snapshot else None
    return (chat.chat or chat) if chat is not None else None


def _message_text(chat: OpenWebUIChat | None, wanted: str | None) -> str | None:
    """The rated assistant message's text from the snapshot, if present."""
    if chat is None or wanted is None:
        return None
    history = list(chat.history.messages.values()) if chat.history else []
    for m in history + list(chat.messages or []):
        if isinstance(m, dict) and m.get("id") == wanted and m.get("role") == "assistant":
            content = m.get("content")
            return content.strip() or None if isinstance(content, str) else None
    return None
