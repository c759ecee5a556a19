"""state/trainer.pid: which trainer child this home's daemon started, so that the next daemon
can end one its predecessor left behind (killed before its child, or a child that missed
its parent-death signal) before starting another.

Boundary: the pid file and the stray check only; the scheduler owns the child's life.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

log = logging.getLogger(__name__)
TRAINER_MODULE = "clawd.training.run"


def trainer_pid_file(paths) -> Path:
    return paths.state_dir / "trainer.pid"


def write(pid_file: Path, pid: int, job_dir: Path) -> None:
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = pid_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": pid, "job_dir": str(job_dir), "started_at": time.time()}))
    os.replace(tmp, pid_file)


def clear(pid_file: Path) -> None:
    pid_file.unlink(missing_ok=True)


def _cmdline(pid: int) -> str | None:
    """The process's command line, or None when it is gone or cannot be read."""
    if Path("/proc/self").exists():
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return None
    try:  # no /proc (macOS): ask ps
        out = subprocess.run(["ps", "-p", str(pid), "-o", "command="], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 and out.stdout.strip() else None


def is_our_trainer(pid: int, job_dir: str) -> bool:
    """Really a trainer of this home: its command line runs the trainer on this job dir
    (a recycled pid belongs to some other program and must not be touched)."""
    cmd = _cmdline(pid)
    return cmd is not None and TRAINER_MODULE in cmd and bool(job_dir) and job_dir in cmd


def end_stray(pid_file: Path) -> int | None:
    """End the trainer a previous daemon of this home left running (or stopped); returns
    its pid, or None when there was none. The pid file is removed either way."""
    try:
        rec = json.loads(pid_file.read_text())
        pid, job_dir = int(rec["pid"]), str(rec["job_dir"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        clear(pid_file)  # unreadable: nothing to trust in it
        return None
    if pid <= 1 or pid == os.getpid() or not is_our_trainer(pid, job_dir):
        clear(pid_file)
        return None
    log.warning("ending a stray trainer (pid %d, job %s) left by a previous daemon", pid, Path(job_dir).name)
    for sig in (signal.SIGCONT, signal.SIGKILL):  # SIGCONT first: a stopped process may be paused mid-step
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            break
    clear(pid_file)
    return pid
