"""Session attribution against a real store: headers beat body fields, header-less
conversations are stitched by message prefix, identical requests are regenerates
(within a window), and turn types default to main (METHOD.md §1)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from starlette.datastructures import Headers

from clawd import sessions
from clawd.errors import InvalidRequest
from clawd.protocol import ChatCompletionRequest, Message
from clawd.store.db import Database
from clawd.store.turns import TurnRecord, insert_turn


@pytest.fixture
async def db(tmp_path):
    d = await Database.open(tmp_path / "clawd.db")
    yield d
    await d.close()


def request(messages, **kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=messages, **kw)


def H(**kv) -> Headers:
    """Real (case-insensitive) HTTP headers, as the API passes them."""
    return Headers({k.replace("_", "-"): v for k, v in kv.items()})


_n = 0


async def record(
    db,
    messages,
    response: str,
    *,
    session_id: str,
    created_at: float | None = None,
    source: str = "new",
    turn_type: str = "main",
    finish_reason: str = "stop",
    client_key: str | None = None,
    tool_calls: list[dict] | None = None,
) -> TurnRecord:
    """Store a turn the way chat.py does: hashes from sessions.py."""
    global _n
    _n += 1
    msgs = [Message.model_validate(m) for m in messages]
    rec = TurnRecord(
        id=f"chatcmpl-t{_n}",
        session_id=session_id,
        turn_type=turn_type,
        request={"messages": messages},
        request_hash=sessions.messages_hash(msgs),
        continuation_hash=sessions.continuation_hash(msgs, response, tool_calls),
        prompt_text="p",
        prompt_ids=[1, 2, 3],
        response_ids=[4, 5],
        response_logprobs=np.array([-0.1, -0.2], np.float32),
        response_text=response,
        finish_reason=finish_reason,
        sampling={},
        engine="fake",
        model="m",
        chat_format="transcript",
        timings={},
        client_key=client_key or sessions.client_key(H(), None),  # the client `attribute(..., H())` sees
        tool_calls=tool_calls or [],
        **({"created_at": created_at} if created_at is not None else {}),
    )
    await insert_turn(db, rec, source=source)
    return rec


U1 = {"role": "user", "content": "What is the capital of France?"}
A1 = "The capital of France is Paris."


# --- explicit ids -------------------------------------------------------------------------


async def test_header_beats_body(db):
    a = await sessions.attribute(db, request([U1], session_id="body-s"), H(x_session_id="hdr-s"))
    assert (a.session_id, a.source) == ("hdr-s", "header")


async def test_body_session_id_used(db):
    a = await sessions.attribute(db, request([U1], session_id="body-s"), H())
    assert (a.session_id, a.source) == ("body-s", "body")
    assert a.requery_of is None


async def test_explicit_session_wins_over_prefix(db):
    await record(db, [U1], A1, session_id="inferred")
    follow = [U1, {"role": "assistant", "content": A1}, {"role": "user", "content": "And Spain?"}]
    a = await sessions.attribute(db, request(follow), H(x_session_id="mine"))
    assert (a.session_id, a.source) == ("mine", "header")


# --- inferred sessions ----------------------------------------------------------------------


async def test_first_request_starts_new_session(db):
    a = await sessions.attribute(db, request([U1]), H())
    assert a.source == "new"
    assert a.session_id.startswith("s-")
    b = await sessions.attribute(db, request([{"role": "user", "content": "other"}]), H())
    assert b.session_id != a.session_id


@pytest.mark.parametrize(
    "echo",
    [
        {"role": "assistant", "content": A1},
        {"role": "assistant", "content": "  " + A1 + "\n"},  # client trimmed / padded whitespace
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "The capital of "}, {"type": "text", "text": "France is Paris."}],
        },
    ],
    ids=["exact", "whitespace", "parts"],
)
async def test_prefix_continues_session(db, echo):
    await record(db, [{"role": "system", "content": "Be brief."}, U1], A1, session_id="s-conv")
    user_as_parts = {"role": "user", "content": [{"type": "text", "text": U1["content"]}]}
    follow = [
        {"role": "system", "content": "Be brief. "},
        user_as_parts,
        echo,
        {"role": "user", "content": "And Spain?"},
    ]
    a = await sessions.attribute(db, request(follow), H())
    assert (a.session_id, a.source, a.requery_of) == ("s-conv", "prefix", None)


async def test_prefix_continues_through_tool_result(db):
    await record(db, [U1], A1, session_id="s-tool")
    follow = [U1, {"role": "assistant", "content": A1}, {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    a = await sessions.attribute(db, request(follow), H())
    assert (a.session_id, a.source) == ("s-tool", "prefix")


async def test_prefix_with_different_answer_is_new_session(db):
    await record(db, [U1], A1, session_id="s-conv")
    follow = [U1, {"role": "assistant", "content": "Lyon."}, {"role": "user", "content": "Sure?"}]
    a = await sessions.attribute(db, request(follow), H())
    assert a.source == "new"
    assert a.session_id != "s-conv"


CALL = {"id": "call_5f0c2a9d41b84e6fa3c7d2e1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("assistant", "same"),
    [
        # smolagents keeps its history as text: our call comes back in its words, with its id.
        ({"role": "assistant", "content": f"Calling tools:\n[{{'id': '{CALL['id']}', 'type': 'function'}}]"}, True),
        ({"role": "assistant", "content": "Calling tools:\n[{'id': 'call_other', 'type': 'function'}]"}, False),
        ({"role": "assistant", "content": "I called f."}, False),  # no id: any other re-written answer
    ],
)
async def test_a_tool_call_turn_rewritten_as_text_continues_when_it_names_our_call_ids(db, assistant, same):
    await record(db, [U1], "", session_id="s-agent", tool_calls=[CALL])
    follow = [U1, assistant, {"role": "user", "content": "Observation:\n42"}]
    a = await sessions.attribute(db, request(follow), H())
    assert (a.session_id == "s-agent", a.source) == (same, "prefix" if same else "new")


async def test_a_tool_call_echoed_with_other_json_spacing_and_id_continues(db):
    # OpenClaw sends our call back with its arguments re-serialised and the id's "_" dropped.
    call = {**CALL, "function": {"name": "f", "arguments": '{"path": "a.txt", "n": 1}'}}
    await record(db, [U1], "", session_id="s-claw", tool_calls=[call])
    echoed = {
        **call,
        "id": "call5f0c2a9d41b84e6fa3c7d2e1",
        "function": {"name": "f", "arguments": '{"n":1,"path":"a.txt"}'},
    }
    follow = [
        U1,
        {"role": "assistant", "tool_calls": [echoed]},
        {"role": "tool", "tool_call_id": echoed["id"], "content": "ok"},
    ]
    a = await sessions.attribute(db, request(follow), H())
    assert (a.session_id, a.source) == ("s-claw", "prefix")
    other = {**echoed, "function": {"name": "f", "arguments": '{"n":2,"path":"a.txt"}'}}  # other arguments
    a = await sessions.attribute(db, request([U1, {"role": "assistant", "tool_calls": [other]}, follow[2]]), H())
    assert a.source == "new"


async def test_a_rewritten_tool_call_turn_from_another_client_is_a_new_session(db):
    await record(db, [U1], "", session_id="s-agent", tool_calls=[CALL], client_key="someone-else")
    follow = [U1, {"role": "assistant", "content": f"Calling tools: {CALL['id']}"}, {"role": "user", "content": "ok"}]
    a = await sessions.attribute(db, request(follow), H())
    assert a.source == "new"


async def test_three_turn_chain(db):
    m1 = [U1]
    await record(db, m1, A1, session_id="s-chain")
    m2 = [*m1, {"role": "assistant", "content": A1}, {"role": "user", "content": "And Spain?"}]
    a2 = await sessions.attribute(db, request(m2), H())
    await record(db, m2, "Madrid.", session_id=a2.session_id, source=a2.source)
    m3 = [*m2, {"role": "assistant", "content": "Madrid."}, {"role": "user", "content": "Thanks!"}]
    a3 = await sessions.attribute(db, request(m3), H())
    assert a2.session_id == a3.session_id == "s-chain"
    assert a3.source == "prefix"


# --- regenerate ---------------------------------------------------------------------------


async def test_identical_messages_are_regenerate(db):
    first = await record(db, [U1], A1, session_id="s-regen")
    a = await sessions.attribute(db, request([{"role": "user", "content": U1["content"] + " "}]), H())
    assert (a.session_id, a.source, a.requery_of) == ("s-regen", "regenerate", first.id)


async def test_regenerate_links_newest_identical_turn(db):
    now = time.time()
    await record(db, [U1], A1, session_id="s-regen", created_at=now - 20)
    second = await record(db, [U1], "Paris.", session_id="s-regen", created_at=now - 10)
    a = await sessions.attribute(db, request([U1]), H(), now=now)
    assert a.requery_of == second.id


async def test_identical_messages_after_window_is_new_session(db):
    now = time.time()
    await record(db, [U1], A1, session_id="s-old", created_at=now - sessions.REGENERATE_WINDOW_S - 60)
    a = await sessions.attribute(db, request([U1]), H(), now=now)
    assert a.source == "new"
    assert a.session_id != "s-old"
    assert a.requery_of is None


async def test_identical_messages_just_inside_window_is_regenerate(db):
    now = time.time()
    first = await record(db, [U1], A1, session_id="s-old", created_at=now - sessions.REGENERATE_WINDOW_S + 60)
    a = await sessions.attribute(db, request([U1]), H(), now=now)
    assert a.requery_of == first.id


async def test_explicit_other_session_is_not_regenerate(db):
    await record(db, [U1], A1, session_id="s-a")
    a = await sessions.attribute(db, request([U1]), H(x_session_id="s-b"))
    assert (a.session_id, a.requery_of) == ("s-b", None)


async def test_explicit_same_session_regenerate_is_linked(db):
    first = await record(db, [U1], A1, session_id="s-a", source="header")
    a = await sessions.attribute(db, request([U1]), H(x_session_id="s-a"))
    assert (a.session_id, a.source, a.requery_of) == ("s-a", "header", first.id)


# --- turn type and done -------------------------------------------------------------------


async def test_turn_type_defaults_main(db):
    a = await sessions.attribute(db, request([U1]), H())
    assert a.turn_type == "main"


async def test_turn_type_header_side_honoured(db):
    a = await sessions.attribute(db, request([U1]), H(x_turn_type="side"))
    assert a.turn_type == "side"


async def test_turn_type_header_beats_body(db):
    a = await sessions.attribute(db, request([U1], turn_type="side"), H(x_turn_type="main"))
    assert a.turn_type == "main"
    b = await sessions.attribute(db, request([U1], turn_type="side"), H())
    assert b.turn_type == "side"


async def test_invalid_turn_type_is_invalid_request(db):
    with pytest.raises(InvalidRequest) as ei:
        await sessions.attribute(db, request([U1]), H(x_turn_type="heartbeat"))
    assert ei.value.status == 400
    assert ei.value.param == "turn_type"


@pytest.mark.parametrize(
    "value,done",
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        ("yes", True),
        ("On", True),
        (" yes ", True),
        ("0", False),
        ("false", False),
        ("no", False),
        ("", False),
        ("2", False),
    ],
)
async def test_session_done_header(db, value, done):
    a = await sessions.attribute(db, request([U1]), H(x_session_done=value))
    assert a.session_done is done


@pytest.mark.parametrize(
    "value,done", [(True, True), ("yes", True), ("1", True), (False, False), (None, False), ("off", False)]
)
async def test_session_done_body(db, value, done):
    a = await sessions.attribute(db, request([U1], session_done=value), H())
    assert a.session_done is done


# --- regenerate is one conversation's, a retry is none ---------------------------------------


async def test_identical_request_from_another_client_is_not_regenerate(db):
    await record(db, [U1], A1, session_id="s-a", client_key=sessions.client_key(H(user_agent="app-a"), "10.0.0.2"))
    for other in (H(user_agent="app-b"), H(user_agent="app-a", authorization="Bearer other")):
        a = await sessions.attribute(db, request([U1]), other, remote="10.0.0.2")
        assert (a.source, a.requery_of) == ("new", None) and a.session_id != "s-a"
    a = await sessions.attribute(db, request([U1]), H(user_agent="app-a"), remote="10.0.0.3")
    assert a.requery_of is None  # same app, another machine: another client


async def test_identical_request_from_the_same_client_is_regenerate(db):
    key = sessions.client_key(H(user_agent="app-a"), "10.0.0.2")
    first = await record(db, [U1], A1, session_id="s-a", client_key=key)
    a = await sessions.attribute(db, request([U1]), H(user_agent="app-a"), remote="10.0.0.2")
    assert (a.session_id, a.source, a.requery_of, a.client_key) == ("s-a", "regenerate", first.id, key)


async def test_a_client_without_session_does_not_regenerate_a_named_sessions_turn(db):
    await record(db, [U1], A1, session_id="s-named", source="header")
    a = await sessions.attribute(db, request([U1]), H())
    assert a.requery_of is None and a.session_id != "s-named"


async def test_same_session_repeat_from_another_client_is_regenerate(db):
    first = await record(db, [U1], A1, session_id="s-a", source="header")
    a = await sessions.attribute(db, request([U1]), H(x_session_id="s-a", user_agent="phone"), remote="10.0.0.9")
    assert a.requery_of == first.id


@pytest.mark.parametrize("finish", ["error", "cancelled"])
async def test_repeat_soon_after_a_failed_turn_is_a_retry(db, finish):
    now = time.time()
    failed = await record(db, [U1], "Par", session_id="s-r", finish_reason=finish, created_at=now - 5)
    a = await sessions.attribute(db, request([U1]), H(), now=now)
    assert (a.session_id, a.source, a.requery_of) == ("s-r", "retry", None)
    # Later than the retry window it is the user asking again: a regenerate.
    a = await sessions.attribute(db, request([U1]), H(), now=failed.created_at + sessions.RETRY_WINDOW_S + 1)
    assert (a.source, a.requery_of) == ("regenerate", failed.id)


async def test_repeat_soon_after_a_finished_turn_is_still_a_regenerate(db):
    now = time.time()
    done = await record(db, [U1], A1, session_id="s-r", created_at=now - 5)
    a = await sessions.attribute(db, request([U1]), H(), now=now)
    assert a.requery_of == done.id


async def test_retry_in_a_named_session_is_no_regenerate(db):
    now = time.time()
    await record(db, [U1], "Pa", session_id="s-h", source="header", finish_reason="cancelled", created_at=now - 2)
    a = await sessions.attribute(db, request([U1]), H(x_session_id="s-h"), now=now)
    assert (a.session_id, a.requery_of) == ("s-h", None)
