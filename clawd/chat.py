"""One turn: request -> session -> prompt -> engine stream -> text pieces out -> one turn row.

Generation runs in its own task, apart from the HTTP response that reads it: a client
that disconnects cancels the generation (within one token step), and the turn row is
still written by the task, whole, whatever happened to the connection.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

from clawd import sessions
from clawd.config import GenerationSettings
from clawd.engines.base import SamplingParams
from clawd.errors import ClawdError, EngineError, ModelNotFound
from clawd.protocol import ChatCompletionRequest, Usage
from clawd.served import ServedModel
from clawd.stops import StopMatcher, tokens_received
from clawd.store import turns
from clawd.store.db import Database

log = logging.getLogger(__name__)
_END = object()


@dataclass
class TurnStream:
    """A running turn. Iterate it for text pieces; afterwards `finish_reason`,
    `usage` and `error` say how it ended."""

    id: str
    created: int
    model: str
    prompt_tokens: int
    session_id: str
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    _cancel: threading.Event = field(default_factory=threading.Event)
    finish_reason: str | None = None
    completion_tokens: int = 0
    error: ClawdError | None = None
    recorded: asyncio.Future | None = None

    async def __aiter__(self) -> AsyncIterator[str]:
        while True:
            item = await self._queue.get()
            if item is _END:
                return
            yield item

    def cancel(self) -> None:
        """The client went away: stop generating before the next token."""
        self._cancel.set()

    @property
    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
        )


class ChatService:
    """Turns: attribute, generate on the served model, stream out, log one row each."""

    def __init__(
        self, model: ServedModel, db: Database, defaults: GenerationSettings, on_turn: Callable[[], None] = lambda: None
    ):
        self.model = model
        self.db = db
        self.defaults = defaults  # replaced by a config reload; read afresh by every request
        self.on_turn = on_turn  # the miner's wake-up call
        self._running: dict[asyncio.Task, TurnStream] = {}

    async def start(
        self,
        req: ChatCompletionRequest,
        headers: Mapping[str, str],
        client: str | None = None,
        remote: str | None = None,
    ) -> TurnStream:
        """Validate, attribute and begin a turn for `client` (its User-Agent) at `remote` (its
        address). Raises ClawdError (4xx) before any token is produced, so the caller can
        still answer with a plain error."""
        model = self.model
        if req.model != model.model_id:
            raise ModelNotFound(req.model)
        rendered, prompt_ids = model.prompt(req.messages, req.tools)
        n_ctx = model.info.n_ctx
        model.check_context(
            len(prompt_ids),
            f"This model's maximum context length is {n_ctx} tokens. "
            f"However, your messages resulted in {len(prompt_ids)} tokens. Shorten the messages.",
        )
        who = await sessions.attribute(self.db, req, headers, remote=remote)
        d = self.defaults
        params = SamplingParams(
            max_tokens=req.max_completion_tokens or req.max_tokens or d.max_tokens,
            temperature=d.temperature if req.temperature is None else req.temperature,
            top_p=d.top_p if req.top_p is None else req.top_p,
            seed=req.seed,
        )
        ts = TurnStream(
            id="chatcmpl-" + uuid.uuid4().hex[:24],
            created=int(time.time()),
            model=model.model_id,
            prompt_tokens=len(prompt_ids),
            session_id=who.session_id,
        )
        job = _TurnJob(self, ts, req, who, rendered, prompt_ids, params, client)
        task = asyncio.create_task(job.run(), name=f"turn-{ts.id}")
        ts.recorded = task
        self._running[task] = ts
        task.add_done_callback(self._running.pop)
        return ts

    async def drain(self, timeout: float = 10.0) -> None:
        """Stop running generations (each within one token) and wait until their
        turns are written, so shutting down never leaves a turn half-recorded."""
        for ts in self._running.values():
            ts.cancel()
        if self._running:
            await asyncio.wait(list(self._running), timeout=timeout)


@dataclass
class _TurnJob:
    svc: ChatService
    ts: TurnStream
    req: ChatCompletionRequest
    who: sessions.Attribution
    rendered: object
    prompt_ids: list[int]
    params: SamplingParams
    client: str | None

    async def run(self) -> None:
        ts, svc = self.ts, self.svc
        model = svc.model
        adapter = model.active_adapter
        ids: list[int] = []
        logprobs: list[float] = []
        text: list[str] = []
        text_ends: list[int] = []  # characters decoded after each token: where the user's text ends
        ended_by_token = False
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        stops = StopMatcher(self.req.stop_list() + self.rendered.stops)
        t_start = time.perf_counter()
        t_first = None
        finish = "length"
        stop_hit = False
        try:
            gen = model.runner.generate(self.prompt_ids, self.params, adapter=adapter, cancel=ts._cancel)
            async with contextlib.aclosing(gen):
                async for tok in gen:
                    if t_first is None:
                        t_first = time.perf_counter()
                    ids.append(tok.id)
                    logprobs.append(tok.logprob)
                    if tok.is_end:
                        finish, ended_by_token = "stop", True
                        break
                    decoded = decoder.decode(tok.piece)
                    text_ends.append((text_ends[-1] if text_ends else 0) + len(decoded))
                    piece, hit = stops.feed(decoded)
                    if piece:
                        text.append(piece)
                        ts._queue.put_nowait(piece)
                    if hit:
                        finish, stop_hit = "stop", True
                        break
            if not stop_hit:  # text held back as a possible stop start is text after all
                tail = stops.feed(decoder.decode(b"", final=True))[0] + stops.flush()
                if tail:
                    text.append(tail)
                    ts._queue.put_nowait(tail)
                if finish != "stop" and ts._cancel.is_set():
                    finish = "cancelled"
        except ClawdError as e:
            ts.error, finish = e, "error"
        except Exception as e:  # an engine bug must end this turn, not the daemon
            log.exception("generation failed")
            ts.error, finish = EngineError(f"generation failed: {e}"), "error"
        finally:
            ts.finish_reason = finish
            ts.completion_tokens = len(ids)
            ts._queue.put_nowait(_END)
        t_end = time.perf_counter()
        if finish == "error" and not ids:
            return  # nothing was sampled: nothing to learn from or to show
        gen_s = (t_end - t_first) if t_first else 0.0
        response_text = "".join(text)
        await self._record(
            ids,
            tokens_received(text_ends, len(response_text), ended_by_token),
            logprobs,
            response_text,
            finish,
            adapter,
            {
                "ttft_ms": round(((t_first or t_end) - t_start) * 1000, 2),
                "total_ms": round((t_end - t_start) * 1000, 2),
                "completion_tok_per_s": round((len(ids) - 1) / gen_s, 2) if gen_s > 0 and len(ids) > 1 else None,
            },
        )

    async def _record(self, ids, seen, logprobs, response_text, finish, adapter, timings) -> None:
        svc, req, who = self.svc, self.req, self.who
        rec = turns.TurnRecord(
            id=self.ts.id,
            session_id=who.session_id,
            turn_type=who.turn_type,
            request={
                "messages": [m.model_dump(exclude_none=True) for m in req.messages],
                **({"tools": req.tools} if req.tools else {}),
            },
            request_hash=sessions.messages_hash(req.messages),
            continuation_hash=sessions.continuation_hash(req.messages, response_text),
            prompt_text=self.rendered.prompt,
            prompt_ids=self.prompt_ids,
            response_ids=ids,
            response_seen=seen,
            response_logprobs=logprobs,
            response_text=response_text,
            finish_reason=finish,
            sampling={
                "max_tokens": self.params.max_tokens,
                "temperature": self.params.temperature,
                "top_p": self.params.top_p,
                "seed": self.params.seed,
                "stop": req.stop_list(),
            },
            engine=svc.model.engine.name,
            model=svc.model.model_id,
            chat_format=svc.model.format.name,
            timings=timings,
            adapter_id=adapter,
            requery_of=who.requery_of,
            client=self.client,
            client_key=self.who.client_key,
        )
        try:
            await turns.insert_turn(svc.db, rec, source=who.source, title=_title(req))
            if who.session_done:
                await turns.mark_session_done(svc.db, who.session_id)
            svc.on_turn()
        except Exception:
            log.exception("could not record turn %s", rec.id)


def _title(req: ChatCompletionRequest) -> str | None:
    first = next((m.text().strip() for m in req.messages if m.role == "user"), "")
    return first[:60] or None
