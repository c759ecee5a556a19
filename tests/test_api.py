"""The HTTP API's published contract, over real HTTP against a real daemon (fake engine):
OpenAI SDK compatibility, the SSE wire format, turn rows in SQLite that match an
independent scoring of the sampled tokens, session inference, OpenAI-shaped errors,
auth, client disconnects and the fair queue (CONVENTIONS.md §1-2, METHOD.md §1)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from clawd.engines.fake import EOS
from clawd.protocol import Message
from clawd.store import turns
from tests.conftest import start_daemon

MODEL = "fake-model"
CHAT = "/v1/chat/completions"
# One client per test, not per request: making an httpx client costs tens of ms (its SSL context).
HTTP: httpx.Client
ERROR_TYPE = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error"}


@pytest.fixture(autouse=True)
def _http():
    global HTTP
    HTTP = httpx.Client(timeout=30)
    yield
    HTTP.close()


def sdk(d, api_key: str = "x", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key=api_key, max_retries=0, **kw)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def body(*messages, **kw) -> dict:
    return {"model": MODEL, "messages": list(messages) or [user("hi")], "temperature": 0, **kw}


def turn_row(d, turn_id: str) -> turns.TurnRecord:
    rec = d.run(turns.get_turn(d.state.db, turn_id))
    assert rec is not None, f"no turn row for {turn_id}"
    return rec


def wait_turn_row(d, turn_id: str, timeout: float = 10) -> turns.TurnRecord:
    deadline = time.time() + timeout
    while time.time() < deadline:
        rec = d.run(turns.get_turn(d.state.db, turn_id))
        if rec is not None:
            return rec
        time.sleep(0.02)
    raise AssertionError(f"turn {turn_id} was never recorded")


def independent_score(d, rec: turns.TurnRecord) -> np.ndarray:
    """Score the stored tokens again, through the engine's own queue."""
    runner = d.state.model.runner
    return d.run(runner.call(runner.engine.score, rec.prompt_ids, rec.response_ids)).logprobs


def assert_openai_error(r: httpx.Response, status: int, *, code=None, param="any") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    payload = r.json()
    assert set(payload) == {"error"}
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ERROR_TYPE[status]
    assert err["code"] == code
    if param != "any":
        assert err["param"] == param
    assert err["param"] is None or isinstance(err["param"], str)
    return err


def assert_serves(d) -> None:
    r = HTTP.post(d.url + CHAT, json=body(user("still there?")), timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "You said: still there?"


def parse_sse(raw: str) -> list:
    """Split an SSE body into events; every event must be exactly one `data: ` line."""
    assert raw.endswith("\n\n")
    events = []
    for block in raw[:-2].split("\n\n"):
        lines = block.split("\n")
        assert len(lines) == 1, f"multi-line event: {block!r}"
        assert lines[0].startswith("data: "), lines[0]
        data = lines[0][len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


# --- the OpenAI SDK -------------------------------------------------------------------------


def test_sdk_non_streaming(fake_daemon):
    d = fake_daemon
    raw = sdk(d).chat.completions.with_raw_response.create(model=MODEL, messages=[user("hello there")], temperature=0)
    c = raw.parse()
    assert c.object == "chat.completion"
    assert c.id.startswith("chatcmpl-")
    assert raw.headers["x-clawd-turn-id"] == c.id
    assert c.model == MODEL
    assert abs(c.created - time.time()) < 60
    assert len(c.choices) == 1
    ch = c.choices[0]
    assert ch.index == 0
    assert ch.message.role == "assistant"
    assert ch.message.content == "You said: hello there"
    assert ch.finish_reason == "stop"
    # the fake tokenizer is bytes + BOS; the reply ends with EOS
    prompt = d.state.model.format.render([Message(role="user", content="hello there")]).prompt
    assert c.usage.prompt_tokens == len(prompt.encode()) + 1
    assert c.usage.completion_tokens == len(b"You said: hello there") + 1
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens


def test_sdk_streaming(fake_daemon):
    d = fake_daemon
    stream = sdk(d).chat.completions.create(
        model=MODEL,
        messages=[user("stream me please")],
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    expected = "You said: stream me please"
    assert {c.id for c in chunks} == {chunks[0].id}
    assert {c.created for c in chunks} == {chunks[0].created}
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == ""
    *choice_chunks, usage_chunk = chunks
    content = [c.choices[0].delta.content for c in choice_chunks[1:-1]]
    assert len(content) >= len(expected) // 2, "one chunk holding the whole answer is not streaming"
    assert all(piece for piece in content)
    assert "".join(content) == expected
    last = choice_chunks[-1].choices[0]
    assert last.finish_reason == "stop"
    assert last.delta.content is None and last.delta.role is None
    assert all(c.choices[0].finish_reason is None for c in choice_chunks[:-1])
    assert all(c.usage is None for c in choice_chunks)
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == len(expected.encode()) + 1
    assert usage_chunk.usage.total_tokens == usage_chunk.usage.prompt_tokens + usage_chunk.usage.completion_tokens
    rec = turn_row(d, chunks[0].id)
    assert rec.response_text == expected
    assert rec.finish_reason == "stop"

    # without include_usage there is no usage chunk
    chunks = list(sdk(d).chat.completions.create(model=MODEL, messages=[user("abc")], temperature=0, stream=True))
    assert all(len(c.choices) == 1 for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_length_limit(fake_daemon):
    d = fake_daemon
    for limit in ("max_tokens", "max_completion_tokens"):  # both names are accepted
        c = sdk(d).chat.completions.create(model=MODEL, messages=[user("hello there")], temperature=0, **{limit: 5})
        assert c.choices[0].message.content == "You s"
        assert c.choices[0].finish_reason == "length"
        assert c.usage.completion_tokens == 5
        rec = turn_row(d, c.id)
        assert rec.finish_reason == "length"
        assert rec.sampling["max_tokens"] == 5

    chunks = list(
        sdk(d).chat.completions.create(
            model=MODEL, messages=[user("hello there")], temperature=0, stream=True, max_tokens=4
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "You "
    assert chunks[-1].choices[0].finish_reason == "length"
    assert turn_row(d, chunks[0].id).finish_reason == "length"


def test_client_stop_strings(fake_daemon):
    d = fake_daemon
    c = sdk(d).chat.completions.create(
        model=MODEL, messages=[user("hello there")], temperature=0, stop=["said", "there"]
    )
    assert c.choices[0].message.content == "You "
    assert c.choices[0].finish_reason == "stop"
    assert turn_row(d, c.id).response_text == "You "

    # The reply ends (EOS) while its tail could still start a stop string: the tail is text.
    c = sdk(d).chat.completions.create(model=MODEL, messages=[user("hello X")], temperature=0, stop=["XYZ"])
    assert c.choices[0].message.content == "You said: hello X"
    assert c.choices[0].finish_reason == "stop"
    assert turn_row(d, c.id).response_text == "You said: hello X"


def test_extra_body_fields_tolerated(fake_daemon):
    d = fake_daemon
    r = HTTP.post(
        d.url + CHAT,
        json=body(
            user("hi"), session_id="body-session", turn_type="side", user="someone", metadata={"x": 1}, logit_bias={}
        ),
    )
    assert r.status_code == 200, r.text
    rec = turn_row(d, r.json()["id"])
    assert (rec.session_id, rec.turn_type) == ("body-session", "side")
    assert r.headers["x-clawd-session-id"] == "body-session"


# --- the SSE wire format ----------------------------------------------------------------------


def test_sse_wire_format(fake_daemon):
    d = fake_daemon
    with HTTP.stream(
        "POST", d.url + CHAT, timeout=30, json=body(user("wire"), stream=True, stream_options={"include_usage": True})
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = parse_sse(raw)
    assert events[-1] == "[DONE]"
    assert "[DONE]" not in events[:-1]
    chunks = events[:-1]
    assert r.headers["x-clawd-turn-id"] == chunks[0]["id"]
    for c in chunks[:-1]:
        assert set(c) == {"id", "object", "created", "model", "choices", "usage"}
        assert c["usage"] is None
        (choice,) = c["choices"]
        assert set(choice) == {"index", "delta", "logprobs", "finish_reason"}
        assert choice["logprobs"] is None
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2]["choices"][0]["delta"] == {}
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == len("You said: wire") + 1
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == "You said: wire"

    # without include_usage, chunks carry no usage key at all
    with HTTP.stream("POST", d.url + CHAT, json=body(user("x"), stream=True)) as r:
        events = parse_sse(r.read().decode())
    assert events[-1] == "[DONE]"
    assert all("usage" not in c and len(c["choices"]) == 1 for c in events[:-1])


# --- the turn row -----------------------------------------------------------------------------


def test_turn_row_matches_independent_score(fake_daemon):
    d = fake_daemon
    for stream in (False, True):
        for sampling in ({"temperature": 0}, {"temperature": 1.8, "seed": 7, "max_tokens": 40}):  # off-distribution too
            check_turn_row(d, stream, sampling)


def check_turn_row(d, stream: bool, sampling: dict) -> None:
    client = sdk(d)
    kw = dict(model=MODEL, messages=[user("score these tokens")], **sampling)
    if stream:
        raw = client.chat.completions.with_raw_response.create(
            stream=True, stream_options={"include_usage": True}, **kw
        )
        chunks = list(raw.parse())
        turn_id, usage = chunks[0].id, chunks[-1].usage
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        raw = client.chat.completions.with_raw_response.create(**kw)
        c = raw.parse()
        turn_id, usage, text = c.id, c.usage, c.choices[0].message.content
    assert raw.headers["x-clawd-turn-id"] == turn_id
    rec = turn_row(d, turn_id)  # written before the response ended
    assert rec.id == turn_id
    assert len(rec.response_ids) == len(rec.response_logprobs) == usage.completion_tokens
    assert len(rec.prompt_ids) == usage.prompt_tokens
    assert rec.response_text == text
    assert rec.prompt_ids == d.state.model.runner.engine.tokenize(rec.prompt_text, add_bos=True)
    assert rec.request == {"messages": [user("score these tokens")]}
    assert rec.turn_type == "main"
    assert (rec.engine, rec.model, rec.chat_format) == ("fake", MODEL, "transcript")
    assert rec.sampling["temperature"] == sampling["temperature"]
    assert rec.response_logprobs.dtype == np.float32
    np.testing.assert_array_equal(rec.response_logprobs, independent_score(d, rec))
    if sampling["temperature"] == 0:
        assert rec.response_ids[-1] == EOS
        assert rec.response_ids[:-1] == list(text.encode())
    else:
        assert (rec.response_logprobs < np.log(0.5)).any(), "expected some off-distribution samples"


def test_seed_makes_sampling_reproducible(fake_daemon):
    client = sdk(fake_daemon)
    kw = dict(model=MODEL, messages=[user("seeded")], temperature=1.5, seed=123, max_tokens=30)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    ra, rb = turn_row(fake_daemon, a.id), turn_row(fake_daemon, b.id)
    assert ra.response_ids == rb.response_ids


# --- sessions over HTTP -----------------------------------------------------------------------


def test_three_turn_conversation_without_headers_is_one_session(fake_daemon):
    d = fake_daemon
    client = sdk(d)
    messages = [{"role": "system", "content": "Be brief."}]
    ids = []
    for i, text in enumerate(["first question", "second question", "third question"]):
        messages.append(user(text))
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, temperature=0)
        c = raw.parse()
        ids.append((c.id, raw.headers["x-clawd-session-id"]))
        # clients echo the answer back, sometimes as parts
        answer = c.choices[0].message.content
        messages.append({"role": "assistant", "content": answer if i != 1 else [{"type": "text", "text": answer}]})
    recs = [turn_row(d, tid) for tid, _ in ids]
    sessions = {r.session_id for r in recs} | {sid for _, sid in ids}
    assert len(sessions) == 1
    (sid,) = sessions
    assert all(r.requery_of is None for r in recs)

    listed = HTTP.get(d.url + "/clawd/sessions").json()
    (s,) = [s for s in listed if s["id"] == sid]
    assert s["turns"] == 3
    assert s["title"] == "first question"
    assert s["done"] is False
    tl = HTTP.get(d.url + f"/clawd/sessions/{sid}/turns").json()
    assert [t["id"] for t in tl] == [tid for tid, _ in reversed(ids)]  # newest first

    # an unrelated conversation gets a session of its own
    other = HTTP.post(d.url + CHAT, json=body(user("a different topic")))
    assert other.headers["x-clawd-session-id"] != sid


def test_regenerate_sets_requery_of(fake_daemon):
    d = fake_daemon
    first = HTTP.post(d.url + CHAT, json=body(user("regenerate me")))
    second = HTTP.post(d.url + CHAT, json=body(user("regenerate me"), temperature=0.9))
    r1, r2 = turn_row(d, first.json()["id"]), turn_row(d, second.json()["id"])
    assert r1.requery_of is None
    assert r2.requery_of == r1.id
    assert r2.session_id == r1.session_id
    summary = HTTP.get(d.url + f"/clawd/turns/{r2.id}").json()
    assert summary["requery_of"] == r1.id


def test_session_headers(fake_daemon):
    d = fake_daemon
    r = HTTP.post(
        d.url + CHAT,
        json=body(user("heartbeat"), session_id="ignored"),
        headers={"X-Session-Id": "agent-7", "X-Turn-Type": "side", "X-Session-Done": "Yes"},
    )
    assert r.status_code == 200
    assert r.headers["x-clawd-session-id"] == "agent-7"
    rec = turn_row(d, r.json()["id"])
    assert (rec.session_id, rec.turn_type) == ("agent-7", "side")
    (s,) = [s for s in HTTP.get(d.url + "/clawd/sessions").json() if s["id"] == "agent-7"]
    assert s["done"] is True


# --- models -----------------------------------------------------------------------------------


def test_models(fake_daemon):
    d = fake_daemon
    r = HTTP.get(d.url + "/v1/models")
    assert r.status_code == 200
    payload = r.json()
    assert payload["object"] == "list"
    (card,) = payload["data"]
    assert card["id"] == MODEL and card["object"] == "model"
    assert isinstance(card["created"], int) and isinstance(card["owned_by"], str)
    one = HTTP.get(d.url + f"/v1/models/{MODEL}")
    assert one.status_code == 200 and one.json() == card
    assert [m.id for m in sdk(d).models.list()] == [MODEL]

    r = HTTP.get(d.url + "/v1/models/gpt-4o")
    assert_openai_error(r, 404, code="model_not_found")
    assert "gpt-4o" in r.json()["error"]["message"]

    # on loopback without require_token, any key or none is accepted
    for headers in ({}, {"Authorization": "Bearer whatever"}):
        assert HTTP.get(d.url + "/v1/models", headers=headers).status_code == 200


# --- errors -----------------------------------------------------------------------------------

BAD_REQUESTS = {
    "malformed-json": (
        dict(content=b'{"model": "fake-model", "messages": [', headers={"content-type": "application/json"}),
        400,
        None,
        "any",
    ),
    "non-object-body": (dict(json=[{"role": "user", "content": "hi"}]), 400, None, "any"),
    "string-body": (dict(json="hello"), 400, None, "any"),
    "missing-messages": (dict(json={"model": MODEL}), 400, None, "messages"),
    "missing-model": (dict(json={"messages": [user("hi")]}), 400, None, "model"),
    "empty-messages": (dict(json={"model": MODEL, "messages": []}), 400, None, "messages"),
    "bad-role": (dict(json=body({"role": "wizard", "content": "hi"})), 400, None, "any"),
    "temperature-range": (dict(json=body(user("hi"), temperature=2.5)), 400, None, "temperature"),
    "n-2": (dict(json=body(user("hi"), n=2)), 400, None, "n"),
    "five-stops": (dict(json=body(user("hi"), stop=["a", "b", "c", "d", "e"])), 400, None, "stop"),
    "last-is-assistant": (dict(json=body(user("hi"), {"role": "assistant", "content": "x"})), 400, None, "messages"),
    "bad-turn-type-header": (dict(json=body(user("hi")), headers={"X-Turn-Type": "cron"}), 400, None, "turn_type"),
    # any model name is served (tests/test_compat.py); parts the model cannot read are refused
    "image-part": (
        dict(json=body({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]})),
        400,
        None,
        "messages[0].content[0]",
    ),
    "top-logprobs-21": (dict(json=body(user("hi"), logprobs=True, top_logprobs=21)), 400, None, "top_logprobs"),
    "top-logprobs-negative": (dict(json=body(user("hi"), logprobs=True, top_logprobs=-1)), 400, None, "top_logprobs"),
    "top-logprobs-alone": (dict(json=body(user("hi"), top_logprobs=2)), 400, None, "top_logprobs"),
    "context-length": (dict(json=body(user("x" * 600))), 400, "context_length_exceeded", "messages"),
    "context-length-stream": (
        dict(json=body(user("x" * 600), stream=True)),
        400,
        "context_length_exceeded",
        "messages",
    ),
}


def test_bad_requests(fake_daemon):
    """Each bad request gets its exact status and OpenAI error shape, records nothing,
    and leaves the daemon serving (one daemon for all cases keeps this fast)."""
    d = fake_daemon
    for case, (kw, status, code, param) in BAD_REQUESTS.items():
        before = d.run(turns.count_turns(d.state.db))
        r = HTTP.post(d.url + CHAT, timeout=30, **kw)
        try:
            assert_openai_error(r, status, code=code, param=param)
        except AssertionError as e:
            raise AssertionError(f"case {case}: {e}") from e
        assert d.run(turns.count_turns(d.state.db)) == before, f"case {case} reached the engine"
        assert_serves(d)


def test_unknown_route_and_method(fake_daemon):
    d = fake_daemon
    for method, path in [("GET", "/v1/nothing"), ("POST", "/v1/completions-nope"), ("GET", "/")]:
        assert_openai_error(HTTP.request(method, d.url + path), 404)
    r = HTTP.get(d.url + CHAT)  # wrong method: still JSON in the OpenAI shape
    assert r.status_code == 405
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert_serves(d)


def test_sdk_raises_typed_errors(fake_daemon):
    client = sdk(fake_daemon)
    with pytest.raises(openai.NotFoundError) as nf:
        client.models.retrieve("nope")
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as br:
        client.chat.completions.create(model=MODEL, messages=[user("y" * 600)])
    assert br.value.code == "context_length_exceeded"
    assert br.value.param == "messages"


# --- auth -------------------------------------------------------------------------------------


def test_require_token(tmp_path):
    from clawd.engines.fake import Engine

    d = start_daemon(tmp_path / "auth-home", Engine(n_ctx=512), env_extra={"CLAWD_SERVER_REQUIRE_TOKEN": "1"})
    try:
        token = d.state.token
        assert token
        r = HTTP.post(d.url + CHAT, json=body(user("hi")))
        assert_openai_error(r, 401, code="invalid_api_key")
        r = HTTP.post(d.url + CHAT, json=body(user("hi")), headers={"Authorization": "Bearer wrong"})
        assert_openai_error(r, 401, code="invalid_api_key")
        r = HTTP.post(d.url + CHAT, json=body(user("hi")), headers={"Authorization": token})
        assert_openai_error(r, 401, code="invalid_api_key")  # scheme is required
        assert_openai_error(HTTP.get(d.url + "/v1/models"), 401, code="invalid_api_key")
        assert_openai_error(HTTP.get(d.url + "/clawd/status"), 401, code="invalid_api_key")
        assert d.run(turns.count_turns(d.state.db)) == 0

        r = HTTP.post(d.url + CHAT, json=body(user("hi")), headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == "You said: hi"
        c = sdk(d, api_key=token).chat.completions.create(model=MODEL, messages=[user("sdk")], temperature=0)
        assert c.choices[0].message.content == "You said: sdk"
        with pytest.raises(openai.AuthenticationError) as ei:
            sdk(d, api_key="nope").models.list()
        assert ei.value.code == "invalid_api_key"
    finally:
        d.stop()


# --- cancellation and the queue ---------------------------------------------------------------


def test_client_disconnect_cancels_generation(slow_fake_daemon):
    d = slow_fake_daemon
    msg = "".join(chr(ord("a") + i % 26) for i in range(200))
    full_reply_tokens = len(f"You said: {msg}") + 1
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", d.url + CHAT, json=body(user(msg), stream=True)) as r:
            assert r.status_code == 200
            turn_id = r.headers["x-clawd-turn-id"]
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                    if got == 3:
                        break
        # leaving the block closed the connection mid-stream
    rec = wait_turn_row(d, turn_id)
    assert rec.finish_reason == "cancelled"
    assert 2 <= len(rec.response_ids) < full_reply_tokens // 4
    assert len(rec.response_logprobs) == len(rec.response_ids)
    assert f"You said: {msg}".startswith(rec.response_text)
    np.testing.assert_array_equal(rec.response_logprobs, independent_score(d, rec))

    t0 = time.perf_counter()
    r = HTTP.post(d.url + CHAT, json=body(user("next")), timeout=30)
    elapsed = time.perf_counter() - t0
    assert r.json()["choices"][0]["message"]["content"] == "You said: next"
    assert elapsed < 0.02 * full_reply_tokens / 2, "the cancelled generation kept the engine busy"


def test_client_disconnect_cancels_a_non_streaming_turn(slow_fake_daemon, monkeypatch):
    """uvicorn does not cancel a plain handler when its client goes; the daemon must notice
    on its own and stop generating, so the turn ends 'cancelled' (not trainable) rather
    than running to the end for nobody."""
    d = slow_fake_daemon
    msg = "".join(chr(ord("a") + i % 26) for i in range(200))
    full_reply_tokens = len(f"You said: {msg}") + 1  # ~4.2 s at 20 ms a token
    payload = json.dumps(body(user(msg))).encode()
    # The engine says when a few tokens are out: the hang-up below is mid-generation however
    # slow the machine, rather than after a guessed sleep.
    engine, a_few_tokens_in = d.state.model.runner.engine, threading.Event()
    real_generate = engine.generate

    def counting_generate(*args, **kw):
        for n, tok in enumerate(real_generate(*args, **kw), 1):
            if n == 3:
                a_few_tokens_in.set()
            yield tok

    monkeypatch.setattr(engine, "generate", counting_generate)
    host, port = d.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST "
            + CHAT.encode()
            + b" HTTP/1.1\r\nHost: "
            + host.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(payload)).encode()
            + b"\r\n\r\n"
            + payload
        )
        assert a_few_tokens_in.wait(15), "generation never started"  # then hang up without reading the reply
    t_gone = time.perf_counter()
    deadline = time.time() + 15
    rows: list[turns.TurnRecord] = []
    while not rows and time.time() < deadline:
        rows = d.run(turns.list_turns(d.state.db))
        time.sleep(0.02)
    assert len(rows) == 1, "the turn was never recorded"
    rec = rows[0]
    assert rec.finish_reason == "cancelled"
    assert 1 <= len(rec.response_ids) < full_reply_tokens // 4
    assert f"You said: {msg}".startswith(rec.response_text)
    assert time.perf_counter() - t_gone < 0.02 * full_reply_tokens / 2, "generation went on for nobody"

    # the engine is free at once for the next client
    r = HTTP.post(d.url + CHAT, json=body(user("next")), timeout=30)
    assert r.json()["choices"][0]["message"]["content"] == "You said: next"


def test_fair_queue_concurrent_streams(slow_fake_daemon):
    d = slow_fake_daemon
    asks = ["alpha alpha alpha alpha", "bravo bravo bravo bravo", "charlie charlie charlie"]
    results: dict[str, dict] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(asks))

    def worker(ask: str) -> None:
        try:
            start.wait(10)
            pieces, times = [], []
            with (
                httpx.Client(timeout=60) as c,
                c.stream(
                    "POST", d.url + CHAT, json=body(user(ask), stream=True, stream_options={"include_usage": True})
                ) as r,
            ):
                assert r.status_code == 200
                events = []
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        events.append(data)
                        continue
                    ev = json.loads(data)
                    events.append(ev)
                    if ev["choices"] and ev["choices"][0]["delta"].get("content"):
                        pieces.append(ev["choices"][0]["delta"]["content"])
                        times.append(time.perf_counter())
            results[ask] = {"pieces": pieces, "times": times, "events": events}
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(a,)) for a in asks]
    for t in threads:
        t.start()
    saw_queue = False
    while any(t.is_alive() for t in threads):
        saw_queue |= HTTP.get(d.url + "/clawd/status").json()["queued"] > 0
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert not errors, errors
    assert saw_queue, "requests should have waited for the engine"

    for ask in asks:
        res = results[ask]
        expected = f"You said: {ask}"
        assert "".join(res["pieces"]) == expected  # nothing from another response
        assert len(res["pieces"]) >= len(expected) // 2
        events = res["events"]
        assert events[-1] == "[DONE]"
        assert len({e["id"] for e in events[:-1]}) == 1
        assert events[-2]["usage"]["completion_tokens"] == len(expected) + 1
        finish = [e["choices"][0]["finish_reason"] for e in events[:-2]]
        assert finish[-1] == "stop" and set(finish[:-1]) == {None}
        # real streaming: the pieces arrive over the generation time, not in one burst
        assert res["times"][-1] - res["times"][0] > 0.02 * (len(expected) - 1) * 0.5

    # one response at a time: generations do not overlap (tolerating client wake-up jitter)
    spans = sorted((r["times"][0], r["times"][-1]) for r in results.values())
    for (_, end_a), (start_b, _) in zip(spans, spans[1:]):
        assert start_b > end_a - 0.1, spans
    ids = {results[a]["events"][0]["id"] for a in asks}
    assert len(ids) == 3
    for tid in ids:
        assert turn_row(d, tid).finish_reason == "stop"


# --- clawd's own routes -----------------------------------------------------------------------


def test_status(fake_daemon):
    d = fake_daemon
    HTTP.post(d.url + CHAT, json=body(user("one")))
    r = HTTP.get(d.url + "/clawd/status")
    assert r.status_code == 200
    s = r.json()
    assert s["pid"] == os.getpid()
    assert (s["engine"], s["model"], s["architecture"], s["n_ctx"]) == ("fake", MODEL, "fake", 512)
    assert s["chat_format"] == "transcript"
    assert s["host"] == "127.0.0.1" and s["port"] == d.state.port
    assert s["active_adapter"] is None
    assert s["busy"] is False and s["queued"] == 0
    assert s["turns"] == 1 and s["sessions"] == 1
    assert os.path.isfile(s["db_path"])
    assert s["home"] == str(d.home)
    assert s["uptime_s"] >= 0
    import clawd

    assert s["version"] == clawd.__version__


def test_turn_and_session_routes(fake_daemon):
    d = fake_daemon
    c = HTTP.post(d.url + CHAT, json=body(user("route check"))).json()
    t = HTTP.get(d.url + f"/clawd/turns/{c['id']}")
    assert t.status_code == 200
    t = t.json()
    assert t["id"] == c["id"]
    assert t["request_messages"] == [user("route check")]
    assert t["response_text"] == "You said: route check"
    assert t["finish_reason"] == "stop"
    assert t["prompt_tokens"] == c["usage"]["prompt_tokens"]
    assert t["completion_tokens"] == c["usage"]["completion_tokens"]
    assert (t["engine"], t["model"], t["turn_type"]) == ("fake", MODEL, "main")
    assert t["adapter_id"] is None and t["requery_of"] is None
    assert {"ttft_ms", "total_ms"} <= set(t["timings"])

    sessions = HTTP.get(d.url + "/clawd/sessions").json()
    assert [s["id"] for s in sessions] == [t["session_id"]]
    st = HTTP.get(d.url + f"/clawd/sessions/{t['session_id']}/turns").json()
    assert [x["id"] for x in st] == [c["id"]]
    assert HTTP.get(d.url + "/clawd/sessions/s-nope/turns").json() == []

    assert_openai_error(HTTP.get(d.url + "/clawd/turns/chatcmpl-nope"), 404)


def test_openapi_served(fake_daemon):
    r = HTTP.get(fake_daemon.url + "/openapi.json")
    assert r.status_code == 200
    spec = r.json()
    assert spec["openapi"].startswith("3.")
    for path in ("/v1/chat/completions", "/v1/models", "/clawd/status", "/clawd/turns/{turn_id}"):
        assert path in spec["paths"]


def test_score_route(fake_daemon):
    """/clawd/score returns the same per-token log-probs as scoring the rendered prompt and the
    completion directly, logs no turn, and rejects unknown or unloaded adapters."""
    d = fake_daemon
    engine = d.state.model.runner.engine
    messages = [user("what is the capital of Spain?")]
    r = HTTP.post(d.url + "/clawd/score", json={"messages": messages, "completion": "Madrid.", "adapter": "base"})
    assert r.status_code == 200, r.text
    out = r.json()
    prompt = d.state.model.format.render([Message(**m) for m in messages]).prompt
    expected = d.run(
        d.state.model.runner.call(
            engine.score,
            engine.tokenize(prompt, add_bos=True),
            engine.tokenize("Madrid.", add_bos=False, special=False),
        )
    )
    assert out["adapter"] is None
    assert len(out["tokens"]) == len(out["logprobs"]) == len(expected.logprobs)
    np.testing.assert_allclose(out["logprobs"], expected.logprobs, rtol=1e-6)
    assert out["total"] == pytest.approx(float(expected.logprobs.sum()), rel=1e-5)
    active = HTTP.post(d.url + "/clawd/score", json={"messages": messages, "completion": "Madrid."}).json()
    assert active["adapter"] is None and active["logprobs"] == out["logprobs"]  # no adapter is active
    assert HTTP.get(d.url + "/clawd/status").json()["turns"] == 0

    assert_openai_error(
        HTTP.post(d.url + "/clawd/score", json={"messages": messages, "completion": "x", "adapter": "a-missing"}), 404
    )
    assert_openai_error(HTTP.post(d.url + "/clawd/score", json={"messages": messages, "completion": ""}), 400)
    assert_openai_error(HTTP.post(d.url + "/clawd/score", json={"messages": [], "completion": "x"}), 400)
    too_long = "x" * (engine.info.n_ctx + 10)
    assert_openai_error(
        HTTP.post(d.url + "/clawd/score", json={"messages": messages, "completion": too_long}),
        400,
        code="context_length_exceeded",
    )
