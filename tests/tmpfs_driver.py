"""A daemon on a disk that fills up: `unshare -rm python -m tests.tmpfs_driver WORKDIR`.

Run inside a user+mount namespace of its own (tests/test_durability.py does it), so it may
mount a small tmpfs without privileges. It mounts one under WORKDIR, starts `clawd serve`
(fake engine) with CLAWD_HOME on it, leaves little free space, fires many clients at
once (streamed and not), and checks what the issue demands:

- no client received a finished turn (a finish chunk, or a 200) whose row is missing;
- health says `degraded` with the reason "disk full";
- once space is freed, health turns ok by itself and a new turn is logged.

The last line of stdout is a JSON report; exit 0 when it ran (the test judges the
report), 77 when the namespace may not mount (the test skips with the printed reason).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from clawd.client import daemon_token
from clawd.paths import resolve_paths

ROOT = Path(__file__).resolve().parent.parent
TMPFS_MB = 6
LEAVE_FREE_KB = 2048  # room for some turns, then the disk is full
CLIENTS, AT_ONCE = 32, 8
CONTENT = 20_000  # characters per request (~150 KB a turn with its ids): a dozen fill what is left


def main(work: Path) -> int:
    mnt = work / "tmpfs"
    mnt.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MB}m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        print(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
        return 77
    home = mnt / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWD_")}
    env.update(
        CLAWD_HOME=str(home),
        CLAWD_MODEL_ENGINE="fake",
        CLAWD_MODEL_N_CTX="65536",
        CLAWD_MINING_ENABLED="0",
        CLAWD_TRAINING_AUTO="0",
        PYTHONPATH=str(ROOT),
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "clawd.cli", "serve", "--port", "0"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log: list[str] = []
    try:
        url = _wait_url(proc, log)
        threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
        # The token the daemon made in its home, sent as the CLI sends it: loopback needs it too.
        auth = {"Authorization": f"Bearer {daemon_token(resolve_paths(env))}"}
        report = _exercise(url, mnt, auth)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    report["daemon_exit"] = proc.returncode
    report["log_tail"] = log[-5:]
    print(json.dumps(report))
    return 0


def _wait_url(proc, log: list[str], timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        log.append(line)
        m = re.search(r"at (http://[\d.]+:\d+)/v1", line)
        if m:
            return m.group(1)
    raise SystemExit("clawd serve did not start:\n" + "".join(log))


def _fill(mnt: Path) -> Path:
    """A filler file that leaves LEAVE_FREE_KB free on the tmpfs."""
    st = os.statvfs(mnt)
    free = st.f_bavail * st.f_frsize
    filler = mnt / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(free - LEAVE_FREE_KB * 1024, 0))
    return filler


def _one_client(url: str, i: int, auth: dict[str, str]) -> dict:
    """One turn; `acknowledged`: the client saw it finish (a finish chunk, or a 200)."""
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": f"client {i} " + "q" * CONTENT}],
        "max_tokens": 16,
        "stream": i % 2 == 0,
    }
    with httpx.Client(base_url=url, timeout=60, headers=auth) as c:
        if not body["stream"]:
            r = c.post("/v1/chat/completions", json=body)
            turn = r.json().get("id") if r.status_code == 200 else None
            return {"i": i, "status": r.status_code, "acknowledged": r.status_code == 200, "turn": turn}
        finished, error = False, None
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            turn = r.headers.get("x-clawd-turn-id")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]["code"]
                elif any(ch.get("finish_reason") for ch in event.get("choices", [])):
                    finished = True
        return {"i": i, "status": r.status_code, "acknowledged": finished, "turn": turn, "error": error}


def _exercise(url: str, mnt: Path, auth: dict[str, str]) -> dict:
    filler = _fill(mnt)
    # Health is watched while the disk is full, not read once afterwards: any write that still
    # fits (a small commit into free pages) rightly clears `degraded`, so a single read after the
    # storm can miss a state the daemon did report.
    reasons: set[str] = set()
    watching = threading.Event()
    watching.set()

    def watch() -> None:
        with httpx.Client(base_url=url, timeout=30, headers=auth) as w:
            while watching.is_set():
                health = w.get("/clawd/health").json()
                if health["status"] == "degraded":
                    reasons.add(health.get("reason"))
                time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with ThreadPoolExecutor(AT_ONCE) as pool:
        results = list(pool.map(lambda i: _one_client(url, i, auth), range(CLIENTS)))
    c = httpx.Client(base_url=url, timeout=30, headers=auth)
    acknowledged = [r for r in results if r["acknowledged"]]
    missing = [r["turn"] for r in acknowledged if c.get(f"/clawd/turns/{r['turn']}").status_code != 200]
    watching.clear()
    watcher.join()
    filler.unlink()  # space returns
    deadline, recovered = time.monotonic() + 30, False
    while time.monotonic() < deadline:
        if c.get("/clawd/health").json()["status"] == "ok":
            recovered = True
            break
        time.sleep(0.1)
    after = _one_client(url, 1, auth)  # a non-streamed one
    logged = after["acknowledged"] and c.get(f"/clawd/turns/{after['turn']}").status_code == 200
    return {
        "clients": len(results),
        "acknowledged": len(acknowledged),
        "refused": len(results) - len(acknowledged),
        "statuses": sorted({r["status"] for r in results}),
        "stream_errors": sorted({r.get("error") for r in results if r.get("error")}),
        "acknowledged_missing": missing,
        "degraded_reasons": sorted(reasons),
        "recovered": recovered,
        "after_recovery_logged": logged,
    }


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
