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
the clip, and the gate judges the result as it judges any adapter. Each answer follows the
sample it answers, so a batch holds both. Answers are cached in the job dir: a resumed run
trains on the same ones without loading the teacher again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from clawd.training.data import Sample
from clawd.training.evaluate import batch_greedy_ids, first_stop, scoring_teacher

SUFFIX = "#teacher"  # turn_id of a teacher answer: its signal's, marked


def is_teacher_answer(sample: Sample) -> bool:
    return sample.turn_id.endswith(SUFFIX)


def answer_ids(ids: list[int], at_end_token: bool, decode, stops: list[str]) -> list[int]:
    """The answer's ids as a sample holds them: an end-of-turn token kept (the turn ended
    there), the tokens that spell a stop string dropped (the user never sees those)."""
    if at_end_token:
        return ids
    hit = first_stop(decode(ids), stops)
    if hit < 0:
        return ids
    ids = list(ids)
    while ids and len(decode(ids)) > hit:  # down to the text before the stop string
        ids.pop()
    return ids


def generate(lm, samples: list[Sample], teacher, max_tokens: int, stops: list[str]) -> list[list[int]] | None:
    """The teacher's greedy answer (ids) to each sample's hinted prompt, or None where the model's
    cache has no batched form (see batch_greedy_ids); an answer cut by `max_tokens` is kept:
    its first tokens, where an opening preference lives, are the teacher's all the same."""
    scorer, context = scoring_teacher(lm, teacher)
    decode = scorer.tokenizer.decode
    with context:
        rows = batch_greedy_ids(
            scorer,
            [s.teacher_prompt_ids for s in samples],
            max_tokens,
            lambda _i, ids: first_stop(decode(ids), stops) >= 0,
        )
    if rows is None:
        return None
    return [answer_ids(ids, ended, decode, stops) for ids, ended in rows]


def with_teacher_answers(
    lm, train: list[Sample], teacher, max_tokens: int, stops: list[str], cache: Path
) -> list[Sample]:
    """`train` with the teacher's answer after each hinted sample (cached in `cache`)."""
    hinted = [i for i, s in enumerate(train) if s.teacher_prompt_ids is not None]
    if cache.exists():
        answers = {int(i): ids for i, ids in json.loads(cache.read_text(encoding="utf-8")).items()}
    else:
        made = generate(lm, [train[i] for i in hinted], teacher, max_tokens, stops) if hinted else []
        answers = {i: ids for i, ids in zip(hinted, made or [])}
        tmp = cache.with_name(cache.name + ".tmp")
        tmp.write_text(json.dumps(answers), encoding="utf-8")
        os.replace(tmp, cache)
    out = []
    for i, s in enumerate(train):
        out.append(s)
        if answers.get(i):  # an answer that ended before any token teaches nothing
            out.append(
                Sample(
                    turn_id=s.turn_id + SUFFIX,
                    prompt_ids=s.prompt_ids,
                    response_ids=answers[i],
                    reward=0,
                    teacher_prompt_ids=s.teacher_prompt_ids,
                )
            )
    return out
