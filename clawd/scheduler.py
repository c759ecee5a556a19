"""When to train, and the life of the trainer child process.

Boundary: decides when a run starts (enough untrained signals, and the user idle for
`idle_minutes` or the clock in the overnight window), builds its job (jobs.py),
runs `python -m clawd.training.run` at low CPU priority, follows its JSON-line progress,
and hands the finished adapter to the registry (adapters.py), which gates and promotes it.

Serving always wins: the moment a user request asks for the engine the trainer is paused
(SIGSTOP, so it gives the CPU back at once) and it resumes (SIGCONT) only after the user has
been quiet for a few seconds. On daemon shut-down the trainer is asked to stop at its next
optimizer step (SIGTERM → checkpoint); the next run resumes that job.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import time
import uuid
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

from clawd import jobs, trainer_pid
from clawd.adapters import Registry
from clawd.config import TrainingSettings
from clawd.errors import AdapterError, Busy, ClawdError, ConfigError, InvalidRequest
from clawd.paths import Paths
from clawd.protocol import TrainingStatus
from clawd.served import ServedModel
from clawd.store import adapters as adapter_rows
from clawd.store import signals
from clawd.store.db import Database
from clawd.teacher_model import teacher_model_path
from clawd.trainer_pid import trainer_pid_file
from clawd.training.data import STOPPED, read_job, write_job

log = logging.getLogger(__name__)


def in_window(window: str, now: datetime) -> bool:
    """Is `now` inside "HH:MM-HH:MM" (local time; may wrap midnight)? Empty = never."""
    if not window.strip():
        return False
    try:
        start, end = (datetime.strptime(p.strip(), "%H:%M").time() for p in window.split("-"))
    except ValueError:
        raise InvalidRequest(f"training.window must look like 01:00-06:00, got {window!r}") from None
    t = now.time()
    return start <= t < end if start <= end else (t >= start or t < end)


class Scheduler:
    def __init__(
        self,
        db: Database,
        model: ServedModel,
        registry: Registry,
        settings: TrainingSettings,
        paths: Paths,
        *,
        top_k: int = 4,
        python: str = sys.executable,
        poll_s: float = 30.0,
        resume_quiet_s: float = 5.0,
    ):
        self.db = db
        self.model = model
        self.top_k = top_k  # mining.top_k: the jobs carry it to the trainer (a config reload updates it)
        self.registry = registry
        self.settings = settings
        self.paths = paths
        self.python = python
        self.poll_s = poll_s
        self.resume_quiet_s = resume_quiet_s
        self.jobs_dir = paths.state_dir / "jobs"
        self.pid_file = trainer_pid_file(paths)
        self.status = TrainingStatus()
        self.history: list[dict] = []  # the current (or last) run's step metrics, for curves
        self._proc: asyncio.subprocess.Process | None = None
        self._paused = False
        self._stopping = False  # we asked the trainer to stop: its job stays resumable
        self._starting = asyncio.Lock()  # one run at a time, even when the loop and the API race
        # After a run that was refused or failed, the same signals would give the same run:
        # automatic training waits until this many untrained signals are ready.
        self._retry_at = 0
        self._resume: asyncio.Task | None = None
        self._run: asyncio.Task | None = None
        self._loop_task: asyncio.Task | None = None
        self._started = time.monotonic()

    # --- when -------------------------------------------------------------------------

    def start(self) -> None:
        self.model.runner.on_user_request(self._user_arrived)
        self._loop_task = asyncio.create_task(self._loop(), name="scheduler")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                go, self.status.reason = await self.should_train()
                if go:
                    await self.run_now()
            except ClawdError as e:
                self.status.reason = str(e)
                log.warning("scheduler: %s", e)
            except Exception as e:  # never let one bad poll end automatic training for good
                self.status.reason = f"scheduler error: {e}"
                log.exception("scheduler poll failed")

    def idle_seconds(self) -> float:
        runner = self.model.runner
        if runner.user_active:
            return 0.0
        return time.monotonic() - max(runner.last_user_end, self._started)

    async def should_train(self, now: datetime | None = None) -> tuple[bool, str]:
        s = self.settings
        if not s.auto:
            return False, "automatic training is off (training.auto)"
        if self.running:
            return False, "a run is in progress"
        n = await jobs.untrained_count(self.db, self.model.model_id, s)
        if n < s.min_signals:
            return False, f"{n} of {s.min_signals} untrained signals ready"
        if n < self._retry_at:
            return False, (
                f"the last run on these signals was refused or failed; waiting for "
                f"{self._retry_at - n} more (or `clawd train --now`)"
            )
        if in_window(s.window, now or datetime.now()):
            return True, f"{n} signals ready, inside the overnight window {s.window}"
        idle = self.idle_seconds()
        if idle >= s.idle_minutes * 60:
            return True, f"{n} signals ready, idle {idle / 60:.0f} min"
        return False, f"{n} signals ready; waiting for {s.idle_minutes:g} idle minutes or the window {s.window}"

    # --- a run ------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._run is not None and not self._run.done()

    async def run_now(self) -> str:
        """Start a run now (resuming a stopped job if there is one); returns its job id."""
        async with self._starting:
            if self.running:
                raise Busy(f"training job {self.status.job_id} is already running")
            job_dir = await self._resumable() or await self._new_job()
            self.status = TrainingStatus(
                state="running", job_id=job_dir.name, phase="start", started_at=time.time(), reason="running"
            )
            self.history = []
            self._stopping = False
            self._run = asyncio.create_task(self._execute(job_dir), name=f"train-{job_dir.name}")
            return job_dir.name

    async def start_run(self, if_ready: bool = False) -> dict:
        """Train now on the ready signals (ignores the idle/window rules). With `if_ready`
        (timers), only when training.min_signals are waiting; otherwise say why not."""
        if if_ready:
            n = await jobs.untrained_count(self.db, self.model.model_id, self.settings)
            if self.running or n < self.settings.min_signals:
                reason = (
                    "a run is in progress"
                    if self.running
                    else f"{n} of {self.settings.min_signals} untrained signals ready"
                )
                return {"job_id": None, "state": self.status.state, "reason": reason}
        return {"job_id": await self.run_now(), "state": "running"}

    async def report(self) -> dict:
        """The status, with why it is not training when it is not, what is held out for the gate,
        and whether the last run's adapter is still the one served."""
        st = self.status.public()
        if not self.running:
            st["reason"] = (await self.should_train())[1]
        st["holdout"] = (await jobs.holdout_rule(self.db, self.model.model_id, self.settings)).explain()
        result = st.get("result") or {}
        if result.get("promoted"):
            result["live"] = result.get("adapter_id") == self.model.active_adapter
        return st

    async def held_out(self, turn_ids: list[str]) -> set[str]:
        """Which of `turn_ids` the gate keeps out of training now."""
        rule = await jobs.holdout_rule(self.db, self.model.model_id, self.settings)
        return {t for t in turn_ids if rule.held_out(t)}

    async def curve(self) -> dict:
        """Per-step metrics for curves: the current or last run of this daemon (`live`), else
        the newest adapter's recorded training curve (`adapter`)."""
        if self.history:
            return {"job_id": self.status.job_id, "source": "live", "steps": self.history}
        for rec in await adapter_rows.list_all(self.db):
            if rec.metrics.get("history"):
                return {"job_id": rec.id, "source": "adapter", "steps": rec.metrics["history"]}
        return {"job_id": None, "source": None, "steps": []}

    async def wait(self) -> dict | None:
        if self._run is not None:
            await asyncio.shield(self._run)
        return self.status.result

    async def _resumable(self) -> Path | None:
        """A stopped job that still fits the world: same served model and weights, same parent
        (the active adapter), same training settings, and none of its turns forgotten or vetoed
        since. Anything else is deleted and rebuilt from fresh signals."""
        if not self.jobs_dir.is_dir():
            return None
        active = await adapter_rows.active(self.db)
        gone = await signals.forgotten_turns(self.db) | await signals.vetoed_turns(self.db)
        for d in sorted(self.jobs_dir.iterdir()):
            if (d / "job.json").is_file() and not (self.paths.adapters_dir / d.name).exists():
                try:
                    job = read_job(d / "job.json")
                except (ValueError, TypeError, KeyError, OSError) as e:
                    log.warning("dropping unreadable training job %s: %s", d.name, e)
                else:
                    turns = {s.turn_id for s in job.train + job.holdout}
                    if (
                        jobs.same_weights(job, self.model)
                        and job.parent_id == (active.id if active else None)
                        and job.config == asdict(self.settings)
                        and job.top_k == self.top_k
                        and not turns & gone
                    ):
                        return d
            shutil.rmtree(d, ignore_errors=True)  # finished, never written, or stale
        return None

    async def _new_job(self) -> Path:
        parent = await adapter_rows.active(self.db)
        job_id = "ad-" + datetime.now().strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:4]
        try:  # checked again at each job: config.toml is reloaded live, and files come and go
            teacher = await asyncio.to_thread(
                teacher_model_path, self.settings.teacher, Path(self.model.info.path), self.paths
            )
        except ConfigError as e:
            raise InvalidRequest(e.message) from e
        job = await jobs.build_job(self.db, self.model, self.settings, job_id=job_id, parent=parent, top_k=self.top_k)
        job.teacher_model_path = str(teacher) if teacher else None
        if not job.train:
            raise InvalidRequest(
                "nothing to train on: no ready signal that an adapter has not learned yet "
                "(chat, give feedback or corrections, then try again)"
            )
        job_dir = self.jobs_dir / job_id
        job_dir.mkdir(parents=True)
        write_job(job, job_dir / "job.json")
        return job_dir

    async def _execute(self, job_dir: Path) -> None:
        st = self.status
        self.paths.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.paths.log_dir / "trainer.log", "ab") as log_file:
            self._proc = await asyncio.create_subprocess_exec(
                self.python,
                "-m",
                "clawd.training.run",
                str(job_dir),
                "--cache",
                str(self.paths.cache_dir),
                "--out",
                str(self.paths.adapters_dir),
                "--parent",  # the child dies with this daemon, even SIGKILLed (training/parent.py)
                str(os.getpid()),
                stdout=asyncio.subprocess.PIPE,
                stderr=log_file,
            )
            try:
                trainer_pid.write(self.pid_file, self._proc.pid, job_dir)
            except OSError as e:  # e.g. a full disk: the child still dies with us (training/parent.py)
                log.warning("could not write %s: %s", self.pid_file, e)
            self._low_priority(self._proc.pid)
            done, error = None, None
            try:
                async for line in self._proc.stdout:
                    event = self._event(line)
                    if event.get("event") == "done":
                        done = event
                    elif event.get("event") == "error":
                        error = event.get("message")
                code = await self._proc.wait()
            finally:
                if self._proc.returncode is None:  # cancelled (daemon stopping): see stop()
                    await self._terminate()
                self._proc = None
                self._paused = False
                trainer_pid.clear(self.pid_file)
        if code == STOPPED or (code != 0 and self._stopping):  # we stopped it: keep the job to resume
            st.state, st.phase = "idle", "stopped"
            st.result = {"job_id": job_dir.name, "stopped_at": st.step, "resumable": True}
            return
        if code != 0 or done is None:
            st.state = "error"
            st.result = {
                "job_id": job_dir.name,
                "error": error or f"trainer exited with code {code} (see {self.paths.log_dir / 'trainer.log'})",
            }
            shutil.rmtree(job_dir, ignore_errors=True)  # a failed job is rebuilt from fresh signals
            await self._wait_for_new_signals()
            return
        st.phase = "promote"
        try:
            st.result = await self._promote(Path(done["path"]))
        except Exception as e:  # a broken adapter must not leave the status "running" forever
            log.exception("promoting %s failed", job_dir.name)
            st.result = {"adapter_id": job_dir.name, "error": f"promotion failed: {e}", "promoted": False}
        st.state = "idle" if "error" not in st.result else "error"
        shutil.rmtree(job_dir, ignore_errors=True)
        if st.result.get("promoted"):
            self._retry_at = 0
        else:
            await self._wait_for_new_signals()

    async def _wait_for_new_signals(self) -> None:
        untrained = await jobs.untrained_count(self.db, self.model.model_id, self.settings)
        self._retry_at = untrained + self.settings.min_signals

    async def _promote(self, path: Path) -> dict:
        try:
            rec = await self.registry.register(path)
        except AdapterError as e:
            return {"adapter_id": path.name, "error": str(e), "promoted": False}
        out = {"adapter_id": rec.id, "gate": rec.gate, "promoted": False}
        if rec.id in await self.registry.retire_forgotten():  # a session was forgotten mid-run
            out["note"] = "trained on a session forgotten while it ran; retired and deleted"
            return out
        if rec.status != "candidate":
            why = "; ".join(rec.gate.get("refused") or [])
            out["note"] = (
                "the eval gate refused it" + (f" ({why})" if why else "") + "; the active adapter is unchanged"
            )
            return out
        try:
            await self.registry.activate(rec.id)
            out["promoted"] = True
        except AdapterError as e:
            out["error"] = str(e)
        return out

    def _low_priority(self, pid: int) -> None:
        # Lowest CPU priority, and on Linux the idle scheduling class (runs only when nothing
        # else wants the CPU), as clawd-train.service does. Set from here rather than in a
        # preexec_fn: forking a threaded process (llama.cpp's threads) must run no Python.
        try:
            os.setpriority(os.PRIO_PROCESS, pid, self.settings.nice)
            if hasattr(os, "SCHED_IDLE"):
                os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass  # gone already, or not permitted in some containers; nice alone still applies

    def _event(self, line: bytes) -> dict:
        try:
            event = json.loads(line)
        except ValueError:
            return {}
        st, kind = self.status, event.get("event")
        if kind == "start":
            st.blas = event.get("blas")
        elif kind == "phase":
            st.phase = event.get("phase")
            st.total = event.get("steps", st.total)
            st.samples = event.get("samples", st.samples)
        elif kind == "prepare":
            st.prepared = event.get("done", 0)
        elif kind == "step":
            st.step, st.total = event.get("step", 0), event.get("total", 0)
            st.metrics = {k: v for k, v in event.items() if k not in ("event", "time")}
            self.history.append(st.metrics)
        return event

    # --- serving first ----------------------------------------------------------------

    def _user_arrived(self) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None or self._stopping:
            return  # a stopping trainer is left to reach its checkpoint
        if not self._paused:
            if not _signal(proc, signal.SIGSTOP):  # the CPU goes back to the user at once
                return
            self._paused = True
            self.status.state = "paused"
        if self._resume is None or self._resume.done():
            self._resume = asyncio.create_task(self._resume_when_quiet())

    async def _resume_when_quiet(self) -> None:
        await self.model.runner.wait_quiet(self.resume_quiet_s)
        proc = self._proc
        if proc is not None and proc.returncode is None and self._paused:
            _signal(proc, signal.SIGCONT)
            self._paused = False
            self.status.state = "running"

    async def stop_run(self, timeout_s: float = 60.0) -> None:
        """Ask the running trainer to stop at its next optimizer step (resumable)."""
        if self._proc is not None:
            await self._terminate(timeout_s)

    async def _terminate(self, timeout_s: float = 60.0) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        self._stopping = True
        _signal(proc, signal.SIGCONT)  # a stopped process cannot handle SIGTERM
        self._paused = False
        _signal(proc, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            _signal(proc, signal.SIGKILL)  # the job dir keeps its last checkpoint (or starts over)
            await proc.wait()

    async def stop(self) -> None:
        for task in (self._loop_task, self._resume):
            if task is not None:
                task.cancel()
        if self.running:
            await self._terminate(20.0)  # within the service manager's stop timeout (45 s)
            await asyncio.gather(self._run, return_exceptions=True)


def _signal(proc: asyncio.subprocess.Process, sig: int) -> bool:
    """Signal the trainer; False if it is already gone (exited, not yet reaped)."""
    try:
        os.kill(proc.pid, sig)
        return True
    except ProcessLookupError:
        return False
