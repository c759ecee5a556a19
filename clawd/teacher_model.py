"""training.teacher = "model:NAME": the OPD teacher is another local model (issue 16).

Boundary: the daemon's side only. It turns the setting into the teacher's GGUF (a path, or a
name from `clawd models list`) and refuses, in one line that says why and what to do, a
teacher the trainer could not use: a missing file, an architecture the trainer cannot load,
or a vocabulary that is not the served model's. OPD compares the teacher's and the student's
log-probs of the same token ids, so the ids must mean the same tokens in both. The trainer
child loads the file (training/run.load_teacher); this module never loads weights.
"""

from __future__ import annotations

from pathlib import Path

from clawd.errors import ConfigError
from clawd.model_registry import second_model_path
from clawd.modelfile import gguf_vocabulary, why_untrainable
from clawd.paths import Paths

PREFIX = "model:"


def teacher_model_path(teacher: str, student: Path, paths: Paths | None) -> Path | None:
    """The GGUF of a "model:NAME" teacher, checked against the served model `student`; None
    for "base" and "policy" (the student's own weights). Raises ConfigError naming the
    problem. Costs a header read of each file (~0.2 s for a 150k-token vocabulary)."""
    if not teacher.startswith(PREFIX):
        return None
    name = teacher[len(PREFIX) :].strip()
    where = f"training.teacher = {teacher!r}"
    path = second_model_path(name, paths, role="teacher")
    if not path.is_file():
        raise ConfigError(
            f"{where}: no model file at {path}; pull one (`clawd models pull NAME`), add one "
            "(`clawd models add FILE`), or give the GGUF's path"
        )
    if not student.is_file():
        raise ConfigError(
            f"{where}: a teacher model needs a GGUF served model, and {student} is a model directory; "
            "use training.teacher = base or policy"
        )
    problem = why_untrainable(path)
    if problem:
        raise ConfigError(f"{where}: the trainer cannot load {path.name}: {problem}")
    try:
        theirs, ours = gguf_vocabulary(path), gguf_vocabulary(student)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: cannot read the vocabulary of {path.name} or {student.name}: {e}") from e
    if theirs != ours:
        how = (
            f"{theirs.tokens:,} tokens against {ours.tokens:,}"
            if theirs.tokens != ours.tokens
            else f"the same {ours.tokens:,} tokens in number, but not the same tokens"
        )
        raise ConfigError(
            f"{where}: {path.name} has another vocabulary than the served {student.name} ({how}); "
            "a teacher scores the student's token ids, so it must share the student's tokenizer "
            "(e.g. a bigger model of the same family)"
        )
    return path
