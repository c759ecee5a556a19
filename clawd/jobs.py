"""Training jobs, daemon side: which signals a run learns from and the samples built from them.

Boundary: reads signals, turns and adapter rows; tokenizes through the ServedModel (teacher
prompts and canaries get the served model's own template and tokenizer, METHOD §1); writes
nothing: the scheduler writes the job it returns as the job file (clawd/training/data.py,
the contract with the trainer child).
The eligibility rule (`usable_turn`) and the hold-out split live here once, so the
scheduler's count and the job builder always agree.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from clawd.config import TrainingSettings
from clawd.protocol import Message
from clawd.served import ServedModel
from clawd.stops import tokens_received
from clawd.store import adapters as adapter_rows
from clawd.store import signals, turns
from clawd.store.db import Database
from clawd.templates import TRANSCRIPT_PREAMBLE
from clawd.training.data import Job, QAQuestion, Sample, TurnEnd
from clawd.training.kl_anchor import ANCHOR_PROMPTS
from clawd.training.qa import QA_MAX_TOKENS, QA_SET

# Fixed prompts for the eval gate's forgetting check (KL to the base model) and the live check
# after a swap: general requests no personal preference should change much.
CANARY = (
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Name three primary colors.", "Red, blue and yellow."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("What do bees make?", "Bees make honey."),
)

# Template text no answer should ever show: role markers of the common chat templates and the
# transcript format's preamble. An answer running on into these is a turn that failed to end
# (the gate's turn-end check, clawd/training/evaluate.py).
TEMPLATE_MARKERS = (
    TRANSCRIPT_PREAMBLE[:31],  # "The following is a conversation"
    "User:",
    "Assistant:",
    "Tool result:",
    "<start_of_turn>",
    "<end_of_turn>",
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|eot_id|>",
    "<|endoftext|>",
    "[INST]",
)

MAX_TRAIN = 10_000  # samples per job, oldest first (a run checkpoints per step, so a long one resumes)
MAX_HOLDOUT = 256  # held-out samples the gate scores per run, newest first


def is_holdout(turn_id: str, fraction: float) -> bool:
    """A stable split: a turn is held out for the gate forever, or never."""
    h = int.from_bytes(hashlib.sha256(turn_id.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def fit(prompt: list[int], response: list[int], max_tokens: int, keep_first: bool) -> tuple[list[int], list[int]]:
    """Cut an over-long sample to max_tokens: the oldest prompt tokens go first (keeping BOS),
    then the response's tail."""
    response = response[: max(1, max_tokens - 8)]
    room = max_tokens - len(response)
    if len(prompt) > room:
        head = prompt[:1] if keep_first else []
        prompt = head + prompt[len(prompt) - (room - len(head)) :]
    return prompt, response


async def usable_turn(db: Database, sig: signals.Signal) -> turns.TurnRecord | None:
    """The signal's turn when a sample can be built from it, else None: the one test that both
    build_job and untrained_count apply, so the scheduler never fires on signals no job takes."""
    if not (sig.reward or sig.hint):
        return None  # METHOD §5: neither an evaluative nor a directive signal -> no sample
    turn = await turns.get_turn(db, sig.turn_id)
    if turn is None or not turn.response_ids or turn.response_seen == 0:
        return None  # deleted, no sampled ids, or the user received none of them
    return turn


def received_ids(model: ServedModel, turn: turns.TurnRecord) -> list[int]:
    """The sampled tokens the user received: what a sample trains on. The stop string's tokens
    ("\nUser:") were sampled but never shown; training them (with r = −1, say) teaches the model
    not to end its turn. A turn that ended with an end-of-turn token keeps it (chat.py counts it).
    A turn recorded before clawd counted (response_seen NULL) is measured against its text,
    which keeps every token wholly inside it (an end token renders as its own text, so it goes too)."""
    ids = turn.response_ids
    if turn.response_seen is not None:
        return ids[: turn.response_seen]
    ends = [len(model.engine.detokenize(ids[: i + 1])) for i in range(len(ids))]
    return ids[: tokens_received(ends, len(turn.response_text), False)]


async def _sample(db: Database, model: ServedModel, sig: signals.Signal, max_tokens: int) -> Sample | None:
    turn = await usable_turn(db, sig)
    if turn is None:
        return None
    received = received_ids(model, turn)
    if not received:
        return None  # the user received nothing of it (a stop at once): nothing to learn from
    reward = sig.reward or 0
    keep_first = model.info.add_bos
    prompt, response = fit(turn.prompt_ids, received, max_tokens, keep_first)
    teacher = None
    if sig.hint:
        teacher, _ = fit(model.teacher_prompt_ids(turn.request, sig.hint), response, max_tokens, keep_first)
    return Sample(turn.id, prompt, response, reward, teacher)


def canary_samples(model: ServedModel) -> list[Sample]:
    out = []
    for i, (question, answer) in enumerate(CANARY):
        prompt = model.prompt_ids([Message(role="user", content=question)])
        # A leading space is how the transcript format's answers begin; templates strip it.
        out.append(Sample(f"canary-{i}", prompt, model.reply_ids(" " + answer)))
    return out


def anchor_prompts(model: ServedModel) -> list[Sample]:
    """training.w_kl_base's everyday prompts (training/kl_anchor.py) in the served model's
    own template, prompt only: the trainer has the base answer them."""
    return [
        Sample(f"anchor-{i}", model.prompt_ids([Message(role="user", content=prompt)]), [])
        for i, prompt in enumerate(ANCHOR_PROMPTS)
    ]


def qa_questions(model: ServedModel) -> list[QAQuestion]:
    """The capability canary's questions (training/qa.py) in the served model's own template."""
    return [
        QAQuestion(model.prompt_ids([Message(role="user", content=question)]), list(accepted))
        for question, accepted in QA_SET
    ]


def qa_fingerprint(questions: list[QAQuestion], end: TurnEnd) -> str:
    """What a QA result depends on besides the weights: the token ids asked, the answers
    accepted, how answers end and how long they may be."""
    what = [[q.prompt_ids, q.accepted] for q in questions], end.stops, QA_MAX_TOKENS
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]


def parent_qa(parent: adapter_rows.AdapterRecord | None, fingerprint: str) -> list[bool] | None:
    """The parent's per-question QA results from its own gate, when it answered the same
    questions (same fingerprint): the next gate need not ask it again."""
    qa = (parent.gate or {}).get("qa") if parent else None
    if isinstance(qa, dict) and qa.get("fingerprint") == fingerprint and isinstance(qa.get("right"), list):
        return [bool(r) for r in qa["right"]]
    return None


def turn_end(model: ServedModel) -> TurnEnd:
    """The served model's turn ends for the gate: its chat format's stop strings (end-of-turn
    tokens the trainer reads from the tokenizer) and the template text answers must not show."""
    rendered = model.prompt([Message(role="user", content=CANARY[0][0])]).rendered
    specials = [t for t in (model.info.bos_token, model.info.eos_token) if t]
    return TurnEnd(stops=list(rendered.stops), markers=[*TEMPLATE_MARKERS, *specials])


@dataclass(frozen=True)
class Holdout:
    """Whether signals are held out for the gate now, and why (for `clawd signals`, `clawd train`
    and the TUI). With few signals, holding a fifth out starves training: hold out only once
    `training.holdout_min` are ready; until then the gate judges on the training signals and
    the canaries, and says so (its `judged_on`)."""

    fraction: float
    ready: int  # ready, non-vetoed signals of the served model, learned ones included
    needed: int

    @property
    def active(self) -> bool:
        return self.fraction > 0 and self.ready >= self.needed

    def held_out(self, turn_id: str) -> bool:
        return self.active and is_holdout(turn_id, self.fraction)

    def explain(self) -> str:
        if self.fraction <= 0:
            return "nothing is held out (training.holdout = 0): the gate judges on the training signals and canaries"
        if self.active:
            return f"{self.fraction:.0%} of signals are held out for the gate (chosen by a stable hash of the turn)"
        return (
            f"nothing is held out until {self.needed} signals are ready ({self.ready} now, "
            "training.holdout_min): every signal trains; the gate judges on them and the canaries"
        )


async def holdout_rule(db: Database, model: str, settings: TrainingSettings) -> Holdout:
    ready = len(await signals.trainable_ids(db, model=model))
    return Holdout(settings.holdout, ready, settings.holdout_min)


async def split_signals(db: Database, model: str, settings: TrainingSettings) -> tuple[list[str], list[str]]:
    """(train, held-out) turn ids a job may take: not yet learned by a live adapter, answered by
    `model`. Split before any cap, so neither side can crowd the other out of a long history;
    the gate judges on the newest held-out signals."""
    rule = await holdout_rule(db, model, settings)
    ids = await signals.trainable_ids(db, model=model, exclude=await adapter_rows.trained_turns(db))
    train = [t for t in ids if not rule.held_out(t)]
    held = [t for t in ids if rule.held_out(t)]
    return train[:MAX_TRAIN], held[-MAX_HOLDOUT:]


async def untrained_count(db: Database, model: str, settings: TrainingSettings) -> int:
    train, _ = await split_signals(db, model, settings)
    n = 0
    for s in await signals.get_many(db, train):
        if await usable_turn(db, s):
            n += 1
    return n


async def build_job(
    db: Database,
    model: ServedModel,
    settings: TrainingSettings,
    *,
    job_id: str,
    parent: adapter_rows.AdapterRecord | None,
    top_k: int,
) -> Job:
    """Everything one trainer run needs. Train samples: ready, non-vetoed signals not yet
    learned by a live adapter; holdout: the newest ready held-out signals (never trained on)."""
    job = Job(
        job_id,
        str(model.info.path),
        model.model_id,
        dataclasses.asdict(settings),
        parent_id=parent.id if parent else None,
        parent_path=parent.path if parent else None,
        top_k=top_k,
    )
    train, held = await split_signals(db, model.model_id, settings)
    for part, ids in ((job.train, train), (job.holdout, held)):
        for sig in await signals.get_many(db, ids):
            sample = await _sample(db, model, sig, settings.max_tokens)
            if sample is not None:
                part.append(sample)
    job.canary = canary_samples(model)
    job.turn_end = turn_end(model)
    if settings.w_kl_base > 0:
        job.anchor = anchor_prompts(model)
    if settings.qa_canary:
        job.qa = qa_questions(model)
        job.qa_fingerprint = qa_fingerprint(job.qa, job.turn_end)
        job.parent_qa = parent_qa(parent, job.qa_fingerprint)
    return job


def same_weights(job: Job, model: ServedModel) -> bool:
    """Was `job` built for the weights `model` serves now (so its ids still mean the same)?"""
    return job.model == model.model_id and job.model_path == str(model.info.path)
