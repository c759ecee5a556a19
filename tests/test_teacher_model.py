"""training.teacher = "model:NAME" (issue 16, item 2): the OPD teacher is another local model.

On tiny real GGUFs: the trainer's teacher arrays are an independent llama-cpp-python scoring of
the hinted context (student support and union support); a teacher whose vocabulary is not the
served model's is refused with one line naming why; the setting is parsed; and a daemon trains,
gates and promotes an adapter with a teacher model, or refuses the run with a 400."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from clawd.config import load_settings
from clawd.errors import ConfigError
from clawd.teacher_model import teacher_model_path
from clawd.training.data import Sample
from tests.conftest import TRAIN_ENV, make_env, start_daemon
from tests.test_training_loop import make_ready_signals, training, wait_run
from tests.test_training_weights import llamacpp_logprobs  # llama-cpp-python's own Llama: the reference
from tests.tiny_models import build_student_and_teacher, build_tiny_gguf

K = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A student, a bigger teacher with the same vocabulary, and two that have another one."""
    d = tmp_path_factory.mktemp("teachers")
    return {
        **build_student_and_teacher(d),
        "more-tokens": build_tiny_gguf(d / "more.gguf", seed=11, extra_tokens=["<|extra|>"]),
        "other-student": build_tiny_gguf(d / "other-student.gguf", seed=0, extra_tokens=["<|a|>"]),
        "other-tokens": build_tiny_gguf(d / "other-tokens.gguf", seed=11, extra_tokens=["<|b|>"]),
    }


def hinted_sample() -> Sample:
    rng = np.random.default_rng(3)
    prompt = [0] + rng.integers(2, 258, 20).tolist()
    hint = rng.integers(2, 258, 9).tolist()  # the hint's tokens, appended to the request
    return Sample("t1", prompt, rng.integers(2, 258, 14).tolist(), -1, prompt + hint)


@pytest.mark.parametrize("support", ["student", "union"])
def test_teacher_arrays_are_an_independent_llama_cpp_scoring_of_the_hinted_context(models, support):
    from clawd.training.evaluate import sample_views
    from clawd.training.weights import load_model

    s = hinted_sample()
    student, teacher = load_model(models["student"]), load_model(models["teacher"])
    view = sample_views(student, s, K, teacher, support)

    ref = llamacpp_logprobs(models["teacher"], s.teacher_prompt_ids + s.response_ids)
    rows = ref[len(s.teacher_prompt_ids) - 1 :]  # the rows that predict the response tokens
    assert rows.shape[0] == len(s.response_ids)
    support_ids = view["ids"][:, 1:]
    want = np.take_along_axis(rows, support_ids, axis=1)
    real = np.ones_like(want, bool) if view["mask"] is None else view["mask"].astype(bool)
    # Measured: ~5e-6 (F32 weights on both sides); padding columns of a union are not scored.
    np.testing.assert_allclose(view["teacher"][real], want[real], atol=1e-4)
    if support == "union":  # S_i ∪ T_i: the teacher's own top-k, as llama.cpp ranks it, is in it
        top = np.argsort(-rows, axis=1)[:, :K]
        for i in range(len(s.response_ids)):
            assert set(top[i]) <= set(support_ids[i][real[i]]), i
        assert real.sum() > support_ids.shape[0] * K  # the teacher ranked tokens the student did not
    # ... and it is the teacher model, not the student's base wearing the hint.
    base = sample_views(student, s, K, "base", "student")["teacher"]
    assert np.abs(base - view["teacher"][:, :K]).max() > 0.1


def test_a_vocabulary_is_its_token_list_whatever_the_weights_or_template(models, tmp_path):
    from clawd.modelfile import gguf_vocabulary

    student = gguf_vocabulary(models["student"])
    templated = build_tiny_gguf(tmp_path / "chat.gguf", seed=5, chat_template="{{ messages }}")
    assert gguf_vocabulary(models["teacher"]) == student == gguf_vocabulary(templated)
    assert student.tokens == 278
    assert len({gguf_vocabulary(models[m]).digest for m in ("student", "more-tokens", "other-tokens")}) == 3


def test_a_teacher_is_the_checked_gguf_and_base_or_policy_need_none(models):
    student = models["student"]
    assert teacher_model_path("base", student, None) is None
    assert teacher_model_path("policy", student, None) is None
    assert teacher_model_path(f"model:{models['teacher']}", student, None) == models["teacher"]


@pytest.mark.parametrize(
    ("student", "teacher", "why"),
    [
        (
            "student",
            "more-tokens",
            "more.gguf has another vocabulary than the served student.gguf (279 tokens against 278)",
        ),
        ("other-student", "other-tokens", "(the same 279 tokens in number, but not the same tokens)"),
    ],
)
def test_a_teacher_with_another_vocabulary_is_refused_naming_why(models, student, teacher, why):
    with pytest.raises(ConfigError) as e:
        teacher_model_path(f"model:{models[teacher]}", models[student], None)
    msg = e.value.message
    assert why in msg, msg
    assert "\n" not in msg and "same family" in msg


def test_a_missing_or_untrainable_teacher_or_a_directory_student_is_refused(models, tmp_path):
    student = models["student"]
    with pytest.raises(ConfigError, match="no model file at .*nowhere.gguf.*clawd models pull"):
        teacher_model_path(f"model:{tmp_path / 'nowhere.gguf'}", student, None)
    with pytest.raises(ConfigError, match="needs a GGUF served model"):
        teacher_model_path(f"model:{models['teacher']}", tmp_path, None)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    with pytest.raises(ConfigError, match="the trainer cannot load junk.gguf"):
        teacher_model_path(f"model:{junk}", student, None)


def test_the_setting_accepts_base_policy_and_model_name_only(tmp_path):
    def teacher(value: str) -> str:
        env = make_env(tmp_path, CLAWD_TRAINING_TEACHER=value)
        return load_settings(tmp_path / "config.toml", env).training.teacher

    assert teacher("base") == "base" and teacher(" policy ") == "policy"
    assert teacher("model:qwen2.5-coder-1.5b-instruct") == "model:qwen2.5-coder-1.5b-instruct"
    for bad in ("model:", "model:  ", "teacher", "gguf:x"):
        with pytest.raises(ConfigError, match="must be base, policy or model:NAME"):
            teacher(bad)


def teacher_daemon(clawd_home, student: Path, teacher: Path, **env):
    """A training daemon serving `student`, with `teacher` as training.teacher (and `env` on top)."""
    from clawd.engines.llamacpp import Engine

    engine = Engine(student, n_ctx=256, n_threads=1, model_id="tiny")
    return start_daemon(clawd_home, engine, {**TRAIN_ENV, "CLAWD_TRAINING_TEACHER": f"model:{teacher}", **env})


def test_a_daemon_trains_and_promotes_with_a_teacher_model(clawd_home, models):
    from clawd.store import adapters as adapter_rows

    d = teacher_daemon(clawd_home, models["student"], models["teacher"])
    try:
        make_ready_signals(d, 4)  # every other one hinted: OPD terms the teacher model scores
        training(d, "POST")
        st = wait_run(d)
        assert st["state"] == "idle" and st["result"]["promoted"], st
        rec = d.run(adapter_rows.get(d.state.db, st["result"]["adapter_id"]))
        assert rec.metrics["teacher"] == {"setting": f"model:{models['teacher']}", "model_path": str(models["teacher"])}
        assert rec.metrics["final"]["opd"] > 0  # the distillation term was there
    finally:
        d.stop()


def test_a_run_with_a_teacher_of_another_vocabulary_is_refused_with_a_400(clawd_home, models):
    d = teacher_daemon(clawd_home, models["student"], models["more-tokens"])
    try:
        make_ready_signals(d, 2)
        with d.client() as c:
            r = c.post("/clawd/training")
        assert r.status_code == 400, r.text
        assert "another vocabulary" in r.json()["error"]["message"]
        assert training(d)["state"] == "idle"  # nothing started, nothing lost
    finally:
        d.stop()
