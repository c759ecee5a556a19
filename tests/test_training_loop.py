"""The closed loop on a tiny real model: signals -> trainer child (real MLX) -> adapter dir ->
gate -> hot-swap into the running engine (verified live) -> rollback, on every base that trains
(a GGUF file on llama.cpp or mlx, an MLX model directory, float or quantized, on mlx); and the
crash-safety contract (SIGKILL at any point, checkpoint-stop and resume, corrupt files,
forgotten sessions, pausing for the user)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from clawd.store import adapters as adapter_rows
from clawd.store import signals
from tests.conftest import TRAIN_ENV, ServeProcess, authed, start_daemon


def chat(d, text: str, seed: int = 0) -> dict:
    with d.client() as c:
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": d.state.model.model_id,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 12,
                "temperature": 0.8,
                "seed": seed,
            },
        )
        assert r.status_code == 200, r.text
        return r.json()


def make_ready_signals(d, n: int) -> list[str]:
    """n real turns, each turned into a ready signal: alternating +1 / -1, every other one hinted."""
    ids = [chat(d, f"question number {i}?", seed=i)["id"] for i in range(n)]
    db = d.state.db

    async def mark():
        await signals.create_missing(db)
        for k, tid in enumerate(ids):
            sig = await signals.get(db, tid)
            sig.status, sig.reward = "ready", (1 if k % 2 == 0 else -1)
            sig.reward_source = "feedback"
            sig.hint = "Answer in one short sentence." if k % 2 == 1 else None
            await signals.save(db, sig)

    d.run(mark())
    return ids


def training(d, method: str = "GET", path: str = "/clawd/training", **kw) -> dict:
    with d.client() as c:
        r = c.request(method, path, **kw)
        assert r.status_code < 400, r.text
        return r.json()


def wait_run(d, timeout: float = 240) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = training(d)
        if st["state"] in ("idle", "error"):
            return st
        time.sleep(0.2)
    raise AssertionError(f"training did not finish: {st}")


def wait_for(d, pred, timeout: float = 120) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = training(d)
        if pred(st):
            return st
        time.sleep(0.05)
    raise AssertionError(f"condition not reached: {st}")


def base_logprobs(d, prompt, target, adapter=None) -> np.ndarray:
    engine = d.state.model.runner.engine
    return d.run(d.state.model.runner.call(engine.score, prompt, target, adapter=adapter)).logprobs


def served_logprobs(d, adapter: str = "active") -> np.ndarray:
    """The served model's log-probs of a fixed reply (fresh cache: exact reruns)."""
    with d.client() as c:
        r = c.post(
            "/clawd/score",
            json={
                "messages": [{"role": "user", "content": "question number 1?"}],
                "completion": "an answer",
                "adapter": adapter,
            },
        )
    assert r.status_code == 200, r.text
    return np.array(r.json()["logprobs"])


# Every base the loop trains on: a GGUF file on llama.cpp and on mlx, an MLX directory (float32
# and 4-bit: QLoRA, LoRA over quantized linears) on mlx. Only a GGUF base gets adapter.gguf.
LOOP_BASES = {"gguf": {"adapter.gguf"}, "gguf-mlx": {"adapter.gguf"}, "dir": set(), "dir-q4": set()}


# The fast loop keeps one base per serving engine (llama.cpp: "gguf"; mlx: "dir-q4", the cheapest);
# the other two bases repeat the same run, so they are `slow`.
LOOP_FAST = {"gguf", "dir-q4"}


@pytest.mark.parametrize(
    "train_base", [b if b in LOOP_FAST else pytest.param(b, marks=pytest.mark.slow) for b in LOOP_BASES]
)
def test_train_promote_serve_and_rollback(train_daemon, train_base):
    d = train_daemon
    engine = d.state.model.runner.engine
    trained = make_ready_signals(d, 4)
    base_before = served_logprobs(d)
    job = training(d, "POST")
    st = wait_run(d)
    assert st["state"] == "idle", st
    res = st["result"]
    assert res["promoted"], res
    aid = res["adapter_id"]
    assert aid == job["job_id"]
    assert res["gate"]["passed"] and res["gate"]["gain"] > 0 and res["gate"]["judged_on"] == "train"
    # the capability canary ran: the whole QA set, parent (the base) and candidate, kept for the next job
    qa = res["gate"]["qa"]
    assert qa["n"] == 50 and len(qa["right"]) == 50 and qa["fingerprint"] and qa["accuracy_parent"] is not None

    # The adapter dir is complete: mlx-lm files, metadata naming its signals, and the GGUF LoRA
    # exactly when there is a GGUF base to serve it on.
    rec = d.run(adapter_rows.get(d.state.db, aid))
    adir = Path(rec.path)
    files = {p.name for p in adir.iterdir()}
    assert files == {"adapters.safetensors", "adapter_config.json", "meta.json"} | LOOP_BASES[train_base], files
    assert sorted(rec.signals) == sorted(trained) and rec.status == "active"
    live = rec.gate["live_check"]
    assert live["corr"] > 0.5
    if engine.name == "mlx":  # MLX serves what MLX trained, on the same weights: near-exact
        assert live["corr"] > 0.99 and live["mean_abs_err"] < 1e-4, live
    assert rec.metrics["steps"] == 4 and rec.metrics["final"]["n_samples"] >= 1

    # New turns wear it, and record it as their provenance; the served log-probs moved.
    out = chat(d, "after training")
    turn = d.run(__import__("clawd.store.turns", fromlist=["x"]).get_turn(d.state.db, out["id"]))
    assert turn.adapter_id == aid
    with d.client() as c:
        assert c.get("/clawd/status").json()["active_adapter"] == aid
        listed = c.get("/clawd/adapters").json()
    assert listed["active"] == aid and listed["adapters"][0]["id"] == aid
    worn = served_logprobs(d)
    assert np.abs(worn - base_before).max() > 1e-3, worn - base_before
    np.testing.assert_array_equal(served_logprobs(d, "base"), base_before)
    probe = json.loads((adir / "meta.json").read_text())["probe"]
    p, t = probe["prompt_ids"], probe["response_ids"]
    probe_base = base_logprobs(d, p, t)

    # Rollback: back to the base model exactly (same engine, no reload), the newer adapter kept (retired).
    training(d, "POST", "/clawd/adapters/rollback")
    assert d.state.model.active_adapter is None and d.state.model.runner.engine is engine
    np.testing.assert_array_equal(served_logprobs(d), base_before)
    np.testing.assert_array_equal(base_logprobs(d, p, t), probe_base)
    assert chat(d, "after rollback")["id"]
    rec = d.run(adapter_rows.get(d.state.db, aid))
    assert rec.status == "retired" and adir.is_dir()
    # ... and can come back.
    training(d, "POST", f"/clawd/adapters/{aid}/activate")
    assert d.state.model.active_adapter == aid
    np.testing.assert_array_equal(served_logprobs(d), worn)

    # Nothing new to learn: a second run is refused with a clear 400.
    with d.client() as c:
        r = c.post("/clawd/training")
    assert r.status_code == 400 and "nothing to train on" in r.json()["error"]["message"]


# "gate" runs the whole training first; the early phases are the cheap ones kept in the fast loop.
@pytest.mark.parametrize("phase", ["prepare", "train", pytest.param("gate", marks=pytest.mark.slow)])
def test_sigkill_trainer_leaves_no_adapter_and_active_unchanged(train_daemon, phase):
    d = train_daemon
    make_ready_signals(d, 4)
    # Kill it the moment its phase event reaches the daemon: a point every run passes, with the
    # trainer still computing (polling the status instead could miss a tiny run's whole phase).
    sched = d.state.scheduler
    seen = sched._event

    def kill_at_phase(line: bytes) -> dict:
        event = seen(line)
        if event.get("event") == "phase" and event.get("phase") == phase and sched._proc is not None:
            os.kill(sched._proc.pid, signal.SIGKILL)
        return event

    sched._event = kill_at_phase
    training(d, "POST")
    st = wait_run(d)
    adapters_dir = d.state.registry.dir
    finished = [p for p in adapters_dir.iterdir() if not p.name.startswith(".")]
    # Killed: nothing went live, nothing was recorded.
    assert st["state"] == "error" and "code -9" in st["result"]["error"], st
    assert d.state.model.active_adapter is None
    assert d.run(adapter_rows.list_all(d.state.db)) == []
    # Whatever is in the adapters dir is whole (a kill just after the final rename leaves a
    # finished adapter behind, never a partial one).
    for p in finished:
        assert {"meta.json", "adapter.gguf", "adapters.safetensors"} <= {f.name for f in p.iterdir()}, p
    # Start-up cleans any temp dir a kill left behind and records finished, unrecorded adapters.
    (adapters_dir / ".tmp-ad-x").mkdir()
    d.run(d.state.registry.restore())
    assert not (adapters_dir / ".tmp-ad-x").exists()
    assert {r.id for r in d.run(adapter_rows.list_all(d.state.db))} == {p.name for p in finished}


@pytest.mark.slow
def test_stop_at_checkpoint_then_resume(train_daemon):
    d = train_daemon
    make_ready_signals(d, 4)
    # A tiny run's steps take milliseconds: polling the status can miss the whole train phase.
    # So the trainer is held (SIGSTOP) the moment its first step reaches the daemon, and the
    # stop request goes in through the API while it is held (the stop sends SIGCONT first).
    sched = d.state.scheduler
    seen, first_step = sched._event, threading.Event()

    def hold_at_first_step(line: bytes) -> dict:
        event = seen(line)
        if event.get("event") == "step" and sched._proc is not None and not first_step.is_set():
            os.kill(sched._proc.pid, signal.SIGSTOP)
            first_step.set()
        return event

    sched._event = hold_at_first_step
    first = training(d, "POST")["job_id"]
    assert first_step.wait(240), training(d)
    training(d, "POST", "/clawd/training/stop")
    st = wait_run(d)
    assert st["result"]["resumable"] and st["result"]["job_id"] == first
    job_dir = d.state.scheduler.jobs_dir / first
    assert (job_dir / "checkpoint" / "step.json").is_file()
    stopped_at = json.loads((job_dir / "checkpoint" / "step.json").read_text())["step"]
    assert training(d, "POST")["job_id"] == first  # resumed, not rebuilt
    st = wait_run(d)
    assert st["result"]["promoted"], st
    rec = d.run(adapter_rows.get(d.state.db, first))
    assert [h["step"] for h in rec.metrics["history"]] == list(range(1, 5))
    assert stopped_at >= 1


@pytest.mark.slow
def test_corrupt_or_mismatched_adapter_is_refused_and_active_kept(train_daemon, tmp_path):
    from tests.tiny_models import build_tiny_gguf, build_tiny_lora

    d = train_daemon
    make_ready_signals(d, 2)
    training(d, "POST")
    st = wait_run(d)
    aid = st["result"]["adapter_id"]
    assert d.state.model.active_adapter == aid
    src = Path(d.run(adapter_rows.get(d.state.db, aid)).path)

    # A copy whose GGUF was built for another architecture and other sizes.
    other = build_tiny_gguf(tmp_path / "other.gguf", arch="qwen2", n_embd=32, n_head=2, n_head_kv=1, n_ff=48)
    bad = d.state.registry.dir / "ad-bad"
    shutil.copytree(src, bad)
    meta = json.loads((bad / "meta.json").read_text())
    meta["id"] = "ad-bad"
    (bad / "meta.json").write_text(json.dumps(meta))
    build_tiny_lora(bad / "adapter.gguf", other)
    with pytest.raises(Exception) as e:
        d.run(d.state.registry.register(bad))
    msg = str(e.value)
    assert "architecture" in msg and "shape" in msg, msg

    # A garbage file under a registered adapter: activation refused, the active one unchanged.
    d.run(d.state.registry.activate(None))
    (src / "adapter.gguf").write_bytes(b"GGUF" + os.urandom(64))
    d.state.model.runner.engine.unload_adapter(aid)
    with d.client() as c:
        r = c.post(f"/clawd/adapters/{aid}/activate")
    assert r.status_code == 400, r.text
    assert aid in r.json()["error"]["message"]
    assert d.state.model.active_adapter is None
    assert d.run(adapter_rows.active(d.state.db)) is None
    rec = d.run(adapter_rows.get(d.state.db, aid))  # fetched after the refusal: marked, never active
    assert rec.status == "rejected" and aid in (rec.note or ""), rec


def copy_adapter(d, src: Path, new_id: str) -> Path:
    """A copy of adapter dir `src` under another id, in the registry's adapters dir."""
    dst = d.state.registry.dir / new_id
    shutil.copytree(src, dst)
    meta = json.loads((dst / "meta.json").read_text())
    (dst / "meta.json").write_text(json.dumps({**meta, "id": new_id}))
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("train_base", ["dir-q4"])
def test_a_mismatched_adapter_on_a_dir_base_is_refused_naming_each_problem(train_daemon):
    """On an MLX directory base the registry checks the mlx-lm files against the base's own
    config.json and safetensors headers (4-bit here: packed weights, in = columns · 32 / bits)."""
    from safetensors.numpy import load_file, save_file

    from clawd.errors import AdapterError

    d = train_daemon
    make_ready_signals(d, 2)
    training(d, "POST")
    aid = wait_run(d)["result"]["adapter_id"]
    assert d.state.model.active_adapter == aid
    src = Path(d.run(adapter_rows.get(d.state.db, aid)).path)
    worn = served_logprobs(d)

    # One copy with every kind of mismatch at once: each one is named.
    bad = copy_adapter(d, src, "ad-bad")
    w = load_file(str(bad / "adapters.safetensors"))
    w["model.layers.0.self_attn.q_proj.lora_a"] = np.zeros((32, 4), np.float32)  # in is 64
    del w["model.layers.0.self_attn.v_proj.lora_b"]
    w["model.layers.0.self_attn.qkv_proj.lora_a"] = np.zeros((64, 4), np.float32)  # no such module
    w["model.layers.0.self_attn.qkv_proj.lora_b"] = np.zeros((4, 64), np.float32)
    w["model.layers.1.mlp.down_proj.lora_a"] = np.zeros((128, 3), np.float32)  # rank 3, config says 4
    w["model.layers.1.mlp.down_proj.lora_b"] = np.zeros((3, 64), np.float32)
    w["model.layers.1.mlp.down_proj.weight"] = np.zeros((64, 128), np.float32)
    save_file(w, str(bad / "adapters.safetensors"))
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["lora_parameters"]["scale"] = "big"
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError) as e:
        d.run(d.state.registry.register(bad))
    problems = str(e.value).split(": ", 1)[1].split("; ")
    wanted = [
        ["no usable lora_parameters.scale", "'big'"],
        ["model.layers.0.self_attn.q_proj", "A (32, 4) / B (4, 64)", "(in, out) = (64, 64)"],
        ["model.layers.0.self_attn.qkv_proj", "no such linear layer"],
        ["model.layers.0.self_attn.v_proj has lora_a but no lora_b"],
        ["model.layers.1.mlp.down_proj", "rank 3", "lora_parameters.rank = 4"],
        ["tensor model.layers.1.mlp.down_proj.weight is neither a .lora_a nor a .lora_b"],
    ]
    assert len(problems) == len(wanted), problems
    for frags in wanted:
        assert any(all(f in p for f in frags) for p in problems), (frags, problems)
    assert d.run(adapter_rows.get(d.state.db, "ad-bad")) is None

    # A registered adapter whose weights are then truncated: activation refused, the active one kept.
    two = copy_adapter(d, src, "ad-two")
    assert d.run(d.state.registry.register(two)).status == "candidate"
    data = (two / "adapters.safetensors").read_bytes()
    (two / "adapters.safetensors").write_bytes(data[: len(data) - 100])
    with d.client() as c:
        r = c.post("/clawd/adapters/ad-two/activate")
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "ad-two" in msg and "truncated" in msg, msg
    assert d.state.model.active_adapter == aid and d.run(adapter_rows.active(d.state.db)).id == aid
    assert "ad-two" not in d.state.model.runner.engine.loaded_adapters
    np.testing.assert_array_equal(served_logprobs(d), worn)
    assert d.run(adapter_rows.get(d.state.db, "ad-two")).status == "rejected"


@pytest.mark.slow
def test_forgetting_a_session_retires_its_adapters(train_daemon):
    d = train_daemon
    ids = make_ready_signals(d, 2)
    training(d, "POST")
    aid = wait_run(d)["result"]["adapter_id"]
    assert d.state.model.active_adapter == aid
    turn = d.run(__import__("clawd.store.turns", fromlist=["x"]).get_turn(d.state.db, ids[0]))
    with d.client() as c:
        out = c.delete(f"/clawd/sessions/{turn.session_id}").json()
    assert out["retired_adapters"] == [aid]
    rec = d.run(adapter_rows.get(d.state.db, aid))
    assert rec.forgotten and rec.status == "retired" and not Path(rec.path).exists()
    assert d.state.model.active_adapter is None
    with d.client() as c:
        r = c.post(f"/clawd/adapters/{aid}/activate")
    assert r.status_code == 400 and "forgotten" in r.json()["error"]["message"]


def proc_state(pid: int) -> str:
    """The process state letter from /proc ("T" = stopped), or "gone" once it has exited."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0]
    except FileNotFoundError:
        return "gone"


def until(pred, timeout: float = 30, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_trainer_pauses_while_the_user_is_served(train_daemon, monkeypatch):
    d = train_daemon
    engine = d.state.model.runner.engine
    make_ready_signals(d, 4)
    d.state.scheduler.resume_quiet_s = 1.0
    training(d, "POST")
    wait_for(d, lambda s: s["phase"] in ("prepare", "train"))
    proc = d.state.scheduler._proc
    # The user's turn is held inside the engine until the test has looked, so "while served"
    # lasts as long as the checks take: no race with the 1 s quiet timer on a loaded machine.
    serving, release, reply = threading.Event(), threading.Event(), {}
    real_generate = engine.generate

    def held_generate(*args, **kw):
        serving.set()
        assert release.wait(120)
        yield from real_generate(*args, **kw)

    def user() -> None:
        reply["out"] = chat(d, "are you there?")

    monkeypatch.setattr(engine, "generate", held_generate)
    asking = threading.Thread(target=user, daemon=True)
    asking.start()
    try:
        assert serving.wait(60), "the user's turn never reached the engine"
        until(lambda: proc_state(proc.pid) == "T", what="the trainer to stop")  # stopped while we are served
        assert training(d)["state"] == "paused"
    finally:
        release.set()
        asking.join(60)
    monkeypatch.undo()
    assert reply.get("out", {}).get("id"), "the user's turn failed"
    st = wait_for(d, lambda s: s["state"] != "paused", timeout=30)
    assert st["state"] in ("running", "idle")
    assert wait_run(d)["result"]["promoted"]


def test_scheduled_trigger_trains_only_when_signals_wait(train_daemon, monkeypatch, capsys):
    """`clawd train --now --scheduled` (what the overnight timer runs): exit 0 without a run when
    too few signals wait; and when no daemon answers, it retries, then fails with one line."""
    from clawd import cli

    d = train_daemon
    monkeypatch.setenv("CLAWD_HOME", str(d.home))
    monkeypatch.setenv("CLAWD_SERVER_PORT", str(d.state.port))
    make_ready_signals(d, 3)
    assert cli.main(["train", "--now", "--scheduled"]) == 0
    assert "not training: 3 of 8 untrained signals ready" in capsys.readouterr().out
    assert training(d)["state"] == "idle" and training(d)["job_id"] is None

    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("CLAWD_SERVER_PORT", str(s.getsockname()[1]))
    monkeypatch.setattr(cli, "SCHEDULED_WAIT_S", 2.5)
    t0 = time.monotonic()
    assert cli.main(["train", "--now", "--scheduled"]) == 1
    assert time.monotonic() - t0 >= 2.5  # it waited for the daemon to come up
    assert "clawd is not running" in capsys.readouterr().err


def score(url: str, adapter: str) -> list[float]:
    r = authed.post(
        url + "/clawd/score",
        timeout=30,
        json={
            "messages": [{"role": "user", "content": "question number 1?"}],
            "completion": "an answer",
            "adapter": adapter,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["logprobs"]


def activate_ignoring_the_kill(url: str, adapter_id: str) -> None:
    try:
        authed.post(f"{url}/clawd/adapters/{adapter_id}/activate", timeout=30)
    except httpx.TransportError:
        pass  # the daemon was killed under the request: that is the point


@pytest.mark.slow
def test_daemon_killed_during_promotion_restarts_on_old_or_new(clawd_home, tiny_gguf):
    """SIGKILL `clawd serve` at random moments of an activation: on restart exactly one of the
    two adapters is active, and llama.cpp serves that adapter's log-probs (verified live)."""
    from clawd.engines.llamacpp import Engine

    # Two adapters, trained in-process for the model id `clawd serve` will give this file.
    d = start_daemon(clawd_home, Engine(tiny_gguf, n_ctx=256, n_threads=1), TRAIN_ENV)
    try:
        ids = []
        for _ in range(2):
            make_ready_signals(d, 4)
            training(d, "POST")
            ids.append(wait_run(d)["result"]["adapter_id"])
        for aid in ids:  # both loaded, so both can be scored by name
            training(d, "POST", f"/clawd/adapters/{aid}/activate")
        expected = {aid: score(d.url, aid) for aid in ids}
        assert expected[ids[0]] != expected[ids[1]] != score(d.url, "base")
    finally:
        d.stop()

    rng = random.Random(0)
    env = {**TRAIN_ENV, "CLAWD_MINING_ENABLED": 0}
    for attempt in range(5):
        serve = ServeProcess(clawd_home, "--model", str(tiny_gguf), env_extra=env)
        try:
            url = serve.wait_ready()
            listed = authed.get(url + "/clawd/adapters", timeout=30).json()
            active = [a["id"] for a in listed["adapters"] if a["status"] == "active"]
            assert len(active) == 1 and active[0] in ids and listed["active"] == active[0], listed
            # Start-up re-applied and re-verified it: the served log-probs are that adapter's.
            np.testing.assert_allclose(score(url, "active"), expected[active[0]], rtol=1e-5)
            if attempt == 4:
                break
            other = ids[1 - ids.index(active[0])]
            # Ask for the other adapter, and kill the daemon somewhere inside that request.
            threading.Thread(target=activate_ignoring_the_kill, args=(url, other), daemon=True).start()
            time.sleep(rng.uniform(0.0, 0.08))  # activation takes tens of ms
        finally:
            serve.kill()
