"""The new user's hour (issue #20's Done-when), on the real embedded 270M model, a real `clawd
serve` subprocess and a fresh CLAWD_HOME (slow: each runs a real training run, minutes):

- README's commands in README's order, its code blocks run as printed: no error exit, no
  traceback, no log line in any output; `clawd train --now` on a pseudo-terminal draws its
  progress bar uninterrupted and exits 0 after a promoted run.
- `clawd chat` in tmux: a question, a correction, a training run, the new adapter on the
  Adapters screen, rolled back from there; no log line ever on screen.

Training runs with the smallest settings the config allows (tests/new_user.py SMALLEST_TRAINING)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from clawd.client import DaemonClient, daemon_token
from clawd.paths import resolve_paths
from tests.conftest import ROOT
from tests.new_user import (
    SMALLEST_TRAINING,
    Serve,
    env_for,
    noise_in,
    readme_blocks,
    readme_commands,
    run_clawd,
    run_on_a_pty,
    screen_lines,
)


def wait_until(check, what: str, timeout: float):
    """`check()`'s first truthy value, polled until `timeout` (the daemon's work has no event a
    test process could wait on)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout:.0f} s")


def client_for(serve: Serve) -> DaemonClient:
    """clawd's own client with the token from the home's token file, as the CLI uses it."""
    return DaemonClient(serve.url, token=daemon_token(resolve_paths(env_for(serve.home))), timeout=120)


def ready_signal(c: DaemonClient, turn_id: str):
    """The turn's signal once the miner made it ready (None before)."""
    r = c.request("GET", f"/clawd/signals/{turn_id}")
    return r.json() if r.status_code == 200 and r.json()["status"] == "ready" else None


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_the_new_users_hour_as_readme_tells_it(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    # Each subcommand below is one README documents (Commands table), so the script cannot drift
    # from it silently; the order is README's: Quick start, Commands, How clawd learns, Training.
    used = {"serve", "status", "doctor", "models", "signals", "train", "adapters", "export"}
    assert used <= readme_commands(), used - readme_commands()
    outputs: dict[str, str] = {}

    def step(*args: str, expect: int = 0, timeout: float = 300) -> str:
        proc = run_clawd(home, *args, timeout=timeout, CLAWD_SERVER_PORT=serve.port)
        out = proc.stdout + proc.stderr
        outputs[" ".join(args)] = out
        assert proc.returncode == expect, f"clawd {' '.join(args)} exited {proc.returncode}:\n{out}"
        assert not noise_in(out), f"clawd {' '.join(args)} printed log lines:\n{out}"
        return proc.stdout

    serve = Serve(home, SMALLEST_TRAINING)  # README: `make serve` (= `clawd serve`), in the background
    try:
        # Commands: what is running, is the set-up sound, which model.
        assert "gemma3-270m" in step("status")
        doctor = step("doctor", timeout=600)
        assert "error" not in {ln.split()[0] for ln in doctor.splitlines() if ln.strip()}, doctor
        assert "gemma3" in step("models")

        # Quick start: "Talk to it with any OpenAI client", both blocks as README prints them.
        (sdk,) = [b for b in readme_blocks("python") if "from openai import OpenAI" in b]
        (curl,) = [b for b in readme_blocks("sh") if b.lstrip().startswith("curl")]
        sdk, curl = (b.replace("http://127.0.0.1:8757", serve.url) for b in (sdk, curl))
        said = subprocess.run(
            [sys.executable, "-c", sdk], env=env_for(home), capture_output=True, text=True, timeout=300
        )
        assert said.returncode == 0 and said.stdout.strip(), said.stdout + said.stderr
        assert not noise_in(said.stdout + said.stderr), said.stderr
        assert "Paris" in said.stdout  # the greedy embedded model knows this one
        curled = subprocess.run(["bash", "-c", curl], env=env_for(home), capture_output=True, text=True, timeout=300)
        assert curled.returncode == 0, curled.stderr
        reply = json.loads(curled.stdout)
        turn_id, text = reply["id"], reply["choices"][0]["message"]["content"]
        assert text and not text.startswith(" ")

        # How clawd learns from you: a correction (POST /clawd/feedback), mined into a signal.
        correction = "Hello! How can I help you today?"
        with client_for(serve) as c:
            c.post("/clawd/feedback", {"turn_id": turn_id, "correction": correction})
            signal = wait_until(lambda: ready_signal(c, turn_id), "the correction mined into a signal", 600)
        assert (signal["reward"], signal["hint"]) == (-1, correction)
        listed = step("signals", "list")
        assert turn_id in listed and "ready" in listed
        assert correction in step("signals", "show", turn_id)

        # Training: `clawd train --now` in a terminal, followed to the end of a promoted run.
        rc, raw = run_on_a_pty(home, "train", "--now", CLAWD_SERVER_PORT=serve.port)
        (tmp_path / "train-now.pty").write_text(raw)  # what the terminal received, for a failure's reader
        lines = screen_lines(raw)
        outputs["train --now"] = "\n".join(lines)
        assert rc == 0, raw[-4000:]
        assert not noise_in("\n".join(lines)), "\n".join(lines)
        # Uninterrupted: every line the terminal shows is the bar, one phase after another, then
        # the one-line verdict, which says the adapter is live. The bar keeps the step done through
        # the gate (it fell back to "gate 0/1" before) and never prints an unknown total as "None".
        *bar, verdict = lines
        phase = re.compile(r"^(job \S+|start|load|scoring π_old / teacher|training|gate|promote) [━╸╺]+ \d+/(\d+|\?) ")
        assert all(phase.match(ln) for ln in bar), "\n".join(ln for ln in bar if not phase.match(ln))
        assert any(re.match(r"^gate [━╸╺]+ 1/1 ", ln) for ln in bar), "\n".join(bar)
        assert "promoted and live" in verdict and "not running" not in raw, verdict

        # Adapters: the new one, active; exported in all three formats; rolled back.
        with client_for(serve) as c:
            adapters = c.get("/clawd/adapters")
        adapter = adapters["active"]
        assert adapter and adapter in step("adapters", "list")
        assert json.loads(step("adapters", "show", adapter))["id"] == adapter
        for fmt, out in (("gguf", tmp_path / "a.gguf"), ("mlx", tmp_path / "mlx"), ("peft", tmp_path / "peft")):
            assert f"as {fmt}" in step("adapters", "export", adapter, "--format", fmt, "--out", str(out))
            assert out.exists() and (out.is_file() or any(out.iterdir())), fmt
        assert "active: none (base model)" in step("adapters", "rollback")
        assert "promoted and live" not in step("train")  # it was rolled back: no longer live

        # Exporting the signals: both formats, one line per ready signal.
        for fmt in ("trl", "jsonl"):
            step("export", "signals", "--format", fmt, "--out", str(tmp_path / f"signals.{fmt}"))
            rows = (tmp_path / f"signals.{fmt}").read_text().splitlines()
            assert len(rows) == 1 and correction in rows[0]
    finally:
        serve.stop()
    print("\n\n".join(f"$ clawd {k}\n{v}" for k, v in outputs.items()))  # shown with -s, for the note


class Tmux:
    """A terminal the test types into and reads (tmux capture-pane), every read checked for log
    lines: issue #20 saw httpx INFO lines overwrite the TUI's input box."""

    def __init__(self, command: str, width: int = 140, height: int = 45):
        self.session = "clawd-hour-" + str(time.monotonic_ns())[-8:]
        subprocess.run(
            ["tmux", "-u", "new-session", "-d", "-s", self.session, "-x", str(width), "-y", str(height), command],
            check=True,
        )
        self.screens = 0

    def screen(self) -> str:
        text = subprocess.run(["tmux", "capture-pane", "-p", "-t", self.session], capture_output=True, text=True).stdout
        self.screens += 1
        assert not noise_in(text), f"a log line on screen:\n{text}"
        return text

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.session, *keys], check=True)

    def type(self, text: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.session, "-l", text], check=True)

    def wait_for(self, text: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if " ".join(text.split()) in " ".join(screen.split()):  # a line the terminal wrapped counts
                return screen
            time.sleep(0.2)  # polling a terminal: there is no event to wait on
        raise AssertionError(f"{text!r} never appeared within {timeout:.0f} s; the screen:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.session], capture_output=True)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_clawd_chat_teaches_trains_and_rolls_back_with_no_log_line_on_screen(tmp_path):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install tmux): it is the terminal this test drives")
    home = tmp_path / "home"
    home.mkdir()
    serve = Serve(home, SMALLEST_TRAINING)
    # The most talkative setting the TUI's process could pick up: every log line it might print.
    env = env_for(home, CLAWD_SERVER_PORT=serve.port, CLAWD_LOG_LEVEL="debug")
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items() if k.startswith(("CLAWD", "PYTHON", "PATH")))
    term = Tmux(f"cd {shlex.quote(str(ROOT))} && env {exports} TERM=xterm-256color clawd chat")
    try:
        with client_for(serve) as c:
            term.wait_for("gemma3-270m")  # the status bar names the served model: the daemon answered

            # Chat: a question, answered greedily by the embedded model.
            term.type("What is the capital of France?")
            term.keys("Enter")
            term.wait_for("Paris", timeout=300)
            wait_until(
                lambda: c.get("/clawd/status")["turns"] == 1 and not c.get("/clawd/status")["busy"],
                "the reply logged",
                300,
            )
            (turn,) = [t for s in c.get("/clawd/sessions") for t in c.get(f"/clawd/sessions/{s['id']}/turns")]

            # A correction, as README's TUI table says: shift+tab focuses the last reply, `c`.
            term.keys("BTab")
            term.keys("c")
            term.wait_for("Correct this reply")
            # Longer than 10 characters: a shorter correction trains as a thumbs-down only (the
            # miner keeps hints of more than 10 characters), though the TUI marks it corrected.
            correction = "Paris, the capital of France."
            term.type(correction)
            term.keys("Enter")
            term.wait_for("✎ corrected", timeout=300)
            signal = wait_until(lambda: ready_signal(c, turn["id"]), "the correction mined into a signal", 600)
            assert (signal["reward"], signal["hint"]) == (-1, correction)

            # Training from the Training screen (F3, `s`), followed there to a promoted adapter.
            term.keys("F3")
            term.wait_for("Curves over steps")
            term.keys("s")
            term.wait_for("RUNNING", timeout=120)  # the run's state, polled by the screen each second
            term.wait_for("promoted, now active", timeout=1800)
            adapter = c.get("/clawd/adapters")["active"]
            assert adapter

            # The Adapters screen (F4) lists it, active; roll it back from there (`b`, confirmed).
            term.keys("F4")
            term.wait_for(adapter)
            term.keys("b")
            term.wait_for(f"Roll back from {adapter}")
            term.keys("y")
            term.wait_for("rolled back to the base model", timeout=120)
            assert c.get("/clawd/adapters")["active"] is None
            assert c.get(f"/clawd/adapters/{adapter}")["status"] == "retired"
        assert term.screens > 10  # every one of them was checked for log lines
    finally:
        term.close()
        serve.stop()


# ---- `clawd train --now`'s bar (fast): what the slow run above showed wrong -------------------------


@pytest.mark.parametrize(
    "status, shown",
    [
        ({"phase": "load", "state": "running", "step": 0, "total": 0}, "load 0/?"),
        ({"phase": "prepare", "state": "running", "prepared": 1, "samples": 2}, "scoring π_old / teacher 1/2"),
        (
            {"phase": "anchors", "state": "running", "prepared": 16, "samples": 16},
            "base answers (training.w_kl_base) 16/16",
        ),
        ({"phase": "train", "state": "running", "step": 0, "total": 1, "metrics": {}}, "training 0/1"),
        # The minutes-long gate after the last step: before, the bar fell back to "gate 0/1".
        ({"phase": "gate", "state": "running", "step": 1, "total": 1}, "gate 1/1"),
        ({"phase": "promote", "state": "running", "step": 1, "total": 1}, "promote 1/1"),
    ],
    ids=["load", "prepare", "anchors", "train", "gate", "promote"],
)
def test_the_train_bar_counts_what_is_done_and_never_prints_none(status, shown):
    from io import StringIO

    from rich.console import Console
    from rich.progress import Progress

    from clawd.cli import train_bar, train_bar_columns

    out = StringIO()
    progress = Progress(*train_bar_columns(), console=Console(file=out, width=100, color_system=None))
    task = progress.add_task("job j", total=None, info="")
    progress.update(task, **train_bar(status))
    progress.console.print(progress.get_renderable())
    line = " ".join(out.getvalue().replace("━", " ").split())
    assert line.startswith(shown), line
    assert "None" not in line
