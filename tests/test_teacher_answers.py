"""training.teacher_answers: the hinted teacher's own greedy answer as one more sample, and
training.teacher_endings: its continuation of the student's finished answer (issue 16).

Each is checked against llama-cpp-python's own greedy decoding of the teacher GGUF in the
hinted context (an independent engine), its place in the training list and its cache, how a
stop string and an end token are kept; the answers in a daemon run that trains on them, the
endings in the trainer's prepare phase (the tiny models' turns seldom end at the end token)."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest

from clawd.training.data import Sample
from tests.test_teacher_model import teacher_daemon
from tests.test_training_loop import make_ready_signals, training, wait_run
from tests.tiny_models import build_student_and_teacher

ROOM = 10  # tokens of the teacher's answer
MAX_LEN = 512  # training.max_tokens


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return build_student_and_teacher(tmp_path_factory.mktemp("teacher-answers"))


def llamacpp_greedy(path: Path, prompt: list[int], max_tokens: int, end_ids) -> list[int]:
    """llama-cpp-python's greedy continuation (F32 K/V), the end token included if it comes."""
    import llama_cpp

    llm = llama_cpp.Llama(
        str(path), n_ctx=256, n_threads=1, logits_all=True, type_k=0, type_v=0, flash_attn=False, verbose=False
    )
    out: list[int] = []
    llm.eval(prompt)
    for _ in range(max_tokens):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(tok)
        if tok in end_ids:
            break
        llm.eval([tok])
    return out


def samples() -> list[Sample]:
    rng = np.random.default_rng(4)
    out = []
    for i in range(3):
        prompt = [0] + rng.integers(2, 258, 12 + 3 * i).tolist()
        hint = rng.integers(2, 258, 6).tolist()
        hinted = prompt + hint if i != 1 else None  # the second has no hint: no answer follows it
        out.append(Sample(f"t{i}", prompt, rng.integers(2, 258, 5).tolist(), -1 if hinted else 1, hinted))
    return out


def test_each_hinted_sample_is_followed_by_the_teacher_models_greedy_answer(models, tmp_path):
    from clawd.training.teacher_answers import is_teacher_answer, with_teacher_answers
    from clawd.training.weights import load_model

    student, teacher = load_model(models["student"]), load_model(models["teacher"])
    train = samples()
    cache = tmp_path / "teacher-answers.json"
    out = with_teacher_answers(student, train, teacher, ROOM, [], cache, MAX_LEN)

    assert [s.turn_id for s in out] == ["t0", "t0#teacher", "t1", "t2", "t2#teacher"]
    assert [is_teacher_answer(s) for s in out] == [False, True, False, False, True]
    for source, answer in ((out[0], out[1]), (out[3], out[4])):
        # trained in the student's own prompt, with the hint's OPD term only
        assert answer.prompt_ids == source.prompt_ids and answer.teacher_prompt_ids == source.teacher_prompt_ids
        assert answer.reward == 0
        want = llamacpp_greedy(models["teacher"], source.teacher_prompt_ids, ROOM, teacher.tokenizer.eos_ids)
        assert answer.response_ids == want
        assert 1 <= len(answer.response_ids) <= ROOM
    # ... the teacher model's answer, not the student's base wearing the hint
    own = {s.turn_id: s for s in with_teacher_answers(student, train, "base", ROOM, [], tmp_path / "b.json", MAX_LEN)}
    assert own["t0#teacher"].response_ids != out[1].response_ids

    # A resumed run reads the cache: the same samples without a teacher to generate with.
    assert with_teacher_answers(None, train, None, ROOM, [], cache, MAX_LEN) == out


def test_one_at_a_time_small_batches_and_a_resume_give_the_same_answers(models, tmp_path, monkeypatch):
    """A model whose cache has no batched form answers one prompt at a time, BATCH bounds the rows
    decoded together, and a run stopped after its first batch keeps it and makes only the rest."""
    from clawd.training import evaluate, teacher_answers
    from clawd.training.weights import load_model

    teacher = load_model(models["teacher"])
    train = samples()
    batched = teacher_answers.with_teacher_answers(teacher, train, "base", ROOM, [], tmp_path / "a.json", MAX_LEN)

    monkeypatch.setattr(evaluate, "_batch_cache", lambda *_a: None)
    alone = teacher_answers.with_teacher_answers(teacher, train, "base", ROOM, [], tmp_path / "b.json", MAX_LEN)
    assert alone == batched

    monkeypatch.setattr(teacher_answers, "BATCH", 1)

    def stop(made: int, total: int) -> None:
        assert total == 2
        raise KeyboardInterrupt  # the trainer's StopRequested, as run.prepare_all's progress raises it

    cache = tmp_path / "c.json"
    with pytest.raises(KeyboardInterrupt):
        teacher_answers.with_teacher_answers(teacher, train, "base", ROOM, [], cache, MAX_LEN, stop)
    assert teacher_answers.pending(train, cache)  # one of the two made and kept
    asked = []
    monkeypatch.setattr(teacher_answers, "generate", lambda lm, part, *a: asked.append(part) or [[7, 7]])
    resumed = teacher_answers.with_teacher_answers(teacher, train, "base", ROOM, [], cache, MAX_LEN)
    assert asked == [[train[2].teacher_prompt_ids]]  # only the missing one
    assert resumed[:2] == batched[:2] and resumed[-1].response_ids == [7, 7]
    assert not teacher_answers.pending(train, cache)


def test_an_answer_that_meets_an_end_token_ends_there_and_keeps_it(models, tmp_path, monkeypatch):
    """Batched greedy ids stop a row at an end-of-turn token and keep it last, as a turn that
    ended does; the other rows run on (the ending row leaves the batch)."""
    from clawd.training import teacher_answers
    from clawd.training.weights import GGUFTokenizer, load_model

    teacher = load_model(models["teacher"])
    train = samples()
    free = teacher_answers.with_teacher_answers(teacher, train, "base", ROOM, [], tmp_path / "a.json", MAX_LEN)
    first = free[1].response_ids
    end = first[3]  # make t0's fourth token the end-of-turn token
    assert end not in first[:3]
    monkeypatch.setattr(GGUFTokenizer, "eos_ids", property(lambda _self: frozenset({end})))
    out = teacher_answers.with_teacher_answers(teacher, train, "base", ROOM, [], tmp_path / "b.json", MAX_LEN)
    by_id = {s.turn_id: s.response_ids for s in out}
    assert by_id["t0#teacher"] == first[:4]  # ended at the end token, and holds it
    other = {s.turn_id: s.response_ids for s in free}["t2#teacher"]
    want = other[: other.index(end) + 1] if end in other else other
    assert by_id["t2#teacher"] == want  # the other row: unchanged up to its own end, if any


def test_an_answer_stays_within_training_max_tokens(models, tmp_path):
    from clawd.training.teacher_answers import with_teacher_answers
    from clawd.training.weights import load_model

    teacher = load_model(models["teacher"])
    train = samples()
    longest = len(train[2].teacher_prompt_ids)  # t2's hinted prompt is the longer one
    out = with_teacher_answers(teacher, train, "base", ROOM, [], tmp_path / "a.json", longest + 3)
    by_id = {s.turn_id: s for s in out}
    assert 1 <= len(by_id["t0#teacher"].response_ids) <= ROOM
    assert len(by_id["t2#teacher"].response_ids) == 3  # cut to what training.max_tokens leaves
    out = with_teacher_answers(teacher, train, "base", ROOM, [], tmp_path / "b.json", len(train[0].teacher_prompt_ids))
    assert [s.turn_id for s in out] == ["t0", "t1", "t2"]  # no room left for any answer


def test_an_answer_keeps_its_end_token_and_loses_a_stop_strings_tokens():
    from clawd.training.teacher_answers import answer_ids

    words = {1: "Paris", 2: ".", 3: "\n", 4: "User", 5: ":", 9: "<end>"}

    def decode(ids):
        return "".join(words[i] for i in ids)

    assert answer_ids([1, 2, 9], True, decode, ["\nUser:"]) == [1, 2, 9]  # ended at the end token
    assert answer_ids([9], True, decode, []) == []  # said nothing: it would teach ending the turn at once
    assert answer_ids([1, 2, 3, 4, 5], False, decode, ["\nUser:"]) == [1, 2]  # the stop string is not said
    assert answer_ids([1, 2, 3], False, decode, ["\nUser:"]) == [1, 2, 3]  # cut by the room: kept as is


@pytest.mark.parametrize("weight", [1.0, 0.5])
def test_a_daemon_run_trains_on_the_teacher_answers(clawd_home, models, weight):
    from clawd.store import adapters as adapter_rows

    # One batch (batch size 16): every step sees the signals and the answers.
    env = {
        "CLAWD_TRAINING_TEACHER_ANSWERS": 6,
        "CLAWD_TRAINING_BATCH_SIZE": 16,
        "CLAWD_TRAINING_TEACHER_ANSWERS_WEIGHT": weight,
    }
    d = teacher_daemon(clawd_home, models["student"], models["teacher"], **env)
    try:
        make_ready_signals(d, 4)  # every other one hinted
        training(d, "POST")
        st = wait_run(d)
        assert st["state"] == "idle" and st["result"]["promoted"], st
        rec = d.run(adapter_rows.get(d.state.db, st["result"]["adapter_id"]))
        assert rec.metrics["samples"] == 4 and rec.metrics["teacher_answers"] == 2
        assert len(rec.signals) == 4  # the teacher's answers are no signals: only these are marked trained
        assert rec.gate["judged_on"] == "train" and rec.gate["n"] == 4  # ... nor what the gate judges
        # the step took the two answers too: 4 signals (each with its reward) + 2 answers (OPD
        # only), each answer counted training.teacher_answers_weight times
        assert rec.metrics["final"]["n_samples"] == 4 + 2 * weight
    finally:
        d.stop()


def ended_at(models, monkeypatch) -> tuple[list[Sample], list[int], int]:
    """samples() where t0 and t1 ended their turn (t1 has no hint) and t2 was cut, with the end
    token chosen as one the teacher writes at least 2 tokens into its continuation of t0's
    answer: (those samples, llama-cpp-python's greedy continuation of t0 with no end token, the
    end token's index in it)."""
    from clawd.training.weights import GGUFTokenizer

    train = samples()
    t0 = train[0]
    free = llamacpp_greedy(models["teacher"], t0.teacher_prompt_ids + t0.response_ids, ROOM, ())
    at = next(j for j in range(2, ROOM - 1) if free[j] not in free[:j])
    end = free[at]
    monkeypatch.setattr(GGUFTokenizer, "eos_ids", property(lambda _self: frozenset({end})))
    ended = [replace(s, response_ids=s.response_ids + [end]) for s in train[:2]] + train[2:]
    return ended, free, at


def test_a_finished_answer_is_continued_by_the_teacher_model_in_the_hinted_context(models, tmp_path, monkeypatch):
    from clawd.training.teacher_answers import endings_pending, is_teacher_answer, with_teacher_endings
    from clawd.training.weights import load_model

    student, teacher = load_model(models["student"]), load_model(models["teacher"])
    train, free, at = ended_at(models, monkeypatch)
    cache = tmp_path / "teacher-endings.json"
    assert endings_pending(student, train, cache)
    out = with_teacher_endings(student, train, teacher, ROOM, [], cache, MAX_LEN)

    # t1 ended but has no hint, t2 has a hint but was cut: only t0 is continued
    assert [s.turn_id for s in out] == ["t0", "t0#teacher-ending", "t1", "t2"]
    source, ending = out[0], out[1]
    body = source.response_ids[:-1]  # the student's answer without its end token
    assert ending.prompt_ids == source.prompt_ids + body
    assert ending.teacher_prompt_ids == source.teacher_prompt_ids + body
    assert ending.reward == 0 and is_teacher_answer(ending)  # the OPD term alone, weighted as an answer
    assert ending.response_ids == free[: at + 1]  # the teacher GGUF's greedy text, ended and holding the end

    # A resumed run reads the cache: the same samples without a teacher to generate with.
    assert not endings_pending(student, train, cache)
    assert with_teacher_endings(student, train, None, ROOM, [], cache, MAX_LEN) == out


def test_an_ending_follows_the_signals_teacher_answer_and_needs_room(models, tmp_path, monkeypatch):
    from clawd.training import teacher_answers
    from clawd.training.teacher_answers import with_teacher_endings
    from clawd.training.weights import load_model

    student, teacher = load_model(models["student"]), load_model(models["teacher"])
    train, free, at = ended_at(models, monkeypatch)
    answer = Sample("t0#teacher", train[0].prompt_ids, [9, 9], 0, train[0].teacher_prompt_ids)
    cache = tmp_path / "e.json"
    out = with_teacher_endings(student, [train[0], answer, *train[1:]], teacher, ROOM, [], cache, MAX_LEN)
    assert [s.turn_id for s in out] == ["t0", "t0#teacher", "t0#teacher-ending", "t1", "t2"]
    assert out[2].response_ids == free[: at + 1]

    # training.max_tokens bounds prompt, answer and ending together: exactly room for the
    # ending's at + 1 tokens, it is made; one less, and the room cuts it, so none.
    t0 = train[0]
    fits = max(len(t0.prompt_ids), len(t0.teacher_prompt_ids)) + len(t0.response_ids) - 1 + at + 1
    out = with_teacher_endings(student, train, teacher, ROOM, [], tmp_path / "f.json", fits)
    assert [s.turn_id for s in out] == ["t0", "t0#teacher-ending", "t1", "t2"]
    out = with_teacher_endings(student, train, teacher, ROOM, [], tmp_path / "g.json", fits - 1)
    assert [s.turn_id for s in out] == ["t0", "t1", "t2"]
    # A room that cuts the continuation before its end: none (it would teach running on), kept
    # as none in the cache so that a resume does not ask again.
    cache = tmp_path / "h.json"
    out = with_teacher_endings(student, train, teacher, at, [], cache, MAX_LEN)
    assert [s.turn_id for s in out] == ["t0", "t1", "t2"]
    assert json.loads(cache.read_text()) == {"t0": []}
    # With no room at all under training.max_tokens the teacher is not asked.
    asked = []
    monkeypatch.setattr(teacher_answers, "generate", lambda lm, part, *a: asked.append(part) or [])
    none = max(len(t0.prompt_ids), len(t0.teacher_prompt_ids)) + len(t0.response_ids) - 1
    out = with_teacher_endings(student, train, teacher, ROOM, [], tmp_path / "i.json", none)
    assert [s.turn_id for s in out] == ["t0", "t1", "t2"] and asked == []


def test_only_a_continuation_that_ended_trains():
    from clawd.training.teacher_answers import _ended, finished_body

    end = {9}
    hinted = Sample("t", [1], [4, 5, 9], -1, [1, 2])
    assert finished_body(hinted, end) == [4, 5]
    assert finished_body(replace(hinted, teacher_prompt_ids=None), end) is None  # no hint
    assert finished_body(replace(hinted, response_ids=[4, 5]), end) is None  # cut, or ended at a stop string
    assert finished_body(replace(hinted, response_ids=[9]), end) is None  # said nothing
    assert _ended([7, 9], 4, end) == [7, 9]  # ended at the end token
    assert _ended([7, 8], 4, end) == [7, 8]  # shorter than its room: a stop string's tokens were dropped
    assert _ended([7, 8, 7, 8], 4, end) == []  # cut by the room
    assert _ended([], 4, end) == []


def test_prepare_all_makes_the_endings_and_loads_the_teacher_only_while_some_are_missing(models, tmp_path, monkeypatch):
    from clawd.config import TrainingSettings
    from clawd.training import run
    from clawd.training.data import Job
    from clawd.training.weights import load_model

    train, free, at = ended_at(models, monkeypatch)
    settings = TrainingSettings(teacher="model:teacher", teacher_answers=ROOM, teacher_endings=ROOM, w_opd=1.0)
    job = Job("j", str(models["student"]), "m", asdict(settings), train=train)
    job.teacher_model_path = str(models["teacher"])
    student = load_model(models["student"])
    run.attach_lora(student, settings, None)
    loads = []
    real_load = run.load_teacher
    monkeypatch.setattr(run, "load_teacher", lambda *a: loads.append(1) or real_load(*a))

    samples, prep, _held = run.prepare_all(student, job, tmp_path, tmp_path / "cache", lambda _i, _n: None)
    ids = ["t0", "t0#teacher", "t0#teacher-ending", "t1", "t2", "t2#teacher"]
    assert [s.turn_id for s in samples] == ids
    assert samples[2].response_ids == free[: at + 1] and len(prep) == len(ids) and loads == [1]
    # resumed with everything cached: no teacher; with the endings lost: the teacher again
    assert run.prepare_all(student, job, tmp_path, tmp_path / "cache", lambda _i, _n: None)[0] == samples
    assert loads == [1]
    (tmp_path / "teacher-endings.json").unlink()
    assert run.prepare_all(student, job, tmp_path, tmp_path / "cache", lambda _i, _n: None)[0] == samples
    assert loads == [1, 1]
