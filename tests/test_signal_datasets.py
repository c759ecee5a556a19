"""`clawd export signals`: conversations go through a real daemon (fake engine, rules judges),
the miner turns them into signals, and the real CLI writes the dataset. Every field of the
output is checked against what the client sent and received, the stored rows, and the fake
engine's documented distribution; what must not be exported (vetoed, empty, waiting, side
turns) is checked to be absent. The export reads the database read-only, so it also runs
with the daemon stopped."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
import sys

import httpx
import numpy as np
import pytest

from clawd.served import HINT_MARKER
from tests.conftest import AUTH, ROOT, make_env
from tests.test_miner import CORRECTION, CORRECTION_HINT, LP_ON, THANKS, UNRELATED, Convo, mine, mining_daemon

TRL_KEYS = {
    "prompt",
    "completion",
    "tools",
    "label",
    "reward",
    "reward_source",
    "hint",
    "teacher_prompt",
    "prompt_ids",
    "completion_ids",
    "completion_logprobs",
    "teacher_logprobs",
    "top_k",
    "student_top_ids",
    "student_top_logprobs",
    "teacher_top_logprobs",
    "turn_id",
    "session_id",
    "model",
    "engine",
    "chat_format",
    "adapter_id",
    "created_at",
}
SYSTEM = "You are terse."


def run_cli(home, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "clawd.cli", *args],
        env=make_env(home),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def read_jsonl(path) -> list[dict]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One daemon's worth of mined conversations, shared by the tests of this module (read only)."""
    home = tmp_path_factory.mktemp("export-home")
    d = mining_daemon(home)
    with httpx.Client(headers=AUTH, timeout=30) as http:
        corrected = Convo(d, http)
        t_corrected = corrected.say("Suggest a color for my living room.")
        corrected.say(CORRECTION)  # its own signal waits for a next state: not exported
        # A system message and list-of-parts content, as some clients send them.
        thanked = Convo(d, http)
        thanked.messages.append({"role": "system", "content": SYSTEM})
        thanked.messages.append(
            {
                "role": "user",
                "content": [{"type": "text", "text": "What color "}, {"type": "text", "text": "is the sky?"}],
            }
        )
        r = http.post(
            d.url + "/v1/chat/completions", json={"model": "fake-model", "messages": thanked.messages, "temperature": 0}
        )
        t_thanked = r.headers["x-clawd-turn-id"]
        thanked.messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        thanked.say(THANKS)
        vetoed = Convo(d, http)
        t_vetoed = vetoed.say("What is two plus two?")
        vetoed.say(THANKS)
        empty = Convo(d, http)
        t_empty = empty.say("Hello there.")
        empty.say(UNRELATED)
        side = Convo(d, http, headers={"X-Turn-Type": "side"})
        t_side = side.say("Summarise the memory file.")
        mine(d)
        assert http.post(d.url + f"/clawd/signals/{t_vetoed}/veto").status_code == 200
        listed = {s["turn_id"]: s for s in http.get(d.url + "/clawd/signals", params={"limit": 100}).json()}
    assert listed[t_corrected]["status"] == "ready" and listed[t_thanked]["status"] == "ready"
    assert listed[t_empty]["status"] == "empty" and listed[t_vetoed]["vetoed"] and t_side not in listed
    ids = dict(corrected=t_corrected, thanked=t_thanked, vetoed=t_vetoed, empty=t_empty, side=t_side)
    yield d, home, ids, {"corrected": corrected, "thanked": thanked}
    d.stop()


def stored(d, turn_id):
    from clawd.store import signals, turns

    return d.run(turns.get_turn(d.state.db, turn_id)), d.run(signals.get(d.state.db, turn_id))


def test_trl_export_field_by_field(world, tmp_path):
    d, home, ids, convos = world
    out = tmp_path / "signals.trl.jsonl"
    res = run_cli(home, "export", "signals", "--format", "trl", "--out", str(out))  # the daemon is running
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip().endswith(f"exported 2 signals as trl to {out}")
    rows = read_jsonl(out)
    # Exactly the ready, non-vetoed signals, oldest first.
    assert [r["turn_id"] for r in rows] == [ids["corrected"], ids["thanked"]]
    for r in rows:
        assert set(r) == TRL_KEYS

    corr, thanks = rows
    turn, sig = stored(d, ids["corrected"])
    # prompt / completion: what the client sent and received, in TRL's conversational shape.
    assert corr["prompt"] == [{"role": "user", "content": "Suggest a color for my living room."}]
    assert corr["completion"] == [{"role": "assistant", "content": convos["corrected"].messages[1]["content"]}]
    assert corr["completion"][0]["content"] == "You said: Suggest a color for my living room."
    assert corr["tools"] is None
    assert (corr["reward"], corr["label"], corr["reward_source"]) == (-1, False, "rules")
    assert corr["hint"] == CORRECTION_HINT
    assert corr["teacher_prompt"] == [
        {"role": "user", "content": "Suggest a color for my living room." + HINT_MARKER + CORRECTION_HINT}
    ]
    # Token level: the exact sampled ids, and every array aligned with them.
    assert corr["prompt_ids"] == turn.prompt_ids
    assert corr["completion_ids"] == turn.response_ids
    n, k = len(turn.response_ids), 4
    assert n == len(corr["completion"][0]["content"]) + 1  # the fake's byte tokens + EOS
    assert corr["top_k"] == k
    assert len(corr["teacher_logprobs"]) == n and len(corr["completion_logprobs"]) == n
    for key in ("student_top_ids", "student_top_logprobs", "teacher_top_logprobs"):
        assert np.asarray(corr[key]).shape == (n, k), key
    # Bit-exact against the stored float32 BLOBs ...
    assert np.array_equal(np.asarray(corr["teacher_logprobs"], np.float32), sig.teacher_logprobs)
    assert np.array_equal(np.asarray(corr["teacher_top_logprobs"], np.float32), sig.teacher_top_logprobs)
    assert np.array_equal(np.asarray(corr["student_top_logprobs"], np.float32), sig.student_top_logprobs)
    assert np.array_equal(np.asarray(corr["student_top_ids"], np.int32), sig.student_top_ids)
    assert np.array_equal(np.asarray(corr["completion_logprobs"], np.float32), turn.response_logprobs)
    # ... and right by an independent reference: the fake puts log 0.9 on its intended reply.
    np.testing.assert_allclose(corr["teacher_logprobs"], LP_ON, atol=1e-6)
    np.testing.assert_allclose(corr["completion_logprobs"], LP_ON, atol=1e-6)
    assert [row[0] for row in corr["student_top_ids"]] == corr["completion_ids"]
    assert (corr["model"], corr["engine"], corr["chat_format"], corr["adapter_id"]) == (
        "fake-model",
        "fake",
        turn.chat_format,
        None,
    )
    assert corr["session_id"] == turn.session_id and corr["created_at"] == turn.created_at

    # The approved answer: reward +1, no hint, so no teacher arrays; parts joined to text.
    assert thanks["prompt"] == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What color is the sky?"},
    ]
    assert thanks["completion"] == [{"role": "assistant", "content": "You said: What color is the sky?"}]
    assert (thanks["reward"], thanks["label"], thanks["hint"], thanks["teacher_prompt"]) == (1, True, None, None)
    for key in ("teacher_logprobs", "top_k", "student_top_ids", "student_top_logprobs", "teacher_top_logprobs"):
        assert thanks[key] is None, key
    assert thanks["completion_ids"] == stored(d, ids["thanked"])[0].response_ids


def test_jsonl_export_is_the_raw_rows(world, tmp_path):
    d, home, ids, _ = world
    out = tmp_path / "raw.jsonl"
    res = run_cli(home, "export", "signals", "--format", "jsonl", "--out", str(out))
    assert res.returncode == 0, res.stderr
    rows = read_jsonl(out)
    assert [r["signal"]["turn_id"] for r in rows] == [ids["corrected"], ids["thanked"]]
    for r in rows:
        turn, sig = stored(d, r["signal"]["turn_id"])
        assert set(r) == {"signal", "turn"}
        assert set(r["signal"]) == set(sig.__dict__) and set(r["turn"]) == set(turn.__dict__)
        for key, value in sig.__dict__.items():
            got = r["signal"][key]
            if isinstance(value, np.ndarray):
                assert np.array_equal(np.asarray(got, value.dtype), value), key
            else:
                assert got == value, key
        for key, value in turn.__dict__.items():
            got = r["turn"][key]
            if isinstance(value, np.ndarray):
                assert np.array_equal(np.asarray(got, value.dtype), value), key
            else:
                assert got == value, key
        assert r["signal"]["status"] == "ready" and r["signal"]["vetoed"] is False


def test_stdout_is_the_default_and_equals_the_file(world, tmp_path):
    _, home, _, _ = world
    out = tmp_path / "a.jsonl"
    assert run_cli(home, "export", "signals", "--out", str(out)).returncode == 0  # --format trl is the default
    res = run_cli(home, "export", "signals")
    assert res.returncode == 0, res.stderr
    assert res.stdout == out.read_text(encoding="utf-8")
    assert "exported 2 signals as trl to stdout" in res.stderr


def test_export_works_with_the_daemon_stopped_and_never_writes(tmp_path, clawd_home):
    d = mining_daemon(clawd_home)
    with httpx.Client(headers=AUTH, timeout=30) as http:
        c = Convo(d, http)
        t1 = c.say("Suggest a color for my living room.")
        c.say(CORRECTION)
        mine(d)
    d.stop()
    db_dir = next(p.parent for p in clawd_home.rglob("clawd.db"))
    db = db_dir / "clawd.db"
    before = {p.name: p.read_bytes() for p in db_dir.iterdir() if p.name.startswith("clawd.db")}
    db.chmod(stat.S_IRUSR)  # a write attempt would now fail loudly
    try:
        out = tmp_path / "stopped.jsonl"
        res = run_cli(clawd_home, "export", "signals", "--out", str(out))
        assert res.returncode == 0, res.stderr
        assert [r["turn_id"] for r in read_jsonl(out)] == [t1]
    finally:
        db.chmod(stat.S_IRUSR | stat.S_IWUSR)
    assert db.read_bytes() == before["clawd.db"]


def test_errors_are_one_actionable_line(tmp_path, clawd_home):
    res = run_cli(clawd_home, "export", "signals")
    assert res.returncode == 1
    assert res.stderr.startswith("clawd: error: no clawd database at ") and "clawd serve" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and res.stdout == ""

    env_paths = __import__("clawd.paths", fromlist=["resolve_paths"]).resolve_paths(make_env(clawd_home))
    db = env_paths.db_file
    db.parent.mkdir(parents=True, exist_ok=True)
    db.write_bytes(b"this is not sqlite at all" * 100)
    res = run_cli(clawd_home, "export", "signals", "--format", "jsonl")
    assert res.returncode == 1 and res.stderr.startswith("clawd: error: cannot read ")
    assert len(res.stderr.strip().splitlines()) == 1

    db.unlink()
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE migrations (id INTEGER PRIMARY KEY, name TEXT, applied_at REAL)")
    conn.execute("INSERT INTO migrations VALUES (999, 'm999_future', 0)")
    conn.commit()
    conn.close()
    res = run_cli(clawd_home, "export", "signals", "--out", str(tmp_path / "x.jsonl"))
    assert res.returncode == 1 and "newer clawd" in res.stderr and "upgrade clawd" in res.stderr
    assert not (tmp_path / "x.jsonl").exists() and not (tmp_path / "x.jsonl.partial").exists()

    res = run_cli(clawd_home, "export", "signals", "--format", "csv")
    assert res.returncode == 2 and "invalid choice: 'csv'" in res.stderr


def test_the_readme_example_loads_with_datasets(world, tmp_path):
    """The README's worked example, run where the `datasets` library is installed."""
    datasets = pytest.importorskip("datasets")
    _, home, _, _ = world
    out = tmp_path / "signals.trl.jsonl"
    assert run_cli(home, "export", "signals", "--out", str(out)).returncode == 0
    ds = datasets.load_dataset("json", data_files=str(out), split="train")
    kto = ds.filter(lambda r: r["label"] is not None).select_columns(["prompt", "completion", "label"])
    assert len(ds) == 2 and len(kto) == 2 and os.path.getsize(out) > 0


def test_unmeasured_logprobs_export_as_null():
    """An upstream engine's end token has no log-prob (NaN in the store): valid JSON says null."""
    from clawd.signal_datasets import _list

    assert _list(np.array([-0.5, np.nan], np.float32)) == [-0.5, None]
    assert json.dumps(_list(np.array([np.nan], np.float32)), allow_nan=False) == "[null]"
    assert _list(np.array([[1, 2]], np.int32)) == [[1, 2]] and _list(None) is None
