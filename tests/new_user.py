"""What a new user's terminal shows, for tests/test_new_user_hour.py: a real `clawd serve`
subprocess on a fresh CLAWD_HOME, `clawd` commands run as the user types them (captured, or on a
pseudo-terminal), README's own code blocks, and the check that nothing on screen is a log line."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT, make_env

README = ROOT / "README.md"

# The smallest run the config allows, so a real run on the embedded model ends in minutes on a
# loaded 2-core machine: one signal is enough for `train --now` (min_signals only gates automatic
# runs, which are off), one step (batch 1, one epoch), a low rank on two projections, and a
# learning rate that moves the one signal's log-probs decisively within that one step. The rules
# judge mines a correction at once (the default `self` judge takes minutes per turn here).
SMALLEST_TRAINING = {
    "CLAWD_TRAINING_AUTO": 0,
    "CLAWD_TRAINING_MIN_SIGNALS": 1,
    "CLAWD_TRAINING_BATCH_SIZE": 1,
    "CLAWD_TRAINING_EPOCHS": 1,
    "CLAWD_TRAINING_RANK": 2,
    "CLAWD_TRAINING_ALPHA": 4.0,
    "CLAWD_TRAINING_TARGETS": "q_proj,v_proj",
    "CLAWD_TRAINING_LEARNING_RATE": 1e-3,
    "CLAWD_TRAINING_MAX_TOKENS": 128,
    "CLAWD_MINING_JUDGE": "rules",
    "CLAWD_MINING_HINT_JUDGE": "rules",
    "CLAWD_MINING_QUIET_S": 0,
    "CLAWD_GENERATION_MAX_TOKENS": 24,
    "CLAWD_GENERATION_TEMPERATURE": 0,
}

# What a log record looks like on a terminal: clawd's format ("2026-… INFO httpx: …"), logging's
# bare default ("INFO:httpx:…"), httpx's request lines, and a traceback.
NOISE = re.compile(
    r"\b(DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: |^(DEBUG|INFO|WARNING|ERROR|CRITICAL):|HTTP Request|Traceback",
    re.MULTILINE,
)
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][0-9A-B]|\x1b[=>]")


def noise_in(text: str) -> list[str]:
    """The lines of `text` that are log records or tracebacks (empty when the screen is clean)."""
    return [ln for ln in text.splitlines() if NOISE.search(ln)]


def env_for(home: Path, **extra) -> dict[str, str]:
    """The user's environment: a fresh CLAWD_HOME, and this Python's `clawd` on PATH (README's
    commands call it by name)."""
    env = make_env(home, **extra)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


class Serve:
    """`clawd serve` in the background, as README's quick start runs it; its output goes to a
    file (a pipe nobody reads would block the daemon once full) that the test reads back."""

    def __init__(self, home: Path, env_extra: dict, *args: str):
        self.home = home
        self.log = home.parent / "serve.log"
        self._out = self.log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "clawd.cli", "serve", "--port", "0", *args],
            env=env_for(home, **env_extra),
            cwd=ROOT,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.url = self._wait_url()
        self.port = self.url.rsplit(":", 1)[1]

    def _wait_url(self, timeout: float = 300.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"clawd: serving \S+ at (http://[\d.]+:\d+)/v1", self.log.read_text())
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)  # polling a file another process writes: there is no event to wait on
        raise AssertionError("clawd serve did not start:\n" + self.log.read_text()[-4000:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._out.close()


def run_clawd(home: Path, *args: str, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "clawd.cli", *args],
        env=env_for(home, **env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_on_a_pty(home: Path, *args: str, timeout: float = 1500, **env) -> tuple[int, str]:
    """`clawd ARGS` with stdout and stderr on one pseudo-terminal, as in a user's terminal (rich
    draws its live progress bar only there): the exit status and every byte it wrote."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "clawd.cli", *args],
        env={**env_for(home, **env), "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"},
        cwd=ROOT,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        close_fds=True,
    )
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed its end
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        else:
            proc.kill()
            raise AssertionError("`clawd " + " ".join(args) + "` did not finish:\n" + b"".join(chunks).decode()[-3000:])
        rc = proc.wait(60)
    finally:
        os.close(master)
    return rc, b"".join(chunks).decode("utf-8", "replace")


def screen_lines(raw: str) -> list[str]:
    """What a terminal shows of `raw`, line by line: escape sequences dropped, and each carriage
    return or cursor move (how rich redraws its bar) starting a new line."""
    text = re.sub(r"\x1b\[[0-9;]*[ABEFGHJKf]", "\n", raw)  # cursor moves and erases
    text = ANSI.sub("", text)
    return [ln.strip() for ln in re.split(r"[\r\n]+", text) if ln.strip()]


def readme_blocks(lang: str) -> list[str]:
    """README's fenced code blocks in `lang`, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", README.read_text(), re.MULTILINE | re.DOTALL)


def readme_commands() -> set[str]:
    """The `clawd` subcommands README's Commands table documents (`clawd adapters list|…` → adapters)."""
    return set(re.findall(r"^\| `clawd (\w+)", README.read_text(), re.MULTILINE))
