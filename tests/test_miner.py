"""The miner's published contract (METHOD.md §1-4): scripted conversations go through the
real HTTP API of a real daemon, the miner runs, and the signals come back through
GET /clawd/signals and the store. Teacher arrays are checked against an independent
scoring (the fake engine's documented distribution; llama-cpp-python's high-level API on
a tiny real GGUF), hint selection against hand-made overlaps, and judge outages against
endpoints that are down and come back."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from clawd.config import MiningSettings, TrainingSettings
from clawd.engines.base import ScoreResult
from clawd.engines.fake import VOCAB
from clawd.engines.fake import Engine as FakeEngine
from clawd.engines.runner import EngineRunner
from clawd.errors import ContextLengthExceeded, EngineError
from clawd.judge import JudgeInput
from clawd.judge_rules import RulesJudge
from clawd.miner import MAX_ATTEMPTS, Miner, overlap
from clawd.protocol import Message
from clawd.served import HINT_MARKER, ServedModel
from clawd.store import signals, turns
from clawd.store.db import Database
from clawd.templates import TranscriptFormat
from tests.conftest import AUTH, start_daemon

MODEL = "fake-model"
CHAT = "/v1/chat/completions"
RULES = {"CLAWD_MINING_ENABLED": 1, "CLAWD_MINING_JUDGE": "rules", "CLAWD_MINING_HINT_JUDGE": "rules"}
THANKS = "Thanks, that's perfect!"
CORRECTION = "No, I meant a warm color like red or orange."
CORRECTION_HINT = "I meant a warm color like red or orange."  # the rules strip the "No," lead-in
UNRELATED = "What is the tallest mountain on Earth?"
LP_ON, LP_OFF = np.log(0.9), np.log(0.1 / (VOCAB - 1))  # the fake engine's documented distribution


# --- helpers ------------------------------------------------------------------------------


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


class Convo:
    """One client-side conversation: keeps the messages and re-sends them, as chat UIs do."""

    def __init__(self, d, http: httpx.Client, model: str = MODEL, headers: dict | None = None, **params):
        self.d, self.http, self.model = d, http, model
        self.headers = headers or {}
        self.params = {"temperature": 0, **params}
        self.messages: list[dict] = []
        self.turn_ids: list[str] = []

    def _post(self, messages: list[dict], headers: dict) -> tuple[str, str]:
        r = self.http.post(
            self.d.url + CHAT,
            json={"model": self.model, "messages": messages, **self.params},
            headers={**self.headers, **headers},
        )
        assert r.status_code == 200, r.text
        return r.headers["x-clawd-turn-id"], r.json()["choices"][0]["message"]["content"]

    def say(self, text: str, **headers) -> str:
        self.messages.append(user(text))
        tid, reply = self._post(self.messages, headers)
        self.messages.append(assistant(reply))
        self.turn_ids.append(tid)
        return tid

    def regenerate(self) -> str:
        """Send the same messages again (the UI's regenerate button)."""
        tid, reply = self._post(self.messages[:-1], {})
        self.messages[-1] = assistant(reply)
        self.turn_ids.append(tid)
        return tid


def mine(d) -> int:
    return d.run(d.state.miner.run_until_idle())


def api_signal(http: httpx.Client, d, turn_id: str) -> dict:
    r = http.get(d.url + f"/clawd/signals/{turn_id}")
    assert r.status_code == 200, r.text
    return r.json()


def api_signals(http: httpx.Client, d, **params) -> dict[str, dict]:
    r = http.get(d.url + "/clawd/signals", params=params)
    assert r.status_code == 200, r.text
    return {s["turn_id"]: s for s in r.json()}


def stored_signal(d, turn_id: str) -> signals.Signal:
    sig = d.run(signals.get(d.state.db, turn_id))
    assert sig is not None
    return sig


def stored_turn(d, turn_id: str) -> turns.TurnRecord:
    rec = d.run(turns.get_turn(d.state.db, turn_id))
    assert rec is not None
    return rec


def pair_only(d) -> None:
    """The pairing half of Miner.step without mining, to observe the 'pending' state."""

    async def go():
        await signals.create_missing(d.state.db)
        for tid in await signals.due(d.state.db, "waiting", limit=1000):
            await d.state.miner._pair(tid)

    d.run(go())


def feedback(http, d, **payload) -> httpx.Response:
    return http.post(d.url + "/clawd/feedback", json=payload)


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    payload = r.json()
    assert set(payload) == {"error"}
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    return err


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_for(predicate, timeout: float = 15, what: str = "condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def http():
    with httpx.Client(headers=AUTH, timeout=30) as c:
        yield c


def mining_daemon(home, engine=None, **env):
    """A daemon with mining on and rules judges, its background miner stopped so that each
    test decides when mining happens (run_until_idle) and can observe every state."""
    d = start_daemon(home, engine or FakeEngine(n_ctx=2048), env_extra={**RULES, **env})
    d.run(d.state.miner.stop())
    return d


@pytest.fixture
def md(clawd_home):
    d = mining_daemon(clawd_home)
    yield d
    d.stop()


# --- evaluative signal from the conversation ----------------------------------------------------


def test_thanks_is_plus_one(md, http):
    c = Convo(md, http)
    t1 = c.say("What color is the sky?")
    t2 = c.say(THANKS)
    assert mine(md) >= 1
    s = api_signal(http, md, t1)
    assert (s["status"], s["reward"], s["reward_source"]) == ("ready", 1, "rules")
    assert s["next_turn_id"] == t2 and s["next_state"] == THANKS and s["next_role"] == "user"
    assert s["session_id"] == stored_turn(md, t1).session_id
    # approval carries no hindsight: no hint, no teacher arrays
    assert s["hints"] == [] and s["hint"] is None and s["teacher_arrays"] is False
    assert api_signal(http, md, t2)["status"] == "waiting"  # no next state yet


def test_correction_is_minus_one_with_hint_and_teacher_arrays(md, http):
    c = Convo(md, http)
    t1 = c.say("Suggest a color for my living room.")
    c.say(CORRECTION)
    mine(md)
    s = api_signal(http, md, t1)
    assert (s["status"], s["reward"], s["reward_source"]) == ("ready", -1, "rules")
    assert s["hints"] == [{"text": CORRECTION_HINT, "source": "user", "overlap": s["hints"][0]["overlap"]}]
    assert s["hint"] == CORRECTION_HINT
    assert s["teacher_arrays"] is True and s["top_k"] == 4

    rec, sig = stored_turn(md, t1), stored_signal(md, t1)
    n, k = len(rec.response_ids), 4
    assert n == len("You said: Suggest a color for my living room.") + 1
    assert sig.teacher_logprobs.shape == (n,) and sig.teacher_logprobs.dtype == np.float32
    assert sig.teacher_top_logprobs.shape == (n, k) and sig.student_top_logprobs.shape == (n, k)
    assert sig.student_top_ids.shape == (n, k) and sig.student_top_ids.dtype == np.int32
    # Independent reference: the fake engine's documented model. The hint sits below the
    # request's "User:" line, so teacher and student intend the same reply: log 0.9 on the
    # intended (here: greedily sampled) token, the rest uniform; ties break to low ids.
    np.testing.assert_array_equal(sig.student_top_ids[:, 0], rec.response_ids)
    for i, tok in enumerate(rec.response_ids):
        rest = [t for t in range(VOCAB) if t != tok][: k - 1]
        np.testing.assert_array_equal(sig.student_top_ids[i, 1:], rest)
    np.testing.assert_allclose(sig.teacher_logprobs, LP_ON, atol=1e-6)
    np.testing.assert_allclose(sig.student_top_logprobs[:, 0], LP_ON, atol=1e-6)
    np.testing.assert_allclose(sig.student_top_logprobs[:, 1:], LP_OFF, atol=1e-6)
    np.testing.assert_allclose(sig.teacher_top_logprobs, sig.student_top_logprobs, atol=1e-6)
    assert s["hints"][0]["overlap"] == n * k  # identical distributions overlap fully


def test_regenerate_is_a_requery(md, http):
    c = Convo(md, http)
    t1 = c.say("Tell me a joke.")
    t2 = c.regenerate()
    assert stored_turn(md, t2).requery_of == t1
    mine(md)
    s = api_signal(http, md, t1)
    assert (s["status"], s["reward"], s["reward_source"]) == ("ready", -1, "requery")
    assert s["next_state"] is None  # a regenerate replaces the answer; it is no next state
    assert api_signal(http, md, t2)["status"] == "waiting"


def test_restated_request_is_a_requery(md, http):
    c = Convo(md, http)
    t1 = c.say("How do I sort a list in Python?")
    t2 = c.say("how do I sort a list in python")
    assert stored_turn(md, t2).requery_of is None  # not a regenerate: a new message
    mine(md)
    s = api_signal(http, md, t1)
    assert (s["status"], s["reward"], s["reward_source"]) == ("ready", -1, "requery")
    assert s["next_turn_id"] == t2


def test_unrelated_follow_up_is_zero_and_empty(md, http):
    c = Convo(md, http)
    t1 = c.say("Tell me a joke.")
    c.say(UNRELATED)
    mine(md)
    s = api_signal(http, md, t1)
    assert (s["status"], s["reward"], s["reward_source"]) == ("empty", 0, "none")
    assert s["hints"] == [] and s["teacher_arrays"] is False
    assert t1 not in md.run(signals.trainable_ids(md.state.db))


# --- explicit feedback ---------------------------------------------------------------------------


def test_thumbs_override_the_judge(md, http):
    a = Convo(md, http)
    thanked = a.say("What color is the sky?")
    a.say(THANKS)
    b = Convo(md, http)
    corrected = b.say("Suggest a color for my living room.")
    b.say(CORRECTION)
    c = Convo(md, http)
    flipped = c.say("Name a fruit.")
    c.say(THANKS)

    assert feedback(http, md, turn_id=thanked, rating="down").status_code == 200
    assert feedback(http, md, turn_id=corrected, rating=1).status_code == 200
    for rating in ("down", "up"):  # the newest thumb wins
        assert feedback(http, md, turn_id=flipped, rating=rating).status_code == 200
    mine(md)
    s = api_signal(http, md, thanked)
    assert (s["status"], s["reward"], s["reward_source"]) == ("ready", -1, "feedback")
    s = api_signal(http, md, corrected)
    assert (s["status"], s["reward"], s["reward_source"]) == ("ready", 1, "feedback")
    assert s["hint"] == CORRECTION_HINT  # the directive signal stays: the user still said it
    s = api_signal(http, md, flipped)
    assert (s["reward"], s["reward_source"]) == (1, "feedback")


def test_correction_feedback_becomes_hint(md, http):
    c = Convo(md, http)
    t1 = c.say("Suggest a color for my living room.")
    text = "Use a warm color such as terracotta."
    r = feedback(http, md, turn_id=t1, correction=f"  {text} ")
    assert r.status_code == 200, r.text
    assert r.json()["turn_id"] == t1
    assert [(x["kind"], x["text"]) for x in r.json()["recorded"]] == [("correction", text)]
    mine(md)  # the last turn of its session: the feedback alone makes it minable
    s = api_signal(http, md, t1)
    assert (s["status"], s["reward"], s["reward_source"]) == ("ready", -1, "feedback")
    assert [(h["text"], h["source"]) for h in s["hints"]] == [(text, "feedback")]
    assert s["hint"] == text and s["teacher_arrays"] is True


def test_feedback_after_mining_reopens_the_turn(md, http):
    c = Convo(md, http)
    t1 = c.say("What color is the sky?")
    c.say(THANKS)
    mine(md)
    assert api_signal(http, md, t1)["reward"] == 1
    assert feedback(http, md, turn_id=t1, rating="down", correction="Say it is blue, in one word.").status_code == 200
    s = api_signal(http, md, t1)
    assert s["status"] == "pending"  # re-opened: new evidence
    mine(md)
    s = api_signal(http, md, t1)
    assert (s["status"], s["reward"], s["reward_source"]) == ("ready", -1, "feedback")
    assert s["hint"] == "Say it is blue, in one word." and s["teacher_arrays"] is True


def test_next_message_after_feedback_on_the_last_turn_still_counts(md, http):
    """Thumbs down on the newest answer, then the user types the correction: the thumb
    mined the turn before its next state existed; the correction must still become its hint."""
    c = Convo(md, http)
    t1 = c.say("Suggest a color for my living room.")
    assert feedback(http, md, turn_id=t1, rating="down").status_code == 200
    mine(md)
    s = api_signal(http, md, t1)
    assert (s["status"], s["reward"], s["hint"]) == ("ready", -1, None)
    t2 = c.say(CORRECTION)
    mine(md)
    s = api_signal(http, md, t1)
    assert (s["status"], s["reward"], s["reward_source"]) == ("ready", -1, "feedback")
    assert (s["next_turn_id"], s["next_state"]) == (t2, CORRECTION)
    assert s["hint"] == CORRECTION_HINT and s["teacher_arrays"] is True
    # a regenerate is no next state, even for a turn mined early
    c2 = Convo(md, http)
    u1 = c2.say("Name a fruit.")
    assert feedback(http, md, turn_id=u1, rating="up").status_code == 200
    mine(md)
    c2.regenerate()
    mine(md)
    s = api_signal(http, md, u1)
    assert (s["reward"], s["reward_source"], s["next_turn_id"]) == (1, "feedback", None)


def test_feedback_while_the_turn_is_being_mined_is_not_lost(md, http):
    """A thumb that arrives while the miner is scoring the turn re-opens it; the miner's
    result, computed from older evidence, must not overwrite that."""
    c = Convo(md, http)
    t1 = c.say("Suggest a color for my living room.")
    c.say(CORRECTION)
    engine = md.state.model.runner.engine
    real_score, entered, go = engine.score, threading.Event(), threading.Event()

    def held_score(*a, **kw):
        entered.set()
        assert go.wait(10)
        return real_score(*a, **kw)

    engine.score = held_score
    try:
        job = asyncio.run_coroutine_threadsafe(md.state.miner.run_until_idle(), md.loop)
        assert entered.wait(10)  # judged -1 by the rules, now scoring the hint
        assert feedback(http, md, turn_id=t1, rating="up").status_code == 200
        go.set()
        job.result(30)
    finally:
        go.set()
        engine.score = real_score
    s = api_signal(http, md, t1)
    assert (s["status"], s["reward"], s["reward_source"]) == ("ready", 1, "feedback")


# --- what gets a signal, and when ------------------------------------------------------------


def test_side_turns_get_no_signal_and_are_no_next_state(md, http):
    sid = {"X-Session-Id": "agent-1"}
    c = Convo(md, http, headers=sid)
    main1 = c.say("What color is the sky?")
    side = Convo(md, http, headers={**sid, "X-Turn-Type": "side"}).say("Summarise the chat for memory.")
    mine(md)
    assert http.get(md.url + f"/clawd/signals/{side}").status_code == 404
    assert side not in api_signals(http, md)
    assert api_signal(http, md, main1)["status"] == "waiting"  # a side turn is no next state
    main2 = c.say(THANKS)
    mine(md)
    s = api_signal(http, md, main1)
    assert (s["reward"], s["next_turn_id"]) == (1, main2)


def test_last_turn_waits_until_next_message_or_session_done(md, http):
    c = Convo(md, http)
    t1 = c.say("What color is the sky?")
    assert mine(md) == 0
    assert api_signal(http, md, t1)["status"] == "waiting"
    t2 = c.say(THANKS)
    assert api_signal(http, md, t1)["status"] == "waiting"  # until the miner pairs it
    mine(md)
    assert api_signal(http, md, t1)["status"] == "ready"
    assert api_signal(http, md, t2)["status"] == "waiting"

    t3 = c.say("Bye now, see you tomorrow.", **{"X-Session-Done": "1"})
    pair_only(md)
    assert api_signal(http, md, t2)["status"] == "pending"  # it has a next state now
    assert api_signal(http, md, t3)["status"] == "pending"  # the session is closed: nothing more comes
    mine(md)
    s = api_signal(http, md, t3)
    assert (s["status"], s["reward"], s["reward_source"], s["next_state"]) == ("empty", 0, "none", None)
    sessions = http.get(md.url + "/clawd/sessions").json()
    assert [x["done"] for x in sessions if x["id"] == stored_turn(md, t3).session_id] == [True]


def test_background_miner_mines_on_its_own(clawd_home, http):
    """Without anyone driving it, the daemon's miner pairs and mines new turns."""
    d = start_daemon(clawd_home, FakeEngine(n_ctx=2048), env_extra=RULES)
    try:
        c = Convo(d, http)
        t1 = c.say("Suggest a color for my living room.")
        c.say(CORRECTION)
        t0 = time.monotonic()
        s = wait_for(lambda: (x := api_signal(http, d, t1))["status"] == "ready" and x, what="background mining")
        # a new turn wakes the miner at once (its poll interval is 5 s)
        assert time.monotonic() - t0 < 2.5
        assert (s["reward"], s["hint"]) == (-1, CORRECTION_HINT)
        status = http.get(d.url + "/clawd/status").json()
        assert status["miner"]["mined"] >= 1 and status["miner"]["judge"] == "rules"
        assert status["signals"]["ready"] == 1 and status["signals"]["waiting"] == 1
    finally:
        d.stop()


def test_a_poke_during_a_step_is_not_lost():
    """poke() means "look now": one that arrives while a step runs wakes the next step at
    once instead of waiting out the poll interval."""

    async def go():
        miner = Miner(None, None, MiningSettings(judge="rules", hint_judge="rules"))
        calls = []

        async def step():
            calls.append(time.monotonic())
            if len(calls) == 1:
                miner.poke()  # a turn is recorded while this step is still working
            return False  # nothing minable

        miner.step = step
        task = asyncio.create_task(miner.run(poll_s=30))
        try:
            for _ in range(200):
                if len(calls) >= 2:
                    break
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return calls

    calls = asyncio.run(go())
    assert len(calls) >= 2, "the poke made during the step was lost (the next step waits for the poll)"
    assert calls[1] - calls[0] < 1.0


def test_stopping_the_miner_mid_write_leaves_the_store_writable(tmp_path):
    """Miner.stop() cancels whatever the miner awaits, including the BEGIN of a write; the
    daemon's one connection must not be left inside a transaction that nobody ends."""

    async def go():
        db = await Database.open(tmp_path / "clawd.db")
        try:
            task = asyncio.create_task(signals.create_missing(db))
            await asyncio.sleep(0)  # the miner's write is now waiting on BEGIN IMMEDIATE
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            # every later write (turns, feedback, signals) goes through the same connection
            assert await asyncio.wait_for(signals.create_missing(db), 10) == 0
            assert not db.conn.in_transaction
        finally:
            await db.close()

    asyncio.run(go())


# --- veto, forget, errors --------------------------------------------------------------------------


def test_a_long_history_never_crowds_out_new_signals(md, http, monkeypatch):
    """What a training job takes from a real database: learned turns and other models' turns are
    excluded in SQL, and the train / held-out split happens before the caps, so neither old
    learned signals nor piled-up held-out ones can push new signals past a limit."""
    import hashlib

    from clawd import jobs as data

    ids = []
    for q in ("What color is the sky?", "What color is grass?", "What color is snow?", "What color is coal?"):
        c = Convo(md, http)
        ids.append(c.say(q))
        c.say(THANKS)
    mine(md)
    db = md.state.db
    assert md.run(signals.trainable_ids(db)) == ids  # oldest first
    assert md.run(signals.trainable_ids(db, exclude=set(ids[:2]))) == ids[2:]
    assert [s.turn_id for s in md.run(signals.get_many(db, ids[::-1]))] == ids[::-1]  # in the asked order
    assert md.run(signals.trainable_ids(db, model=MODEL)) == ids
    assert md.run(signals.trainable_ids(db, model="another-model")) == []  # its ids mean nothing here

    # A fraction that holds out exactly the two turns with the smallest hashes.
    h = {t: int.from_bytes(hashlib.sha256(t.encode()).digest()[:8], "big") / 2**64 for t in ids}
    fraction = sorted(h.values())[2]
    held = [t for t in ids if h[t] < fraction]
    train = [t for t in ids if t not in held]
    every = TrainingSettings(holdout=fraction, holdout_min=0)  # hold out from the first signal
    assert md.run(data.split_signals(db, MODEL, every)) == (train, held)
    monkeypatch.setattr(data, "MAX_TRAIN", 1)
    monkeypatch.setattr(data, "MAX_HOLDOUT", 1)
    assert md.run(data.split_signals(db, MODEL, every)) == (train[:1], held[-1:])  # held out: the newest


def test_veto_unveto_round_trip(md, http, monkeypatch, capsys):
    from clawd import cli

    c = Convo(md, http)
    t1 = c.say("What color is the sky?")
    c.say(THANKS)
    mine(md)
    trainable = lambda: md.run(signals.trainable_ids(md.state.db))  # noqa: E731
    assert trainable() == [t1]

    r = http.post(md.url + f"/clawd/signals/{t1}/veto")
    assert r.status_code == 200 and r.json()["vetoed"] is True and r.json()["turn_id"] == t1
    assert api_signal(http, md, t1)["vetoed"] is True
    assert trainable() == []
    assert http.get(md.url + "/clawd/status").json()["signals"]["vetoed"] == 1
    r = http.post(md.url + f"/clawd/signals/{t1}/unveto")
    assert r.status_code == 200 and r.json()["vetoed"] is False
    assert trainable() == [t1]

    # the same through the CLI, which talks to the daemon over HTTP
    monkeypatch.setenv("CLAWD_HOME", str(md.home))
    monkeypatch.setenv("CLAWD_SERVER_PORT", str(md.state.port))
    assert cli.main(["signals", "veto", t1]) == 0
    assert "VETOED" in capsys.readouterr().out
    assert trainable() == []
    assert cli.main(["signals", "unveto", t1]) == 0
    assert trainable() == [t1]
    assert cli.main(["signals", "veto", "chatcmpl-nope"]) == 1
    assert "No signal" in capsys.readouterr().err


def test_forget_session(md, http, monkeypatch, capsys):
    from clawd import cli

    a = Convo(md, http)
    a1 = a.say("Suggest a color for my living room.")
    a2 = a.say(CORRECTION)
    assert feedback(http, md, turn_id=a1, rating="down").status_code == 200
    b = Convo(md, http)
    b1 = b.say("What color is the sky?")
    mine(md)
    sid = stored_turn(md, a1).session_id

    r = http.delete(md.url + f"/clawd/sessions/{sid}")
    assert r.status_code == 200, r.text
    assert r.json() == {"session_id": sid, "forgotten_turns": 2, "retired_adapters": []}
    for tid in (a1, a2):
        assert http.get(md.url + f"/clawd/turns/{tid}").status_code == 404
        assert http.get(md.url + f"/clawd/signals/{tid}").status_code == 404

    async def rows(sql, *args):
        return [tuple(r) for r in await md.state.db.conn.execute_fetchall(sql, args)]

    assert md.run(rows("SELECT COUNT(*) FROM feedback"))[0][0] == 0
    assert md.run(rows("SELECT COUNT(*) FROM signals WHERE session_id = ?", sid))[0][0] == 0
    assert md.run(signals.forgotten_turns(md.state.db)) == {a1, a2}
    assert {r[1] for r in md.run(rows("SELECT turn_id, session_id FROM forgotten"))} == {sid}
    # the other session is untouched
    assert api_signal(http, md, b1)["status"] == "waiting"
    assert http.delete(md.url + f"/clawd/sessions/{sid}").status_code == 404

    monkeypatch.setenv("CLAWD_HOME", str(md.home))
    monkeypatch.setenv("CLAWD_SERVER_PORT", str(md.state.port))
    b_sid = stored_turn(md, b1).session_id
    assert cli.main(["forget", b_sid]) == 0
    assert "1 turns" in capsys.readouterr().out
    assert http.get(md.url + f"/clawd/turns/{b1}").status_code == 404
    assert md.run(signals.forgotten_turns(md.state.db)) == {a1, a2, b1}


def test_unknown_ids_are_404(md, http):
    c = Convo(md, http)
    c.say("hello there")
    for r in (
        http.get(md.url + "/clawd/signals/chatcmpl-nope"),
        http.post(md.url + "/clawd/signals/chatcmpl-nope/veto"),
        http.post(md.url + "/clawd/signals/chatcmpl-nope/unveto"),
        http.delete(md.url + "/clawd/sessions/s-nope"),
        feedback(http, md, turn_id="chatcmpl-nope", rating="up"),
        feedback(http, md, turn_id="chatcmpl-nope", correction="Do it differently please."),
    ):
        assert_openai_error(r, 404)


def openwebui_payload(rating, message_id: str, messages: dict, **data) -> dict:
    """Open WebUI's rating body (CONVENTIONS.md §2)."""
    return {
        "type": "rating",
        "data": {"rating": rating, "model_id": MODEL, "sibling_model_ids": None, "tags": [], **data},
        "meta": {
            "arena": False,
            "model_id": MODEL,
            "message_id": message_id,
            "message_index": 3,
            "chat_id": "7b1c0d2e",
        },
        "snapshot": {
            "chat": {"id": "7b1c0d2e", "title": "Colors", "history": {"currentId": message_id, "messages": messages}}
        },
    }


def test_openwebui_rating_maps_to_the_right_turn(md, http):
    c = Convo(md, http)
    t1 = c.say("What color is the sky?")
    t2 = c.say("Suggest a color for my living room.")
    msgs = {}
    for i, m in enumerate(c.messages):
        mid = f"m{i}"
        msgs[mid] = {
            "id": mid,
            "parentId": f"m{i - 1}" if i else None,
            "role": m["role"],
            "content": m["content"],
            "timestamp": 1767225600 + i,
        }
    assert c.messages[3]["content"] == stored_turn(md, t2).response_text

    r = feedback(http, md, **openwebui_payload(-1, "m3", msgs, reason="Too plain", comment="use a warmer tone please"))
    assert r.status_code == 200, r.text
    assert r.json()["turn_id"] == t2
    assert [x["kind"] for x in r.json()["recorded"]] == ["down", "correction"]
    r = feedback(http, md, **openwebui_payload("1", "m1", msgs))  # the backend also takes strings
    assert r.status_code == 200 and r.json()["turn_id"] == t1
    mine(md)
    s = api_signal(http, md, t2)
    assert (s["reward"], s["reward_source"]) == (-1, "feedback")
    assert [(h["text"], h["source"]) for h in s["hints"]] == [("Too plain use a warmer tone please", "feedback")]
    s = api_signal(http, md, t1)
    assert (s["reward"], s["reward_source"]) == (1, "feedback")

    # a rated message that this daemon never answered
    msgs["m3"]["content"] = "Something another model said."
    assert_openai_error(feedback(http, md, **openwebui_payload(1, "m3", msgs)), 404)


def test_malformed_feedback_is_a_400(md, http):
    tid = Convo(md, http).say("hello there")
    url = md.url + "/clawd/feedback"
    bad = [
        http.post(url, content=b"{not json", headers={"content-type": "application/json"}),
        http.post(url, json=[tid, "up"]),
        http.post(url, json={"turn_id": tid}),  # neither rating nor correction
        http.post(url, json={"turn_id": tid, "correction": "   "}),
        http.post(url, json={"turn_id": tid, "rating": "sideways"}),
        http.post(url, json={"turn_id": tid, "rating": "up", "stars": 5}),
        http.post(url, json={"turn_id": 12, "rating": "up"}),
        http.post(url, json={"type": "rating", "data": {}}),  # Open WebUI without data.rating
        http.post(url, json={"type": "rating", "data": {"rating": 1}, "meta": {"message_id": "x"}}),  # no snapshot
        http.post(url, json={"type": "evaluation", "data": {"rating": 1}}),
    ]
    for r in bad:
        assert_openai_error(r, 400)
    assert assert_openai_error(bad[4], 400)["param"] == "rating"
    mine(md)
    assert api_signal(http, md, tid)["status"] == "waiting"  # nothing was recorded


# --- restart ---------------------------------------------------------------------------------------


def test_restart_catches_up_on_turns_logged_with_mining_off(clawd_home, http):
    d = start_daemon(clawd_home, FakeEngine(n_ctx=2048))  # mining off
    try:
        assert d.state.miner is None
        a = Convo(d, http)
        thanked = a.say("What color is the sky?")
        a.say(THANKS)
        b = Convo(d, http)
        corrected = b.say("Suggest a color for my living room.")
        b.say(CORRECTION)
        assert api_signals(http, d) == {}
        assert http.get(d.url + "/clawd/status").json()["miner"] is None
    finally:
        d.stop()

    d = start_daemon(clawd_home, FakeEngine(n_ctx=2048), env_extra=RULES)  # background miner on
    try:
        got = wait_for(
            lambda: (
                (s := api_signals(http, d))
                and all(s.get(t, {}).get("status") == "ready" for t in (thanked, corrected))
                and s
            ),
            what="catch-up mining",
        )
        assert (got[thanked]["reward"], got[corrected]["reward"]) == (1, -1)
        assert got[corrected]["hint"] == CORRECTION_HINT
        assert len(got) == 4  # every main turn has its row; the two last ones wait
    finally:
        d.stop()


# --- judge outages -----------------------------------------------------------------------------------


class StubOpenAI(ThreadingHTTPServer):
    """A minimal OpenAI-compatible judge endpoint that always answers `reply`."""

    def __init__(self, port: int, reply: str):
        self.reply, self.requests = reply, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _json(self, obj):
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._json({"object": "list", "data": [{"id": "judge-model", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                outer.requests.append(body)
                self._json({"choices": [{"index": 0, "message": {"role": "assistant", "content": outer.reply}}]})

            def log_message(self, *a):
                pass

        super().__init__(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.shutdown()
        self.server_close()


def test_unreachable_endpoint_judge_keeps_turns_pending_until_it_returns(clawd_home, http):
    port = closed_port()
    d = mining_daemon(clawd_home, CLAWD_MINING_JUDGE=f"openai:http://127.0.0.1:{port}/v1", CLAWD_MINING_RETRY_S=1.0)
    stub = None
    try:
        a = Convo(d, http)
        undecided = a.say("Tell me a joke.")
        a.say(UNRELATED)
        b = Convo(d, http)
        thanked = b.say("What color is the sky?")
        b.say(THANKS)
        assert mine(d) == 2  # one mined by the rules, one attempted
        assert mine(d) == 0  # backing off: not retried at once
        s = api_signal(http, d, undecided)
        assert s["status"] == "pending" and s["attempts"] == 1 and s["reward"] is None
        assert f"127.0.0.1:{port}" in s["error"]
        status = http.get(d.url + "/clawd/status").json()
        assert f"127.0.0.1:{port}" in status["miner"]["judge_error"]
        assert status["signals"]["pending"] == 1
        assert api_signal(http, d, thanked)["reward"] == 1  # the rules needed no judge
        # the daemon keeps serving
        r = http.post(d.url + CHAT, json={"model": MODEL, "messages": [user("still there?")], "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "You said: still there?"

        stub = StubOpenAI(port, "The user moved on to a new request. \\boxed{1}")
        retry_at = stored_signal(d, undecided).retry_at
        wait_for(lambda: time.time() >= retry_at, what="the back-off to pass")
        mine(d)
        s = api_signal(http, d, undecided)
        assert (s["status"], s["reward"], s["reward_source"], s["votes"]) == ("ready", 1, "openai", [1, 1, 1])
        assert s["error"] is None
        # the judge saw the user's original request, the answer and what came next
        prompt = stub.requests[0]["messages"][-1]["content"]
        assert "Tell me a joke." in prompt and "You said: Tell me a joke." in prompt and UNRELATED in prompt
        assert stub.requests[0]["model"] == "judge-model" and len(stub.requests) == 3
        assert http.get(d.url + "/clawd/status").json()["signals"]["pending"] == 0
    finally:
        if stub:
            stub.close()
        d.stop()


def test_missing_gguf_judge_is_reported_and_retried(clawd_home, http, tmp_path):
    from tests.tiny_models import build_tiny_gguf

    judge_path = tmp_path / "judge.gguf"
    d = mining_daemon(
        clawd_home, CLAWD_MINING_JUDGE=f"gguf:{judge_path}", CLAWD_MINING_RETRY_S=1.0, CLAWD_MODEL_N_THREADS=1
    )
    try:
        c = Convo(d, http)
        undecided = c.say("Tell me a joke.")
        c.say(UNRELATED)
        mine(d)
        s = api_signal(http, d, undecided)
        assert s["status"] == "pending" and s["attempts"] == 1
        assert str(judge_path) in s["error"] and "does not exist" in s["error"]
        assert "could not start" in http.get(d.url + "/clawd/status").json()["miner"]["judge_error"]
        assert http.post(d.url + CHAT, json={"model": MODEL, "messages": [user("hi")]}).status_code == 200

        # The model file appears (a tiny random model: its votes are unparseable, so 0).
        build_tiny_gguf(tmp_path / "build.gguf", n_ctx_train=4096)
        shutil.move(tmp_path / "build.gguf", judge_path)
        retry_at = stored_signal(d, undecided).retry_at
        wait_for(lambda: time.time() >= retry_at, what="the back-off to pass")
        mine(d)
        s = api_signal(http, d, undecided)
        assert (s["status"], s["reward"], s["reward_source"]) == ("empty", 0, "gguf")
        assert len(s["votes"]) == 3 and s["error"] is None
    finally:
        d.stop()


def test_a_turn_the_engine_fails_on_backs_off_then_is_given_up(clawd_home, http):
    """A non-judge failure (the engine erring on one turn's scoring) backs that turn off
    rather than crashing the step or retrying it forever ahead of everyone else; after
    MAX_ATTEMPTS its directive signal is given up and its reward (the user's correction: -1)
    kept, so an engine that cannot score the teacher still yields evaluative signals."""
    engine = FakeEngine(n_ctx=2048)
    d = mining_daemon(clawd_home, engine)
    try:
        a = Convo(d, http)
        failing = a.say("Suggest a color for my living room.")
        a.say(CORRECTION)
        b = Convo(d, http)
        fine = b.say("Suggest a paint for my kitchen walls.")
        b.say(CORRECTION)
        bad_response = stored_turn(d, failing).response_ids
        real_score, failures = engine.score, []

        def score(prompt_ids, target_ids, **kw):
            if list(target_ids) == bad_response:
                failures.append(1)
                raise EngineError("llama_decode failed with code -3")
            return real_score(prompt_ids, target_ids, **kw)

        engine.score = score
        t0 = time.time()
        assert mine(d) == 2  # the failing turn (oldest) is attempted, the other one still mined
        assert failures == [1]
        sig = stored_signal(d, failing)
        assert (sig.status, sig.attempts) == ("pending", 1)
        assert "llama_decode failed" in sig.error
        assert sig.retry_at > t0 + 30  # the first back-off is retry_s (60 s by default)
        s = api_signal(http, d, fine)
        assert (s["status"], s["reward"], s["hint"], s["teacher_arrays"]) == ("ready", -1, CORRECTION_HINT, True)
        assert mine(d) == 0 and failures == [1]  # backing off: not retried at once

        for attempt in range(2, MAX_ATTEMPTS + 1):
            sig = stored_signal(d, failing)
            sig.retry_at = 0.0  # as if the back-off had run out
            d.run(signals.save(d.state.db, sig))
            assert mine(d) == 1 and len(failures) == attempt
            sig = stored_signal(d, failing)
            assert sig.attempts == attempt and "llama_decode failed" in sig.error
            assert sig.status == ("ready" if attempt == MAX_ATTEMPTS else "pending")
        s = api_signal(http, d, failing)
        assert (s["status"], s["reward"], s["hint"], s["teacher_arrays"]) == ("ready", -1, None, False)
        assert s["reward_source"] == "rules" and s["hints"] == []
        assert mine(d) == 0 and len(failures) == MAX_ATTEMPTS  # given up: never mined again
        assert api_signal(http, d, fine)["status"] == "ready"
    finally:
        d.stop()


def test_a_row_that_raises_anything_backs_off_then_ends_empty_and_never_blocks_the_rest(clawd_home, http):
    """Any exception while mining a row (here a judge bug: a RuntimeError on one turn) is
    counted on that row with its error, backs it off exponentially, and after MAX_ATTEMPTS the
    row ends `empty` with the error kept; the rows behind it are mined all along."""
    d = mining_daemon(clawd_home, CLAWD_MINING_RETRY_S="0.001")
    try:
        a = Convo(d, http)
        bad = a.say("Suggest a color for my living room.")
        a.say(CORRECTION)
        rules, calls = d.state.miner.rules, []
        bad_text = stored_turn(d, bad).response_text
        real_evaluate = rules.evaluate

        def evaluate(inp):
            if inp.response == bad_text:
                calls.append(time.time())
                raise RuntimeError("judge bug on this one row")
            return real_evaluate(inp)

        rules.evaluate = evaluate
        good = []
        for i in range(3):  # rows queued behind the failing (oldest) one
            b = Convo(d, http)
            good.append(b.say(f"Suggest a paint number {i} for my kitchen walls."))
            b.say(CORRECTION)
        assert mine(d) >= 4  # the bad row (oldest) is tried, and every other row is mined in the same pass
        for tid in good:
            assert stored_signal(d, tid).status == "ready"
        sig = stored_signal(d, bad)
        assert sig.attempts >= 1 and sig.error == "RuntimeError: judge bug on this one row"

        def given_up():
            mine(d)
            return stored_signal(d, bad).status == "empty"

        wait_for(given_up, what="the failing row to be given up")
        sig = stored_signal(d, bad)
        assert sig.attempts == MAX_ATTEMPTS and len(calls) == MAX_ATTEMPTS
        assert sig.error == "RuntimeError: judge bug on this one row"
        gaps = [b - a for a, b in zip(calls, calls[1:])]
        assert all(g >= 0.001 * 2**i for i, g in enumerate(gaps))  # backed off, doubling
        assert mine(d) == 0 and len(calls) == MAX_ATTEMPTS  # given up: never tried again
        c = Convo(d, http)  # and new rows still get mined
        late = c.say("Suggest a rug for my hallway please.")
        c.say(CORRECTION)
        mine(d)
        assert stored_signal(d, late).status == "ready"
    finally:
        d.stop()


# --- overlap-guided hint selection (METHOD §4) ---------------------------------------------------


def test_overlap_counts_shared_top_k_tokens():
    s = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
    t = np.array([[4, 3, 99, 98], [8, 7, 6, 5], [13, 14, 15, 16]])
    assert overlap(s, t) == 2 + 4 + 0
    assert overlap(s, s) == 12
    assert overlap(s, t[:, ::-1]) == 6  # order within a row does not matter
    rng = np.random.default_rng(0)
    for _ in range(20):  # against a brute-force count
        a = np.array([rng.permutation(12)[:4] for _ in range(7)])  # top-k rows hold distinct ids
        b = np.array([rng.permutation(12)[:4] for _ in range(7)])
        assert overlap(a, b) == sum(1 for i in range(7) for x in a[i] if x in b[i])


class ScriptedEngine:
    """Engine stub for Miner._direct: the student (the active adapter) and each hint's
    teacher return hand-made top-k arrays, so the right selection is known."""

    name = "scripted"
    info = SimpleNamespace(add_bos=True)

    def __init__(self, student_top: np.ndarray, teacher_tops: dict[str, np.ndarray | None]):
        self.student_top = student_top
        self.teacher_tops = teacher_tops
        self.prompts: dict[int, str] = {}
        self.calls: list[dict] = []

    def tokenize(self, text, *, add_bos, special=True):
        self.prompts[len(self.prompts) + 1000] = text
        return [len(self.prompts) + 999]

    def score(self, prompt_ids, target_ids, *, top_k=0, adapter=None, at_ids=None, cancel=None, slot=0):
        n = len(target_ids)
        self.calls.append({"prompt_ids": list(prompt_ids), "adapter": adapter, "at_ids": at_ids, "top_k": top_k})
        if adapter == "policy-1":  # the student: pi_old, the adapter being trained
            return ScoreResult(
                np.full(n, -0.5, np.float32), self.student_top.astype(np.int32), np.full((n, top_k), -1.0, np.float32)
            )
        text = self.prompts[prompt_ids[0]]
        (hint,) = [h for h in self.teacher_tops if text.endswith(HINT_MARKER + h + "\nAssistant:")]
        top = self.teacher_tops[hint]
        if top is None:
            raise ContextLengthExceeded("too long for this test")
        tag = float(list(self.teacher_tops).index(hint) + 1)  # arrays that say whose they are
        return ScoreResult(
            np.full(n, -tag, np.float32),
            top.astype(np.int32),
            np.full((n, top_k), -tag, np.float32),
            np.full(np.asarray(at_ids).shape, -10 * tag, np.float32),
        )


def _top_with_overlap(student_top: np.ndarray, per_row: int, seed: int) -> np.ndarray:
    """Teacher top-k rows sharing exactly `per_row` tokens with each student row."""
    rng = np.random.default_rng(seed)
    rows = []
    for s in student_top:
        shared = list(rng.permutation(s)[:per_row])
        fresh = list(1000 + rng.permutation(100)[: len(s) - per_row])
        rows.append(rng.permutation(shared + fresh))
    return np.array(rows)


USER_HINT = "I meant a warm color like red or orange."  # 40 chars, from the next state
SHORT_HINT = "Use warm colors."  # 16 chars
LONG_HINT = "Suggest one warm color, such as terracotta, and say why it works."  # 65 chars


@pytest.mark.parametrize(
    "overlaps, chosen",
    [
        ({SHORT_HINT: 1, USER_HINT: 3, LONG_HINT: 3}, USER_HINT),  # max overlap, tie -> the shorter hint
        ({SHORT_HINT: 2, USER_HINT: 1, LONG_HINT: 4}, LONG_HINT),  # max overlap beats length
        ({SHORT_HINT: 2, USER_HINT: 2, LONG_HINT: 2}, SHORT_HINT),  # all tied -> the shortest
        ({SHORT_HINT: 0, USER_HINT: None, LONG_HINT: 1}, LONG_HINT),  # a hint that does not fit is skipped
    ],
)
def test_overlap_guided_selection(tmp_path, overlaps, chosen):
    n, k = 6, 4
    student_top = np.arange(1, n * k + 1).reshape(n, k)
    teacher_tops = {
        h: None if o is None else _top_with_overlap(student_top, o, i) for i, (h, o) in enumerate(overlaps.items())
    }
    engine = ScriptedEngine(student_top, teacher_tops)

    class HintJudge:
        async def hints(self, inp):
            assert inp.next_state == CORRECTION and inp.request[-1]["content"] == "Suggest a color."
            return [LONG_HINT, SHORT_HINT, "too short", SHORT_HINT]

    request = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            user("Suggest a color."),
            assistant("Blue."),
            user("Suggest a color."),
        ]
    }
    turn = turns.TurnRecord(
        id="chatcmpl-t",
        session_id="s",
        turn_type="main",
        request=request,
        request_hash="h",
        continuation_hash="c",
        prompt_text="p",
        prompt_ids=[1, 2, 3],
        response_ids=list(range(50, 50 + n)),
        response_logprobs=np.zeros(n),
        response_text="Blue.",
        finish_reason="stop",
        sampling={},
        engine="scripted",
        model="m",
        chat_format="transcript",
        timings={},
    )
    sig = signals.Signal(
        turn_id=turn.id,
        session_id="s",
        status="pending",
        next_state=CORRECTION,
        next_role="user",
        reward=-1,
        reward_source="rules",
    )

    async def go():
        db = await Database.open(tmp_path / "clawd.db")
        runner = EngineRunner(engine)
        try:
            model = ServedModel(runner, TranscriptFormat())
            model.active_adapter = "policy-1"
            miner = Miner(
                db,
                model,
                MiningSettings(judge="rules", hint_judge="stub", top_k=k, max_hints=3),
                make_judge=lambda spec: HintJudge(),
            )
            await miner._direct(sig, turn)
        finally:
            await db.close()
            runner._thread.shutdown(wait=True)

    asyncio.run(go())

    # candidates: > 10 chars, deduplicated, shortest first, with their hand-made overlaps
    assert [(h["text"], h["source"]) for h in sig.hints] == [
        (SHORT_HINT, "stub"),
        (USER_HINT, "user"),
        (LONG_HINT, "stub"),
    ]
    assert {h["text"]: h["overlap"] for h in sig.hints} == {
        h: None if o is None else o * n for h, o in overlaps.items()
    }
    assert sig.hint == chosen
    # the stored arrays are the chosen hint's teacher's, at the student's top-k
    tag = list(teacher_tops).index(chosen) + 1
    assert sig.top_k == k
    np.testing.assert_array_equal(sig.student_top_ids, student_top)
    np.testing.assert_array_equal(sig.student_top_logprobs, np.full((n, k), -1.0))
    np.testing.assert_array_equal(sig.teacher_logprobs, np.full(n, -tag))
    np.testing.assert_array_equal(sig.teacher_top_logprobs, np.full((n, k), -10 * tag))
    # the teacher is the frozen base model (no adapter), scored at the student's top-k,
    # on the turn's own sampled tokens, with the hint after the LAST user message
    student_call, *teacher_calls = engine.calls
    assert student_call["adapter"] == "policy-1" and student_call["prompt_ids"] == turn.prompt_ids
    assert len(teacher_calls) == 3
    for call in teacher_calls:
        assert call["adapter"] is None and call["top_k"] == k
        np.testing.assert_array_equal(call["at_ids"], student_top)
        text = engine.prompts[call["prompt_ids"][0]]
        assert text.count("User: Suggest a color.") == 2
        assert text.count(HINT_MARKER) == 1 and "Assistant: Blue.\nUser: Suggest a color." + HINT_MARKER in text


def _direct_with_rules(tmp_path, engine, sig, turn, **settings) -> None:
    """Miner._direct on `sig` with the rules as both judges, over `engine` (the student being
    the "policy-1" adapter, as ScriptedEngine expects)."""

    async def go():
        db = await Database.open(tmp_path / "clawd.db")
        model = ServedModel(EngineRunner(engine), TranscriptFormat())
        model.active_adapter = "policy-1"
        try:
            await Miner(db, model, MiningSettings(judge="rules", hint_judge="rules", **settings))._direct(sig, turn)
        finally:
            await db.close()
            model.runner._thread.shutdown(wait=True)

    asyncio.run(go())


def test_no_candidates_means_no_teacher_work(tmp_path):
    engine = ScriptedEngine(np.zeros((2, 4)), {})
    turn = SimpleNamespace(
        id="chatcmpl-x", request={"messages": [user("Hi")]}, response_text="Hello.", prompt_ids=[1], response_ids=[2, 3]
    )
    sig = signals.Signal(
        turn_id="chatcmpl-x", session_id="s", status="pending", next_state=THANKS, next_role="user", reward=1
    )
    _direct_with_rules(tmp_path, engine, sig, turn)
    assert sig.hints == [] and sig.hint is None and sig.teacher_logprobs is None
    assert engine.calls == []


UNRECOGNISED = "Every reply should kick off with a one-line summary so I can find the gist."


@pytest.mark.parametrize("reward, source", [(-1, "gguf"), (0, "none")])
def test_a_correction_only_an_llm_judge_read_still_gets_the_users_words_as_hint(tmp_path, reward, source):
    """The rules do not recognise UNRECOGNISED as a correction, so they make no hint of it on their
    own; once an LLM judge (the cascade) read the turn as -1, the user's words are the hint all the
    same. Undecided, the turn stays without one. (Words the rules read as approval never become a
    hint: test_feedback_after_mining_reopens_the_turn.)"""
    assert RulesJudge().evaluate(JudgeInput([user("Suggest a color.")], "Blue.", UNRECOGNISED, "user")) is None
    n, k = 2, 4
    student_top = np.arange(1, n * k + 1).reshape(n, k)
    engine = ScriptedEngine(student_top, {UNRECOGNISED: _top_with_overlap(student_top, 2, 0)})
    turn = SimpleNamespace(
        id="chatcmpl-u",
        request={"messages": [user("Suggest a color.")]},
        response_text="Blue.",
        prompt_ids=[1],
        response_ids=[2, 3],
    )
    sig = signals.Signal(
        turn_id=turn.id,
        session_id="s",
        status="pending",
        next_state=UNRECOGNISED,
        next_role="user",
        reward=reward,
        reward_source=source,
    )
    _direct_with_rules(tmp_path, engine, sig, turn, top_k=k)
    if reward == -1:
        assert [(h["text"], h["source"]) for h in sig.hints] == [(UNRECOGNISED, "user")]
        assert sig.hint == UNRECOGNISED and sig.teacher_logprobs is not None
    else:
        assert sig.hints == [] and sig.hint is None and engine.calls == []


# --- teacher arrays against an independent scoring on a real (tiny) GGUF --------------------------


def _log_softmax(rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.float64)
    m = rows.max(axis=1, keepdims=True)
    return rows - m - np.log(np.exp(rows - m).sum(axis=1, keepdims=True))


def _independent_logprobs(llm, prompt_ids: list[int], response_ids: list[int]) -> np.ndarray:
    """Full-vocabulary log-probs at each response position, via the high-level Llama."""
    llm.reset()
    llm.eval(prompt_ids + response_ids[:-1])
    p, n = len(prompt_ids), len(response_ids)
    return _log_softmax(np.asarray(llm.scores[p - 1 : p - 1 + n]))


def test_teacher_arrays_match_an_independent_scoring(clawd_home, http, tiny_gguf):
    from llama_cpp import Llama

    from clawd.engines.llamacpp import Engine

    d = mining_daemon(clawd_home, Engine(tiny_gguf, n_ctx=512, n_threads=1, model_id="tiny"))
    try:
        c = Convo(d, http, model="tiny", headers={"X-Session-Id": "tiny-1"}, temperature=0.8, seed=3, max_tokens=24)
        t1 = c.say("Suggest a color for my living room.")
        c.say(CORRECTION)
        mine(d)
        s = api_signal(http, d, t1)
        assert (s["status"], s["reward"], s["hint"]) == ("ready", -1, CORRECTION_HINT)
        rec, sig = stored_turn(d, t1), stored_signal(d, t1)
    finally:
        d.stop()

    n, k = len(rec.response_ids), 4
    assert n >= 2 and sig.teacher_logprobs.shape == (n,) and sig.teacher_top_logprobs.shape == (n, k)
    llm = Llama(model_path=str(tiny_gguf), n_ctx=512, logits_all=True, n_threads=1, verbose=False)
    try:
        # the teacher context, rebuilt from the spec (METHOD §3)
        msgs = [dict(m) for m in rec.request["messages"]]
        last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user")
        msgs[last_user]["content"] += "\n\n[user's hint / instruction]\n" + sig.hint
        fmt = TranscriptFormat(add_bos=True)
        teacher_prompt = llm.tokenize(
            fmt.render([Message(**m) for m in msgs]).prompt.encode(), add_bos=True, special=True
        )
        student_prompt = llm.tokenize(
            fmt.render([Message(**m) for m in rec.request["messages"]]).prompt.encode(), add_bos=True, special=True
        )
        assert student_prompt == rec.prompt_ids
        teacher = _independent_logprobs(llm, teacher_prompt, rec.response_ids)
        student = _independent_logprobs(llm, student_prompt, rec.response_ids)
    finally:
        llm.close()

    rows = np.arange(n)
    d_sampled = np.abs(sig.teacher_logprobs - teacher[rows, rec.response_ids]).max()
    d_top = np.abs(sig.teacher_top_logprobs - np.take_along_axis(teacher, sig.student_top_ids.astype(int), 1)).max()
    # the student's top-k: the k largest of the base model's distribution, most likely first
    ref_top_lp = -np.sort(-student, axis=1)[:, :k]
    d_student = np.abs(sig.student_top_logprobs - ref_top_lp).max()
    d_student_at = np.abs(
        sig.student_top_logprobs - np.take_along_axis(student, sig.student_top_ids.astype(int), 1)
    ).max()
    print(
        f"\ntiny llama (F32), n={n}: max|Δ| teacher sampled {d_sampled:.2e}, teacher at student top-k "
        f"{d_top:.2e}, student top-k {d_student:.2e} / at ids {d_student_at:.2e}"
    )
    assert d_sampled < 1e-4 and d_top < 1e-4 and d_student < 1e-4 and d_student_at < 1e-4
    ref_top_ids = np.argsort(-student, axis=1, kind="stable")[:, :k]
    gaps = np.diff(-np.sort(-student, axis=1)[:, : k + 1], axis=1)
    clear = (np.abs(gaps) > 1e-3).all(axis=1)  # rows without near-ties among the top k+1
    assert clear.sum() >= n // 2
    np.testing.assert_array_equal(sig.student_top_ids[clear], ref_top_ids[clear])
    # the hint changes the context, so the teacher really differs from the student
    assert np.abs(teacher - student).max() > 1e-3
