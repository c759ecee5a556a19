"""training.teacher_answers: the hinted teacher's own greedy answer to each hinted training
sample, trained on as one more sample (issue 16).

Why: on-policy distillation scores the teacher only along the answer the student sampled. A
preference that takes two tokens the student never writes gets a signal at the first alone:
teacher-weighted distillation raised Qwen 0.5B's P("In") at the first position from 0.006 to
0.34, but P("short" | "In") stayed at 0.001 (the teacher's 0.986) for as long as the student's
own answers did not open with "In" (docs/learning.md). The teacher's answer walks those
positions: scored along it, the support and the teacher's weights there pull the student
toward each token the teacher writes, the "short" after "In" and the "Cheers" after the last
line included.

The answer trains with the hint's OPD term only (reward 0: no RL term, the user judged the
student's answer, not this one), in the student's own prompt, so its π_old, support and
teacher arrays come from run.prepare exactly as for a sampled answer. It is off-policy, so
the ratio clip binds on its low-probability tokens after the first step; that is the point of
the clip, and the gate judges the result as it judges any adapter. Each answer is placed right
after the sample it answers (the same batch, unless that sample closes one). Answers are
cached in the job dir as they are made: a stopped run keeps them, and a resumed one makes only
the missing ones, or none and then loads no teacher.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from clawd.training.data import Sample
from clawd.training.evaluate import batch_greedy_ids, first_stop, scoring_teacher

ANSWER_SUFFIX = "#teacher"  # turn_id of a teacher answer: its signal's, marked (turn ids are hex)
BATCH = 16  # answers decoded together: the K/V cache grows with rows × the longest prompt


def is_teacher_answer(sample: Sample) -> bool:
    return sample.turn_id.endswith(ANSWER_SUFFIX)


def answer_ids(ids: list[int], at_end_token: bool, decode, stops: list[str]) -> list[int]:
    """The answer's ids as a sample holds them: an end-of-turn token kept (the turn ended
    there), the tokens that spell a stop string dropped (the user never sees those; a token
    that holds text and the stop's start goes with it). [] for an answer that says nothing:
    training on it would teach to end the turn at once."""
    if at_end_token:
        return ids if decode(ids[:-1]).strip() else []
    hit = first_stop(decode(ids), stops)
    if hit >= 0:
        ids = list(ids)
        while ids and len(decode(ids)) > hit:
            ids.pop()
    return ids if decode(ids).strip() else []


def room_for(sample: Sample, room: int, max_len: int) -> int:
    """Tokens its answer may take: `room`, less what would take the sample past training.max_tokens
    (jobs.fit cut the prompts to fit the student's answer, not this one)."""
    return min(room, max_len - max(len(sample.prompt_ids), len(sample.teacher_prompt_ids or [])))


def generate(lm, prompts: list[list[int]], teacher, room: list[int], stops: list[str]) -> list[list[int]]:
    """The greedy answer (ids) of `teacher` (see evaluate.scoring_teacher) to each prompt, each
    within its room; an answer cut by its room is kept: its first tokens, where an opening
    preference lives, are the teacher's all the same. Also makes the base's answers to the
    training.w_kl_base prompts (kl_anchor.base_answers)."""
    scorer, context = scoring_teacher(lm, teacher)
    decode = scorer.tokenizer.decode

    def full(ids: list[int], limit: int) -> bool:
        return len(ids) >= limit or (bool(stops) and first_stop(decode(ids), stops) >= 0)

    with context:
        rows = batch_greedy_ids(scorer, prompts, max(room), lambda i, ids: full(ids, room[i]))
        if rows is None:  # a cache with no batched form: one at a time
            rows = [
                batch_greedy_ids(scorer, [p], r, lambda _i, ids, r=r: full(ids, r))[0] for p, r in zip(prompts, room)
            ]
    return [answer_ids(ids, ended, decode, stops) for ids, ended in rows]


def with_teacher_answers(
    lm,
    train: list[Sample],
    teacher,
    room: int,
    stops: list[str],
    cache: Path,
    max_len: int,
    progress: Callable[[int, int], None] = lambda _i, _n: None,
) -> list[Sample]:
    """`train` with the teacher's answer after each hinted sample. Answers are made BATCH at a
    time, each batch saved to `cache` before `progress(made, total)` (which may raise to stop)."""
    answers = _read(cache)
    todo = _missing(train, answers)
    for b in range(0, len(todo), BATCH):
        part = todo[b : b + BATCH]
        fits = [(i, r) for i in part if (r := room_for(train[i], room, max_len)) > 0]
        made = (
            generate(lm, [train[i].teacher_prompt_ids for i, _ in fits], teacher, [r for _, r in fits], stops)
            if fits
            else []
        )
        answers.update({str(i): [] for i in part})  # a sample already at training.max_tokens: none
        answers.update({str(i): ids for (i, _), ids in zip(fits, made)})
        _write(cache, answers)
        progress(min(b + BATCH, len(todo)), len(todo))
    out = []
    for i, s in enumerate(train):
        out.append(s)
        if answers.get(str(i)):
            out.append(
                Sample(
                    turn_id=s.turn_id + ANSWER_SUFFIX,
                    prompt_ids=s.prompt_ids,
                    response_ids=answers[str(i)],
                    reward=0,
                    teacher_prompt_ids=s.teacher_prompt_ids,
                )
            )
    return out


def pending(train: list[Sample], cache: Path) -> bool:
    """Whether some hinted sample has no answer in `cache` yet (then the teacher must be loaded)."""
    return bool(_missing(train, _read(cache)))


def _missing(train: list[Sample], answers: dict[str, list[int]]) -> list[int]:
    """The hinted samples (by index) with no answer made yet, answered or found to have no room."""
    return [i for i, s in enumerate(train) if s.teacher_prompt_ids is not None and str(i) not in answers]


def _read(cache: Path) -> dict[str, list[int]]:
    return json.loads(cache.read_text(encoding="utf-8")) if cache.exists() else {}


def _write(cache: Path, answers: dict[str, list[int]]) -> None:
    tmp = cache.with_name(cache.name + ".tmp")
    tmp.write_text(json.dumps(answers), encoding="utf-8")
    os.replace(tmp, cache)
