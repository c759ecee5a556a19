"""Import boundaries from DESIGN.md, proven on a fresh interpreter's sys.modules."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

HEAVY = ("llama_cpp", "mlx", "mlx_lm", "textual", "tui", "fastapi", "uvicorn", "numpy")


def loaded_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys, json\nprint(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_cli_starts_without_heavy_libraries():
    # `clawd --help` and `clawd status` must be instant: nothing heavy at import time.
    assert loaded_after("import clawd.cli").isdisjoint(HEAVY)


def test_daemon_never_imports_the_tui_or_textual():
    mods = loaded_after("import clawd.daemon, clawd.api, clawd.chat, clawd.models, clawd.engines.fake")
    assert "textual" not in mods and "tui" not in mods
    assert "llama_cpp" not in mods  # loaded only when a llama.cpp engine is built
    # MLX lives in the trainer child: a crash or OOM in training can never take serving down,
    # and the daemon does not pay mlx_lm's ~1.6 s import or its memory.
    mods = loaded_after("import clawd.daemon, clawd.adapters, clawd.scheduler, clawd.jobs, clawd.training.data")
    assert mods.isdisjoint({"mlx", "mlx_lm"})


def test_engine_module_defers_llama_cpp_until_used():
    assert "llama_cpp" not in loaded_after("import clawd.engines.llamacpp")


# Every module the trainer child (`python -m clawd.training.run`) imports, its function-level
# imports included: the job file is its whole contract with the daemon.
TRAINER_CHILD = (
    "clawd.training.run",
    "clawd.training.data",
    "clawd.training.evaluate",
    "clawd.training.loss",
    "clawd.training.weights",
    "clawd.training.export",
    "clawd.training.blas",
)


def test_trainer_child_loads_nothing_of_the_daemon():
    probe = f"import {', '.join(TRAINER_CHILD)}\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    mods = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert set(TRAINER_CHILD) <= mods  # the probe really imported them
    daemon_side = {
        m
        for m in mods
        if m.split(".")[0] == "aiosqlite"
        or m in ("clawd.chat", "clawd.miner", "clawd.jobs", "clawd.served", "clawd.daemon", "clawd.api")
        or m.startswith("clawd.store")
    }
    assert not daemon_side
