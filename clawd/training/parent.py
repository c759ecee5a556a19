"""The trainer child dies with its daemon.

A trainer whose daemon was SIGKILLed would compute on until its next stdout write failed,
and a paused (SIGSTOPped) one would stay stopped with a whole model in memory, unknown to
the next daemon. So the child watches its parent from its first line: on Linux the kernel
kills it (prctl PR_SET_PDEATHSIG, which also ends a stopped process); elsewhere a thread
polls the parent pid.

Boundary: part of the trainer child; stdlib only, imports nothing of clawd.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_S = 0.5
ORPHANED = 3  # exit status when the parent is already gone (nobody reads it)


def _parent_gone(parent_pid: int) -> bool:
    # Reparented (to init or a subreaper) means the daemon is dead, even if its pid was reused.
    return os.getppid() != parent_pid


def _poll(parent_pid: int) -> None:
    while not threading.Event().wait(POLL_S):
        if _parent_gone(parent_pid):
            os._exit(ORPHANED)


def die_with_parent(parent_pid: int) -> str:
    """Arrange for this process to end when `parent_pid` (its daemon) does; returns how
    ("pdeathsig" or "poll"). Exits at once if the parent is already gone."""
    how = "poll"
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
                how = "pdeathsig"
        except (OSError, AttributeError):
            pass  # no libc prctl (unusual libc): fall back to polling
    # The parent may have died between our fork and the prctl, when no signal would come.
    if _parent_gone(parent_pid):
        os._exit(ORPHANED)
    if how == "poll":
        threading.Thread(target=_poll, args=(parent_pid,), name="parent-watch", daemon=True).start()
    return how
