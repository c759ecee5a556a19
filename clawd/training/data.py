"""Training jobs: ready signals -> the token sequences one trainer run learns from.

Boundary: the daemon side (`build_job`, async, no MLX) turns signals into token ids — the
very ids the served model sampled, and teacher prompts tokenized by the served model's own
tokenizer with the same template — so the trainer never re-tokenizes anything (METHOD §1).
The trainer side only reads the job file (`read_job`). A job is one JSON file, written
atomically; it is the whole contract between the daemon and `python -m clawd.training.run`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from clawd.chat import ChatService
from clawd.config import TrainingSettings
from clawd.miner import teacher_prompt_ids
from clawd.protocol import Message
from clawd.store import adapters as adapter_rows
from clawd.store import signals, turns
from clawd.store.db import Database

# Fixed prompts for the eval gate's forgetting check (KL to the base model) and the live check
# after a swap: general requests no personal preference should change much.
CANARY = (
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Name three primary colors.", "Red, blue and yellow."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("What do bees make?", "Bees make honey."),
)


@dataclass
class Sample:
    turn_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    reward: int = 0  # METHOD §2: +1 / -1 / 0 (0 = no RL term)
    teacher_prompt_ids: list[int] | None = None  # the prompt with the selected hint; None = no OPD term


@dataclass
class Job:
    id: str
    model_path: str
    model: str  # the served model id the adapter belongs to
    config: dict  # TrainingSettings as a dict
    train: list[Sample] = field(default_factory=list)
    holdout: list[Sample] = field(default_factory=list)
    canary: list[Sample] = field(default_factory=list)
    parent_id: str | None = None  # continue from this adapter (the active one), None = from base
    parent_path: str | None = None
    created_at: float = field(default_factory=time.time)

    @property
    def settings(self) -> TrainingSettings:
        return TrainingSettings(**self.config)


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
        prompt = head + prompt[len(prompt) - (room - len(head)):]
    return prompt, response


async def usable_turn(db: Database, sig: signals.Signal) -> turns.TurnRecord | None:
    """The signal's turn when a sample can be built from it, else None: the one test that both
    build_job and untrained_count apply, so the scheduler never fires on signals no job takes."""
    if not (sig.reward or sig.hint):
        return None  # METHOD §5: neither an evaluative nor a directive signal -> no sample
    turn = await turns.get_turn(db, sig.turn_id)
    return turn if turn is not None and turn.response_ids else None  # deleted, or no sampled ids


async def _sample(db: Database, chat: ChatService, sig: signals.Signal, max_tokens: int) -> Sample | None:
    turn = await usable_turn(db, sig)
    if turn is None:
        return None
    reward = sig.reward or 0
    keep_first = chat.runner.engine.info.add_bos
    prompt, response = fit(turn.prompt_ids, turn.response_ids, max_tokens, keep_first)
    teacher = None
    if sig.hint:
        teacher, _ = fit(teacher_prompt_ids(chat, turn, sig.hint), response, max_tokens, keep_first)
    return Sample(turn.id, prompt, response, reward, teacher)


def canary_samples(chat: ChatService) -> list[Sample]:
    engine, out = chat.runner.engine, []
    for i, (question, answer) in enumerate(CANARY):
        rendered = chat.format.render([Message(role="user", content=question)], None)
        prompt = engine.tokenize(rendered.prompt, add_bos=rendered.add_bos and engine.info.add_bos)
        # A leading space is how the transcript format's answers begin; templates strip it.
        response = engine.tokenize(" " + answer, add_bos=False, special=False)
        out.append(Sample(f"canary-{i}", prompt, response))
    return out


async def split_signals(db: Database, model: str, holdout: float) -> tuple[list[str], list[str]]:
    """(train, held-out) turn ids a job may take: not yet learned by a live adapter, answered by
    `model`. Split before any cap, so neither side can crowd the other out of a long history;
    the gate judges on the newest held-out signals."""
    ids = await signals.trainable_ids(db, model=model, exclude=await adapter_rows.trained_turns(db))
    train = [t for t in ids if not is_holdout(t, holdout)]
    held = [t for t in ids if is_holdout(t, holdout)]
    return train[:MAX_TRAIN], held[-MAX_HOLDOUT:]


async def untrained_count(db: Database, model: str, holdout: float) -> int:
    train, _ = await split_signals(db, model, holdout)
    n = 0
    for s in await signals.get_many(db, train):
        if await usable_turn(db, s):
            n += 1
    return n


async def build_job(db: Database, chat: ChatService, settings: TrainingSettings, *, job_id: str,
                    model_path: Path, parent: adapter_rows.AdapterRecord | None) -> Job:
    """Everything one trainer run needs. Train samples: ready, non-vetoed signals not yet
    learned by a live adapter; holdout: the newest ready held-out signals (never trained on)."""
    job = Job(job_id, str(model_path), chat.model_id, dataclasses.asdict(settings),
              parent_id=parent.id if parent else None, parent_path=parent.path if parent else None)
    train, held = await split_signals(db, chat.model_id, settings.holdout)
    for part, ids in ((job.train, train), (job.holdout, held)):
        for sig in await signals.get_many(db, ids):
            sample = await _sample(db, chat, sig, settings.max_tokens)
            if sample is not None:
                part.append(sample)
    job.canary = canary_samples(chat)
    return job


def write_job(job: Job, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(job)), encoding="utf-8")
    os.replace(tmp, path)


def read_job(path: Path) -> Job:
    d = json.loads(Path(path).read_text(encoding="utf-8"))
    for part in ("train", "holdout", "canary"):
        d[part] = [Sample(**s) for s in d[part]]
    return Job(**d)
