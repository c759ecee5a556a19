"""The async face of a synchronous engine.

Engines are single-threaded by contract. The runner owns the one worker thread that
may touch the engine and a FIFO lock in front of it, so requests are served in arrival
order (asyncio.Lock wakes waiters first-come first-served), and the event loop never
blocks on a model.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from clawd.engines.base import Engine, SampledToken, SamplingParams

T = TypeVar("T")
_DONE = object()


class EngineRunner:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._lock = asyncio.Lock()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._waiting = 0

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    @property
    def queued(self) -> int:
        """Requests waiting for the engine (not counting the one it is serving)."""
        return self._waiting

    async def _acquire(self) -> None:
        self._waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self._waiting -= 1

    async def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """Run one engine method on the engine thread, in turn."""
        await self._acquire()
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._thread, lambda: fn(*args, **kwargs))
        finally:
            self._lock.release()

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *,
        adapter: str | None, cancel: threading.Event,
    ) -> AsyncIterator[SampledToken]:
        """Stream tokens from the engine thread. Setting `cancel` (or closing this
        iterator) stops generation before the next token."""
        await self._acquire()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def work() -> None:
            try:
                for tok in self.engine.generate(prompt_ids, params, adapter=adapter, cancel=cancel):
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
        finally:
            # Only an early exit stops the engine: `cancel` belongs to the caller, who
            # reads it afterwards to tell a cancelled turn from one that ran to its end.
            if not finished:
                cancel.set()
            # The engine stays taken until its thread has really stopped (at most one
            # token step away), so the next request never overlaps this one.
            worker.add_done_callback(lambda _: self._lock.release())

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self.engine.close()
