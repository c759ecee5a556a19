"""The learning benchmark end to end on the real embedded 270M model (slow): one user, one
method, two optimizer steps, a tiny budget — so the harness cannot rot. It must drive a real
daemon through sessions, mining, a training run and the gate, and write its three outputs. And
(fast, tiny GGUF): the teacher column asks the teacher model when the run names one."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, make_env


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_short_learning_run_writes_json_table_and_plot(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/learning.py",
            "--users",
            "terse",
            "--methods",
            "hybrid",
            "--seeds",
            "0",
            "--steps",
            "2",
            "--batch",
            "2",
            "--epochs",
            "2",
            "--eval-prompts",
            "2",
            "--max-tokens",
            "16",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=make_env(tmp_path / "unused-home"),
        capture_output=True,
        text=True,
        timeout=850,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((out / "results.json").read_text())
    (arm,) = r["arms"]
    assert (arm["user"], arm["method"], arm["stopped"]) == ("terse", "hybrid", None)
    # Compliance before and after the one run (2 epochs = 2 optimizer steps), on 2 held-out prompts.
    assert [p["step"] for p in arm["curve"]] == [0, 2]
    assert all(len(p["answers"]) == 2 and 0 <= p["greedy"] <= 1 and 0 <= p["sampled"] <= 1 for p in arm["curve"])
    # ... and of the hinted base (the teacher) on the same prompts, the user's correction appended.
    teacher = arm["teacher"]["answers"]
    assert len(teacher) == 2 and all("[user's hint / instruction]" in a["prompt"] for a in teacher)
    # Every session became a mined signal; the sessions the detector failed carry the user's hint.
    assert len(arm["sessions"]) >= 2 and all(s["signal"] in ("ready", "empty") for s in arm["sessions"])
    for s in arm["sessions"]:
        assert s["reward"] == (1 if s["passed"] else -1), s
        assert bool(s["hint"]) == (not s["passed"]), s
    (run,) = arm["rounds"]
    assert run["steps"] == 2 and run["gate"]["kl_to_base"] >= 0 and "promoted" in run
    table = (out / "results.md").read_text()
    assert "| terse | hybrid | 1 |" in table and "Command: `clawd bench learning" in table
    if importlib.util.find_spec("matplotlib") is None:
        return  # the plot is optional (the bench extra)
    assert (out / "compliance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_teacher_column_asks_the_teacher_model_when_the_run_names_one(tmp_path):
    """With training.teacher = "model:PATH" the OPD teacher is that model, so the "teacher + hint"
    column must be its hinted answers, not the served student's (a daemon of its own serves it)."""
    from clawd.bench.learning import Budget, daemon_settings, measure_teacher_model, teacher_gguf
    from clawd.bench.users import resolve_user
    from tests.tiny_models import build_tiny_gguf

    teacher = build_tiny_gguf(tmp_path / "tiny-teacher.gguf", seed=11, n_layer=3, n_embd=96, n_ff=192)
    budget = Budget(eval_prompts=2, max_tokens=4, extra={"CLAWD_TRAINING_TEACHER": f"model:{teacher}"})
    assert teacher_gguf(daemon_settings("hybrid", budget)) == teacher
    assert teacher_gguf(daemon_settings("hybrid", Budget())) is None  # the served base teaches
    assert teacher_gguf(daemon_settings("hybrid-self", Budget())) is None  # the policy teaches

    point = measure_teacher_model(teacher, resolve_user("signoff"), budget, tmp_path / "teacher-home")
    assert point["model"] == "tiny-teacher"
    assert len(point["answers"]) == 2 and all("[user's hint / instruction]" in a["prompt"] for a in point["answers"])
    assert 0 <= point["greedy"] <= 1 and 0 <= point["sampled"] <= 1


def test_an_arm_asks_a_teacher_model_once_per_user_and_never_hints_the_student(tmp_path, monkeypatch):
    """The wiring in run_arm, with the daemon and the measurement faked (the real ones are the
    test above and the slow run): two methods of one user with a teacher model measure the
    teacher once, in a daemon serving the teacher, and ask the student only bare prompts."""
    from clawd.bench import learning
    from clawd.bench.users import resolve_user

    asked: list[tuple[str, str | int, bool]] = []

    class FakeDaemon:
        def __init__(self, home, settings, *, model=None):
            self.model_id = Path(model).stem

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def fake_measure(d, user, budget, step, hinted=None, hint_source="judge"):
        asked.append((d.model_id, step, hinted is not None))
        return {"step": step, "greedy": 0.5, "sampled": 0.25, "answers": []}

    monkeypatch.setattr(learning, "Daemon", FakeDaemon)
    monkeypatch.setattr(learning, "measure", fake_measure)
    teacher = tmp_path / "big-teacher.gguf"
    budget = learning.Budget(steps=0, extra={"CLAWD_TRAINING_TEACHER": f"model:{teacher}"})
    user, teachers, arms = resolve_user("signoff"), {}, []
    for method in ("hybrid", "opd"):
        arm = {"user": user.name, "method": method, "seed": 0}
        learning.run_arm(
            arm, user, budget, tmp_path / method, tmp_path / "student.gguf", tmp_path, lambda: None, teachers
        )
        arms.append(arm)

    assert asked == [
        ("big-teacher", "teacher", True),  # once, before the first arm's student daemon
        ("student", 0, False),
        ("student", 0, False),
    ]
    assert all(a["teacher"]["model"] == "big-teacher" for a in arms)


def test_a_teacher_model_with_a_self_method_is_refused(tmp_path):
    """-self methods teach with the active adapter; a --set teacher would silently replace it."""
    proc = subprocess.run(
        [sys.executable, "benchmarks/learning.py", "--users", "terse", "--methods", "hybrid,hybrid-self",
         "--set", "CLAWD_TRAINING_TEACHER=model:/x.gguf", "--out", str(tmp_path / "out")],
        cwd=ROOT, env=make_env(tmp_path / "home"), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1 and "conflicts with hybrid-self" in proc.stderr, proc.stderr
