"""The trainer child never outlives its daemon: a SIGKILLed daemon takes its running or paused
trainer with it (the real `clawd.training.run` child, parent-death signal), and a new daemon
ends a stray trainer of its home that it finds in state/trainer.pid (and nothing else)."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from clawd import trainer_pid
from clawd.engines.fake import Engine as FakeEngine
from clawd.paths import resolve_paths
from tests.conftest import TRAIN_ENV, ServeProcess, make_env, start_daemon


def process_state(pid: int) -> str | None:
    """The one-letter state in /proc (R, S, T, Z, ...), or None once the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def alive(pid: int) -> bool:
    return process_state(pid) not in (None, "Z", "X")  # a zombie has ended; only its exit status is left


def wait_until(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def make_ready_signals(home: Path, n: int) -> None:
    """Mark every logged main turn a ready +1 signal, straight in the database (the daemon
    has it open in WAL mode; this is what mining would have written)."""
    db = sqlite3.connect(resolve_paths(make_env(home)).db_file, timeout=30)
    count = "SELECT COUNT(*) FROM turns WHERE turn_type = 'main'"
    wait_until(lambda: db.execute(count).fetchone()[0] == n, 30, "the turns to be logged")
    with db:
        now = time.time()
        db.execute(
            "INSERT OR IGNORE INTO signals (turn_id, session_id, status, reward, reward_source, created_at, updated_at)"
            " SELECT id, session_id, 'ready', 1, 'feedback', ?, ? FROM turns WHERE turn_type = 'main'",
            (now, now),
        )
        assert db.execute("SELECT COUNT(*) FROM signals WHERE status = 'ready'").fetchone()[0] == n
    db.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process states from /proc")
def test_a_sigkilled_daemon_leaves_no_trainer_running_or_stopped(clawd_home, tiny_gguf):
    d = ServeProcess(clawd_home, "--model", str(tiny_gguf), env_extra={**TRAIN_ENV, "CLAWD_MINING_ENABLED": 0})
    try:
        url = d.wait_ready()
        paths = resolve_paths(make_env(clawd_home))
        with httpx.Client(
            base_url=url, timeout=60, headers={"Authorization": f"Bearer {paths.token_file.read_text().strip()}"}
        ) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            for i in range(3):
                r = c.post(
                    "/v1/chat/completions",
                    json={"model": model, "messages": [{"role": "user", "content": f"question {i}?"}], "max_tokens": 8},
                )
                assert r.status_code == 200, r.text
            make_ready_signals(clawd_home, 3)
            r = c.post("/clawd/training")
            assert r.status_code == 200, r.text
            # The child has run its first lines (the parent watch) once it reports its BLAS.
            wait_until(lambda: c.get("/clawd/training").json()["blas"], 120, "the trainer to start")
        rec = trainer_pid.trainer_pid_file(paths)
        pid = int(__import__("json").loads(rec.read_text())["pid"])
        assert trainer_pid.is_our_trainer(pid, str(paths.state_dir / "jobs"))
        os.kill(pid, signal.SIGSTOP)  # paused, as the daemon pauses it for a user request
        wait_until(lambda: process_state(pid) in ("T", "t"), 5, "the trainer to stop")
        d.proc.kill()
        d.proc.wait(10)
        t0 = time.monotonic()
        wait_until(lambda: not alive(pid), 2.0, "the trainer to die with its daemon")
        assert time.monotonic() - t0 < 2.0
    finally:
        d.kill()


def stray(tmp_path: Path, *marks: str) -> subprocess.Popen:
    """A long-lived process whose command line carries `marks` (as a trainer's carries its module and job dir)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", *marks])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process states from /proc")
def test_start_up_ends_a_stray_stopped_trainer_of_this_home(clawd_home, tmp_path):
    paths = resolve_paths(make_env(clawd_home))
    job_dir = paths.state_dir / "jobs" / "ad-20260101-000000-abcd"
    p = stray(tmp_path, "-m", "clawd.training.run", str(job_dir))
    try:
        os.kill(p.pid, signal.SIGSTOP)  # left paused by a daemon that was killed
        trainer_pid.write(trainer_pid.trainer_pid_file(paths), p.pid, job_dir)
        d = start_daemon(clawd_home, FakeEngine())
        try:
            assert p.wait(5) == -signal.SIGKILL
            assert not trainer_pid.trainer_pid_file(paths).exists()
        finally:
            d.stop()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize(
    "marks",
    [
        ("-m", "clawd.training.run", "/elsewhere/jobs/ad-1"),  # a trainer of another home
        ("unrelated", "program"),  # the pid was recycled by something else
    ],
)
def test_a_pid_file_naming_someone_elses_process_kills_nothing(clawd_home, tmp_path, marks):
    paths = resolve_paths(make_env(clawd_home))
    p = stray(tmp_path, *marks)
    try:
        pid_file = trainer_pid.trainer_pid_file(paths)
        trainer_pid.write(pid_file, p.pid, paths.state_dir / "jobs" / "ad-1")
        assert trainer_pid.end_stray(pid_file) is None
        assert p.poll() is None  # untouched
        assert not pid_file.exists()
    finally:
        p.kill()
        p.wait()


def test_a_trainer_whose_parent_is_already_gone_exits_at_once(tmp_path):
    """The race the parent watch closes: the daemon died before the child set its death signal."""
    code = "from clawd.training.parent import die_with_parent; die_with_parent(1); print('still running')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=os.environ)
    assert out.returncode == 3 and "still running" not in out.stdout


CHILD = """
import sys, time
sys.platform = "darwin"  # no prctl: the polling watch, as on macOS
from clawd.training.parent import die_with_parent
import os
print(die_with_parent(os.getppid()), flush=True)
time.sleep(120)
"""
PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
how = child.stdout.readline().strip()
print(child.pid, how, flush=True)
child.wait()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process states from /proc")
def test_without_prctl_the_polling_watch_ends_the_child_when_its_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, text=True, env=os.environ)
    pid = None
    try:
        pid, how = parent.stdout.readline().split()
        pid = int(pid)
        assert how == "poll" and alive(pid)
        parent.kill()
        parent.wait(10)
        wait_until(lambda: not alive(pid), 2.0, "the child to notice its parent is gone")
    finally:
        if parent.poll() is None:
            parent.kill()
        if pid is not None and alive(pid):  # the watch failed: do not leave it behind
            os.kill(pid, signal.SIGKILL)
