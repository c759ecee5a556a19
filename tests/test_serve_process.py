"""`clawd serve` as a real process: start-up errors are one line, SIGKILL loses no
completed turn, and the CLI talks to the running daemon."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys

import pytest

from tests.conftest import ROOT, ServeProcess, authed, make_env


def clawd(home, *args, **env_extra) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "clawd.cli", *args],
        env=make_env(home, **env_extra),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("clawd: error:")]
    assert len(errors) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return errors[0]


def test_missing_model_is_one_line(clawd_home, tmp_path):
    line = one_line_error(clawd(clawd_home, "serve", "--port", "0", "--model", str(tmp_path / "nope.gguf")))
    assert "does not exist" in line and "model.path" in line


def test_non_gguf_model_is_one_line(clawd_home, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a model" * 100)
    line = one_line_error(clawd(clawd_home, "serve", "--port", "0", "--model", str(bad)))
    assert "not a GGUF file" in line


def test_truncated_gguf_is_one_line(clawd_home, tmp_path, tiny_gguf):
    cut = tmp_path / "cut.gguf"
    data = tiny_gguf.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    line = one_line_error(clawd(clawd_home, "serve", "--port", "0", "--model", str(cut)))
    assert "could not load" in line


def test_bad_config_is_one_line(clawd_home):
    (clawd_home / "config.toml").write_text("[server]\nport = 'eighty'\n")
    line = one_line_error(clawd(clawd_home, "serve"))
    assert "server.port" in line


def test_port_in_use_is_one_line(clawd_home, tiny_gguf):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = one_line_error(clawd(clawd_home, "serve", "--model", str(tiny_gguf), "--port", str(port)))
    assert "already in use" in line


def test_status_and_models_cli(clawd_home, tiny_gguf):
    proc = clawd(clawd_home, "status", CLAWD_SERVER_PORT=1)  # nothing listens on port 1
    assert proc.returncode == 3 and "not running" in proc.stdout
    models = clawd(clawd_home, "models", "--json", CLAWD_MODEL_PATH=str(tiny_gguf))
    info = json.loads(models.stdout)
    assert info["present"] and info["architecture"] == "llama" and info["path"] == str(tiny_gguf)

    serve = ServeProcess(clawd_home, "--model", str(tiny_gguf))
    try:
        url = serve.wait_ready()
        port = url.rsplit(":", 1)[1]
        status = clawd(clawd_home, "status", "--json", CLAWD_SERVER_PORT=port)
        assert status.returncode == 0, status.stderr
        data = json.loads(status.stdout)
        assert data["running"] and data["model"] == "tiny-llama" and data["turns"] == 0
        text = clawd(clawd_home, "status", CLAWD_SERVER_PORT=port).stdout
        assert "tiny-llama" in text and "0 turns" in text
    finally:
        serve.proc.send_signal(signal.SIGTERM)
        code, out = serve.finish()
    assert code == 0, out


def _chat(url: str, model: str, text: str, **extra) -> dict:
    r = authed.post(
        url + "/v1/chat/completions",
        timeout=60,
        json={"model": model, "messages": [{"role": "user", "content": text}], "temperature": 0, **extra},
    )
    r.raise_for_status()
    return r.json()


def _kill_mid_stream(home, model_args, model_id, max_tokens):
    """Two finished turns, then SIGKILL while a third streams. Returns the finished ids."""
    serve = ServeProcess(home, *model_args)
    try:
        url = serve.wait_ready()
        done = [_chat(url, model_id, f"question {i}", max_tokens=8)["id"] for i in range(2)]
        body = {
            "model": model_id,
            "stream": True,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "messages": [{"role": "user", "content": "tell me everything"}],
        }
        with authed.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    serve.proc.send_signal(signal.SIGKILL)
                    break
    finally:
        serve.kill()
    return done


def _check_store_after_kill(home, done: list[str]) -> None:
    db = home / "data" / "clawd.db"
    con = sqlite3.connect(db)
    try:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        rows = {
            r[0]: r
            for r in con.execute("SELECT id, length(response_ids), length(response_logprobs), finish_reason FROM turns")
        }
    finally:
        con.close()
    for turn_id in done:
        assert turn_id in rows, "a completed turn was lost"
        _, n_ids, n_lps, _ = rows[turn_id]
        assert n_ids == n_lps and n_ids > 0  # 4 bytes per token in both arrays
    # Whatever else is there is whole: a row exists only once its turn ended.
    for _, n_ids, n_lps, finish in rows.values():
        assert n_ids == n_lps and finish in ("stop", "length", "cancelled")


def test_sigkill_during_stream_loses_no_completed_turn(clawd_home, tiny_gguf):
    done = _kill_mid_stream(clawd_home, ["--model", str(tiny_gguf)], "tiny-llama", 200)
    _check_store_after_kill(clawd_home, done)
    # The daemon comes back on the same home and keeps serving and logging.
    serve = ServeProcess(clawd_home, "--model", str(tiny_gguf))
    try:
        url = serve.wait_ready()
        again = _chat(url, "tiny-llama", "after the crash", max_tokens=4)
        turns = authed.get(url + f"/clawd/turns/{again['id']}").json()
        assert turns["completion_tokens"] == again["usage"]["completion_tokens"]
    finally:
        serve.kill()


@pytest.mark.slow
def test_sigkill_mid_stream_real_model(clawd_home):
    """On the 270M model (~40 tok/s) the kill surely lands mid-generation: the
    interrupted turn is absent, not half-written."""
    done = _kill_mid_stream(clawd_home, [], "gemma3-270m", 400)
    _check_store_after_kill(clawd_home, done)
    con = sqlite3.connect(clawd_home / "data" / "clawd.db")
    try:
        assert con.execute("SELECT COUNT(*) FROM turns").fetchone()[0] == len(done)
    finally:
        con.close()
