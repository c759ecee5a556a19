"""Start-up and shut-down of the daemon: store, engine, API, server, in that order.

The model is loaded before the port is bound, so a bad model or a taken port is a
one-line error at start-up rather than a daemon that answers 500s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import gc
import logging
import signal
import socket
from collections.abc import Mapping
from pathlib import Path

import uvicorn

from clawd.adapters import Registry
from clawd.api import ApiState, create_app
from clawd.chat import ChatService
from clawd.config import DEPRECATED_REQUIRE_TOKEN, Settings
from clawd.engines.base import Engine
from clawd.engines.runner import EngineRunner
from clawd.errors import ConfigError
from clawd.judge import LikelihoodJudge, LLMJudge
from clawd.judge_completers import JUDGE_FORMS, completer_for
from clawd.judge_examples import EXAMPLES
from clawd.miner import Miner
from clawd.modelfile import why_untrainable
from clawd.openwebui.connector import FeedbackSync
from clawd.paths import PRIVATE_DIR, Paths, make_private
from clawd.reload import ConfigWatcher
from clawd.scheduler import Scheduler
from clawd.served import ServedModel
from clawd.store.db import Database
from clawd.teacher_model import teacher_model_path
from clawd.templates import choose_format
from clawd.token import ensure_token
from clawd.trainer_pid import end_stray, trainer_pid_file

log = logging.getLogger(__name__)
HEALTH_PROBE_S = 2.0  # while degraded: how often a tiny write checks whether the disk is back


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket ourselves so 'port in use' is a clear error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto named, not 0: asyncio sets TCP_NODELAY only on connections whose socket says
    # IPPROTO_TCP. Without it every keep-alive response waited ~40 ms (Nagle meets the
    # client's delayed ACK between uvicorn's header and body writes).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"port {port} on {host} is already in use (another clawd?): stop it, or pass --port / set server.port"
            ) from e
        raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror}): check server.host") from e
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn re-raises the stop signal once it has shut down, turning a clean stop
    into death by SIGTERM; a daemon that drained its streams exits 0 instead."""

    on_exit = None  # called once when a stop signal arrives (set by serve())

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for streams
        else:
            if not self.should_exit and self.on_exit is not None:
                self.on_exit()
            self.should_exit = True


async def build_state(settings: Settings, paths: Paths, engine: Engine, port: int) -> ApiState:
    # Before anything can start another: a trainer a killed predecessor left behind holds a
    # model in memory (and, if it was paused, holds it forever).
    end_stray(trainer_pid_file(paths))
    try:
        paths.data_dir.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
        make_private(paths, create_db=True)  # 0600 before SQLite makes it, or its -wal / -shm
    except OSError as e:
        raise ConfigError(f"cannot create the database {paths.db_file}: {e.strerror}; check CLAWD_HOME") from e
    if settings.server.require_token:
        log.warning(DEPRECATED_REQUIRE_TOKEN)
    db = await Database.open(paths.db_file)
    info = engine.info
    fmt = choose_format(settings.model.chat_format, info.chat_template, info.bos_token, info.eos_token, info.add_bos)
    model = ServedModel(EngineRunner(engine), fmt)
    miner = None
    if settings.mining.enabled:
        # Judges read the miner's current settings, which a config reload may replace.
        miner = Miner(
            db,
            model,
            settings.mining,
            make_judge=lambda spec: build_judge(
                spec, dataclasses.replace(settings, mining=miner.settings), model, paths
            ),
        )
    chat = ChatService(model, db, settings.generation, on_turn=miner.poke if miner else lambda: None)
    registry = scheduler = None
    # The trainer builds its MLX model from the served weights: a GGUF file (llama.cpp serves its
    # GGUF LoRA, mlx its mlx-lm files) or an MLX/HF model directory (mlx only). Upstream and fake
    # engines have no weights here to train.
    base = Path(info.path)
    training_off = None
    if (engine.name == "llamacpp" and base.is_file()) or (engine.name == "mlx" and base.exists()):
        training_off = why_untrainable(base)
        if training_off:
            log.warning("training is off: %s", training_off)
    else:
        training_off = f"the {engine.name} engine has no local weights to train (llamacpp and mlx have)"
    if training_off is None:
        try:  # said now, not first at the night's run; serving does not need the teacher
            teacher_model_path(settings.training.teacher, base, paths)
        except ConfigError as e:
            log.warning("training runs will be refused until this is fixed: %s", e.message)
        paths.adapters_dir.mkdir(parents=True, exist_ok=True)
        registry = Registry(db, model, paths.adapters_dir, info.path, cache_dir=paths.cache_dir)
        await registry.restore()
        scheduler = Scheduler(db, model, registry, settings.training, paths, top_k=settings.mining.top_k)
    return ApiState(
        chat=chat,
        model=model,
        db=db,
        miner=miner,
        token=ensure_token(paths.token_file),
        # require_token = true (deprecated) still forces the token, over trust_loopback.
        trust_loopback=settings.server.trust_loopback and not settings.server.require_token,
        allowed_origins=settings.server.allowed_origins,
        exports_dir=str(paths.exports_dir),
        host=settings.server.host,
        port=port,
        home=str(paths.config_dir),
        registry=registry,
        scheduler=scheduler,
        training_off=training_off,
        max_request_bytes=int(settings.server.max_request_mb * 1024 * 1024),
        openwebui=FeedbackSync(db, settings.openwebui, reopen=miner.on_feedback if miner else None),
    )


LIKELIHOOD = "likelihood:"


def build_judge(spec: str, settings: Settings, model: ServedModel, paths: Paths | None = None) -> LLMJudge | None:
    """A judge from its config spec (see MiningSettings.judge); "likelihood:SPEC" scores the
    verdict with SPEC's model (clawd.judge.LikelihoodJudge) instead of sampling votes. A
    "gguf:" judge is a second llama.cpp model, loaded next to the served one (its own weights
    and KV cache of model.n_ctx: measured RSS 0.6 GB for Qwen2.5 0.5B Q4_K_M, 1.8 GB for 1.5B at n_ctx 4096)."""

    def load_second_model(name: str) -> ServedModel:
        from clawd.engines.llamacpp import Engine
        from clawd.model_registry import second_model_path  # deferred: only named judge models need it

        path = second_model_path(name, paths, role="judge")
        engine = Engine(path, n_ctx=settings.model.n_ctx, n_threads=settings.model.n_threads, model_id=path.stem)
        info = engine.info
        fmt = choose_format("auto", info.chat_template, info.bos_token, info.eos_token, info.add_bos)
        return ServedModel(EngineRunner(engine), fmt)

    likelihood = spec.strip().startswith(LIKELIHOOD)
    inner = spec.strip()[len(LIKELIHOOD) :] if likelihood else spec
    if likelihood and not (inner == "self" or inner.startswith("gguf:")):
        raise ConfigError(
            f"judge {spec!r}: a likelihood judge scores with a model clawd runs itself: "
            f"{LIKELIHOOD}self or {LIKELIHOOD}gguf:PATH (judges: {JUDGE_FORMS})."
        )
    completer = completer_for(inner, chat=model, gguf_loader=load_second_model)
    if completer is None:
        return None
    examples = EXAMPLES if settings.mining.judge_examples else ()
    if likelihood:
        return LikelihoodJudge(completer, margin=settings.mining.likelihood_margin, examples=examples)
    return LLMJudge(completer, votes=settings.mining.votes, temperature=settings.mining.temperature, examples=examples)


async def serve(
    settings: Settings,
    paths: Paths,
    engine: Engine,
    *,
    on_ready=None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> None:
    """Run until SIGINT/SIGTERM, then finish or cancel streams and close the store.

    `env` and `overrides` are what `settings` were loaded from; given `env`, config.toml
    is watched and reloaded live with them (clawd/reload.py). Without it, no watch."""
    sock = bind_socket(settings.server.host, settings.server.port)
    port = sock.getsockname()[1]
    state = await build_state(settings, paths, engine, port)
    config = uvicorn.Config(
        create_app(state), log_level=settings.log_level, access_log=False, timeout_graceful_shutdown=5, lifespan="off"
    )
    server = _Server(config)
    loop = asyncio.get_running_loop()
    draining: list[asyncio.Task] = []  # referenced, so the task is not collected mid-run

    def on_exit() -> None:
        # On a stop signal, end running generations now (each within one token) so their streams
        # close with a finish chunk and [DONE] instead of being cut at the grace timeout.
        loop.call_soon_threadsafe(lambda: draining.append(loop.create_task(state.chat.drain())))

    server.on_exit = on_exit
    watcher = None
    if env is not None:
        watcher = ConfigWatcher(
            paths.config_file,
            env,
            overrides or {},
            settings,
            chat=state.chat,
            miner=state.miner,
            scheduler=state.scheduler,
            openwebui=state.openwebui,
        )
        state.config = watcher.state
        await watcher.start()
    if on_ready:
        on_ready(state, server)  # the caller may stop it with server.should_exit = True
    log.info("clawd serving %s on http://%s:%d", state.model.model_id, settings.server.host, port)
    if state.miner:
        state.miner.start()
    if state.scheduler:
        state.scheduler.start()
    if state.openwebui:
        state.openwebui.start()  # idle until openwebui.url is set (config.toml is reloaded live)
    probe = asyncio.create_task(state.db.watch_health(HEALTH_PROBE_S), name="storage-probe")
    # Everything built so far (modules, the app, the model's metadata) lives as long as the
    # daemon: frozen, the collector's full passes skip it. A full pass over it took ~50 ms,
    # a pause that every request (health included) waited through now and then. Collected
    # first, so no garbage of the start-up is frozen with it.
    gc.collect()
    gc.freeze()
    try:
        await server.serve(sockets=[sock])
    finally:
        probe.cancel()
        if watcher:
            await watcher.stop()
        if state.openwebui:
            await state.openwebui.stop()
        if state.scheduler:
            await state.scheduler.stop()  # the trainer checkpoints; the next run resumes it
        if state.miner:
            await state.miner.stop()
        await state.chat.drain()
        await state.db.close()
        await asyncio.get_running_loop().run_in_executor(None, state.model.runner.close)
        sock.close()
