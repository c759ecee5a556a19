"""HTTP routes: parse -> call -> serialize, nothing else.

OpenAI-compatible routes under /v1, clawd's own under /clawd, on one router per noun; the
routes reach the daemon's parts through one dependency (`State`) and leave every decision
to those parts (the miner, the scheduler, the registry, sessions). Every error leaves as an
OpenAI error object with the right status (CONVENTIONS.md §1), including malformed JSON
and unknown routes; a bad request never reaches the engine and never gets a 5xx.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from clawd import __version__, feedback, review, sessions
from clawd.adapters import Registry
from clawd.chat import ChatService, TurnStream
from clawd.errors import AuthError, ClawdError, InvalidRequest, ModelNotFound, NotFound
from clawd.miner import Miner
from clawd.protocol import (
    ActiveAdapter,
    AdapterList,
    AdapterView,
    ChatCompletionRequest,
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
LOOPBACK = {"127.0.0.1", "::1", "localhost"}


@dataclass
class ApiState:
    """What the routes need; built by the daemon."""

    chat: ChatService
    model: ServedModel
    db: Database
    miner: Miner | None  # None when mining is disabled
    token: str
    require_token: bool
    host: str
    port: int
    home: str
    config: ReloadState | None = None  # while config.toml is watched
    registry: Registry | None = None  # None: no training on this engine (training_off says why)
    scheduler: Scheduler | None = None
    training_off: str | None = None  # why there is no registry / scheduler

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


def _error(e: ClawdError) -> JSONResponse:
    headers = {"Retry-After": str(getattr(e, "retry_after", 1))} if e.status == 503 else None
    return JSONResponse(e.to_openai(), status_code=e.status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0] if exc.errors() else {}
    if err.get("type") == "json_invalid":
        return "We could not parse the JSON body of your request: send valid JSON.", None
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if param is None:
        return "The request body must be a JSON object with 'model' and 'messages'.", None
    msg = err.get("msg", "invalid request")
    return (f"Invalid value for '{param}': {msg}" if param else f"Invalid request: {msg}"), param


def _state(request: Request) -> ApiState:
    return request.app.state.clawd


State = Annotated[ApiState, Depends(_state)]


def authorize(request: Request, state: State) -> None:
    """Loopback clients are trusted unless require_token; anyone else needs the token."""
    host = request.client.host if request.client else ""
    if host in LOOPBACK and not state.require_token:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip(), state.token):
        raise AuthError(
            "Incorrect API key provided: send 'Authorization: Bearer <token>' with the token from `clawd token`."
        )


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
    app.add_exception_handler(ClawdError, _clawd_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _crash)
    for router in (openai, daemon, history, adapters, training):
        app.include_router(router, dependencies=[Depends(authorize)])
    return app


async def _clawd_error(_: Request, e: ClawdError):
    return _error(e)


async def _invalid(_: Request, exc: RequestValidationError):
    msg, param = _validation_message(exc)
    return _error(InvalidRequest(msg, param=param))


async def _http(_: Request, exc: StarletteHTTPException):
    if exc.status_code == 404:
        return _error(NotFound("Unknown route: see /openapi.json for what this server serves."))
    e = InvalidRequest(str(exc.detail))
    e.status = exc.status_code
    return _error(e)


async def _crash(_: Request, exc: Exception):
    log.exception("unhandled error")
    return _error(ClawdError(f"internal error: {exc}"))


# ---- OpenAI-compatible ----------------------------------------------------------------------


@openai.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request, state: State):
    client = request.headers.get("user-agent")
    ts = await state.chat.start(
        req, request.headers, client=client, remote=request.client.host if request.client else None
    )
    headers = {"X-Clawd-Turn-Id": ts.id, "X-Clawd-Session-Id": ts.session_id}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _sse(ts, include_usage),
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    # uvicorn does not cancel a plain handler when its client goes, so watch for that
    # while the turn runs: a reply nobody will read is cancelled, not generated in full.
    collect = asyncio.ensure_future(_collect(ts))
    watch = asyncio.ensure_future(_cancel_on_disconnect(ts, request))
    try:
        text = await collect
        await _recorded(ts)
    finally:
        watch.cancel()
        collect.cancel()  # no-op when finished
        ts.cancel()  # no-op when finished; stops generation if this request was cancelled
    if ts.error:
        raise ts.error
    body = {
        "id": ts.id,
        "object": "chat.completion",
        "created": ts.created,
        "model": ts.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": _openai_finish(ts.finish_reason),
            }
        ],
        "usage": ts.usage.model_dump(),
    }
    return JSONResponse(body, headers=headers)


@openai.get("/v1/models", response_model=ModelList)
async def models(state: State):
    return ModelList(data=[ModelCard(id=state.model.model_id, created=state.created)])


@openai.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def model(model_id: str, state: State):
    if model_id != state.model.model_id:
        raise ModelNotFound(model_id)
    return ModelCard(id=model_id, created=state.created)


# ---- the daemon -----------------------------------------------------------------------------


@daemon.get("/health")
async def health():
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


@history.post("/feedback")
async def post_feedback(request: Request, state: State):
    """clawd's own {"turn_id", "rating", "correction"} or Open WebUI's rating payload."""
    try:
        payload = await request.json()
    except ValueError:
        raise InvalidRequest("We could not parse the JSON body of your request: send valid JSON.") from None
    if not isinstance(payload, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    try:
        if "turn_id" in payload:
            req = feedback.FeedbackRequest.model_validate(payload)
        else:
            req = await feedback.from_openwebui(state.db, payload)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ())) or None
        raise InvalidRequest(f"Invalid feedback: {err.get('msg')}", param=param) from None
    rows = await feedback.record(state.db, req, raw=payload)
    if state.miner:
        await state.miner.on_feedback(req.turn_id)
    return {"turn_id": req.turn_id, "recorded": [{"id": f.id, "kind": f.kind, "text": f.text} for f in rows]}


@history.get("/signals", response_model=list[SignalView])
async def list_signals(state: State, status: str | None = None, session_id: str | None = None, limit: int = 100):
    rows = await signals.list_signals(state.db, status=status, session_id=session_id, limit=limit)
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
    forgotten = await sessions.forget(state.db, session_id, state.registry)
    if forgotten is None:
        raise NotFound(f"No session {session_id!r}.")
    return forgotten


@history.get("/sessions", response_model=list[SessionSummary])
async def list_sessions(state: State, limit: int = 100):
    rows = await turns.list_sessions(state.db, limit=limit)
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
async def session_turns(session_id: str, state: State, limit: int = 100):
    recs = await turns.list_turns(state.db, session_id=session_id, limit=limit)
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


@adapters.post("/{adapter_id}/export")
async def export_adapter(adapter_id: str, request: Request, state: State):
    """{"format": "mlx"|"gguf"|"peft" (default: gguf where the adapter has one, else mlx),
    "path": "..."}: written on this machine."""
    try:
        body = await request.json()
    except ValueError:
        raise InvalidRequest('send a JSON body {"format": ..., "path": ...}') from None
    if not isinstance(body, dict) or not isinstance(body.get("path"), str):
        raise InvalidRequest("'path' (a string) is required", param="path")
    fmt = body.get("format")
    fmt, out = await state.need_registry().export(adapter_id, None if fmt is None else str(fmt), body["path"])
    return {"adapter_id": adapter_id, "format": fmt, "path": str(out)}


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
    )


def _openai_finish(reason: str | None) -> str:
    """clawd's own end states (cancelled, error) are not OpenAI finish reasons."""
    return reason if reason in ("stop", "length", "tool_calls", "content_filter") else "stop"


async def _collect(ts: TurnStream) -> str:
    return "".join([piece async for piece in ts])


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


async def _sse(ts: TurnStream, include_usage: bool):
    """Server-sent events, one per token piece, flushed as produced."""
    head = {"id": ts.id, "object": "chat.completion.chunk", "created": ts.created, "model": ts.model}
    extra = {"usage": None} if include_usage else {}

    def chunk(delta: dict, finish: str | None = None) -> str:
        return _event(
            {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}
        )

    try:
        yield chunk({"role": "assistant", "content": ""})
        async for piece in ts:
            yield chunk({"content": piece})
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
