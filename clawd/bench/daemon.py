"""A real `clawd serve` subprocess on its own CLAWD_HOME, and the few HTTP calls a benchmark makes.

Boundary: process life (start, wait for "serving", stop) and thin request helpers over
clawd/client.py; what to ask and what to measure is the caller's business. Output goes to a
log file in the home (a pipe nobody reads would stall the daemon).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from clawd.client import DaemonClient
from clawd.errors import ClawdError
from clawd.paths import resolve_paths
from clawd.token import read_token


class DaemonFailed(ClawdError):
    """The benchmark's daemon did not start, or a run inside it failed."""


class Daemon:
    def __init__(
        self, home: Path, settings: dict[str, str], *, model: Path | None = None, start_timeout_s: float = 180.0
    ):
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        self.log = home / "serve.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWD_")}
        env.update(CLAWD_HOME=str(home), **settings)
        args = [sys.executable, "-m", "clawd.cli", "serve", "--port", "0"]
        if model is not None:
            args += ["--model", str(model)]
        with open(self.log, "w") as fh:
            self.proc = subprocess.Popen(args, env=env, stdout=fh, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + start_timeout_s
        while True:
            m = re.search(r"at (http://[\d.]+:\d+)/v1", self.log.read_text())
            if m:
                self.url = m.group(1)
                break
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise DaemonFailed(
                    f"clawd serve did not start; its log ({self.log}) ends:\n" + self.log.read_text()[-2000:]
                )
            time.sleep(0.1)
        # The API needs the token from loopback too: the one this home's daemon made.
        token = read_token(resolve_paths({"CLAWD_HOME": str(home)}).token_file)
        self.http = DaemonClient(self.url, token=token, timeout=600)
        self.model_id = self.get("/v1/models")["data"][0]["id"]

    def get(self, path: str, **params) -> dict:
        return self.http.get(path, **params)

    def post(self, path: str, body: dict | None = None, **params) -> dict:
        return self.http.post(path, body, **params)

    def chat(
        self,
        messages: list[dict],
        *,
        max_tokens: int,
        temperature: float,
        seed: int,
        session_id: str,
        side: bool = False,
    ) -> dict:
        """One non-streamed completion: {"id": turn id, "text": ..., "finish_reason": ...}."""
        body = {
            "model": self.model_id,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "seed": seed,
            "session_id": session_id,
            "turn_type": "side" if side else "main",
        }
        out = self.post("/v1/chat/completions", body)
        choice = out["choices"][0]
        return {"id": out["id"], "text": choice["message"]["content"] or "", "finish_reason": choice["finish_reason"]}

    def wait_mined(self, turn_id: str, timeout_s: float = 600.0) -> dict:
        """The turn's signal once the miner is done with it (ready or empty)."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            r = self.http.request("GET", f"/clawd/signals/{turn_id}")
            if r.status_code == 200 and r.json()["status"] in ("ready", "empty"):
                return r.json()
            time.sleep(0.2)
        raise DaemonFailed(f"turn {turn_id} was not mined within {timeout_s:.0f} s")

    def train(self, timeout_s: float = 3600.0, on_progress=None) -> dict | None:
        """Start a run if training.min_signals untrained signals are ready; wait for it and
        return its result (adapter, gate, promoted), or None when too few signals wait."""
        started = self.post("/clawd/training", if_ready=1)
        if not started.get("job_id"):
            return None
        job, deadline = started["job_id"], time.time() + timeout_s
        while time.time() < deadline:
            st = self.get("/clawd/training")
            if on_progress:
                on_progress(st)
            if st["job_id"] == job and st["state"] in ("idle", "error") and st["result"] is not None:
                return {"job_id": job, **st["result"]}
            time.sleep(1.0)
        raise DaemonFailed(f"training job {job} did not finish within {timeout_s:.0f} s")

    def stop(self) -> None:
        if getattr(self, "http", None) is not None:
            self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
