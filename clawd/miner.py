"""The miner: every main turn becomes a training signal (METHOD.md §1-4), in the background.

For each trainable turn it pairs the next state (the session's next main request's newest
message), takes the evaluative reward from the strongest evidence (explicit feedback,
then regenerate / re-query, then rules, then an LLM judge), gathers hint candidates,
scores the turn's *sampled* response tokens under the teacher (base model + hint) at the
student's top-k tokens, and keeps the hint whose teacher top-k overlaps the student's
most. Engine work runs at background priority: a user request preempts it within one
token or scoring chunk, and the step is simply redone later (every step is idempotent).
"""

from __future__ import annotations

import asyncio
import difflib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from clawd import judge as judges
from clawd.config import MiningSettings
from clawd.errors import ClawdError, ContextLengthExceeded, Preempted
from clawd.judge_rules import RulesJudge
from clawd.protocol import Message
from clawd.served import ServedModel
from clawd.store import feedback, signals, turns
from clawd.store.db import Database

log = logging.getLogger(__name__)
RESTATE_SIMILARITY = 0.85  # a new user message this close to the previous one re-asks it
PREEMPT_RETRY_S = 1.0
# A turn that keeps failing for a non-judge reason (e.g. an engine that cannot score the
# teacher, or a bug that raises on one row) is given up after this many tries: it keeps its
# reward (without a hint) when it had one, else it ends `empty` with its error recorded.
MAX_ATTEMPTS = 5
MAX_BACKOFF_S = 3600.0


@dataclass
class MinerStatus:
    judge: str
    hint_judge: str
    judge_error: str | None = None
    judge_error_at: float | None = None
    mined: int = 0
    busy_since: float | None = None
    counts: dict = field(default_factory=dict)


def last_user_text(messages: list[dict]) -> str:
    for m in reversed(messages):
        if m.get("role") == "user":
            return Message.model_validate(m).text()
    return ""


def overlap(student_top: np.ndarray, teacher_top: np.ndarray) -> int:
    """O = sum over positions of |S_i ∩ T_i| (METHOD §4)."""
    return int(sum(len(set(s.tolist()) & set(t.tolist())) for s, t in zip(student_top, teacher_top)))


def clean_candidates(texts: list[tuple[str, str]], limit: int) -> list[tuple[str, str]]:
    """(text, source) pairs: stripped length > 10, deduplicated, shortest first, at most `limit`."""
    seen, out = set(), []
    for text, source in texts:
        t = (text or "").strip()
        if len(t) <= 10 or t.lower() in seen:
            continue
        seen.add(t.lower())
        out.append((t, source))
    return sorted(out, key=lambda c: len(c[0]))[:limit]


class Miner:
    def __init__(
        self,
        db: Database,
        model: ServedModel,
        settings: MiningSettings,
        make_judge: Callable[[str], judges.LLMJudge | None] = lambda spec: None,
    ):
        self.db = db
        self.model = model
        self.settings = settings
        self.rules = RulesJudge()
        self._make_judge = make_judge
        self._judges: dict[str, judges.LLMJudge | None] = {"rules": None}
        self._judge_retry_at = 0.0
        self.status = MinerStatus(judge=settings.judge, hint_judge=settings.hint_judge)
        self._wake = asyncio.Event()
        self._repair = True  # pairing is re-checked when woken or polled, not per mined turn
        self._task: asyncio.Task | None = None

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="miner")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for j in self._judges.values():
            close = getattr(getattr(j, "completer", None), "aclose", None)
            if close:
                await close()

    async def _judge(self, spec: str) -> judges.LLMJudge | None:
        """The judge for a config spec, built on first use. A judge that fails to come
        up (unreachable endpoint, bad model file) is retried after a back-off; meanwhile
        turns that need it stay pending, and `clawd status` shows why."""
        if spec in self._judges:
            return self._judges[spec]
        if time.time() < self._judge_retry_at:
            raise judges.JudgeUnavailable(self.status.judge_error or f"judge {spec} is unavailable")
        try:
            # Off the event loop: a gguf judge loads a whole model.
            self._judges[spec] = await asyncio.to_thread(self._make_judge, spec)
        except ClawdError as e:
            self._judge_retry_at = time.time() + self.settings.retry_s
            raise judges.JudgeUnavailable(f"judge {spec} could not start: {e.message}") from e
        return self._judges[spec]

    async def on_feedback(self, turn_id: str) -> None:
        """Feedback is new evidence: a turn already mined is judged again, and soon."""
        if await signals.get(self.db, turn_id) is not None:
            await signals.reopen(self.db, turn_id)
        self.poke()

    def poke(self) -> None:
        """New turn or feedback: look now rather than at the next poll."""
        self._repair = True
        self._wake.set()

    async def run(self, poll_s: float = 5.0) -> None:
        while True:
            # Cleared before the step, not after: a poke that arrives during the step
            # must wake the next wait rather than be lost for a whole poll interval.
            self._wake.clear()
            try:
                worked = await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one step must not end mining for good
                log.exception("miner step failed")
                worked = False
            if not worked:
                try:
                    await asyncio.wait_for(self._wake.wait(), poll_s)
                except TimeoutError:
                    self._repair = True  # e.g. a session marked done

    async def step(self) -> bool:
        """Pair what can be paired, then mine one pending turn. Returns whether a turn
        was mined (so the caller knows to go on at once)."""
        if self._repair:
            self._repair = False
            await signals.create_missing(self.db)
            for turn_id in await signals.due(self.db, "waiting", limit=1000):
                try:
                    await self._pair(turn_id)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # one unpairable row must not stop the others being paired
                    log.exception("pairing turn %s failed", turn_id)
                    await signals.record_failure(
                        self.db,
                        turn_id,
                        f"{type(e).__name__}: {e}"[:2000],
                        backoff=self._backoff,
                        max_attempts=MAX_ATTEMPTS,
                    )
        pending = await signals.due(self.db, "pending", limit=1)
        if not pending:
            return False
        self.status.busy_since = time.time()
        try:
            await self.mine(pending[0])
        finally:
            self.status.busy_since = None
        return True

    async def run_until_idle(self, max_steps: int = 1000) -> int:
        """Mine everything minable now (tests, benchmarks)."""
        self._repair = True
        n = 0
        while n < max_steps and await self.step():
            n += 1
        return n

    # ---- pairing ---------------------------------------------------------------------

    async def _pair(self, turn_id: str) -> None:
        sig = await signals.get(self.db, turn_id)
        turn = await turns.get_turn(self.db, turn_id)
        if sig is None or turn is None or sig.status != "waiting":
            return
        await self._late_next_state(turn)
        nxt = await turns.next_main_turn(self.db, turn)
        if nxt is not None and nxt.requery_of != turn.id:
            newest = nxt.request["messages"][-1]
            sig.next_turn_id = nxt.id
            sig.next_state = Message.model_validate(newest).text()
            sig.next_role = newest.get("role")
            sig.status = "pending"
        elif nxt is not None or await turns.find_requery_of(self.db, turn.id):
            sig.status = "pending"  # regenerated: negative evidence, no next state
        elif await feedback.for_turn(self.db, turn.id) or await turns.session_done(self.db, turn.session_id):
            sig.status = "pending"
        else:
            return  # nothing yet: wait for the user's next message
        await signals.save(self.db, sig)

    async def _late_next_state(self, turn: turns.TurnRecord) -> None:
        """Feedback (or a closed session) can get a session's newest turn mined before
        its next state exists. When that next state arrives (`turn`), give it to the
        earlier turn and mine that again, so e.g. the correction typed after a thumbs
        down still becomes its hint."""
        prev = await turns.previous_main_turn(self.db, turn)
        if prev is None or turn.requery_of == prev.id:
            return  # a regenerate is no next state
        psig = await signals.get(self.db, prev.id)
        if psig is None or psig.status not in ("ready", "empty") or psig.next_turn_id is not None:
            return
        newest = turn.request["messages"][-1]
        psig.next_turn_id, psig.next_role = turn.id, newest.get("role")
        psig.next_state = Message.model_validate(newest).text()
        psig.status, psig.retry_at = "pending", 0.0
        await signals.save(self.db, psig, if_updated_at=psig.updated_at)

    # ---- mining one turn -------------------------------------------------------------

    def _backoff(self, attempts: int) -> float:
        """Seconds to wait before the next try: retry_s, doubling per attempt, capped."""
        return min(MAX_BACKOFF_S, self.settings.retry_s * 2 ** max(0, attempts - 1))

    async def mine(self, turn_id: str) -> None:
        """Mine one turn. Whatever goes wrong (a bug, a corrupt row, an engine error) is
        counted against THIS row and backs it off, so the next rows are mined meanwhile and a
        row that keeps failing ends `empty` rather than being retried at the head forever."""
        try:
            await self._mine(turn_id)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("mining turn %s failed", turn_id)
            error = f"{type(e).__name__}: {e}"[:2000]
            # Written by SQL on the row's counters alone: the row itself may be what cannot be read.
            await signals.record_failure(self.db, turn_id, error, backoff=self._backoff, max_attempts=MAX_ATTEMPTS)

    async def _mine(self, turn_id: str) -> None:
        sig = await signals.get(self.db, turn_id)
        turn = await turns.get_turn(self.db, turn_id)
        if sig is None or turn is None:
            return
        read_at = sig.updated_at  # saves below are dropped if feedback re-opened the row meanwhile
        await self.model.runner.wait_quiet(self.settings.quiet_s)
        try:
            await self._evaluate(sig, turn)
            await self._direct(sig, turn)
        except Preempted:
            sig.retry_at = time.time() + PREEMPT_RETRY_S
            await signals.save(self.db, sig, if_updated_at=read_at)  # same status: redone from scratch later
            return
        except judges.JudgeUnavailable as e:
            sig.attempts += 1
            sig.error = e.message
            sig.retry_at = time.time() + self._backoff(sig.attempts)
            self.status.judge_error, self.status.judge_error_at = e.message, time.time()
            await signals.save(self.db, sig, if_updated_at=read_at)
            log.warning("judge unavailable, turn %s retried later: %s", turn_id, e.message)
            return
        except ClawdError as e:  # e.g. the engine failed on this turn: back off, then give up on it
            sig.attempts += 1
            sig.error = e.message
            sig.retry_at = time.time() + self._backoff(sig.attempts)
            if sig.attempts >= MAX_ATTEMPTS:  # give up the directive signal, keep the evaluative one
                sig.status = "ready" if sig.reward else "empty"
                sig.hints, sig.hint = [], None
                sig.student_top_ids = sig.student_top_logprobs = sig.teacher_logprobs = sig.teacher_top_logprobs = None
            await signals.save(self.db, sig, if_updated_at=read_at)
            log.warning("mining turn %s failed (attempt %d): %s", turn_id, sig.attempts, e.message)
            return
        sig.status = "ready" if (sig.reward or sig.hint) else "empty"
        sig.error = None
        if await signals.save(self.db, sig, if_updated_at=read_at):
            self.status.mined += 1

    async def _requeried(self, turn: turns.TurnRecord, sig: signals.Signal) -> bool:
        if await turns.find_requery_of(self.db, turn.id):
            return True
        if sig.next_role != "user" or not sig.next_state:
            return False
        before = last_user_text(turn.request["messages"]).strip().lower()
        after = sig.next_state.strip().lower()
        return bool(before) and difflib.SequenceMatcher(None, before, after).ratio() >= RESTATE_SIMILARITY

    def _judge_input(self, sig: signals.Signal, turn: turns.TurnRecord) -> judges.JudgeInput:
        return judges.JudgeInput(
            request=turn.request["messages"],
            response=turn.response_text,
            next_state=sig.next_state or "",
            next_role=sig.next_role or "user",
        )

    async def _evaluate(self, sig: signals.Signal, turn: turns.TurnRecord) -> None:
        """r(t) from the strongest evidence available (METHOD §2)."""
        notes = await feedback.for_turn(self.db, turn.id)
        thumbs = [f for f in notes if f.kind in ("up", "down")]
        sig.votes = []
        if thumbs:
            sig.reward, sig.reward_source = (1 if thumbs[-1].kind == "up" else -1), "feedback"
        elif any(f.kind == "correction" for f in notes):
            sig.reward, sig.reward_source = -1, "feedback"
        elif await self._requeried(turn, sig):
            sig.reward, sig.reward_source = -1, "requery"
        elif not sig.next_state:
            sig.reward, sig.reward_source = 0, "none"
        else:
            inp = self._judge_input(sig, turn)
            verdict = self.rules.evaluate(inp)
            judge = await self._judge(self.settings.judge) if verdict is None else None
            if judge is not None:
                try:
                    verdict = await judge.evaluate(inp)
                    self.status.judge_error = None  # it answered: whatever failed before has recovered
                except ContextLengthExceeded:
                    verdict = None  # the turn does not fit the judge: no evaluative signal
            if verdict is None:
                sig.reward, sig.reward_source = 0, "none"
            else:
                sig.reward, sig.reward_source, sig.votes = verdict.score, verdict.source, list(verdict.votes)

    async def _direct(self, sig: signals.Signal, turn: turns.TurnRecord) -> None:
        """Hint candidates, teacher scoring, overlap-guided selection (METHOD §3-4)."""
        notes = await feedback.for_turn(self.db, turn.id)
        raw = [(f.text, "feedback") for f in notes if f.kind == "correction" and f.text]
        inp = self._judge_input(sig, turn)
        if sig.next_state:
            # judged a correction by whichever judge: the user's words are a hint even where
            # the rules did not recognise them (an LLM judge decides where they are unsure)
            own = self.rules.correction(inp, corrected=sig.reward == -1)
            if own:
                raw.append((own, "user"))
            # A clearly approved answer carries no hindsight; skip the costly hint judge.
            hint_judge = await self._judge(self.settings.hint_judge) if sig.reward != 1 else None
            if hint_judge is not None:
                try:
                    raw += [(h, self.settings.hint_judge) for h in await hint_judge.hints(inp)]
                except ContextLengthExceeded:
                    pass  # too long for the judge; the user's own words may still serve
        cands = clean_candidates(raw, self.settings.max_hints)
        sig.hints, sig.hint = [], None
        sig.student_top_ids = sig.student_top_logprobs = sig.teacher_logprobs = sig.teacher_top_logprobs = None
        if not cands:
            return
        k = self.settings.top_k
        runner, engine = self.model.runner, self.model.engine
        student = await runner.call(
            engine.score,
            turn.prompt_ids,
            turn.response_ids,
            top_k=k,
            adapter=self.model.active_adapter,
            background=True,
        )
        best = None
        for text, source in cands:
            prompt_ids = self.model.teacher_prompt_ids(turn.request, text)
            try:
                teacher = await runner.call(
                    engine.score,
                    prompt_ids,
                    turn.response_ids,
                    top_k=k,
                    adapter=None,
                    at_ids=student.top_ids,
                    background=True,
                )
            except ContextLengthExceeded:
                sig.hints.append({"text": text, "source": source, "overlap": None})
                continue
            o = overlap(student.top_ids, teacher.top_ids)
            sig.hints.append({"text": text, "source": source, "overlap": o})
            if best is None or o > best[0]:  # strict: ties keep the shorter hint
                best = (o, text, teacher)
        if best is None:
            return
        _, sig.hint, teacher = best
        sig.top_k = k
        sig.student_top_ids = student.top_ids.astype(np.int32)
        sig.student_top_logprobs = student.top_logprobs
        sig.teacher_logprobs = teacher.logprobs
        sig.teacher_top_logprobs = teacher.at_logprobs
