"""HTTP routes: parse -> call -> serialize, nothing else.

OpenAI-compatible routes under /v1, clawd's own under /clawd, on one router per noun; the
routes reach the daemon's parts through one dependency (`State`) and leave every decision
to those parts (the miner, the scheduler, the registry, sessions). Every error leaves as an
OpenAI error object with the right status (CONVENTIONS.md §1), including malformed JSON
and unknown routes; a bad request never reaches the engine and never gets a 5xx.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Body, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from clawd import __version__, feedback, guard, review, sessions
from clawd.adapters import Registry, mlx_lm_command
from clawd.chat import ChatService, Piece, TurnStream
from clawd.errors import ClawdError, InvalidRequest, ModelNotFound, NotFound, UpstreamUnavailable
from clawd.limits import RESPONSES as LIMIT_RESPONSES
from clawd.limits import BodySizeLimit
from clawd.logprobs import chat_logprobs, completion_logprobs
from clawd.miner import Miner
from clawd.openwebui.connector import FeedbackSync, PullError
from clawd.protocol import (
    ActiveAdapter,
    AdapterList,
    AdapterView,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    ExportRequest,
    ExportResult,
    ModelCard,
    ModelList,
    ScoreRequest,
    SessionSummary,
    SignalView,
    Status,
    TrainingHistory,
    TrainingStart,
    TrainingStatus,
    TurnSummary,
)
from clawd.reload import ReloadState
from clawd.scheduler import Scheduler
from clawd.served import ServedModel
from clawd.store import adapters as adapter_rows
from clawd.store import signals, turns
from clawd.store.db import Database

log = logging.getLogger(__name__)


@dataclass
class ApiState:
    """What the routes need; built by the daemon."""

    chat: ChatService
    model: ServedModel
    db: Database
    miner: Miner | None  # None when mining is disabled
    token: str
    host: str
    port: int
    home: str
    exports_dir: str = ""  # where POST /clawd/adapters/{id}/export writes; "" = no exports
    trust_loopback: bool = False  # server.trust_loopback: loopback needs no token
    allowed_origins: str = ""  # server.allowed_origins
    config: ReloadState | None = None  # while config.toml is watched
    registry: Registry | None = None  # None: no training on this engine (training_off says why)
    scheduler: Scheduler | None = None
    training_off: str | None = None  # why there is no registry / scheduler
    max_request_bytes: int = 1 << 20  # server.max_request_mb
    openwebui: FeedbackSync | None = None  # pulls Open WebUI's ratings while openwebui.url is set

    def need_registry(self) -> Registry:
        if self.registry is None:
            raise NotFound(f"adapters are not available: {self.training_off or 'training is off'}")
        return self.registry

    def need_scheduler(self) -> Scheduler:
        if self.scheduler is None:
            raise NotFound(f"training is not available: {self.training_off or 'training is off'}")
        return self.scheduler

    started: float = field(default_factory=time.time)
    created: int = field(default_factory=lambda: int(time.time()))


def _documented(description: str, **headers: str) -> dict:
    doc: dict = {"model": ErrorResponse, "description": description}
    if headers:
        doc["headers"] = {name: {"description": text, "schema": {"type": "string"}} for name, text in headers.items()}
    return doc


# The errors every route can answer, in the schema (/openapi.json) as what they are: validation
# errors are 400 (FastAPI's 422 is taken out of the schema, see _openapi), all OpenAI error objects.
ERROR_RESPONSES: dict[int | str, dict] = {
    400: _documented("Invalid request: a malformed body or parameter (every validation error)."),
    401: _documented("No or wrong bearer token (`clawd token` prints it)."),
    404: _documented("No such route, model, turn, session, signal or adapter."),
    405: _documented("This route does not take this method.", Allow="The methods this route takes."),
    500: _documented("An internal error: a bug in clawd."),
    503: _documented("Busy or not ready (e.g. the engine is overloaded); retry later.", **{"Retry-After": "Seconds."}),
}
# Every route documents these: the refusals of the middlewares in front of every route (guard.py:
# 400 / 401 / 403 / 415, limits.py: 413), then this module's own descriptions.
ROUTE_RESPONSES: dict[int | str, dict] = {**guard.RESPONSES, **LIMIT_RESPONSES, **ERROR_RESPONSES}
MAX_LIMIT = 1000  # `limit` query parameters are clamped to 1..MAX_LIMIT


def _limit(limit: int) -> int:
    """A `limit` query parameter, clamped (SQLite takes no integer beyond 64 bits)."""
    return max(1, min(limit, MAX_LIMIT))


LIMIT = Query(100, description=f"how many, newest first: 1-{MAX_LIMIT} (values outside are clamped)")


def _error(e: ClawdError) -> JSONResponse:
    headers = {"Retry-After": str(getattr(e, "retry_after", 1))} if e.status == 503 else None
    return JSONResponse(e.to_openai(), status_code=e.status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0] if exc.errors() else {}
    if err.get("type") == "json_invalid":
        return "We could not parse the JSON body of your request: send valid JSON.", None
    # A union body's errors carry the member's tag (feedback's "clawd" / "openwebui"): not a field.
    loc = [str(p) for p in err.get("loc", ()) if p != "body" and p not in feedback.BODY_TAGS]
    param = ".".join(loc) or None
    if param is None:
        return f"The request body must be a JSON object ({err.get('msg', 'invalid')}).", None
    msg = err.get("msg", "invalid request")
    return (f"Invalid value for '{param}': {msg}" if param else f"Invalid request: {msg}"), param


def _state(request: Request) -> ApiState:
    return request.app.state.clawd


State = Annotated[ApiState, Depends(_state)]


openai = APIRouter(tags=["openai"])
daemon = APIRouter(prefix="/clawd", tags=["daemon"])
history = APIRouter(prefix="/clawd", tags=["sessions, turns, feedback and signals"])
adapters = APIRouter(prefix="/clawd/adapters", tags=["adapters"])
training = APIRouter(prefix="/clawd/training", tags=["training"])


def create_app(state: ApiState) -> FastAPI:
    app = FastAPI(
        title="clawd", version=__version__, description="A local agent daemon that learns from your conversations."
    )
    app.state.clawd = state
    # Starlette runs the last middleware added first. The body-size limit goes inside the guard, so a
    # request the guard refuses never has its body counted; a big body with the token gets its 413.
    app.add_middleware(BodySizeLimit, max_bytes=state.max_request_bytes)
    # Outermost, so nothing runs for a request the guard refuses (clawd/guard.py).
    app.add_middleware(
        guard.Guard,
        policy=guard.Policy(
            token=state.token,
            host=state.host,
            port=state.port,
            allowed_origins=state.allowed_origins,
            trust_loopback=state.trust_loopback,
        ),
    )
    app.add_exception_handler(ClawdError, _clawd_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _crash)
    for router in (openai, daemon, history, adapters, training):
        app.include_router(router, responses=ROUTE_RESPONSES)
    app.openapi = lambda: _openapi(app)
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema, less its 422s: clawd answers validation errors with 400 (documented)."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)
        for path in schema.get("paths", {}).values():
            for op in path.values():
                if isinstance(op, dict):
                    op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


async def _clawd_error(_: Request, e: ClawdError):
    return _error(e)


async def _invalid(_: Request, exc: RequestValidationError):
    msg, param = _validation_message(exc)
    return _error(InvalidRequest(msg, param=param))


async def _http(request: Request, exc: StarletteHTTPException):
    if exc.status_code == 404:
        return _error(NotFound("Unknown route: see /openapi.json for what this server serves."))
    e = InvalidRequest(str(exc.detail))
    e.status = exc.status_code
    response = _error(e)
    if exc.status_code == 405:
        response.headers["Allow"] = ", ".join(_allowed_methods(request))
    return response


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route takes on this path, read off the app's own schema (Starlette's
    Allow would name one route's methods only; /v1 and /clawd share paths across routes)."""
    methods: set[str] = set()
    for template, ops in _openapi(request.app).get("paths", {}).items():
        if re.fullmatch(re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template)), request.url.path):
            methods |= {m.upper() for m in ops}
    if "GET" in methods:
        methods.add("HEAD")  # Starlette answers HEAD wherever it answers GET
    return sorted(methods)


async def _crash(_: Request, exc: Exception):
    log.exception("unhandled error")
    return _error(ClawdError(f"internal error: {exc}"))


# ---- OpenAI-compatible ----------------------------------------------------------------------


# A turn is acknowledged only once its row is written; when it cannot be, these say why.
TURN_RESPONSES = {
    507: {"description": "The disk is full: the turn could not be logged (the daemon is degraded)."},
    503: {"description": "Busy, or the database cannot be written: the turn could not be logged."},
}


# A streamed answer is server-sent events, a plain one a JSON object.
STREAM_RESPONSES: dict[int | str, dict] = {
    200: {
        "description": "The answer: a JSON completion object, or with `stream` server-sent chunk events.",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            # One event per chunk: its data is a JSON chunk object, the last one `[DONE]`.
            "text/event-stream": {
                "schema": {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
            },
        },
    }
}


@openai.post("/v1/chat/completions", responses=STREAM_RESPONSES | TURN_RESPONSES)
async def chat_completions(req: ChatCompletionRequest, request: Request, state: State):
    client = request.headers.get("user-agent")
    ts = await state.chat.start(
        req, request.headers, client=client, remote=request.client.host if request.client else None
    )
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _streaming(ts, _sse(ts, include_usage, bool(req.logprobs)))
    pieces = await _finish(ts, request)
    calls = [c.openai() for p in pieces for c in p.calls]
    content = "".join(p.text for p in pieces)
    message = {"role": "assistant", "content": content or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    body = {
        "id": ts.id,
        "object": "chat.completion",
        "created": ts.created,
        "model": ts.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": chat_logprobs(_tokens(pieces)) if req.logprobs else None,
                "finish_reason": _openai_finish(ts.finish_reason),
            }
        ],
        "usage": ts.usage.model_dump(),
    }
    return JSONResponse(body, headers=_turn_headers(ts))


@openai.post("/v1/completions", responses=STREAM_RESPONSES | TURN_RESPONSES)
async def completions(req: CompletionRequest, request: Request, state: State):
    """The legacy raw-prompt endpoint: no chat template; logged as a side turn, never mined."""
    ts = await state.chat.start_raw(req, request.headers, client=request.headers.get("user-agent"))
    prompt_chars = len(_prompt_text(req))
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _streaming(ts, _completion_sse(ts, include_usage, req.logprobs is not None, prompt_chars))
    pieces = await _finish(ts, request)
    lp = completion_logprobs(_tokens(pieces), prompt_chars)[0] if req.logprobs is not None else None
    body = {
        "id": ts.id,
        "object": "text_completion",
        "created": ts.created,
        "model": ts.model,
        "choices": [
            {
                "index": 0,
                "text": "".join(p.text for p in pieces),
                "logprobs": lp,
                "finish_reason": _openai_finish(ts.finish_reason),
            }
        ],
        "usage": ts.usage.model_dump(),
    }
    return JSONResponse(body, headers=_turn_headers(ts))


def _prompt_text(req: CompletionRequest) -> str:
    """The prompt text (start_raw has checked its shape)."""
    return req.prompt if isinstance(req.prompt, str) else req.prompt[0]


def _turn_headers(ts: TurnStream) -> dict[str, str]:
    return {"X-Clawd-Turn-Id": ts.id, "X-Clawd-Session-Id": ts.session_id}


def _streaming(ts: TurnStream, events) -> StreamingResponse:
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={**_turn_headers(ts), "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _finish(ts: TurnStream, request: Request) -> list[Piece]:
    """The whole reply of a non-streamed turn, once its row is written."""
    # uvicorn does not cancel a plain handler when its client goes, so watch for that
    # while the turn runs: a reply nobody will read is cancelled, not generated in full.
    collect = asyncio.ensure_future(_collect(ts))
    watch = asyncio.ensure_future(_cancel_on_disconnect(ts, request))
    try:
        pieces = await collect
        await _recorded(ts)
    finally:
        watch.cancel()
        collect.cancel()  # no-op when finished
        ts.cancel()  # no-op when finished; stops generation if this request was cancelled
    if ts.error:
        raise ts.error
    return pieces


@openai.get("/v1/models", response_model=ModelList)
async def models(state: State):
    return ModelList(data=[_model_card(state)])


@openai.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def model(model_id: str, state: State):
    if model_id != state.model.model_id:
        raise ModelNotFound(model_id)
    return _model_card(state)


def _model_card(state: ApiState) -> ModelCard:
    fmt = state.model.tool_format
    return ModelCard(
        id=state.model.model_id, created=state.created, tool_calls=fmt is not None, tool_format=fmt and fmt.name
    )


# ---- the daemon -----------------------------------------------------------------------------


@daemon.get("/health")
async def health(state: State):
    """{"status": "ok"}, or "degraded" with the reason ("disk full", "read-only", "other")
    while turns cannot be logged; it turns ok by itself once a write succeeds again."""
    storage = state.db.health
    if storage.degraded:
        return {"status": "degraded", "reason": storage.reason, "detail": storage.detail}
    return {"status": "ok"}


@daemon.get("/status", response_model=Status)
async def status(state: State):
    info, runner = state.model.info, state.model.runner
    return Status(
        version=__version__,
        pid=os.getpid(),
        uptime_s=round(time.time() - state.started, 1),
        host=state.host,
        port=state.port,
        model=info.id,
        model_path=str(info.path),
        engine=state.model.engine.name,
        architecture=info.architecture,
        n_ctx=info.n_ctx,
        chat_format=state.model.format.name,
        active_adapter=state.model.active_adapter,
        busy=runner.busy,
        queued=runner.queued,
        turns=await turns.count_turns(state.db),
        sessions=await turns.count_sessions(state.db),
        db_path=str(state.db.path),
        home=state.home,
        signals=await signals.counts(state.db),
        miner=_miner_status(state.miner),
        training=state.scheduler.status.public() if state.scheduler is not None else None,
        config=state.config.public() if state.config is not None else None,
        storage=state.db.health.public(),
        openwebui=state.openwebui.status.public() if state.openwebui and state.openwebui.settings.url else None,
    )


@daemon.post("/score")
async def score(req: ScoreRequest, state: State):
    """Log-probs of a given reply: compare adapters (or an adapter and the base model)."""
    if req.adapter == "active":
        adapter = state.model.active_adapter
    elif req.adapter == "base":
        adapter = None
    else:
        adapter = (await state.need_registry().get(req.adapter)).id
        if adapter not in state.model.engine.loaded_adapters:
            raise InvalidRequest(f"adapter {adapter} is not loaded: activate it first", param="adapter")
    return await state.model.score(req.messages, req.completion, adapter)


# ---- sessions, turns, feedback and signals --------------------------------------------------


@history.post(
    "/feedback",
    responses={
        409: guard.RESPONSES[400]
        | {"description": "An Open WebUI rating whose text matches several turns and that names none by id"}
    },
)
async def post_feedback(body: Annotated[feedback.FeedbackBody, Body()], state: State):
    """clawd's own {"turn_id", "rating", "correction"}, Open WebUI's rating payload (attached to the
    turn that carried its message id, else by text when unambiguous: 409 when not), or a JSON array
    of Open WebUI's records (its export file), each applied on its own and reported."""
    reopen = state.miner.on_feedback if state.miner else None
    if isinstance(body, list):
        return await feedback.import_openwebui(state.db, body, reopen)
    if isinstance(body, feedback.OpenWebUIFeedback):
        applied = await feedback.from_openwebui(state.db, body, reopen)
        return {"turn_id": applied.turn_id, **applied.public()}
    req = body
    rows = await feedback.record(state.db, req, raw=body.model_dump(mode="json", exclude_unset=True))
    if state.miner:
        await state.miner.on_feedback(req.turn_id)
    return {"turn_id": req.turn_id, "recorded": [{"id": f.id, "kind": f.kind, "text": f.text} for f in rows]}


@history.post(
    "/openwebui/pull", responses={502: guard.RESPONSES[400] | {"description": "Open WebUI could not be asked"}}
)
async def pull_openwebui(state: State):
    """Pull Open WebUI's new, changed and removed ratings now (the connector also does so every
    openwebui.poll_s). 404 while openwebui.url is not set."""
    sync = state.openwebui
    if sync is None or not sync.settings.url:
        raise NotFound("Open WebUI is not connected: `clawd connect openwebui --url URL --api-key KEY`")
    try:
        counts = await sync.pull_once()
    except PullError as e:
        raise UpstreamUnavailable(str(e)) from e
    return {"pulled": counts, **sync.status.public()}


@history.get("/signals", response_model=list[SignalView])
async def list_signals(state: State, status: str | None = None, session_id: str | None = None, limit: int = LIMIT):
    rows = await signals.list_signals(state.db, status=status, session_id=session_id, limit=_limit(limit))
    held = await state.scheduler.held_out([s.turn_id for s in rows]) if state.scheduler else set()
    return [{**s.public(), "held_out": s.turn_id in held} for s in rows]


@history.get("/signals/{turn_id}", response_model=SignalView)
async def get_signal(turn_id: str, state: State):
    sig = await signals.get(state.db, turn_id)
    if sig is None:
        raise NotFound(f"No signal for turn {turn_id!r} (side turns and unfinished turns have none).")
    held = await state.scheduler.held_out([turn_id]) if state.scheduler else set()
    return {**sig.public(), "held_out": turn_id in held}


@history.post("/signals/{turn_id}/veto", response_model=SignalView)
async def veto(turn_id: str, state: State):
    """A vetoed signal never trains."""
    return await _veto(state.db, turn_id, True)


@history.post("/signals/{turn_id}/unveto", response_model=SignalView)
async def unveto(turn_id: str, state: State):
    return await _veto(state.db, turn_id, False)


async def _veto(db: Database, turn_id: str, vetoed: bool) -> dict:
    if not await signals.set_vetoed(db, turn_id, vetoed):
        raise NotFound(f"No signal for turn {turn_id!r}.")
    return (await signals.get(db, turn_id)).public()


@history.delete("/sessions/{session_id}")
async def forget(session_id: str, state: State):
    """Forget a session: its turns, feedback and signals are deleted."""
    forgotten = await sessions.forget(state.db, sessions.check_session_id(session_id), state.registry)
    if forgotten is None:
        raise NotFound(f"No session {session_id!r}.")
    return forgotten


@history.get("/sessions", response_model=list[SessionSummary])
async def list_sessions(state: State, limit: int = LIMIT):
    rows = await turns.list_sessions(state.db, limit=_limit(limit))
    return [
        SessionSummary(
            id=r["id"],
            created_at=r["created_at"],
            updated_at=r["updated_at"],
            title=r["title"],
            turns=r["turn_count"],
            done=bool(r["done"]),
        )
        for r in rows
    ]


@history.get("/sessions/{session_id}/turns", response_model=list[TurnSummary])
async def session_turns(session_id: str, state: State, limit: int = LIMIT):
    recs = await turns.list_turns(state.db, session_id=sessions.check_session_id(session_id), limit=_limit(limit))
    return [_summary(r) for r in recs]


@history.get("/turns/{turn_id}", response_model=TurnSummary)
async def get_turn(turn_id: str, state: State):
    rec = await turns.get_turn(state.db, turn_id)
    if rec is None:
        raise NotFound(f"No turn {turn_id!r}: turn ids come from the X-Clawd-Turn-Id header.")
    return _summary(rec)


# ---- adapters -------------------------------------------------------------------------------


@adapters.get("", response_model=AdapterList)
async def list_adapters(state: State):
    return AdapterList(
        active=state.model.active_adapter,
        adapters=[AdapterView(**r.public()) for r in await adapter_rows.list_all(state.db)],
    )


@adapters.post("/rollback", response_model=ActiveAdapter)
async def rollback_adapter(state: State):
    rec = await state.need_registry().rollback()
    return ActiveAdapter(active=rec.id if rec else None)


@adapters.get("/{adapter_id}", response_model=AdapterView)
async def show_adapter(adapter_id: str, state: State):
    return (await state.need_registry().get(adapter_id)).public()


@adapters.post("/{adapter_id}/activate", response_model=ActiveAdapter)
async def activate_adapter(adapter_id: str, state: State):
    """Hot-swap an adapter in (`base` = no adapter), verified live."""
    rec = await state.need_registry().activate(None if adapter_id == "base" else adapter_id)
    return ActiveAdapter(active=rec.id if rec else None)


@adapters.get("/{adapter_id}/signals")
async def adapter_signals(adapter_id: str, state: State):
    """What the adapter learned from: its training and held-out signals with their prompts."""
    rec = await adapter_rows.get(state.db, adapter_id)
    if rec is None:
        raise NotFound(f"no adapter {adapter_id!r}: see `clawd adapters list`")
    return {"adapter_id": adapter_id, "signals": await review.learned_from(state.db, rec)}


@adapters.post("/{adapter_id}/compare")
async def compare_adapter(adapter_id: str, state: State, n: int = 3, max_tokens: int = 96):
    """Answers of base / previous / this adapter to `n` of its training prompts, generated now
    in the background (user requests come first; nothing is logged as a turn)."""
    if not 1 <= n <= 10 or not 1 <= max_tokens <= 1024:
        raise InvalidRequest("n must be 1-10 and max_tokens 1-1024", param="n" if not 1 <= n <= 10 else "max_tokens")
    return await review.side_by_side(
        state.db, state.model, state.need_registry(), adapter_id, n=n, max_tokens=max_tokens
    )


@adapters.post(
    "/{adapter_id}/export",
    response_model=ExportResult,
    response_model_exclude_none=True,  # mlx_model and command only where there are some
    responses={
        409: guard.RESPONSES[400] | {"description": "An export of that name exists (send force: true to overwrite)"}
    },
)
async def export_adapter(adapter_id: str, req: ExportRequest, state: State):
    """Write the adapter to `<data dir>/exports/<name>` on the daemon's machine: never anywhere
    else (`clawd adapters export ID --out PATH` copies it on from there)."""
    if not state.exports_dir:
        raise NotFound("exports are not available on this daemon")
    fmt, out, mlx_model = await state.need_registry().export(
        adapter_id, req.format, Path(state.exports_dir) / req.name, force=req.force
    )
    result = ExportResult(adapter_id=adapter_id, format=fmt, path=str(out))
    if mlx_model is not None:  # what mlx-lm runs the adapter on, and the command that does
        result.mlx_model, result.command = str(mlx_model), mlx_lm_command(mlx_model, out)
    return result


# ---- training -------------------------------------------------------------------------------


@training.get("", response_model=TrainingStatus)
async def training_status(state: State):
    return await state.need_scheduler().report()


@training.get("/history", response_model=TrainingHistory)
async def training_history(state: State):
    """Per-step metrics for curves: the current or last run of this daemon (`live`), else
    the newest adapter's recorded training curve (`adapter`)."""
    return await state.need_scheduler().curve()


@training.post("", response_model=TrainingStart, response_model_exclude_unset=True)
async def start_training(state: State, if_ready: bool = False):
    """Train now on the ready signals (ignores the idle/window rules). With `if_ready`
    (timers), only when training.min_signals are waiting; otherwise say why not."""
    return TrainingStart(**await state.need_scheduler().start_run(if_ready))


@training.post("/stop", response_model=TrainingStatus)
async def stop_training(state: State):
    """Stop the run at its next optimizer step; the next run resumes it."""
    sched = state.need_scheduler()
    await sched.stop_run()
    return sched.status.public()


def _miner_status(miner) -> dict | None:
    if miner is None:
        return None
    st = miner.status
    return {
        "judge": st.judge,
        "hint_judge": st.hint_judge,
        "judge_error": st.judge_error,
        "judge_error_at": st.judge_error_at,
        "mined": st.mined,
        "busy": st.busy_since is not None,
    }


def _summary(r: turns.TurnRecord) -> TurnSummary:
    return TurnSummary(
        id=r.id,
        session_id=r.session_id,
        turn_type=r.turn_type,
        created_at=r.created_at,
        request_messages=r.request.get("messages", []),
        response_text=r.response_text,
        finish_reason=r.finish_reason,
        prompt_tokens=len(r.prompt_ids),
        completion_tokens=len(r.response_ids),
        engine=r.engine,
        model=r.model,
        adapter_id=r.adapter_id,
        requery_of=r.requery_of,
        timings=r.timings,
        tool_calls=r.tool_calls,
    )


def _openai_finish(reason: str | None) -> str:
    """clawd's own end states (cancelled, error) are not OpenAI finish reasons."""
    return reason if reason in ("stop", "length", "tool_calls", "content_filter") else "stop"


async def _collect(ts: TurnStream) -> list[Piece]:
    return [piece async for piece in ts]


def _tokens(pieces: list[Piece]) -> list:
    return [t for p in pieces for t in p.tokens]


async def _cancel_on_disconnect(ts: TurnStream, request: Request, poll_s: float = 0.1) -> None:
    """Cancel the turn once the client has gone (the turn then ends as 'cancelled')."""
    while not await request.is_disconnected():
        await asyncio.sleep(poll_s)
    ts.cancel()


async def _recorded(ts: TurnStream) -> None:
    """Wait for the turn row, so a client that has the whole response can already send
    feedback on its id. Shielded: a client going away must not abort the write."""
    if ts.recorded is not None:
        await asyncio.shield(ts.recorded)


def _event(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _sse(ts: TurnStream, include_usage: bool, logprobs: bool):
    """Server-sent events, one per token piece, flushed as produced."""
    head = {"id": ts.id, "object": "chat.completion.chunk", "created": ts.created, "model": ts.model}
    extra = {"usage": None} if include_usage else {}

    def chunk(delta: dict, finish: str | None = None, piece: Piece | None = None) -> str:
        lp = chat_logprobs(piece.tokens) if logprobs and piece is not None else None
        return _event(
            {**head, "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}], **extra}
        )

    try:
        yield chunk({"role": "assistant", "content": ""})
        async for piece in ts:
            lp_piece = piece  # a piece's log-probs go out once, with its first chunk
            if piece.text or not piece.deltas:
                yield chunk({"content": piece.text}, piece=lp_piece)
                lp_piece = None
            for delta in piece.deltas:
                yield chunk({"tool_calls": [delta]}, piece=lp_piece)
                lp_piece = None
        if ts.error:
            yield _event(ts.error.to_openai())
        else:
            yield chunk({}, _openai_finish(ts.finish_reason))
            if include_usage:
                yield _event({**head, "choices": [], "usage": ts.usage.model_dump()})
        await _recorded(ts)
        yield "data: [DONE]\n\n"
    finally:
        ts.cancel()


async def _completion_sse(ts: TurnStream, include_usage: bool, logprobs: bool, offset: int):
    """/v1/completions as server-sent events: `text_completion` objects, one per piece."""
    head = {"id": ts.id, "object": "text_completion", "created": ts.created, "model": ts.model}
    extra = {"usage": None} if include_usage else {}

    def chunk(text: str, lp: dict | None, finish: str | None = None) -> str:
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
        return _event({**head, "choices": [choice], **extra})

    try:
        async for piece in ts:
            lp = None
            if logprobs:
                lp, offset = completion_logprobs(piece.tokens, offset)
            yield chunk(piece.text, lp)
        if ts.error:
            yield _event(ts.error.to_openai())
        else:
            yield chunk("", None, _openai_finish(ts.finish_reason))
            if include_usage:
                yield _event({**head, "choices": [], "usage": ts.usage.model_dump()})
        await _recorded(ts)
        yield "data: [DONE]\n\n"
    finally:
        ts.cancel()
