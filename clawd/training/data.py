"""The job file: the whole contract between the daemon and `python -m clawd.training.run`.

Boundary: a job is one JSON file, written atomically by the daemon (clawd/jobs.py builds it)
and read by the trainer child. It holds token ids only — the very ids the served model
sampled, and teacher prompts tokenized by the served model's own tokenizer with the same
template — so the trainer never re-tokenizes anything (METHOD §1). This module imports no
database, chat or miner code: the trainer child loads it and nothing of the daemon.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from clawd.config import TrainingSettings

STOPPED = 75  # the trainer's exit code for "stopped at a checkpoint on request; run again to resume"
DEFAULT_TOP_K = 4  # top-k of a job file written before jobs carried it (MiningSettings.top_k's default)


@dataclass
class Sample:
    turn_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    reward: int = 0  # METHOD §2: +1 / -1 / 0 (0 = no RL term)
    teacher_prompt_ids: list[int] | None = None  # the prompt with the selected hint; None = no OPD term


@dataclass
class TurnEnd:
    """How the served model's turns end, for the gate's turn-end check (training/evaluate.py):
    greedy canary answers end at an end-of-turn token or at one of `stops`, and none may show
    any of `markers` (template text: role markers, the transcript preamble) that the parent's
    answer did not, compared where either answer ended (evaluate.new_leaks)."""

    stops: list[str] = field(default_factory=list)
    markers: list[str] = field(default_factory=list)
    # A canary answer is one short sentence, but a lesson for longer answers makes it two or
    # three: at 32 tokens Qwen2.5-0.5B's own two sentences on bees were cut and counted as not
    # ended. 128 leaves room for a paragraph; answers that end early leave the batch, so an
    # adapter that still ends its turns costs no more.
    max_tokens: int = 128


@dataclass
class QAQuestion:
    """One question of the capability canary (training/qa.py), tokenized by the daemon with
    the served model's template, and the answers that count as right."""

    prompt_ids: list[int]
    accepted: list[str]


@dataclass
class Job:
    id: str
    model_path: str
    model: str  # the served model id the adapter belongs to
    config: dict  # TrainingSettings as a dict
    train: list[Sample] = field(default_factory=list)
    holdout: list[Sample] = field(default_factory=list)
    canary: list[Sample] = field(default_factory=list)
    # training.w_kl_base > 0: the everyday prompts (kl_anchor.ANCHOR_PROMPTS) in the served
    # model's template, prompt only (the trainer has the base answer them). Empty: off.
    anchor: list[Sample] = field(default_factory=list)
    parent_id: str | None = None  # continue from this adapter (the active one), None = from base
    parent_path: str | None = None
    created_at: float = field(default_factory=time.time)
    top_k: int = DEFAULT_TOP_K  # mining.top_k: the student's top-k per position for OPD (METHOD §4)
    turn_end: TurnEnd | None = None  # None: a job file written before the gate checked turn ends
    qa: list[QAQuestion] = field(default_factory=list)  # empty: no QA canary (off, or an older job file)
    # The parent's per-question QA results from its own gate, when it was asked these very
    # questions: the gate then asks only the candidate. None: the gate asks the parent too.
    parent_qa: list[bool] | None = None
    qa_fingerprint: str | None = None  # jobs.qa_fingerprint: kept in the gate's result for the next job
    # training.teacher = "model:NAME": the teacher's GGUF, resolved and its vocabulary checked
    # against the served model's by the daemon (clawd/teacher_model.py). None for base / policy.
    teacher_model_path: str | None = None

    @property
    def settings(self) -> TrainingSettings:
        return TrainingSettings(**self.config)


def write_job(job: Job, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(job)), encoding="utf-8")
    os.replace(tmp, path)


def read_job(path: Path) -> Job:
    d = json.loads(Path(path).read_text(encoding="utf-8"))
    for part in ("train", "holdout", "canary", "anchor"):
        d[part] = [Sample(**s) for s in d.get(part, [])]
    if d.get("turn_end") is not None:
        d["turn_end"] = TurnEnd(**d["turn_end"])
    d["qa"] = [QAQuestion(**q) for q in d.get("qa", [])]
    return Job(**d)
