"""One turn: request -> session -> prompt -> engine stream -> text pieces out -> one turn row.

Generation runs in its own task, apart from the HTTP response that reads it: a client
that disconnects cancels the generation (within one token step), and the turn row is
still written by the task, whole, whatever happened to the connection.

Two kinds of turn share that loop: a chat turn (the chat template's prompt; `main` unless the
client says `side`) and a raw completion (/v1/completions: the client's prompt as it is,
always logged as a `side` turn so it is never mined, see `start_raw`).

A turn ends for its reader only once its row is committed: the finish chunk (or the
non-streamed 200) is an acknowledgement that the turn is logged. If the write fails the
reader gets a storage error instead (507 disk full, 503 otherwise), never a finish.
Rendering and tokenizing run on a worker thread: a long prompt costs its own request
time, not the event loop's (health and other streams keep answering).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import dataclasses
import hashlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

from clawd import sessions
from clawd.config import GenerationSettings
from clawd.engines.base import SampledToken, SamplingParams
from clawd.errors import ClawdError, ContextLengthExceeded, EngineError, InvalidRequest, StorageUnavailable
from clawd.openwebui import origin as openwebui_origin
from clawd.protocol import ChatCompletionRequest, CompletionRequest, Message, Usage
from clawd.served import ServedModel
from clawd.stops import StopMatcher, tokens_received
from clawd.store import turns
from clawd.store.db import Database
from clawd.tool_calls import plan as tool_plan
from clawd.tool_calls.parsers import Call, Content, Delta, PlainParser

log = logging.getLogger(__name__)
_END = object()
# No tokenizer makes fewer than one token of 64 characters of text (real ones average 3-5),
# so a request this long cannot fit the context: refused before paying to tokenize it.
MAX_CHARS_PER_TOKEN = 64
RAW_FORMAT = "raw"  # the turn row's chat_format for a raw completion: no template was applied


@dataclass(frozen=True)
class Piece:
    """A stretch of reply text and the sampled tokens that produced it (their log-probs go
    out with it). The text may be empty: tokens whose text was stripped or cut by a stop."""

    text: str
    tokens: tuple[SampledToken, ...] = ()
    calls: tuple[Call, ...] = ()  # tool calls completed with this piece (tool_calls/parsers.py)
    deltas: tuple[dict, ...] = ()  # their stream form: `delta.tool_calls` entries, in order


@dataclass
class TurnStream:
    """A running turn. Iterate it for Pieces; afterwards `finish_reason`, `usage` and
    `error` say how it ended."""

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

    async def __aiter__(self) -> AsyncIterator[Piece]:
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


@dataclass(frozen=True)
class _TurnLog:
    """What a turn's row says besides what generation produced."""

    who: sessions.Attribution
    request: dict
    request_hash: str
    continuation: Callable[[str, list[dict]], str]  # the reply's content and calls -> continuation_hash
    prompt_text: str
    chat_format: str
    stops: list[str]  # the request's own stop strings, as logged in `sampling`
    title: str | None
    parser: Callable[[], object] = PlainParser  # makes the reply's tool-call parser
    client_ids: tuple[str | None, str | None] = (None, None)  # the chat UI's chat and message ids


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
        """Validate, attribute and begin a chat turn for `client` (its User-Agent) at `remote`
        (its address). Raises ClawdError (4xx) before any token is produced, so the caller can
        still answer with a plain error. Any model name is served: see ChatCompletionRequest.model."""
        model = self.model
        _refuse_non_text(req.messages)
        if req.top_logprobs and not req.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true (as with OpenAI).", param="top_logprobs")
        top = self._top_logprobs((req.top_logprobs or 0) if req.logprobs else 0, "top_logprobs")
        engine = model.engine
        tools = tool_plan.plan(
            tools_raw=req.tools,
            tool_choice=req.tool_choice,
            parallel_tool_calls=req.parallel_tool_calls,
            response_format=req.response_format,
            fmt=model.tool_format,
            to_gbnf=engine.grammar_from_schema if engine.supports_grammar else None,
            engine=engine.name,
        )
        n_ctx = model.info.n_ctx
        _refuse_far_too_long(sum(len(m.text()) for m in req.messages), n_ctx, "messages")
        rendered, prompt_ids = await asyncio.to_thread(model.prompt, req.messages, req.tools)
        model.check_context(
            len(prompt_ids),
            f"This model's maximum context length is {n_ctx} tokens. "
            f"However, your messages resulted in {len(prompt_ids)} tokens. Shorten the messages.",
        )
        # Open WebUI's ids for this chat and reply (a rating there names them), and whether it is
        # one of its background tasks (title, tags, ...): a side turn, never mined.
        ui = openwebui_origin.origin(headers, req.messages)
        who = await sessions.attribute(self.db, req, headers, remote=remote, background_task=ui.task is not None)
        params = self._params(req.max_completion_tokens or req.max_tokens, req.temperature, req.top_p, req.seed, top)
        params = dataclasses.replace(params, grammar=tools.grammar)
        turn_log = _TurnLog(
            who=who,
            request={
                "messages": [m.model_dump(exclude_none=True) for m in req.messages],
                **({"tools": req.tools} if req.tools else {}),
            },
            request_hash=sessions.messages_hash(req.messages),
            continuation=lambda text, calls: sessions.continuation_hash(req.messages, text, calls),
            prompt_text=rendered.prompt,
            chat_format=model.format.name,
            stops=req.stop_list(),
            title=_title(req),
            parser=tools.parser,
            client_ids=(ui.chat_id, ui.message_id),
        )
        # A chat reply is shown without the whitespace a model opens with (" The" after
        # "Assistant:"), as chat UIs expect; the stored token ids stay exactly as sampled.
        stops = req.stop_list() + rendered.stops
        return self._begin("chatcmpl-", prompt_ids, params, stops, turn_log, client, strip_leading=True)

    async def start_raw(
        self, req: CompletionRequest, headers: Mapping[str, str], client: str | None = None
    ) -> TurnStream:
        """Begin a raw completion (/v1/completions): the prompt is tokenized as it is, with
        no chat template, and continued.

        It is logged, like every turn, but as a `side` turn whatever the client says, so the
        miner never makes a signal of it (store/signals.py pairs `main` turns only): a raw
        prompt has no messages, so there is no user whose next message could judge the reply,
        and no turn to which the teacher's hint could be appended (METHOD §3); and clients
        that use this endpoint (autocomplete, evals) are not conversations to learn from."""
        model = self.model
        prompt = _raw_prompt(req)
        if req.echo:
            raise InvalidRequest("echo: true is not supported: send echo: false (the default).", param="echo")
        if req.suffix:
            raise InvalidRequest("suffix (fill-in-the-middle) is not supported.", param="suffix")
        top = self._top_logprobs(req.logprobs or 0, "logprobs")
        n_ctx = model.info.n_ctx
        _refuse_far_too_long(len(prompt), n_ctx, "prompt")
        prompt_ids = await asyncio.to_thread(model.engine.tokenize, prompt, add_bos=model.info.add_bos)
        if not prompt_ids:
            raise InvalidRequest("prompt must not be empty.", param="prompt")
        try:
            model.check_context(
                len(prompt_ids),
                f"This model's maximum context length is {n_ctx} tokens. "
                f"However, your prompt resulted in {len(prompt_ids)} tokens. Shorten the prompt.",
            )
        except ContextLengthExceeded as e:
            e.param = "prompt"  # there are no messages here
            raise
        session_id, source = headers.get("x-session-id"), "header"
        if not session_id:
            session_id, source = (req.session_id, "body") if req.session_id else (sessions.new_session_id(), "new")
        who = sessions.Attribution(session_id, source, "side", None, False)
        params = self._params(req.max_tokens, req.temperature, req.top_p, req.seed, top)
        turn_log = _TurnLog(
            who=who,
            request={"prompt": prompt},
            request_hash=_raw_hash(prompt),
            continuation=lambda text, _calls: _raw_hash(prompt + text),
            prompt_text=prompt,
            chat_format=RAW_FORMAT,
            stops=req.stop_list(),
            title=prompt.strip()[:60] or None,
        )
        # A raw continuation keeps its leading whitespace: " Paris" after "...France is" is
        # the text the client asked for.
        return self._begin("cmpl-", prompt_ids, params, req.stop_list(), turn_log, client, strip_leading=False)

    def _top_logprobs(self, k: int, param: str) -> int:
        most = self.model.engine.max_top_logprobs
        if k > most:
            raise InvalidRequest(
                f"{param}: {k} is more than the {self.model.engine.name} engine can report"
                + (f" (at most {most})." if most else ": it reports the sampled tokens' log-probs only (send 0)."),
                param=param,
            )
        return k

    def _params(self, max_tokens, temperature, top_p, seed, top_logprobs: int) -> SamplingParams:
        d = self.defaults
        return SamplingParams(
            max_tokens=max_tokens or d.max_tokens,
            temperature=d.temperature if temperature is None else temperature,
            top_p=d.top_p if top_p is None else top_p,
            seed=seed,
            top_logprobs=top_logprobs,
        )

    def _begin(self, prefix, prompt_ids, params, stops, turn_log, client, *, strip_leading) -> TurnStream:
        ts = TurnStream(
            id=prefix + uuid.uuid4().hex[:24],
            created=int(time.time()),
            model=self.model.model_id,
            prompt_tokens=len(prompt_ids),
            session_id=turn_log.who.session_id,
        )
        job = _TurnJob(self, ts, turn_log, prompt_ids, params, stops, strip_leading, client)
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
    turn_log: _TurnLog
    prompt_ids: list[int]
    params: SamplingParams
    stops: list[str]
    strip_leading: bool
    client: str | None

    async def run(self) -> None:
        ts, svc = self.ts, self.svc
        model = svc.model
        adapter = model.active_adapter
        ids: list[int] = []
        logprobs: list[float] = []
        text: list[str] = []  # the model's own text (tool markup included), as logged
        content: list[str] = []  # what the client is shown as content
        calls: list[Call] = []
        parser = self.turn_log.parser()
        pending: list[SampledToken] = []  # sampled, their text not released yet
        leading = self.strip_leading  # still stripping: no visible character released yet
        text_ends: list[int] = []  # characters decoded after each token: where the user's text ends
        released = 0  # characters past the stop matcher (before the leading strip): what the user got
        ended_by_token = False
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        stops = StopMatcher(self.stops)
        t_start = time.perf_counter()
        t_first = None
        finish = "length"
        stop_hit = False

        def release(piece: str, last: bool = False) -> None:
            nonlocal leading, released
            released += len(piece)
            if leading:
                piece = piece.lstrip()  # a first piece of only whitespace releases nothing
                leading = not piece
            text.append(piece)
            # Tool markup is held by the parser until it is known to be a call or text;
            # the tokens behind held text go out with the next piece that is released.
            events = (parser.feed(piece) if piece else []) + (parser.finish() if last else [])
            shown = "".join(e.text for e in events if isinstance(e, Content))
            done = tuple(e for e in events if isinstance(e, Call))
            deltas = tuple(e.entry for e in events if isinstance(e, Delta))
            if shown or done or deltas or (last and pending):
                content.append(shown)
                calls.extend(done)
                ts._queue.put_nowait(Piece(shown, tuple(pending), done, deltas))
                pending.clear()

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
                    pending.append(tok)
                    decoded = decoder.decode(tok.piece)
                    text_ends.append((text_ends[-1] if text_ends else 0) + len(decoded))
                    piece, hit = stops.feed(decoded)
                    release(piece)
                    if hit:
                        finish, stop_hit = "stop", True
                        break
            tail = ""
            if not stop_hit:  # text held back as a possible stop start is text after all
                tail = stops.feed(decoder.decode(b"", final=True))[0] + stops.flush()
                if finish != "stop" and ts._cancel.is_set():
                    finish = "cancelled"
            release(tail, last=True)
        except ClawdError as e:
            ts.error, finish = e, "error"
        except Exception as e:  # an engine bug must end this turn, not the daemon
            log.exception("generation failed")
            ts.error, finish = EngineError(f"generation failed: {e}"), "error"
        finally:
            if calls and finish == "stop":
                finish = "tool_calls"
            ts.finish_reason = finish
            ts.completion_tokens = len(ids)
        t_end = time.perf_counter()
        try:
            if finish == "error" and not ids:
                return  # nothing was sampled: nothing to learn from or to show
            gen_s = (t_end - t_first) if t_first else 0.0
            await self._record(
                ids,
                tokens_received(text_ends, released, ended_by_token),
                logprobs,
                "".join(text),
                "".join(content),
                [c.openai() for c in calls],
                finish,
                adapter,
                {
                    "ttft_ms": round(((t_first or t_end) - t_start) * 1000, 2),
                    "total_ms": round((t_end - t_start) * 1000, 2),
                    "completion_tok_per_s": round((len(ids) - 1) / gen_s, 2) if gen_s > 0 and len(ids) > 1 else None,
                },
            )
        finally:
            # Only now may the reader finish: the row is committed (or the error says why not).
            ts._queue.put_nowait(_END)

    async def _record(self, ids, seen, logprobs, response_text, content, calls, finish, adapter, timings) -> None:
        svc, ts, tl = self.svc, self.ts, self.turn_log
        who = tl.who
        # Hashing and packing a long prompt take a while: on a worker thread, like its tokenizing.
        rec = await asyncio.to_thread(
            self._turn_record, ids, seen, logprobs, response_text, content, calls, finish, adapter, timings
        )
        try:
            await turns.insert_turn(svc.db, rec, source=who.source, title=tl.title)
        except ClawdError as e:  # the disk (full, read-only): the store has made the daemon degraded
            log.error("could not record turn %s: %s", rec.id, e.message)
            ts.error, ts.finish_reason = e, "error"
            return
        except Exception as e:
            log.exception("could not record turn %s", rec.id)
            ts.error, ts.finish_reason = StorageUnavailable(f"this turn could not be logged: {e}"), "error"
            return
        try:
            if who.session_done:
                await turns.mark_session_done(svc.db, who.session_id)
        except Exception:  # the turn is logged; a session not marked done is only a missed hint
            log.exception("could not mark session %s done", who.session_id)
        svc.on_turn()

    def _turn_record(
        self, ids, seen, logprobs, response_text, content, calls, finish, adapter, timings
    ) -> turns.TurnRecord:
        svc, tl = self.svc, self.turn_log
        who = tl.who
        return turns.TurnRecord(
            id=self.ts.id,
            session_id=who.session_id,
            turn_type=who.turn_type,
            request=tl.request,
            request_hash=tl.request_hash,
            continuation_hash=tl.continuation(content, calls),
            prompt_text=tl.prompt_text,
            prompt_ids=self.prompt_ids,
            response_ids=ids,
            response_seen=seen,
            response_logprobs=logprobs,
            response_text=response_text,  # the model's text, tool-call markup included
            tool_calls=calls,  # the calls parsed out of it, as the client got them
            finish_reason=finish,
            sampling={
                "max_tokens": self.params.max_tokens,
                "temperature": self.params.temperature,
                "top_p": self.params.top_p,
                "seed": self.params.seed,
                "stop": tl.stops,
                **({"grammar": self.params.grammar} if self.params.grammar else {}),
            },
            engine=svc.model.engine.name,
            model=svc.model.model_id,
            chat_format=tl.chat_format,
            timings=timings,
            adapter_id=adapter,
            requery_of=who.requery_of,
            client=self.client,
            client_key=who.client_key,
            client_chat_id=tl.client_ids[0],
            client_message_id=tl.client_ids[1],
        )


def _refuse_far_too_long(n_chars: int, n_ctx: int, param: str) -> None:
    """The cheap check before tokenizing (see MAX_CHARS_PER_TOKEN)."""
    if n_chars > MAX_CHARS_PER_TOKEN * n_ctx:
        e = ContextLengthExceeded(
            f"This model's maximum context length is {n_ctx} tokens. However, your {param} "
            f"{'is' if param == 'prompt' else 'are'} {n_chars} characters long, far more than fit. "
            f"Shorten the {param}."
        )
        e.param = param
        raise e


def _refuse_non_text(messages: list[Message]) -> None:
    """Only text reaches the model. A part it cannot read (an image, audio, a file) is refused,
    never dropped: the reply would answer a question nobody asked."""
    for i, m in enumerate(messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            if part.type != "text":
                raise InvalidRequest(
                    f"messages[{i}].content[{j}] is a {part.type!r} part, and this model reads text only: "
                    "send text parts (or a string) instead.",
                    param=f"messages[{i}].content[{j}]",
                )


def _raw_prompt(req: CompletionRequest) -> str:
    p = req.prompt
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        return p[0]
    if isinstance(p, str):
        return p
    raise InvalidRequest(
        "prompt must be a string or a list holding one string (token-id prompts and batches are not supported).",
        param="prompt",
    )


def _raw_hash(text: str) -> str:
    """A raw turn's request / continuation hash, in its own namespace: no chat request's
    messages hash can equal it, so a chat turn is never taken for its regenerate or sequel."""
    return hashlib.sha256(b"raw\0" + text.encode("utf-8")).hexdigest()


def _title(req: ChatCompletionRequest) -> str | None:
    first = next((m.text().strip() for m in req.messages if m.role == "user"), "")
    return first[:60] or None
