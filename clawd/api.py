"""HTTP routes: parse -> call -> serialize, nothing else.

OpenAI-compatible routes under /v1, clawd's own under /clawd. Every error leaves as an
OpenAI error object with the right status (CONVENTIONS.md §1), including malformed JSON
and unknown routes; a bad request never reaches the engine and never gets a 5xx.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from clawd import __version__
from clawd.chat import ChatService, TurnStream
from clawd.errors import AuthError, ClawdError, InvalidRequest, NotFound
from clawd.protocol import (ChatCompletionRequest, ModelCard, ModelList, ScoreRequest, SessionSummary,
                            Status, TurnSummary)
from clawd import feedback, review
from clawd.miner import forget_session
from clawd.store import adapters as adapter_rows
from clawd.store import signals, turns
from clawd.store.db import Database
from clawd.training.data import untrained_count

log = logging.getLogger(__name__)
LOOPBACK = {"127.0.0.1", "::1", "localhost"}


@dataclass
class ApiState:
    """What the routes need; built by the daemon."""

    chat: ChatService
    db: Database
    miner: object | None  # clawd.miner.Miner (None when mining is disabled)
    token: str
    require_token: bool
    host: str
    port: int
    home: str
    config: object | None = None  # clawd.reload.ReloadState while config.toml is watched
    registry: object | None = None  # clawd.adapters.Registry
    scheduler: object | None = None  # clawd.scheduler.Scheduler (None: no training on this engine)
    training_off: str | None = None  # why there is no registry / scheduler
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


def create_app(state: ApiState) -> FastAPI:
    app = FastAPI(title="clawd", version=__version__,
                  description="A local agent daemon that learns from your conversations.")
    app.state.clawd = state

    @app.exception_handler(ClawdError)
    async def _clawd_error(_: Request, e: ClawdError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        msg, param = _validation_message(exc)
        return _error(InvalidRequest(msg, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return _error(NotFound("Unknown route: see /openapi.json for what this server serves."))
        e = InvalidRequest(str(exc.detail))
        e.status = exc.status_code
        return _error(e)

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception):
        log.exception("unhandled error")
        return _error(ClawdError(f"internal error: {exc}"))

    def authorize(request: Request) -> None:
        """Loopback clients are trusted unless require_token; anyone else needs the token."""
        host = request.client.host if request.client else ""
        if host in LOOPBACK and not state.require_token:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip(), state.token):
            raise AuthError("Incorrect API key provided: send 'Authorization: Bearer <token>' "
                            "with the token from `clawd token`.")

    auth = [Depends(authorize)]

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        client = request.headers.get("user-agent")
        ts = await state.chat.start(req, request.headers, client=client)
        headers = {"X-Clawd-Turn-Id": ts.id, "X-Clawd-Session-Id": ts.session_id}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_sse(ts, include_usage), media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
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
            "id": ts.id, "object": "chat.completion", "created": ts.created, "model": ts.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": _openai_finish(ts.finish_reason)}],
            "usage": ts.usage.model_dump(),
        }
        return JSONResponse(body, headers=headers)

    @app.get("/v1/models", response_model=ModelList, dependencies=auth)
    async def models():
        return ModelList(data=[ModelCard(id=state.chat.model_id, created=state.created)])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, dependencies=auth)
    async def model(model_id: str):
        if model_id != state.chat.model_id:
            from clawd.errors import ModelNotFound
            raise ModelNotFound(model_id)
        return ModelCard(id=model_id, created=state.created)

    @app.get("/clawd/health", dependencies=auth)
    async def health():
        return {"status": "ok"}

    @app.get("/clawd/status", response_model=Status, dependencies=auth)
    async def status():
        import os

        info = state.chat.runner.engine.info
        return Status(
            version=__version__, pid=os.getpid(), uptime_s=round(time.time() - state.started, 1),
            host=state.host, port=state.port, model=info.id, model_path=str(info.path),
            engine=state.chat.runner.engine.name, architecture=info.architecture, n_ctx=info.n_ctx,
            chat_format=state.chat.format.name, active_adapter=state.chat.active_adapter(),
            busy=state.chat.runner.busy, queued=state.chat.runner.queued,
            turns=await turns.count_turns(state.db),
            sessions=await turns.count_sessions(state.db),
            db_path=str(state.db.path), home=state.home,
            signals=await signals.counts(state.db),
            miner=_miner_status(state.miner),
            training=state.scheduler.status.public() if state.scheduler is not None else None,
            config=state.config.public() if state.config is not None else None,
        )

    @app.post("/clawd/feedback", dependencies=auth)
    async def post_feedback(request: Request):
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
        if await signals.get(state.db, req.turn_id) is not None:
            await signals.reopen(state.db, req.turn_id)  # new evidence: judge again
        if state.miner:
            state.miner.poke()
        return {"turn_id": req.turn_id, "recorded": [{"id": f.id, "kind": f.kind, "text": f.text} for f in rows]}

    @app.get("/clawd/signals", dependencies=auth)
    async def list_signals(status: str | None = None, session_id: str | None = None, limit: int = 100):
        rows = await signals.list_signals(state.db, status=status, session_id=session_id, limit=limit)
        return [s.public() for s in rows]

    @app.get("/clawd/signals/{turn_id}", dependencies=auth)
    async def get_signal(turn_id: str):
        sig = await signals.get(state.db, turn_id)
        if sig is None:
            raise NotFound(f"No signal for turn {turn_id!r} (side turns and unfinished turns have none).")
        return sig.public()

    async def _veto(turn_id: str, vetoed: bool) -> dict:
        if not await signals.set_vetoed(state.db, turn_id, vetoed):
            raise NotFound(f"No signal for turn {turn_id!r}.")
        return (await signals.get(state.db, turn_id)).public()

    @app.post("/clawd/signals/{turn_id}/veto", dependencies=auth)
    async def veto(turn_id: str):
        """A vetoed signal never trains."""
        return await _veto(turn_id, True)

    @app.post("/clawd/signals/{turn_id}/unveto", dependencies=auth)
    async def unveto(turn_id: str):
        return await _veto(turn_id, False)

    @app.delete("/clawd/sessions/{session_id}", dependencies=auth)
    async def forget(session_id: str):
        """Forget a session: its turns, feedback and signals are deleted."""
        ids = await forget_session(state.db, session_id)
        if not ids:
            raise NotFound(f"No session {session_id!r}.")
        retired = await state.registry.retire_forgotten() if state.registry is not None else []
        return {"session_id": session_id, "forgotten_turns": len(ids), "retired_adapters": retired}

    @app.get("/clawd/sessions", response_model=list[SessionSummary], dependencies=auth)
    async def list_sessions(limit: int = 100):
        rows = await turns.list_sessions(state.db, limit=limit)
        return [SessionSummary(id=r["id"], created_at=r["created_at"], updated_at=r["updated_at"],
                               title=r["title"], turns=r["turn_count"], done=bool(r["done"])) for r in rows]

    @app.get("/clawd/sessions/{session_id}/turns", response_model=list[TurnSummary], dependencies=auth)
    async def session_turns(session_id: str, limit: int = 100):
        recs = await turns.list_turns(state.db, session_id=session_id, limit=limit)
        return [_summary(r) for r in recs]

    @app.get("/clawd/turns/{turn_id}", response_model=TurnSummary, dependencies=auth)
    async def get_turn(turn_id: str):
        rec = await turns.get_turn(state.db, turn_id)
        if rec is None:
            raise NotFound(f"No turn {turn_id!r}: turn ids come from the X-Clawd-Turn-Id header.")
        return _summary(rec)

    def _registry():
        if state.registry is None:
            raise NotFound(f"adapters are not available: {state.training_off or 'training is off'}")
        return state.registry

    def _scheduler():
        if state.scheduler is None:
            raise NotFound(f"training is not available: {state.training_off or 'training is off'}")
        return state.scheduler

    @app.get("/clawd/adapters", dependencies=auth)
    async def list_adapters():
        active = state.chat.active_adapter()
        return {"active": active, "adapters": [r.public() for r in await adapter_rows.list_all(state.db)]}

    @app.get("/clawd/adapters/{adapter_id}", dependencies=auth)
    async def show_adapter(adapter_id: str):
        return (await _registry().get(adapter_id)).public()

    @app.post("/clawd/adapters/{adapter_id}/activate", dependencies=auth)
    async def activate_adapter(adapter_id: str):
        """Hot-swap an adapter in (`base` = no adapter), verified live."""
        rec = await _registry().activate(None if adapter_id == "base" else adapter_id)
        return {"active": rec.id if rec else None}

    @app.post("/clawd/adapters/rollback", dependencies=auth)
    async def rollback_adapter():
        rec = await _registry().rollback()
        return {"active": rec.id if rec else None}

    @app.get("/clawd/adapters/{adapter_id}/signals", dependencies=auth)
    async def adapter_signals(adapter_id: str):
        """What the adapter learned from: its training and held-out signals with their prompts."""
        rec = await adapter_rows.get(state.db, adapter_id)
        if rec is None:
            raise NotFound(f"no adapter {adapter_id!r}: see `clawd adapters list`")
        return {"adapter_id": adapter_id, "signals": await review.learned_from(state.db, rec)}

    @app.post("/clawd/adapters/{adapter_id}/compare", dependencies=auth)
    async def compare_adapter(adapter_id: str, n: int = 3, max_tokens: int = 96):
        """Answers of base / previous / this adapter to `n` of its training prompts, generated now
        in the background (user requests come first; nothing is logged as a turn)."""
        if not 1 <= n <= 10 or not 1 <= max_tokens <= 1024:
            raise InvalidRequest("n must be 1-10 and max_tokens 1-1024", param="n" if not 1 <= n <= 10 else "max_tokens")
        return await review.side_by_side(state.db, state.chat, _registry(), adapter_id, n=n, max_tokens=max_tokens)

    @app.post("/clawd/adapters/{adapter_id}/export", dependencies=auth)
    async def export_adapter(adapter_id: str, request: Request):
        """{"format": "mlx"|"gguf"|"peft" (default: gguf where the adapter has one, else mlx),
        "path": "..."}: written on this machine."""
        try:
            body = await request.json()
        except ValueError:
            raise InvalidRequest("send a JSON body {\"format\": ..., \"path\": ...}") from None
        if not isinstance(body, dict) or not isinstance(body.get("path"), str):
            raise InvalidRequest("'path' (a string) is required", param="path")
        fmt = body.get("format")
        fmt, out = await _registry().export(adapter_id, None if fmt is None else str(fmt), body["path"])
        return {"adapter_id": adapter_id, "format": fmt, "path": str(out)}

    @app.post("/clawd/score", dependencies=auth)
    async def score(req: ScoreRequest):
        """Log-probs of a given reply: compare adapters (or an adapter and the base model)."""
        if req.adapter == "active":
            adapter = state.chat.active_adapter()
        elif req.adapter == "base":
            adapter = None
        else:
            adapter = (await _registry().get(req.adapter)).id
            if adapter not in state.chat.runner.engine.loaded_adapters:
                raise InvalidRequest(f"adapter {adapter} is not loaded: activate it first", param="adapter")
        return await state.chat.score(req.messages, req.completion, adapter)

    @app.get("/clawd/training", dependencies=auth)
    async def training_status():
        sched = _scheduler()
        st = sched.status.public()
        if not sched.running:
            st["reason"] = (await sched.should_train())[1]
        return st

    @app.get("/clawd/training/history", dependencies=auth)
    async def training_history():
        """Per-step metrics for curves: the current or last run of this daemon (`live`), else
        the newest adapter's recorded training curve (`adapter`)."""
        sched = _scheduler()
        if sched.history:
            return {"job_id": sched.status.job_id, "source": "live", "steps": sched.history}
        for rec in await adapter_rows.list_all(state.db):
            if rec.metrics.get("history"):
                return {"job_id": rec.id, "source": "adapter", "steps": rec.metrics["history"]}
        return {"job_id": None, "source": None, "steps": []}

    @app.post("/clawd/training", dependencies=auth)
    async def start_training(if_ready: bool = False):
        """Train now on the ready signals (ignores the idle/window rules). With `if_ready`
        (timers), only when training.min_signals are waiting; otherwise say why not."""
        sched = _scheduler()
        if if_ready:
            n = await untrained_count(state.db, state.chat.model_id, sched.settings.holdout)
            if sched.running or n < sched.settings.min_signals:
                reason = "a run is in progress" if sched.running else \
                    f"{n} of {sched.settings.min_signals} untrained signals ready"
                return {"job_id": None, "state": sched.status.state, "reason": reason}
        job_id = await sched.run_now()
        return {"job_id": job_id, "state": "running"}

    @app.post("/clawd/training/stop", dependencies=auth)
    async def stop_training():
        """Stop the run at its next optimizer step; the next run resumes it."""
        await _scheduler().stop_run()
        return _scheduler().status.public()

    return app


def _miner_status(miner) -> dict | None:
    if miner is None:
        return None
    st = miner.status
    return {"judge": st.judge, "hint_judge": st.hint_judge, "judge_error": st.judge_error,
            "judge_error_at": st.judge_error_at, "mined": st.mined, "busy": st.busy_since is not None}


def _summary(r: turns.TurnRecord) -> TurnSummary:
    return TurnSummary(
        id=r.id, session_id=r.session_id, turn_type=r.turn_type, created_at=r.created_at,
        request_messages=r.request.get("messages", []), response_text=r.response_text,
        finish_reason=r.finish_reason, prompt_tokens=len(r.prompt_ids),
        completion_tokens=len(r.response_ids), engine=r.engine, model=r.model,
        adapter_id=r.adapter_id, requery_of=r.requery_of, timings=r.timings,
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
        return _event({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                            "finish_reason": finish}], **extra})

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
