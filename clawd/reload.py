"""Live config reload: watch config.toml and apply what is safe to change while serving.

Boundary: the watcher re-runs `load_settings` with the same environment mapping and CLI
overrides the daemon started with (so the layering stays defaults < file < env < flags),
then applies the live-safe part to the running objects it was handed: generation
defaults (ChatService.defaults), mining settings (Miner.settings; built judges are
dropped so a new judge spec or vote count takes effect) and log_level (the loggers).
Every other changed key needs a restart and is only reported. An invalid file keeps the
previous settings running and is reported as one line. The state is what
GET /clawd/status shows under "config".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from clawd.config import Settings, load_settings, settings_to_dict
from clawd.errors import ConfigError

log = logging.getLogger(__name__)

# Keys applied to the running daemon. Everything else (server.*, model.*) is fixed at
# start-up: generation.top_k is baked into the engine's sampler and mining.enabled decides
# whether a miner exists at all, so they need a restart too.
LIVE_PREFIXES = ("generation.", "mining.", "training.", "openwebui.", "log_level")
RESTART_ONLY = {"generation.top_k", "mining.enabled"}
# A safety net under file events (missed on some filesystems, or while the watch starts):
# the file's content is compared at least this often.
RECHECK_MS = 2000


def _flat(s: Settings) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in settings_to_dict(s).items():
        if isinstance(v, dict):
            out.update({f"{k}.{sk}": sv for sk, sv in v.items()})
        else:
            out[k] = v
    return out


def changed_keys(old: Settings, new: Settings) -> list[str]:
    """The settings keys whose values differ, in declaration order."""
    a, b = _flat(old), _flat(new)
    return [k for k in a if a[k] != b[k]]


def is_live(key: str) -> bool:
    return key.startswith(LIVE_PREFIXES) and key not in RESTART_ONLY


@dataclass
class ReloadState:
    """What the last reload did, for /clawd/status."""

    last_reload_at: float | None = None
    last_error: str | None = None
    last_error_at: float | None = None
    restart_required: list[str] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)  # live keys changed by the last good reload
    watching: bool = False

    def public(self) -> dict:
        return dataclasses.asdict(self)


class ConfigWatcher:
    """Reloads `config_file` into the running daemon (chat, miner) when it changes."""

    def __init__(
        self,
        config_file: Path,
        env: Mapping[str, str],
        overrides: Mapping[str, object],
        started: Settings,
        *,
        chat,
        miner=None,
        scheduler=None,
        openwebui=None,
    ):
        self.config_file = Path(config_file)
        self.env = dict(env)
        self.overrides = dict(overrides)
        self.started = started  # what the restart-only parts are still running with
        self.current = started
        self.chat = chat
        self.miner = miner
        self.scheduler = scheduler
        self.openwebui = openwebui  # the Open WebUI connector (openwebui/connector.py FeedbackSync)
        self.state = ReloadState()
        self._seen = self._digest()
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    # ---- one reload ---------------------------------------------------------------------

    def _digest(self) -> bytes | None:
        try:
            return hashlib.sha256(self.config_file.read_bytes()).digest()
        except OSError:
            return None  # missing (means defaults) or unreadable (load_settings will say why)

    def check(self) -> bool:
        """Reload if the file's content changed since last looked at. Returns whether it did."""
        digest = self._digest()
        if digest == self._seen:
            return False
        self._seen = digest
        self.reload()
        return True

    def reload(self) -> bool:
        """Load the file again and apply it. Returns False (and keeps the running
        settings) when the file is invalid."""
        try:
            new = load_settings(self.config_file, self.env, self.overrides)
        except ConfigError as e:
            self.state.last_error, self.state.last_error_at = e.message, time.time()
            log.error("config not reloaded, previous settings kept: %s", e.message)
            return False
        live = [k for k in changed_keys(self.current, new) if is_live(k)]
        self.apply(new, live)
        self.current = new
        self.state.restart_required = [k for k in changed_keys(self.started, new) if not is_live(k)]
        self.state.applied = live
        self.state.last_error = self.state.last_error_at = None
        self.state.last_reload_at = time.time()
        if live:
            log.info("config reloaded: applied %s", ", ".join(live))
        if self.state.restart_required:
            log.warning("config changes that take effect after a restart: %s", ", ".join(self.state.restart_required))
        return True

    def apply(self, new: Settings, live: list[str]) -> None:
        if any(k.startswith("generation.") for k in live):
            self.chat.defaults = new.generation  # read afresh by every request
        if self.miner is not None and any(k.startswith("mining.") for k in live):
            self._apply_mining(new)
        if self.scheduler is not None and any(k.startswith("training.") for k in live):
            self.scheduler.settings = new.training  # read afresh at every check and by the next run
        if self.scheduler is not None and "mining.top_k" in live:
            self.scheduler.top_k = new.mining.top_k  # the next job carries it to the trainer
        if self.openwebui is not None and any(k.startswith("openwebui.") for k in live):
            self.openwebui.settings = new.openwebui  # read afresh by every pull
            self.openwebui.poke()  # a new address or key is tried now, not a poll later
        if "log_level" in live:
            level = new.log_level.upper()
            for name in ("", "uvicorn", "uvicorn.error"):
                logging.getLogger(name).setLevel(level)

    def _apply_mining(self, new: Settings) -> None:
        miner, old = self.miner, self.miner.settings
        miner.settings = new.mining
        miner.status.judge, miner.status.hint_judge = new.mining.judge, new.mining.hint_judge
        # Judges are built on first use from the settings of that moment; drop them so the
        # next turn builds them from the new spec, votes and temperature.
        dropped = [j for spec, j in miner._judges.items() if spec != "rules" and j is not None]
        miner._judges = {"rules": None}
        if (old.judge, old.hint_judge) != (new.mining.judge, new.mining.hint_judge):
            miner._judge_retry_at = 0.0  # a new spec is tried at once, not after the old back-off
            miner.status.judge_error = miner.status.judge_error_at = None
        if dropped:
            asyncio.get_running_loop().create_task(_close_when_idle(miner, dropped))
        miner.poke()

    # ---- watching ----------------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="config-watch")
        # One turn of the loop runs the task up to its first real wait, by which point
        # watchfiles has registered the watch: an edit made right after start-up is seen.
        await asyncio.sleep(0)

    async def stop(self) -> None:
        self._stop.set()
        if self._task:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def run(self) -> None:
        from watchfiles import awatch

        name = self.config_file.name

        def only_config(_change, path: str) -> bool:
            return Path(path).name == name

        # The directory, not the file: editors replace config.toml by renaming a new file
        # over it, which would end a watch on the old file.
        self.state.watching = True
        try:
            for polling in (False, True):
                try:
                    async for _ in awatch(
                        self.config_file.parent,
                        watch_filter=only_config,
                        recursive=False,
                        step=100,
                        rust_timeout=RECHECK_MS,
                        yield_on_timeout=True,
                        stop_event=self._stop,
                        force_polling=polling or None,
                    ):
                        self.check()
                    return
                except (OSError, RuntimeError) as e:  # e.g. inotify watch limit reached
                    if polling:
                        raise
                    log.warning("cannot watch %s for changes (%s); polling it instead", self.config_file, e)
        except (OSError, RuntimeError) as e:
            self.state.last_error, self.state.last_error_at = f"config watch stopped: {e}", time.time()
            log.error("config watch stopped, restart clawd to apply config changes: %s", e)
        finally:
            self.state.watching = False


async def _close_when_idle(miner, dropped: list, poll_s: float = 0.5) -> None:
    """Close replaced judges' clients once no mining step can still be using them."""
    while miner.status.busy_since is not None:
        await asyncio.sleep(poll_s)
    for judge in dropped:
        close = getattr(getattr(judge, "completer", None), "aclose", None)
        if close:
            try:
                await close()
            except Exception as e:  # a judge client that fails to close is only a leak, not an outage
                log.warning("could not close a replaced judge: %s", e)
