"""The engine turnstile (engines/runner.py): user requests in arrival order and before
background work; a user arrival preempts background generation within a token step and
background scoring between chunks; cancelled waiters never wedge the gate."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from clawd.engines.base import SamplingParams
from clawd.engines.fake import Engine as FakeEngine
from clawd.engines.runner import EngineRunner, _Turnstile
from clawd.errors import Preempted

TOKEN_S = 0.05  # the slow fake engine's time per token


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def until(predicate, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.002)


class Recorder:
    """Engine-thread work that logs who ran, when, and whether two ever overlapped."""

    def __init__(self):
        self.order: list[str] = []
        self.started: dict[str, float] = {}
        self.inside = 0
        self.overlap = False
        self.lock = threading.Lock()

    def work(self, name: str, hold: threading.Event | None = None, seconds: float = 0.0, cancel=None, slot=0) -> str:
        with self.lock:
            self.inside += 1
            self.overlap |= self.inside > 1
            self.order.append(name)
            self.started[name] = time.monotonic()
        try:
            if hold is not None:
                assert hold.wait(10)
            time.sleep(seconds)
            return name
        finally:
            with self.lock:
                self.inside -= 1


def test_foreground_requests_are_served_in_arrival_order():
    async def go():
        runner, rec, hold = EngineRunner(FakeEngine()), Recorder(), threading.Event()
        try:
            assert not runner.busy and runner.queued == 0
            holder = asyncio.create_task(runner.call(rec.work, "holder", hold))
            await until(lambda: rec.order == ["holder"])
            waiters = []
            for name in ("u1", "u2", "u3", "u4"):
                waiters.append(asyncio.create_task(runner.call(rec.work, name)))
                await asyncio.sleep(0)  # arrives (and queues) before the next one
            assert runner.busy and runner.queued == 4
            hold.set()
            assert await asyncio.gather(holder, *waiters) == ["holder", "u1", "u2", "u3", "u4"]
            assert rec.order == ["holder", "u1", "u2", "u3", "u4"] and not rec.overlap
            assert not runner.busy and runner.queued == 0
        finally:
            runner.close()

    run(go())


def test_background_waits_behind_every_queued_foreground_request():
    async def go():
        runner, rec, hold = EngineRunner(FakeEngine()), Recorder(), threading.Event()
        try:
            holder = asyncio.create_task(runner.call(rec.work, "holder", hold))
            await until(lambda: rec.order == ["holder"])
            tasks = []
            for name, background in (("bg1", True), ("u1", False), ("bg2", True), ("u2", False)):
                tasks.append(asyncio.create_task(runner.call(rec.work, name, background=background)))
                await asyncio.sleep(0)
            # `queued` counts user requests only; background work is not "queued users"
            assert runner.queued == 2 and runner.busy
            hold.set()
            await asyncio.gather(holder, *tasks)
            assert rec.order == ["holder", "u1", "u2", "bg1", "bg2"] and not rec.overlap
            # a user request never preempts another user request: the holder ran to its end
            assert not runner.busy and runner.queued == 0
        finally:
            runner.close()

    run(go())


def test_user_request_preempts_background_generation_within_a_token():
    async def go():
        engine = FakeEngine(n_ctx=4096, token_delay=TOKEN_S)
        runner, rec = EngineRunner(engine), Recorder()
        prompt = engine.tokenize("User: " + "tell me everything " * 30, add_bos=True)  # ~580 tokens intended
        got: list[float] = []
        outcome: dict = {}

        async def background():
            try:
                async for _ in runner.generate(
                    prompt,
                    SamplingParams(max_tokens=1000, temperature=0),
                    adapter=None,
                    cancel=threading.Event(),
                    background=True,
                ):
                    got.append(time.monotonic())
            except Preempted:
                outcome["preempted_at"] = time.monotonic()
            else:
                outcome["finished"] = True

        try:
            bg = asyncio.create_task(background())
            await until(lambda: len(got) >= 3)
            arrived = time.monotonic()
            fg = asyncio.create_task(runner.call(rec.work, "user"))
            await asyncio.sleep(0)
            assert runner.queued == 1 and runner.busy
            assert await fg == "user"
            await bg
        finally:
            runner.close()
        assert "finished" not in outcome, "background generation ran to its end"
        after = sum(t > arrived for t in got)
        fg_wait = rec.started["user"] - arrived
        print(
            f"\npreempted generation: {after} token(s) after the user arrived, user started after "
            f"{fg_wait * 1000:.0f} ms (token step {TOKEN_S * 1000:.0f} ms), background saw Preempted "
            f"{(outcome['preempted_at'] - arrived) * 1000:.0f} ms after"
        )
        assert after <= 1  # at most the token already being computed
        assert fg_wait < 2 * TOKEN_S + 0.05  # about one token step, not the whole generation
        assert outcome["preempted_at"] - arrived < 2 * TOKEN_S + 0.05
        assert len(got) < 20

    run(go())


def test_user_generation_is_never_preempted():
    """Only background work yields: a user's stream runs to its end while others wait."""

    async def go():
        engine = FakeEngine(token_delay=0.005)
        runner = EngineRunner(engine)
        prompt = engine.tokenize("User: hello there", add_bos=True)
        try:

            async def stream():
                return [
                    t.id
                    async for t in runner.generate(
                        prompt, SamplingParams(temperature=0), adapter=None, cancel=threading.Event()
                    )
                ]

            first = asyncio.create_task(stream())
            await until(lambda: runner.busy)  # the first is streaming when the second arrives
            second = asyncio.create_task(stream())
            a, b = await asyncio.gather(first, second)
            expected = [*b"You said: hello there", 257]
            assert a == expected and b == expected
        finally:
            runner.close()

    run(go())


@pytest.fixture(scope="module")
def tiny_engine(tiny_gguf):
    from clawd.engines.llamacpp import Engine

    engine = Engine(tiny_gguf, n_ctx=512, n_threads=1, n_batch=4, model_id="tiny")
    yield engine
    engine.close()


def test_background_scoring_is_preempted_between_chunks(tiny_engine):
    engine = tiny_engine
    prompt = engine.tokenize("The following is a conversation.\nUser: Hello there!\nAssistant:", add_bos=True)
    target = engine.tokenize(" Hello, here is a long answer about the weather. " * 20, add_bos=False)[:400]
    assert len(prompt) + len(target) < 512 and len(target) > 300
    reference = engine.score(prompt, target, top_k=4)  # before the runner owns the engine

    real_decode = engine._decode
    decodes: list[bool] = []  # per decode call: was the cancel event already set?
    box: dict = {}
    reached, go_on = threading.Event(), threading.Event()

    def spying_decode(tokens, start_pos, want_logits):
        cancel = box.get("cancel")
        decodes.append(bool(cancel and cancel.is_set()))
        if len(decodes) == 10:  # well inside the scoring loop: let the user arrive now
            reached.set()
            assert go_on.wait(10)
        return real_decode(tokens, start_pos, want_logits)

    def background_score(p, t, *, cancel, **kw):
        box["cancel"] = cancel
        return engine.score(p, t, cancel=cancel, **kw)

    async def scenario():
        runner = EngineRunner(engine)
        try:
            bg = asyncio.create_task(runner.call(background_score, prompt, target, top_k=4, background=True))
            await until(reached.is_set)
            fg = asyncio.create_task(runner.call(engine.score, prompt, target, top_k=4))
            await asyncio.sleep(0)  # the user is queued and the cancel event is set
            assert box["cancel"].is_set() and runner.queued == 1
            t0 = time.monotonic()
            go_on.set()
            with pytest.raises(Preempted):
                await bg
            preempt_s = time.monotonic() - t0
            return await fg, preempt_s
        finally:
            runner._thread.shutdown(wait=True)  # the engine belongs to the module fixture

    engine._decode = spying_decode
    try:
        user_result, preempt_s = run(scenario())
    finally:
        go_on.set()
        engine._decode = real_decode
    n_chunks = len(target) // 4
    cancelled_index = decodes.index(True) if True in decodes else len(decodes)
    print(
        f"\npreempted score: stopped after decode {cancelled_index}/{n_chunks} chunks, "
        f"{preempt_s * 1000:.1f} ms after the user arrived"
    )
    # The chunk in flight finishes; no chunk of the background call starts after the
    # cancel (decodes after that index belong to the user's own score).
    assert cancelled_index == 10
    assert preempt_s < 1.0
    # The half-finished background call left the KV cache consistent: the user's score
    # (which reuses the cached prefix) equals the reference.
    np.testing.assert_allclose(user_result.logprobs, reference.logprobs, atol=1e-5)
    np.testing.assert_array_equal(user_result.top_ids, reference.top_ids)


def test_cancelled_waiters_do_not_deadlock_the_gate():
    async def go():
        runner, rec, hold = EngineRunner(FakeEngine()), Recorder(), threading.Event()
        try:
            holder = asyncio.create_task(runner.call(rec.work, "holder", hold))
            await until(lambda: rec.order == ["holder"])
            gone_user = asyncio.create_task(runner.call(rec.work, "gone-user"))
            gone_bg = asyncio.create_task(runner.call(rec.work, "gone-bg", background=True))
            bg = asyncio.create_task(runner.call(rec.work, "bg", background=True))
            await asyncio.sleep(0)
            assert runner.queued == 1
            gone_user.cancel()
            gone_bg.cancel()
            await asyncio.sleep(0)
            assert runner.queued == 0  # a cancelled user no longer counts as queued
            hold.set()
            assert await holder == "holder" and await bg == "bg"
            for t in (gone_user, gone_bg):
                with pytest.raises(asyncio.CancelledError):
                    await t
            assert rec.order == ["holder", "bg"]
            assert not runner.busy
            assert await asyncio.wait_for(runner.call(rec.work, "later"), 5) == "later"

            # An impatient caller that gives up while its call runs does not free the engine
            # early: the next call starts only when the first has really finished.
            slow = asyncio.create_task(runner.call(rec.work, "slow", None, 0.2))
            await until(lambda: "slow" in rec.order)
            slow.cancel()
            after = await runner.call(rec.work, "after")
            assert after == "after" and rec.started["after"] - rec.started["slow"] >= 0.19
            assert not rec.overlap and not runner.busy
        finally:
            runner.close()

    run(go())


def test_ownership_handed_to_a_waiter_cancelled_at_that_moment_is_passed_on():
    async def go():
        gate = _Turnstile()
        await gate.acquire(False, None)
        a = asyncio.create_task(gate.acquire(False, None))
        b = asyncio.create_task(gate.acquire(True, None))
        await asyncio.sleep(0)
        gate.release()  # hands the engine to `a` ...
        a.cancel()  # ... whose caller goes away before it could run
        with pytest.raises(asyncio.CancelledError):
            await a
        await asyncio.wait_for(b, 5)  # passed on to the next waiter
        assert gate.held
        gate.release()
        assert not gate.held and gate.waiting() == 0

        # the same with nobody else waiting: the gate ends up free
        await gate.acquire(False, None)
        c = asyncio.create_task(gate.acquire(True, None))
        await asyncio.sleep(0)
        gate.release()
        c.cancel()
        with pytest.raises(asyncio.CancelledError):
            await c
        assert not gate.held
        await asyncio.wait_for(gate.acquire(True, None), 5)

    run(go())


def test_background_handed_the_engine_while_a_user_queues_is_preempted_at_once():
    """Ownership is handed to a background waiter, and before it resumes a user queues (so
    there was no background holder to preempt yet): it must find its cancel event set."""

    async def go():
        gate = _Turnstile()
        await gate.acquire(False, None)
        cancel = threading.Event()
        bg = asyncio.create_task(gate.acquire(True, cancel))
        await asyncio.sleep(0)
        assert gate.waiting(True) == 1
        user = asyncio.create_task(gate.acquire(False, None))  # runs before `bg` wakes ...
        gate.release()  # ... to the hand-off made here
        await asyncio.wait_for(bg, 5)
        assert gate.held and gate.holder_background
        assert not user.done() and gate.waiting(False) == 1
        assert cancel.is_set()  # preempted as soon as it holds the engine
        gate.release()
        await asyncio.wait_for(user, 5)
        assert gate.held and not gate.holder_background
        gate.release()
        assert not gate.held and gate.waiting() == 0

    run(go())


def test_closing_a_stream_early_stops_the_engine_before_the_next_request():
    async def go():
        engine = FakeEngine(n_ctx=4096, token_delay=0.01)
        runner, rec = EngineRunner(engine), Recorder()
        prompt = engine.tokenize("User: " + "x" * 300, add_bos=True)
        try:
            gen = runner.generate(
                prompt, SamplingParams(max_tokens=1000, temperature=0), adapter=None, cancel=threading.Event()
            )
            n = 0
            async for _ in gen:
                n += 1
                if n == 3:
                    break
            await gen.aclose()
            t0 = time.monotonic()
            assert await runner.call(rec.work, "next") == "next"
            assert rec.started["next"] - t0 < 0.2  # not behind the rest of the abandoned stream
            assert not runner.busy
        finally:
            runner.close()

    run(go())
