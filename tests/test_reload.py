"""Live config reload on real daemons: a `clawd serve` process (tiny llama.cpp model)
whose config.toml is edited while it runs, and an in-process daemon for the parts a
subprocess cannot show (restart-only keys without a --port flag, the miner's judges)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from clawd.config import load_settings
from clawd.paths import ensure_dirs, resolve_paths
from tests.conftest import ROOT, RunningDaemon, ServeProcess, authed, give_token, make_env

BASE = """\
[generation]
max_tokens = 40
temperature = 0.0

[mining]
judge = "self"
"""
SIDE = {"X-Turn-Type": "side"}  # never mined: keeps the miner off the engine during these tests


def edit(home: Path, text: str, *, atomic: bool = True) -> float:
    """Write config.toml as editors do (a new file renamed over it) or in place. A unique
    first line makes every edit a change. Returns the time just before the write."""
    t = time.time()
    text = f"# edit {t!r}\n{text}"
    target = home / "config.toml"
    if atomic:
        tmp = home / ".config.toml.swp"
        tmp.write_text(text)
        os.replace(tmp, target)
    else:
        target.write_text(text)
    return t


def wait_status(url: str, pred, timeout: float = 10.0) -> dict:
    deadline = time.time() + timeout
    status = None
    while time.time() < deadline:
        status = authed.get(url + "/clawd/status", timeout=5).json()
        if pred(status):
            return status
        time.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout} s; last status config: {status and status.get('config')}")


def reloaded_since(t: float):
    return lambda s: (s["config"]["last_reload_at"] or 0) > t


def failed_since(t: float):
    return lambda s: (s["config"]["last_error_at"] or 0) > t


def complete(url: str, text: str = "hello there") -> dict:
    r = authed.post(
        url + "/v1/chat/completions",
        headers=SIDE,
        timeout=60,
        json={"model": "tiny-llama", "messages": [{"role": "user", "content": text}]},
    )
    r.raise_for_status()
    return r.json()


# ---- a `clawd serve` process ------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_gguf):
    home = tmp_path_factory.mktemp("reload-home")
    (home / "config.toml").write_text(BASE)
    serve = ServeProcess(home, "--model", str(tiny_gguf))
    try:
        url = serve.wait_ready()
        yield home, url, serve
    finally:
        serve.kill()


def test_status_shows_the_watch(served):
    _, url, _ = served
    config = authed.get(url + "/clawd/status").json()["config"]
    assert config["watching"] is True
    assert config["restart_required"] == [] and config["last_error"] is None


def test_max_tokens_change_applies_to_the_next_request(served):
    home, url, _ = served
    wait_status(url, reloaded_since(edit(home, BASE)))
    before = complete(url)["usage"]["completion_tokens"]
    assert before > 3  # the old limit (40) lets the greedy tiny model run past the new one

    t = edit(home, BASE.replace("max_tokens = 40", "max_tokens = 3"))
    status = wait_status(url, reloaded_since(t))
    assert "generation.max_tokens" in status["config"]["applied"]
    out = complete(url)
    assert out["usage"]["completion_tokens"] <= 3 and out["choices"][0]["finish_reason"] == "length"
    # A request's own max_tokens still wins over the default.
    r = authed.post(
        url + "/v1/chat/completions",
        headers=SIDE,
        timeout=60,
        json={"model": "tiny-llama", "max_tokens": 6, "messages": [{"role": "user", "content": "hello there"}]},
    )
    assert 3 < r.json()["usage"]["completion_tokens"] <= 6


def test_judge_change_is_visible_in_status(served):
    home, url, _ = served
    wait_status(url, reloaded_since(edit(home, BASE)))
    assert authed.get(url + "/clawd/status").json()["miner"]["judge"] == "self"
    t = edit(home, BASE.replace('judge = "self"', 'judge = "rules"\nhint_judge = "rules"'), atomic=False)
    status = wait_status(url, lambda s: s["miner"]["judge"] == "rules")
    assert status["config"]["last_reload_at"] > t
    assert status["miner"]["hint_judge"] == "rules"
    assert {"mining.judge", "mining.hint_judge"} <= set(status["config"]["applied"])


def test_invalid_edit_keeps_the_running_config(served):
    home, url, _ = served
    wait_status(url, reloaded_since(edit(home, BASE.replace("max_tokens = 40", "max_tokens = 5"))))
    assert complete(url)["usage"]["completion_tokens"] == 5

    t = edit(home, BASE.replace("[generation]", "[generation", 1).replace("max_tokens = 40", "max_tokens = 2"))
    status = wait_status(url, failed_since(t))
    assert "invalid TOML" in status["config"]["last_error"]
    assert "\n" not in status["config"]["last_error"]  # one line
    assert complete(url)["usage"]["completion_tokens"] == 5  # still the last good settings

    t = edit(home, BASE.replace("max_tokens = 40", 'max_tokens = "many"'))
    status = wait_status(url, failed_since(t))
    assert "generation.max_tokens" in status["config"]["last_error"]
    assert complete(url)["usage"]["completion_tokens"] == 5

    t = edit(home, BASE.replace("max_tokens = 40", "max_tokens = 4"))
    status = wait_status(url, reloaded_since(t))
    assert status["config"]["last_error"] is None
    assert complete(url)["usage"]["completion_tokens"] == 4


def test_port_edit_under_a_port_flag_needs_no_restart(served):
    # ServeProcess passes --port 0: flags win over config.toml, so the edit changes nothing.
    home, url, _ = served
    status = wait_status(url, reloaded_since(edit(home, BASE + "\n[server]\nport = 9\n")))
    assert status["config"]["restart_required"] == []


def test_cli_status_shows_reload_state(served):
    home, url, _ = served
    t = edit(home, BASE + '\n[model]\nchat_format = "transcript"\n')
    wait_status(url, reloaded_since(t))
    port = url.rsplit(":", 1)[1]
    p = subprocess.run(
        [sys.executable, "-m", "clawd.cli", "status"],
        env=make_env(home, CLAWD_SERVER_PORT=port),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    line = next(ln for ln in p.stdout.splitlines() if ln.strip().startswith("config"))
    assert "reloaded" in line and "restart to apply model.chat_format" in line
    p = subprocess.run(
        [sys.executable, "-m", "clawd.cli", "status", "--json"],
        env=make_env(home, CLAWD_SERVER_PORT=port),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(p.stdout)["config"]["restart_required"] == ["model.chat_format"]


# ---- an in-process daemon started as `clawd serve` would start it, without flags ----------------


def start_watched(home: Path, engine, **env_extra) -> RunningDaemon:
    """Like conftest.start_daemon, but serve() gets the env so it watches config.toml."""
    from clawd import daemon

    env = make_env(home, **env_extra)
    paths = resolve_paths(env)
    ensure_dirs(paths)
    give_token(home, env)
    settings = load_settings(paths.config_file, env)
    box: dict = {}
    ready = threading.Event()

    def on_ready(state, server):
        box.update(state=state, server=server, loop=asyncio.get_running_loop())
        ready.set()

    def target():
        try:
            asyncio.run(daemon.serve(settings, paths, engine, on_ready=on_ready, env=env, overrides={}))
        except BaseException as e:
            box["error"] = e
            ready.set()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    assert ready.wait(60) and "error" not in box, box.get("error")
    url = f"http://127.0.0.1:{box['state'].port}"
    return RunningDaemon(url, box["state"], home, thread, box["server"], box["loop"])


@pytest.fixture
def watched(clawd_home):
    from clawd.engines.fake import Engine

    (clawd_home / "config.toml").write_text("[server]\nport = 0\n\n[mining]\nenabled = false\n")
    d = start_watched(clawd_home, Engine(n_ctx=512))
    yield d
    d.stop()


def test_restart_only_keys_are_reported_not_applied(watched):
    home, url = watched.home, watched.url
    root_level = logging.getLogger().level
    text = (
        "[server]\nport = 45678\n\n[model]\nn_ctx = 128\n\n[mining]\nenabled = false\n\n"
        "[generation]\ntop_k = 5\ntemperature = 0.1\n"
    )
    try:
        status = wait_status(url, reloaded_since(edit(home, 'log_level = "debug"\n' + text)))
        assert status["config"]["restart_required"] == ["server.port", "model.n_ctx", "generation.top_k"]
        assert set(status["config"]["applied"]) == {"generation.temperature", "log_level"}
        assert watched.state.chat.defaults.temperature == 0.1  # applied
        assert watched.state.model.runner.engine.info.n_ctx == 512  # not applied
        assert logging.getLogger().level == logging.DEBUG
        assert status["port"] == watched.state.port != 45678  # still serving where it started

        # Editing a key back to the value the daemon runs with clears it from the list.
        from clawd.config import ModelSettings

        default_n_ctx = f"n_ctx = {ModelSettings().n_ctx}"  # what the daemon started with
        t = edit(home, text.replace("port = 45678", "port = 0").replace("n_ctx = 128", default_n_ctx))
        status = wait_status(url, reloaded_since(t))
        assert status["config"]["restart_required"] == ["generation.top_k"]
    finally:
        logging.getLogger().setLevel(root_level)


def test_mining_change_replaces_built_judges(clawd_home):
    from clawd.engines.fake import Engine
    from clawd.judge import LLMJudge

    (clawd_home / "config.toml").write_text("[mining]\nenabled = true\nvotes = 3\n")
    d = start_watched(clawd_home, Engine(n_ctx=512))
    try:
        miner = d.state.miner
        built = d.run(_build(miner, "self"))
        assert isinstance(built, LLMJudge) and built.votes == 3 and "self" in miner._judges
        t = edit(clawd_home, "[mining]\nenabled = true\nvotes = 5\ntemperature = 0.2\n")
        wait_status(d.url, reloaded_since(t))
        assert miner.settings.votes == 5
        assert list(miner._judges) == ["rules"]  # the cached judge was dropped...
        rebuilt = d.run(_build(miner, "self"))
        assert (rebuilt.votes, rebuilt.temperature) == (5, 0.2)  # ...and is rebuilt from the new settings
    finally:
        d.stop()


async def _build(miner, spec):
    return await miner._judge(spec)
