"""An Open WebUI rating -> the one clawd turn it rates, or why there is none.

1. By message id: the turn whose request carried X-OpenWebUI-Message-Id equal to the rating's
   meta.message_id (origin.py). Exact, whatever the text.
2. Else by the rated message's text (the snapshot's copy), and only when that names one turn:
   among the turns of the rating's chat (X-OpenWebUI-Chat-Id) when any has that text, else
   among all. Two chats that got the same answer leave the rating unattached (`ambiguous`)
   rather than guessed: a guess would teach the other chat's answer the wrong lesson.

Only main turns are candidates: Open WebUI's task requests carry the chat's message id too,
and they are side turns (never rated).
"""

from __future__ import annotations

from dataclasses import dataclass

from clawd.openwebui.ratings import Rating
from clawd.store import turns
from clawd.store.db import Database


@dataclass(frozen=True)
class Match:
    turn_id: str | None
    outcome: str  # attached | not_found | ambiguous
    how: str  # message_id | text | ""
    detail: str | None = None


async def find_turn(db: Database, rating: Rating) -> Match:
    if rating.message_id:
        ids = await turns.main_turn_ids_by_client_message(db, rating.message_id)
        if ids:
            return Match(ids[0], "attached", "message_id")  # newest: a Continue re-sends the id
    if not rating.text:
        return Match(
            None,
            "not_found",
            "",
            "no clawd turn has this message id, and the rating has no snapshot text to match"
            if rating.message_id
            else "the rating names no message: it needs meta.message_id (and snapshot.chat)",
        )
    found = await turns.main_turn_ids_by_response_text(db, rating.text.strip())
    if rating.chat_id:
        same_chat = [t for t in found if t[1] == rating.chat_id]
        found = same_chat or [t for t in found if t[1] is None]  # another known chat's turn is not this one
    if not found:
        return Match(None, "not_found", "", "no clawd turn answered the rated message's text")
    if len({t for t, _ in found}) > 1:
        return Match(
            None,
            "ambiguous",
            "",
            f"{len(found)} clawd turns answered exactly the rated text and the rating names none of them by id; "
            "send X-OpenWebUI-Message-Id from Open WebUI (README: Use clawd with Open WebUI)",
        )
    return Match(found[0][0], "attached", "text")
