"""Inputs are cleaned at the edge (issue 18 item 8): every shape of a wrong body, id or limit
is the client's 4xx with an OpenAI error object, never a 500, an empty reply or an echo of
what was sent; 405s name the allowed methods; the schema documents what the API answers."""

from __future__ import annotations

import copy
import json
import random

import httpx
import pytest

from tests.conftest import start_daemon

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def fake_daemon(tmp_path_factory):
    """One daemon for the module: every test here only reads, or writes what no other test counts."""
    from clawd.engines.fake import Engine

    home = tmp_path_factory.mktemp("clawd-home")
    d = start_daemon(home, Engine(n_ctx=512))
    token = {"Authorization": f"Bearer {d.state.token}"}  # as the CLI and TUI send it (needed for writes)
    d.client = lambda **kw: httpx.Client(base_url=d.url, timeout=30, headers=token, **kw)
    yield d
    d.stop()


def assert_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def openwebui(message_id: str = "m1", content: str = "an answer") -> dict:
    return {
        "type": "rating",
        "data": {"rating": 1, "reason": "", "comment": ""},
        "meta": {"message_id": message_id, "chat_id": "c1"},
        "snapshot": {
            "chat": {
                "history": {"messages": {message_id: {"id": message_id, "role": "assistant", "content": content}}},
                "messages": [{"id": message_id, "role": "assistant", "content": content}],
            }
        },
    }


# Every field clawd reads in an Open WebUI payload, with a value of the wrong shape.
WRONG_SHAPES = [
    ("data", "x"),
    ("data", [1]),
    ("data.rating", {"a": 1}),
    ("data.rating", None),
    ("data.comment", {"a": 1}),
    ("data.reason", [1]),
    ("meta", "x"),
    ("meta", 3),
    ("meta.message_id", {"a": 1}),
    ("snapshot", "x"),
    ("snapshot", []),
    ("snapshot.chat", "x"),
    ("snapshot.chat.history", "x"),
    ("snapshot.chat.history.messages", []),
    ("snapshot.chat.messages", "x"),
    ("snapshot.chat.chat", 7),
    ("type", {"a": 1}),
]


def _set(body: dict, dotted: str, value) -> dict:
    out = copy.deepcopy(body)
    node = out
    *parents, last = dotted.split(".")
    for key in parents:
        node = node[key]
    node[last] = value
    return out


@pytest.mark.parametrize("field,value", WRONG_SHAPES)
def test_openwebui_feedback_with_a_wrong_shape_is_a_400(fake_daemon, field, value):
    with fake_daemon.client() as c:
        assert_error(c.post("/clawd/feedback", json=_set(openwebui(), field, value)), 400)


def _mutations(rng: random.Random, node, depth=0):
    """A copy of `node` with random leaves and subtrees replaced by values of other types."""
    pool = [None, 0, -1, 2**70, 1.5, "", "x", "\x00", [], [1, "a"], {}, {"k": []}, True]
    if isinstance(node, dict):
        return {k: (rng.choice(pool) if rng.random() < 0.3 else _mutations(rng, v, depth + 1)) for k, v in node.items()}
    if isinstance(node, list):
        return [_mutations(rng, v, depth + 1) for v in node]
    return rng.choice(pool) if rng.random() < 0.5 else node


def test_400_random_feedback_bodies_never_get_a_server_error(fake_daemon):
    """The issue's experiment: 22 of 400 random bodies were 500s."""
    rng = random.Random(18)
    seen = set()
    with fake_daemon.client() as c:
        for _ in range(400):
            body = _mutations(rng, openwebui())
            r = c.post("/clawd/feedback", content=json.dumps(body), headers={"content-type": "application/json"})
            assert r.status_code < 500, (body, r.text[:300])
            assert_error(r, r.status_code)
            seen.add(r.status_code)
    assert seen <= {400, 404}


@pytest.mark.parametrize("limit", ["0", "-5", str(10**30), "1000000", "-99999999999999999999999"])
@pytest.mark.parametrize("route", ["/clawd/signals", "/clawd/sessions", "/clawd/sessions/s-1/turns"])
def test_limits_are_clamped(fake_daemon, route, limit):
    with fake_daemon.client() as c:
        r = c.get(route, params={"limit": limit})
    assert r.status_code == 200, r.text
    assert isinstance(r.json(), list)


def test_limits_still_limit(fake_daemon):
    with fake_daemon.client() as c:
        for i in range(3):
            r = c.post(
                CHAT,
                json={"model": "fake-model", "messages": [{"role": "user", "content": f"q{i}"}], "session_id": "s-lim"},
            )
            assert r.status_code == 200, r.text
        assert len(c.get("/clawd/sessions/s-lim/turns", params={"limit": 2}).json()) == 2
        assert len(c.get("/clawd/sessions/s-lim/turns", params={"limit": 0}).json()) == 1  # clamped up to 1
        assert len(c.get("/clawd/sessions/s-lim/turns", params={"limit": 10**30}).json()) == 3


BAD_SESSION_IDS = ["a\r\nSet-Cookie: x=1", "tab\there", "nul\x00", "é", "", "x" * 129, "y" * 300_000]


@pytest.mark.parametrize("sid", BAD_SESSION_IDS, ids=lambda s: repr(s[:12]))
def test_a_bad_session_id_in_the_body_is_a_400_that_does_not_echo_it(fake_daemon, sid):
    with fake_daemon.client() as c:
        r = c.post(
            CHAT, json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "session_id": sid}
        )
    err = assert_error(r, 400)
    assert err["param"] == "session_id"
    assert len(r.content) < 1000 and "x-clawd-session-id" not in r.headers
    if len(sid) > 20:
        assert sid[:20] not in r.text


@pytest.mark.parametrize("sid", [b"tab\there", "\xe9t\xe9".encode("latin-1"), b"z" * 200])
def test_a_bad_session_id_header_is_a_400(fake_daemon, sid):
    with fake_daemon.client() as c:
        r = c.post(
            CHAT,
            json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-session-id": sid},
        )
    assert assert_error(r, 400)["param"] == "session_id"
    assert "x-clawd-session-id" not in r.headers


def test_a_good_session_id_is_kept(fake_daemon):
    sid = "my session: 1 (printable ~ ASCII)"
    with fake_daemon.client() as c:
        r = c.post(
            CHAT, json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "session_id": sid}
        )
        assert r.status_code == 200 and r.headers["x-clawd-session-id"] == sid
        assert c.get(f"/clawd/sessions/{sid}/turns").status_code == 200


@pytest.mark.parametrize("path", ["/clawd/sessions/%0A", "/clawd/sessions/" + "q" * 300, "/clawd/sessions/%C3%A9"])
def test_a_bad_session_id_in_the_path_is_a_400(fake_daemon, path):
    with fake_daemon.client() as c:
        assert_error(c.delete(path), 400)
        assert_error(c.get(path + "/turns"), 400)


def test_405_names_the_allowed_methods(fake_daemon):
    with fake_daemon.client() as c:
        r = c.put("/clawd/training")
        assert_error(r, 405)
        assert set(r.headers["allow"].split(", ")) >= {"GET", "POST"}
        r = c.get(CHAT)
        assert_error(r, 405)
        assert r.headers["allow"] == "POST"


def test_the_schema_documents_400_not_422_and_every_error(fake_daemon):
    with fake_daemon.client() as c:
        schema = c.get("/openapi.json").json()
    assert "422" not in json.dumps(schema["paths"])
    assert "HTTPValidationError" not in schema.get("components", {}).get("schemas", {})
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            codes = set(op["responses"])
            assert {"400", "401", "404", "405", "500", "503"} <= codes, (method, path, codes)
    assert "Allow" in schema["paths"]["/clawd/health"]["get"]["responses"]["405"]["headers"]
    body = schema["paths"]["/clawd/feedback"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    members = json.dumps(body)
    assert "FeedbackRequest" in members and "OpenWebUIFeedback" in members
    comps = schema["components"]["schemas"]
    assert "turn_id" in comps["FeedbackRequest"]["properties"] and "data" in comps["OpenWebUIFeedback"]["properties"]


def test_tool_call_arguments_nested_deeper_than_json_can_walk_are_text_not_a_500(tmp_path):
    """An echoed assistant call whose arguments nest 1500 deep: sessions compare them as text
    (and a chat template renders them as text) instead of raising RecursionError."""
    from clawd.engines.fake import Engine
    from clawd.templates import _json_or_text

    deep = "[" * 1500
    history = [
        {"role": "user", "content": "call it"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": deep}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]
    d = start_daemon(tmp_path / "home", Engine(n_ctx=4096))  # room for the 1500 brackets
    try:
        auth = {"Authorization": f"Bearer {d.state.token}"}
        r = httpx.post(d.url + CHAT, json={"model": "m", "messages": history, "max_tokens": 4}, headers=auth)
    finally:
        d.stop()
    assert r.status_code == 200, r.text[:300]
    assert _json_or_text(deep) == deep
