"""Repeats are punishments only within one conversation (issue 15), through the real HTTP API,
store and miner (rules judge): a regenerate is a repeat in the same session, or from the same
client without one. Identical requests in separate sessions, or from another client, say
nothing about an earlier answer, and a retry after a failed or cut-off turn is no regenerate."""

from __future__ import annotations

import httpx
import pytest

from clawd.engines.fake import Engine as FakeEngine
from clawd.store import turns
from tests.conftest import AUTH
from tests.test_miner import CHAT, MODEL, Convo, api_signals, mine, mining_daemon, stored_turn, wait_for

HELLO = [{"role": "user", "content": "Say hello"}]


@pytest.fixture
def http():
    with httpx.Client(timeout=30, headers=AUTH) as c:
        yield c


@pytest.fixture
def md(clawd_home):
    d = mining_daemon(clawd_home, FakeEngine(n_ctx=2048, token_delay=0.01))
    yield d
    d.stop()


def post(d, http, headers: dict | None = None, messages=HELLO) -> str:
    r = http.post(d.url + CHAT, json={"model": MODEL, "messages": messages, "temperature": 0}, headers=headers or {})
    assert r.status_code == 200, r.text
    return r.headers["x-clawd-turn-id"]


def minus_ones(d, http) -> dict:
    mine(d)
    return {t: s for t, s in api_signals(http, d).items() if s["reward"] == -1}


def test_ten_identical_requests_from_one_client_in_separate_sessions_make_no_minus_one(md, http):
    ids = [
        post(md, http, {"User-Agent": "ci-script", "X-Session-Id": f"run-{i}", "X-Session-Done": "1"})
        for i in range(10)
    ]
    assert all(stored_turn(md, t).requery_of is None for t in ids)
    assert minus_ones(md, http) == {}
    assert all(api_signals(http, md)[t]["status"] in ("ready", "empty") for t in ids)  # mined, not left waiting


def test_the_same_request_from_other_clients_is_no_regenerate(md, http):
    first = post(md, http, {"User-Agent": "app-a", "X-Session-Done": "1"})
    others = [post(md, http, {"User-Agent": f"app-{c}", "X-Session-Done": "1"}) for c in "bcd"]
    assert all(stored_turn(md, t).requery_of is None for t in others)
    assert len({stored_turn(md, t).session_id for t in [first, *others]}) == 4
    assert minus_ones(md, http) == {}


def test_a_same_session_repeat_is_still_a_regenerate(md, http):
    c = Convo(md, http, headers={"User-Agent": "chat-ui"})
    t1 = c.say("Say hello")
    t2 = c.regenerate()
    assert stored_turn(md, t2).requery_of == t1
    assert minus_ones(md, http)[t1]["reward_source"] == "requery"


def test_a_retry_after_a_disconnect_is_no_regenerate(md, http):
    # The client goes away mid-answer (a timeout, a dropped connection), then sends it again.
    with httpx.Client(timeout=30, headers=AUTH) as gone:
        with gone.stream(
            "POST", md.url + CHAT, json={"model": MODEL, "messages": HELLO, "stream": True, "max_tokens": 200}
        ) as r:
            assert r.status_code == 200
            cut = r.headers["x-clawd-turn-id"]
            next(r.iter_lines())  # the first chunk arrived; now the connection drops
    wait_for(
        lambda: (t := md.run(turns.get_turn(md.state.db, cut))) is not None and t.finish_reason == "cancelled",
        what="the cut-off turn to be recorded as cancelled",
    )
    retry = post(md, http)
    assert stored_turn(md, retry).requery_of is None
    assert stored_turn(md, retry).session_id == stored_turn(md, cut).session_id
    assert minus_ones(md, http) == {}
