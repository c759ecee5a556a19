"""What a new user trips over in the first hour (issue: the first hour): a quiet CLI, `clawd
status` that survives a broken config.toml, and config limits that are the API's limits.
Each runs the real CLI (a subprocess) against a real daemon on the fake engine."""

from __future__ import annotations

import json

import pytest

from clawd.config import TEMPERATURE_MAX, load_settings
from clawd.errors import ConfigError
from clawd.protocol import ChatCompletionRequest
from tests.conftest import AUTH
from tests.test_serve_process import clawd
from tests.test_tui_app import app_for  # noqa: F401 - the TUI tests' app fixture


def _port(d) -> str:
    return d.url.rsplit(":", 1)[1]


def test_commands_print_no_http_log_lines_unless_verbose(fake_daemon, clawd_home):
    quiet = clawd(clawd_home, "status", CLAWD_SERVER_PORT=_port(fake_daemon), CLAWD_LOG_LEVEL="info")
    assert quiet.returncode == 0, quiet.stderr
    assert "HTTP Request" not in quiet.stderr and "httpx" not in quiet.stderr
    loud = clawd(clawd_home, "-v", "status", CLAWD_SERVER_PORT=_port(fake_daemon), CLAWD_LOG_LEVEL="info")
    assert loud.returncode == 0 and "HTTP Request: GET" in loud.stderr  # -v brings them back


@pytest.mark.parametrize(
    "bad, named",
    [
        ("[generation]\ntemperature = 5.0\n", "generation.temperature"),  # accepted before; the API refuses it
        ("[generation]\ntop_p = 0.0\n", "generation.top_p"),
        ("[generation\ntemperature = 0.5\n", "invalid TOML"),
        ("[generation]\ntemprature = 0.5\n", "unknown key"),
    ],
)
def test_status_reports_a_broken_config_and_still_finds_the_daemon(fake_daemon, clawd_home, bad, named):
    (clawd_home / "config.toml").write_text(f"[server]\nport = {_port(fake_daemon)}\n{bad}")
    # A file that is not TOML at all says nothing, its port included: that user's daemon is found
    # where the environment (or the default) says.
    env = {"CLAWD_SERVER_PORT": _port(fake_daemon)} if "TOML" in named else {}
    text = clawd(clawd_home, "status", **env)
    assert text.returncode == 0, text.stderr
    assert "config.toml has an error" in text.stdout and named in text.stdout
    assert "fake" in text.stdout  # the running daemon's status is still shown
    data = json.loads(clawd(clawd_home, "status", "--json", **env).stdout)
    assert data["running"] and named in data["config_error"]
    # Every other command still refuses the file with its one-line error.
    other = clawd(clawd_home, "config")
    assert other.returncode == 1 and named in other.stderr


def test_a_good_config_has_no_config_error(fake_daemon, clawd_home):
    (clawd_home / "config.toml").write_text(f"[server]\nport = {_port(fake_daemon)}\n")
    data = json.loads(clawd(clawd_home, "status", "--json").stdout)
    assert data["running"] and data["config_error"] is None


def test_config_limits_are_the_api_limits(tmp_path):
    cfg = tmp_path / "config.toml"
    for value, ok in ((TEMPERATURE_MAX, True), (TEMPERATURE_MAX + 0.5, False)):
        cfg.write_text(f"[generation]\ntemperature = {value}\n")
        api_ok = True
        try:
            ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], temperature=value)
        except ValueError:
            api_ok = False
        try:
            load_settings(cfg, {})
            config_ok = True
        except ConfigError as e:
            config_ok = False
            assert "generation.temperature" in e.message and f"<= {TEMPERATURE_MAX}" in e.message
        assert config_ok == api_ok == ok


# ---- `clawd train --now` follows the run to its end, whatever promotion takes --------------------


class SlowThenAnswering:
    """A stand-in daemon whose first GET /clawd/training outlasts the client's timeout (as a
    daemon busy promoting did), then answers; it records how many requests it saw."""

    def __init__(self, first_delay_s: float):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.seen = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                outer.seen += 1
                if outer.seen == 1:
                    outer.first_started.set()
                    outer.release.wait(first_delay_s)  # the work a busy daemon is doing
                body = json.dumps({"state": "idle", "job_id": "j"}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.first_started, self.release = threading.Event(), threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def test_following_a_run_waits_out_a_slow_answer():
    from clawd.cli import follow_training
    from clawd.client import DaemonClient

    slow = SlowThenAnswering(first_delay_s=5.0)
    try:
        with DaemonClient(slow.url) as c:
            st = follow_training(c, patience_s=30.0, request_s=0.3)
        assert st == {"state": "idle", "job_id": "j"} and slow.seen >= 2  # timed out once, then answered
    finally:
        slow.close()


def test_following_gives_up_after_its_patience_or_at_once_when_refused():
    from clawd.cli import follow_training
    from clawd.client import DaemonClient, DaemonUnreachable
    from tests.test_client import free_port

    slow = SlowThenAnswering(first_delay_s=5.0)
    try:
        with DaemonClient(slow.url) as c, pytest.raises(DaemonUnreachable):
            follow_training(c, patience_s=0.0, request_s=0.3)  # no patience: the first timeout ends it
    finally:
        slow.close()
    with DaemonClient(f"http://127.0.0.1:{free_port()}") as c, pytest.raises(DaemonUnreachable, match="not running"):
        follow_training(c, patience_s=30.0, request_s=0.3)  # refused: the daemon is gone, no waiting


@pytest.mark.slow
def test_train_now_exits_zero_after_a_promoted_run(train_daemon, clawd_home):
    from tests.test_training_loop import make_ready_signals

    make_ready_signals(train_daemon, 4)
    proc = clawd(clawd_home, "train", "--now", CLAWD_SERVER_PORT=_port(train_daemon))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "promoted" in proc.stdout and "not running" not in proc.stdout + proc.stderr
    assert "HTTP Request" not in proc.stderr


# ---- where did my corrections go? the hold-out rule ------------------------------------------------


@pytest.fixture
def md_holdout(fake_daemon):
    from tests.test_training_loop import make_ready_signals

    return fake_daemon, make_ready_signals(fake_daemon, 6)


def test_few_signals_are_not_held_out_and_the_status_says_why(md_holdout):
    import hashlib

    from clawd import jobs
    from clawd.config import TrainingSettings

    d, ids = md_holdout
    db, model = d.state.db, d.state.model.model_id
    # A fraction that holds out exactly the three turns with the smallest hashes, once active.
    h = sorted(int.from_bytes(hashlib.sha256(t.encode()).digest()[:8], "big") / 2**64 for t in ids)
    fraction = h[3]
    few = TrainingSettings(holdout=fraction, holdout_min=len(ids) + 1)
    rule = d.run(jobs.holdout_rule(db, model, few))
    assert not rule.active and f"until {len(ids) + 1} signals are ready ({len(ids)} now" in rule.explain()
    assert d.run(jobs.split_signals(db, model, few)) == (ids, [])  # every signal trains
    assert d.run(jobs.untrained_count(db, model, few)) == len(ids)

    enough = TrainingSettings(holdout=fraction, holdout_min=len(ids))
    train, held = d.run(jobs.split_signals(db, model, enough))
    assert len(held) == 3 and sorted(train + held) == sorted(ids)
    assert all(jobs.is_holdout(t, fraction) for t in held) and not any(jobs.is_holdout(t, fraction) for t in train)
    assert "of signals are held out for the gate" in d.run(jobs.holdout_rule(db, model, enough)).explain()


def test_held_out_signals_are_shown_in_the_api_and_the_cli(clawd_home, tiny_gguf):
    from clawd import jobs
    from clawd.engines.llamacpp import Engine
    from tests.conftest import TRAIN_ENV, start_daemon
    from tests.test_training_loop import make_ready_signals

    env = {**TRAIN_ENV, "CLAWD_TRAINING_HOLDOUT": 0.5, "CLAWD_TRAINING_HOLDOUT_MIN": 4}
    d = start_daemon(clawd_home, Engine(tiny_gguf, n_ctx=256, n_threads=1, model_id="tiny"), env)
    try:
        ids = make_ready_signals(d, 6)
        with d.client() as c:
            shown = {s["turn_id"]: s["held_out"] for s in c.get("/clawd/signals").json()}
            assert shown == {t: jobs.is_holdout(t, 0.5) for t in ids}
            one = ids[0]
            assert c.get(f"/clawd/signals/{one}").json()["held_out"] == jobs.is_holdout(one, 0.5)
            assert "50% of signals are held out" in c.get("/clawd/training").json()["holdout"]
        listed = clawd(clawd_home, "signals", "list", CLAWD_SERVER_PORT=_port(d))
        assert listed.returncode == 0, listed.stderr
        for t in ids:
            line = next(x for x in listed.stdout.splitlines() if x.startswith(t))
            assert ("held-out" in line) == jobs.is_holdout(t, 0.5)
        status = clawd(clawd_home, "train", CLAWD_SERVER_PORT=_port(d))
        assert "gate: 50% of signals are held out" in status.stdout
    finally:
        d.stop()


# ---- a correction on a stopped reply --------------------------------------------------------------


def test_a_correction_on_a_stopped_reply_trains(clawd_home):
    import httpx

    from tests.test_miner import Convo, api_signal, feedback, mine, mining_daemon

    d = mining_daemon(clawd_home)
    try:
        with httpx.Client(headers=AUTH, timeout=30) as http:
            stopped = Convo(d, http).say("Suggest a color for my living room.")
            unrated = Convo(d, http).say("What color is the sky?")
            # The user pressed stop on both (the TUI's stop ends a turn as 'cancelled').
            d.run(d.state.db.conn.execute("UPDATE turns SET finish_reason = 'cancelled'"))
            d.run(d.state.db.conn.commit())
            text = "Use a warm color such as terracotta."
            assert feedback(http, d, turn_id=stopped, correction=text).status_code == 200
            mine(d)
            s = api_signal(http, d, stopped)
            assert (s["status"], s["reward"], s["reward_source"], s["hint"]) == ("ready", -1, "feedback", text)
            # A stopped reply nobody rated says nothing about itself: still no signal.
            assert http.get(d.url + f"/clawd/signals/{unrated}").status_code == 404
    finally:
        d.stop()


# ---- doctor: a slow BLAS measurement on a busy machine is not an install problem ------------------


def test_doctor_blames_a_busy_machine_not_the_library_it_already_uses():
    from clawd.doctor import blas_verdict

    fast = blas_verdict("numpy BLAS", "d", 50.0, 2.0, optimized=True, remedy="install X")
    assert fast.level == "ok"
    busy = blas_verdict("numpy BLAS", "d", 1.0, 2.0, optimized=True, remedy="install X", load=(3.5, 2))
    assert busy.level == "warning" and "busy (load average 3.5 on 2 cores)" in busy.detail
    assert "install X" not in busy.detail
    missing = blas_verdict("numpy BLAS", "d", 1.0, 2.0, optimized=False, remedy="install X")
    assert missing.level == "warning" and "install X" in missing.detail and "busy" not in missing.detail


# ---- the TUI: no stale "Start clawd?" after the daemon comes back --------------------------------


async def test_the_start_offer_goes_away_when_the_daemon_comes_up_by_itself(clawd_home, app_for):
    from clawd.engines.fake import Engine
    from tests.conftest import start_daemon
    from tests.test_tui_app import GREEDY, SIZE, _free_port, until
    from tui.screens.modals import ConfirmModal

    port = _free_port()
    launched = []
    app = app_for(f"http://127.0.0.1:{port}", start_daemon=lambda: launched.append("tui"))
    started = []
    try:
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: isinstance(app.screen, ConfirmModal), what="the offer")
            # Started elsewhere (a service, another terminal), not through the offer.
            started.append(start_daemon(clawd_home, Engine(n_ctx=512), {"CLAWD_SERVER_PORT": port, **GREEDY}))
            await until(pilot, lambda: not isinstance(app.screen, ConfirmModal), timeout=30, what="the offer to go")
            assert app.status is not None and launched == []  # gone without starting a second daemon
    finally:
        for d in started:
            d.stop()


async def test_after_a_correction_the_keys_rate_the_new_reply(fake_daemon, app_for):
    from tests.test_tui_app import SIZE, feedback_of, replies, say, until, until_correction_modal_takes_keys

    d = fake_daemon
    app = app_for(d.url)
    async with app.run_test(size=SIZE) as pilot:
        first = await say(pilot, "what is two plus two")
        await pilot.press("shift+tab")  # from the prompt to the reply
        await pilot.press("c")
        await until_correction_modal_takes_keys(pilot)
        await pilot.press(*"four", "enter")
        await until(pilot, lambda: len(replies(app)) == 2 and replies(app)[-1].state == "done", what="next reply")
        second = replies(app)[-1]
        assert app.focused is second
        await pilot.press("u")
        await until(pilot, lambda: feedback_of(d, second.turn_id) == [("up", None)], what="the new reply rated")
        assert ("up", None) not in feedback_of(d, first.turn_id)


# ---- `clawd chat` in a real terminal: nothing but the TUI on screen --------------------------------


def _pane(session: str) -> str:
    import subprocess

    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout


def test_clawd_chat_in_a_terminal_shows_no_log_lines(fake_daemon, clawd_home):
    import shlex
    import shutil
    import subprocess
    import sys
    import time
    import uuid

    from tests.conftest import ROOT, make_env

    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install tmux): it is the terminal this test drives")
    session = "clawd-" + uuid.uuid4().hex[:8]
    # The most talkative setting: every log line the CLI or the TUI's HTTP client could print.
    env = make_env(clawd_home, CLAWD_SERVER_PORT=_port(fake_daemon), CLAWD_LOG_LEVEL="debug")
    exports = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in env.items() if k.startswith(("CLAWD", "PYTHON")))
    cmd = f"cd {shlex.quote(str(ROOT))} && env {exports} {shlex.quote(sys.executable)} -m clawd.cli chat"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "120", "-y", "40", cmd], check=True)

    def wait_for(text: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = _pane(session)
            if text in screen:
                return screen
            time.sleep(0.1)  # polling a terminal: there is no event to wait on
        raise AssertionError(f"{text!r} never appeared; the screen:\n{_pane(session)}")

    try:
        wait_for("fake")  # the status bar names the served model once the daemon answered
        subprocess.run(["tmux", "send-keys", "-t", session, "hello there", "Enter"], check=True)
        # A finished reply shows its turn id. Not its text: the fake engine samples (p 0.9 per
        # intended token at the TUI's temperature), so "You said: hello there" can come out garbled.
        screen = wait_for("chatcmpl-")
        for noise in ("DEBUG", "INFO", "HTTP Request", "httpx", "Traceback"):
            assert noise not in screen, screen
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
