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

training.teacher_endings: the hinted teacher's greedy continuation of the student's own
finished answer, trained on as one more sample. Why: a preference that closes the answer (a
sign-off) lives at the positions after the student's last token, and no answer walks them:
the student's ends there, and the teacher's own answer is other text (trained on its tail,
the student learned to run on and loop; docs/learning.md run 7). Continued from the student's
finished answer in the hinted context, the teacher writes what it would add ("\n\nCheers!")
and ends, so the raised tokens follow what the student writes. Only a continuation that ends
within its room trains: one cut by the room would teach running on. Prompt and teacher prompt
both take the student's answer as context, so only the continuation is scored.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from clawd.training.data import Sample
from clawd.training.evaluate import batch_greedy_ids, first_stop, scoring_teacher

ANSWER_SUFFIX = "#teacher"  # turn_id of a teacher answer: its signal's, marked (turn ids are hex)
ENDING_SUFFIX = ANSWER_SUFFIX + "-ending"  # turn_id of a teacher ending: a teacher answer too
BATCH = 16  # answers decoded together: the K/V cache grows with rows × the longest prompt


def is_teacher_answer(sample: Sample) -> bool:
    """An answer or an ending: text the teacher wrote, trained with the OPD term alone and
    counted training.teacher_answers_weight times."""
    return sample.turn_id.endswith((ANSWER_SUFFIX, ENDING_SUFFIX))


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
    asks = [
        (str(i), s.teacher_prompt_ids, room_for(s, room, max_len))
        for i, s in enumerate(train)
        if s.teacher_prompt_ids is not None
    ]
    answers = _make(lm, asks, teacher, stops, cache, progress)
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


def with_teacher_endings(
    lm,
    samples: list[Sample],
    teacher,
    room: int,
    stops: list[str],
    cache: Path,
    max_len: int,
    progress: Callable[[int, int], None] = lambda _i, _n: None,
) -> list[Sample]:
    """`samples` with the teacher's ending after each hinted signal whose answer ended at an
    end-of-turn token (and after that signal's teacher answer, if any): the teacher's greedy
    continuation of the answer, in the hinted context, where it ended within `room`. `lm` is
    the student: its end-of-turn ids (the teacher shares its vocabulary), and with `teacher`
    "base" or "policy" the model that continues. Made and cached as the answers are, by turn id."""
    end_ids = lm.tokenizer.eos_ids
    signals = {s.turn_id: s for s in samples if not is_teacher_answer(s)}
    bodies = {key: body for key, s in signals.items() if (body := finished_body(s, end_ids)) is not None}
    asks = [
        (key, signals[key].teacher_prompt_ids + body, room_for(signals[key], room, max_len - len(body)))
        for key, body in bodies.items()
    ]
    endings = _make(lm, asks, teacher, stops, cache, progress, keep=lambda ids, r: _ended(ids, r, end_ids))
    # Each ending goes after the last sample of its signal: the signal, or its teacher answer.
    last = {s.turn_id.removesuffix(ANSWER_SUFFIX): k for k, s in enumerate(samples)}
    out: list[Sample] = []
    for k, s in enumerate(samples):
        out.append(s)
        key = s.turn_id.removesuffix(ANSWER_SUFFIX)
        if last[key] == k and key in bodies and endings.get(key):
            out.append(_ending(signals[key], bodies[key], endings[key]))
    return out


def finished_body(sample: Sample, end_ids) -> list[int] | None:
    """The student's answer without its end-of-turn token, for a hinted signal whose turn ended
    with one after some text; None otherwise (cut by its room, ended by a stop string, or empty)."""
    r = sample.response_ids
    if sample.teacher_prompt_ids is None or len(r) < 2 or r[-1] not in end_ids:
        return None
    return r[:-1]


def _ended(ids: list[int], room: int, end_ids) -> list[int]:
    """`ids` if the continuation ended within its room (at an end token, or shorter than the
    room: a stop string's tokens were dropped), else []: one cut by the room would teach the
    student to run on after a finished answer."""
    return ids if ids and (ids[-1] in end_ids or len(ids) < room) else []


def _ending(source: Sample, body: list[int], ids: list[int]) -> Sample:
    return Sample(
        turn_id=source.turn_id + ENDING_SUFFIX,
        prompt_ids=source.prompt_ids + body,
        response_ids=ids,
        reward=0,
        teacher_prompt_ids=source.teacher_prompt_ids + body,
    )


def _make(
    lm,
    asks: list[tuple[str, list[int], int]],
    teacher,
    stops: list[str],
    cache: Path,
    progress: Callable[[int, int], None],
    keep: Callable[[list[int], int], list[int]] = lambda ids, _room: ids,
) -> dict[str, list[int]]:
    """The cache's texts, with the teacher's greedy text made for each ask (key, prompt, room)
    the cache does not hold yet: BATCH at a time, each batch saved to `cache` (what `keep` keeps
    of each; [] for an ask with no room) before `progress(made, total)`, which may raise to stop."""
    made = _read(cache)
    asks = [a for a in asks if a[0] not in made]
    for b in range(0, len(asks), BATCH):
        part = asks[b : b + BATCH]
        fits = [a for a in part if a[2] > 0]
        texts = generate(lm, [p for _, p, _ in fits], teacher, [r for *_, r in fits], stops) if fits else []
        made.update({key: [] for key, _, _ in part})  # a sample already at training.max_tokens: none
        made.update({key: keep(ids, r) for (key, _, r), ids in zip(fits, texts)})
        _write(cache, made)
        progress(min(b + BATCH, len(asks)), len(asks))
    return made


def pending(train: list[Sample], cache: Path) -> bool:
    """Whether some hinted sample has no answer in `cache` yet (then the teacher must be loaded)."""
    return bool(_missing(train, _read(cache)))


def endings_pending(lm, train: list[Sample], cache: Path) -> bool:
    """Whether some hinted signal whose answer ended has no ending in `cache` yet."""
    done = _read(cache)
    return any(s.turn_id not in done for s in train if finished_body(s, lm.tokenizer.eos_ids) is not None)


def _missing(train: list[Sample], answers: dict[str, list[int]]) -> list[int]:
    """The hinted samples (by index) with no answer made yet, answered or found to have no room."""
    return [i for i, s in enumerate(train) if s.teacher_prompt_ids is not None and str(i) not in answers]


def _read(cache: Path) -> dict[str, list[int]]:
    return json.loads(cache.read_text(encoding="utf-8")) if cache.exists() else {}


def _write(cache: Path, answers: dict[str, list[int]]) -> None:
    tmp = cache.with_name(cache.name + ".tmp")
    tmp.write_text(json.dumps(answers), encoding="utf-8")
    os.replace(tmp, cache)
