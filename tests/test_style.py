"""One style, checked in the default test run: `ruff format` and `ruff check` as configured in
pyproject.toml ([tool.ruff]). Fix with `ruff format . && ruff check --fix .`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

PATHS = ["clawd", "tui", "tests", "benchmarks", "examples"]


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if exe is None:
        pytest.fail("ruff is not installed: it is in the test extra (pip install -e '.[test]')")
    return [exe]


def test_code_is_formatted():
    out = subprocess.run([*_ruff(), "format", "--check", *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, f"run `ruff format {' '.join(PATHS)}`:\n{out.stdout}{out.stderr}"


def test_lint_passes():
    out = subprocess.run(
        [*_ruff(), "check", "--output-format", "concise", *PATHS], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, f"ruff check:\n{out.stdout}{out.stderr}"
