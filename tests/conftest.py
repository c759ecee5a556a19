"""Shared fixtures: a clawd home per test, tiny real GGUF models, and real daemons
(in-process on a thread, or as a `clawd serve` subprocess) listening on loopback."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from clawd.config import load_settings
from clawd.paths import ensure_dirs, resolve_paths

ROOT = Path(__file__).resolve().parent.parent

# Every test daemon (in-process or `clawd serve`) finds this token in its home's token file,
# so tests send it like the CLI and TUI send theirs: the API needs it from loopback too.
TEST_TOKEN = "clawd-test-token"
AUTH = {"Authorization": f"Bearer {TEST_TOKEN}"}


class _Authed:
    """httpx's one-shot functions (get, post, stream, ...) that send TEST_TOKEN."""

    def __getattr__(self, name: str):
        fn = getattr(httpx, name)

        def call(*args, headers: dict | None = None, **kw):
            return fn(*args, headers={**AUTH, **(headers or {})}, **kw)

        return call


authed = _Authed()


def give_token(home: Path, env: dict | None = None) -> None:
    """Write TEST_TOKEN as the home's token file (0600, as clawd makes it), unless one exists."""
    token_file = resolve_paths(env or make_env(home)).token_file
    token_file.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(TEST_TOKEN + "\n")


@pytest.fixture
def clawd_home(tmp_path) -> Path:
    home = tmp_path / "clawd-home"
    home.mkdir()
    return home


def make_env(home: Path, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWD_")}
    env["CLAWD_HOME"] = str(home)
    env.update({k: str(v) for k, v in extra.items()})
    return env


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    from tests.tiny_models import build_tiny_gguf

    return build_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def tiny_lora(tiny_gguf, tmp_path_factory) -> Path:
    from tests.tiny_models import build_tiny_lora

    return build_tiny_lora(tmp_path_factory.mktemp("tiny-lora") / "tiny-lora.gguf", tiny_gguf)


@dataclass
class RunningDaemon:
    url: str
    state: object  # clawd.api.ApiState
    home: Path
    thread: threading.Thread
    server: object
    loop: asyncio.AbstractEventLoop

    def client(self, **kw) -> httpx.Client:
        """An HTTP client of this daemon that sends the token (pass headers to override)."""
        return httpx.Client(base_url=self.url, timeout=30, **{"headers": AUTH, **kw})

    def run(self, coro):
        """Run a coroutine on the daemon's own event loop (for store checks)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def start_daemon(home: Path, engine, env_extra: dict | None = None) -> RunningDaemon:
    """A real daemon (uvicorn on a real socket) on a thread of this process."""
    from clawd import daemon

    # Mining is off unless a test turns it on: it would compete with what a test times.
    env = make_env(
        home, **{"CLAWD_SERVER_PORT": 0, "CLAWD_MINING_ENABLED": 0, "CLAWD_MINING_QUIET_S": 0, **(env_extra or {})}
    )
    paths = resolve_paths(env)
    ensure_dirs(paths)
    give_token(home, env)
    settings = load_settings(paths.config_file, env)
    ready = threading.Event()
    box: dict = {}

    def on_ready(state, server):
        box.update(state=state, server=server, loop=asyncio.get_running_loop())
        ready.set()

    def target():
        try:
            asyncio.run(daemon.serve(settings, paths, engine, on_ready=on_ready))
        except BaseException as e:  # surface start-up failures to the test
            box["error"] = e
            ready.set()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    assert ready.wait(60), "daemon did not start"
    if "error" in box:
        raise box["error"]
    state = box["state"]
    url = f"http://127.0.0.1:{state.port}"
    for _ in range(200):  # uvicorn accepts once serve() has started
        try:
            httpx.get(url + "/clawd/health", timeout=1)
            break
        except httpx.TransportError:
            time.sleep(0.02)
    return RunningDaemon(url, state, home, thread, box["server"], box["loop"])


@pytest.fixture
def fake_daemon(clawd_home):
    from clawd.engines.fake import Engine

    d = start_daemon(clawd_home, Engine(n_ctx=512))
    yield d
    d.stop()


@pytest.fixture
def slow_fake_daemon(clawd_home):
    """Fake engine that takes 20 ms per token, for cancellation and queueing tests."""
    from clawd.engines.fake import Engine

    d = start_daemon(clawd_home, Engine(n_ctx=512, token_delay=0.02))
    yield d
    d.stop()


@pytest.fixture
def tiny_daemon(clawd_home, tiny_gguf):
    from clawd.engines.llamacpp import Engine

    d = start_daemon(clawd_home, Engine(tiny_gguf, n_ctx=256, n_threads=1, model_id="tiny"))
    yield d
    d.stop()


# Fast, decisive training on the tiny model: no holdout, a loose gate, a big learning rate.
TRAIN_ENV = {
    "CLAWD_TRAINING_AUTO": 0,
    "CLAWD_TRAINING_HOLDOUT": 0.0,
    "CLAWD_TRAINING_KL_BOUND": 50.0,
    "CLAWD_TRAINING_RANK": 4,
    "CLAWD_TRAINING_ALPHA": 8.0,
    "CLAWD_TRAINING_LEARNING_RATE": 0.02,
    "CLAWD_TRAINING_BATCH_SIZE": 2,
    "CLAWD_TRAINING_EPOCHS": 2,
}


@pytest.fixture(scope="session")
def tiny_mlx_dirs(tmp_path_factory, tiny_gguf) -> dict[str, Path]:
    """The tiny GGUF's weights as MLX model directories: "dir" (float32) and "dir-q4" (4-bit)."""
    from tests.tiny_mlx import build_tiny_mlx_dir

    where = tmp_path_factory.mktemp("tiny-mlx")
    return {
        "dir": build_tiny_mlx_dir(where / "llama", tiny_gguf),
        "dir-q4": build_tiny_mlx_dir(where / "llama-q4", tiny_gguf, bits=4),
    }


@pytest.fixture
def train_base() -> str:
    """What `train_daemon` serves; a test picks another with @pytest.mark.parametrize("train_base", ...):
    "gguf" (the tiny GGUF on llama.cpp), "gguf-mlx" (the same file on the mlx engine), or
    "dir" / "dir-q4" (an MLX model directory, float32 / 4-bit, on the mlx engine)."""
    return "gguf"


@pytest.fixture
def train_daemon(request, clawd_home, tiny_gguf, train_base):
    """A daemon on a tiny model (see train_base) with the trainer (real MLX child) enabled."""
    if train_base == "gguf":
        from clawd.engines.llamacpp import Engine

        engine = Engine(tiny_gguf, n_ctx=256, n_threads=1, model_id="tiny")
    else:
        from clawd.engines.mlx import Engine

        path = tiny_gguf if train_base == "gguf-mlx" else request.getfixturevalue("tiny_mlx_dirs")[train_base]
        engine = Engine(path, n_ctx=256, model_id="tiny", cache_dir=clawd_home / "cache")
    d = start_daemon(clawd_home, engine, TRAIN_ENV)
    yield d
    d.stop()


class ServeProcess:
    """`clawd serve` as a real subprocess, for crash and start-up tests."""

    def __init__(self, home: Path, *args: str, env_extra: dict | None = None):
        self.home = home
        give_token(home)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "clawd.cli", "serve", "--port", "0", *args],
            # One thread: llama.cpp's threads spin-wait on each other, which on a loaded
            # 2-core CI machine turns a tiny model's milliseconds into seconds.
            env=make_env(home, **{"CLAWD_MODEL_N_THREADS": 1, **(env_extra or {})}),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.output: list[str] = []
        self.url = None

    def wait_ready(self, timeout: float = 120) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.output.append(line)
            m = re.search(r"at (http://[\d.]+:\d+)/v1", line)
            if m:
                self.url = m.group(1)
                return self.url
        raise AssertionError("clawd serve did not start:\n" + "".join(self.output))

    def finish(self, timeout: float = 30) -> tuple[int, str]:
        out, _ = self.proc.communicate(timeout=timeout)
        self.output.append(out or "")
        return self.proc.returncode, "".join(self.output)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
