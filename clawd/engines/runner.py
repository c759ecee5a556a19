"""The async face of a synchronous engine, with the user first.

Engines are single-threaded by contract. The runner owns the one worker thread that may
touch the engine and a turnstile in front of it with two queues: user requests
(foreground) are served in arrival order and always before background work (the miner's
judging and scoring). When a user request arrives while background work holds the
engine, that work is preempted: its cancel event is set, the engine stops at its next
token or scoring chunk, and the background caller gets `Preempted` and retries later.
So a user waits at most one token step for the miner, never for a whole judge call.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from clawd.engines.base import Engine, SampledToken, SamplingParams
from clawd.errors import Preempted

T = TypeVar("T")
_DONE = object()


class _Turnstile:
    """One holder at a time; foreground waiters before background ones, FIFO within each."""

    def __init__(self):
        self._held = False
        self.holder_background = False
        self.last_foreground_end = 0.0  # time.monotonic()
        self._holder_cancel: threading.Event | None = None  # set when the holder is background
        self._waiters: dict[bool, deque[asyncio.Future]] = {False: deque(), True: deque()}
        self.on_user: Callable[[], None] = lambda: None  # a user request wants the engine

    @property
    def held(self) -> bool:
        return self._held

    def waiting(self, background: bool | None = None) -> int:
        queues = self._waiters.values() if background is None else [self._waiters[background]]
        return sum(1 for q in queues for f in q if not f.done())

    async def acquire(self, background: bool, cancel: threading.Event | None) -> None:
        if not background:
            self.on_user()
        if not self._held and (not background or not self.waiting(False)):
            self._take(background, cancel)
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters[background].append(fut)
        if not background and self._holder_cancel is not None:
            self._holder_cancel.set()  # preempt background work for the user
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # ownership arrived as we were cancelled: pass it on
            raise
        self._take(background, cancel)

    def _take(self, background: bool, cancel: threading.Event | None) -> None:
        self._held = True
        self.holder_background = background
        self._holder_cancel = cancel if background else None
        if background and cancel is not None and self.waiting(False):
            cancel.set()  # a user queued while ownership was being handed to us

    def release(self) -> None:
        if not self.holder_background:
            self.last_foreground_end = time.monotonic()
        self._holder_cancel = None
        for background in (False, True):
            queue = self._waiters[background]
            while queue:
                fut = queue.popleft()
                if not fut.done():
                    fut.set_result(None)  # hand over: stays held
                    return
        self._held = False


class EngineRunner:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._gate = _Turnstile()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    @property
    def busy(self) -> bool:
        return self._gate.held

    def on_user_request(self, hook: Callable[[], None]) -> None:
        """Call `hook` (on the event loop, synchronously) whenever a user request asks for the
        engine: the trainer pauses on it, before the request's prefill competes for the CPU."""
        self._gate.on_user = hook

    @property
    def user_active(self) -> bool:
        gate = self._gate
        return bool(gate.waiting(background=False) or (gate.held and not gate.holder_background))

    @property
    def last_user_end(self) -> float:
        """time.monotonic() when the engine last finished a user request (0 = never)."""
        return self._gate.last_foreground_end

    @property
    def queued(self) -> int:
        """User requests waiting for the engine (not counting the one it is serving)."""
        return self._gate.waiting(background=False)

    async def wait_quiet(self, quiet_s: float) -> None:
        """Wait until no user request has used or wanted the engine for `quiet_s`.
        Background work that starts right after a user turn would evict that user's
        prompt from the KV cache and sit in the way of their next message."""
        gate = self._gate
        while True:
            user_active = self.user_active
            remaining = gate.last_foreground_end + quiet_s - time.monotonic()
            if not user_active and remaining <= 0:
                return
            await asyncio.sleep(max(remaining, 0.05) if not user_active else 0.1)

    async def call(self, fn: Callable[..., T], *args, background: bool = False, **kwargs) -> T:
        """Run one engine method on the engine thread, in turn. Background calls get a
        `cancel` keyword (a threading.Event the runner sets to preempt them; a preempted
        call raises Preempted) and `slot=1` (the background prompt cache)."""
        cancel = threading.Event() if background else None
        if background:
            kwargs.update(cancel=cancel, slot=1)
        await self._gate.acquire(background, cancel)
        job = asyncio.get_running_loop().run_in_executor(self._thread, lambda: fn(*args, **kwargs))
        # Released when the thread is done, not when an impatient caller gives up.
        job.add_done_callback(lambda _: self._gate.release())
        return await asyncio.shield(job)

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        adapter: str | None,
        cancel: threading.Event,
        background: bool = False,
    ) -> AsyncIterator[SampledToken]:
        """Stream tokens from the engine thread. Setting `cancel` (or closing this
        iterator) stops generation before the next token. Background generation that
        the runner preempted for a user request raises Preempted."""
        await self._gate.acquire(background, cancel)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def work() -> None:
            try:
                for tok in self.engine.generate(
                    prompt_ids, params, adapter=adapter, cancel=cancel, slot=1 if background else 0
                ):
                    loop.call_soon_threadsafe(queue.put_nowait, tok)
                    if cancel.is_set():
                        break
            except BaseException as e:  # handed to the consumer, raised there
                loop.call_soon_threadsafe(queue.put_nowait, e)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, _DONE)

        worker = loop.run_in_executor(self._thread, work)
        finished = False
        try:
            while True:
                item = await queue.get()
                if item is _DONE:
                    finished = True
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
            if background and cancel.is_set():
                raise Preempted("generation was preempted by a user request")
        finally:
            # Only an early exit stops the engine: `cancel` belongs to the caller, who
            # reads it afterwards to tell a cancelled turn from one that ran to its end.
            if not finished:
                cancel.set()
            # The engine stays taken until its thread has really stopped (at most one
            # token step away), so the next request never overlaps this one.
            worker.add_done_callback(lambda _: self._gate.release())

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self.engine.close()
