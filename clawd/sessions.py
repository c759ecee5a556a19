"""Which conversation a request belongs to, and whether it re-asks an earlier turn.

Clients may say (X-Session-Id / X-Turn-Type headers, or session_id / turn_type body
fields; the header wins). Most don't, so clawd infers: a request whose messages extend
an earlier request's messages plus that turn's response continues that turn's session;
a request whose messages equal an earlier request's is a regenerate of that turn, but only
within one conversation: the same session when the client names one, else the same client
(client_key: token, User-Agent, address) without one. An identical request from another
client or session is someone asking the same thing, and says nothing about the earlier
answer. A repeat soon after a turn that failed or was cut off is a retry, not a regenerate.
Turns default to `main` (trainable): the reference system defaulted to `side` and so
silently trained nothing for header-less clients (METHOD.md §1).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from clawd.errors import InvalidRequest
from clawd.protocol import SESSION_ID_PATTERN, ChatCompletionRequest, Message
from clawd.store import signals, turns
from clawd.store.db import Database

REGENERATE_WINDOW_S = 6 * 3600  # an identical request days later is a new question, not a regenerate
# A repeat this soon after a turn that ended in an error, a disconnect or a client timeout
# (finish_reason error / cancelled) is the client (or an SDK's automatic retry) trying again:
# it got no answer to judge, so the repeat is no evidence against one. Seconds, because SDK
# retries back off for a few seconds and a person re-sending after a failure does so at once.
RETRY_WINDOW_S = 30.0
_CUT_SHORT = ("error", "cancelled")
_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class Attribution:
    session_id: str
    source: str  # header | body | prefix | regenerate | new
    turn_type: str  # main | side
    requery_of: str | None
    session_done: bool
    client_key: str | None = None


def _canonical(m: Message) -> dict:
    """What identifies a message across client round trips (clients re-send our
    answers with whitespace trimmed, and as string or parts)."""
    d = {"role": "system" if m.role == "developer" else m.role, "content": m.text().strip()}
    if m.tool_calls:
        d["tool_calls"] = [[c.function.name, _same_json(c.function.arguments)] for c in m.tool_calls]
    if m.tool_call_id:
        d["tool_call_id"] = m.tool_call_id
    return d


def _same_json(arguments):
    """A call's arguments as any client echoes them: OpenClaw sends ours back re-serialised
    (`{"a":1}` for `{"a": 1}`), so the JSON value counts, not its spelling."""
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):  # RecursionError: nesting deeper than json can walk
        return arguments


def messages_hash(messages: list[Message]) -> str:
    blob = json.dumps([_canonical(m) for m in messages], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def continuation_hash(messages: list[Message], response_text: str, tool_calls: list[dict] | None = None) -> str:
    """The hash a follow-up request's prefix will have if it continues this turn (a turn
    that called tools comes back as its content plus those calls, as the client got them)."""
    return messages_hash([*messages, Message(role="assistant", content=response_text, tool_calls=tool_calls or None)])


def check_session_id(value: str, param: str = "session_id") -> str:
    """`value` when it is a usable session id (SESSION_ID_PATTERN), else a 400 that does not echo it."""
    if not re.fullmatch(SESSION_ID_PATTERN, value):
        raise InvalidRequest(
            "a session id is 1-128 printable ASCII characters, without control characters", param=param
        )
    return value


def client_key(headers: Mapping[str, str], remote: str | None) -> str:
    """Who is asking, as far as HTTP tells: the credential, the User-Agent and the remote host
    (not the port: each connection gets a new one). Hashed, so no token is stored."""
    parts = (
        headers.get("authorization") or headers.get("x-api-key") or "",
        headers.get("user-agent") or "",
        remote or "",
    )
    return "c-" + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def new_session_id() -> str:
    return "s-" + uuid.uuid4().hex[:16]


def _flag(value) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() in _TRUE)


async def attribute(
    db: Database,
    req: ChatCompletionRequest,
    headers: Mapping[str, str],
    *,
    remote: str | None = None,
    now: float | None = None,
    background_task: bool = False,
) -> Attribution:
    """Decide session, turn type and regenerate link for one request from `remote` (the
    client's address). A `background_task` (a chat UI's title or tags request, see
    openwebui/origin.py) is a side turn whatever else it says."""
    now = time.time() if now is None else now
    key = client_key(headers, remote)
    turn_type = headers.get("x-turn-type") or req.turn_type or "main"
    if turn_type not in ("main", "side"):
        raise InvalidRequest(f"X-Turn-Type must be 'main' or 'side', got {turn_type[:40]!r}", param="turn_type")
    if background_task:
        turn_type = "side"
    done = _flag(headers.get("x-session-done")) or _flag(req.session_done)
    explicit, source = headers.get("x-session-id"), "header"
    if not explicit and req.session_id:
        explicit, source = req.session_id, "body"
    if explicit:
        check_session_id(explicit)

    earlier = await turns.find_repeat(
        db, messages_hash(req.messages), since=now - REGENERATE_WINDOW_S, session_id=explicit, client_key=key
    )
    retry = earlier is not None and earlier.finish_reason in _CUT_SHORT and now - earlier.created_at <= RETRY_WINDOW_S
    requery_of = earlier.id if earlier and not retry else None
    if explicit:
        return Attribution(explicit, source, turn_type, requery_of, done, key)
    if earlier:
        return Attribution(earlier.session_id, "retry" if retry else "regenerate", turn_type, requery_of, done, key)

    # Continuation: the newest assistant message closes the prefix an earlier turn produced.
    for k in range(len(req.messages) - 1, 0, -1):
        if req.messages[k - 1].role != "assistant":
            continue
        parent = await turns.find_by_continuation_hash(db, messages_hash(req.messages[:k]))
        if parent is None and k > 1:
            parent = await _rewritten_tool_turn(db, req.messages[: k - 1], req.messages[k - 1], key, now)
        if parent:
            return Attribution(parent.session_id, "prefix", turn_type, None, done, key)
        break  # only the latest assistant message can be the one we just answered
    return Attribution(new_session_id(), "new", turn_type, None, done, key)


async def _rewritten_tool_turn(
    db: Database, before: list[Message], assistant: Message, key: str, now: float
) -> turns.TurnRecord | None:
    """The same client's turn that answered exactly `before` with tool calls, when `assistant`
    is that answer re-written by the client: agents that keep their history as text
    (smolagents: "Calling tools: [{'id': 'call_…', …}]") send our calls back in their own
    words, so the exact prefix never matches. Our call ids are random and unique, so a
    message that names every one of them is that turn's answer; any other re-written
    answer still starts a new session (the reply judged would not be the one logged)."""
    earlier = await turns.find_repeat(
        db, messages_hash(before), since=now - REGENERATE_WINDOW_S, session_id=None, client_key=key
    )
    if earlier is None or not earlier.tool_calls:
        return None
    text = assistant.text()
    return earlier if all(c.get("id") and c["id"] in text for c in earlier.tool_calls) else None


async def forget(db: Database, session_id: str, registry=None) -> dict | None:
    """Forget a session: delete its turns, feedback and signals, then retire every adapter
    trained on them (`registry`, a clawd.adapters.Registry, when training is on). None when
    there is no such session."""
    rows = await turns.list_turns(db, session_id=session_id, limit=1_000_000)
    ids = [r.id for r in rows]
    async with db.transaction():
        await signals.record_forgotten(db, session_id, ids)
        await turns.delete_session(db, session_id)
    if not ids:
        return None
    retired = await registry.retire_forgotten() if registry is not None else []
    return {"session_id": session_id, "forgotten_turns": len(ids), "retired_adapters": retired}
