"""The TUI is a pure HTTP client (DESIGN.md boundaries): it loads no model runtime and no
clawd engine, and only tui/client.py knows the daemon's URLs."""

from __future__ import annotations

import re

from tests.conftest import ROOT
from tests.test_boundaries import loaded_after


def test_tui_imports_no_engine_or_training_library():
    mods = loaded_after(
        "import tui.app, tui.client, tui.screens.chat, tui.screens.learning, tui.screens.training, tui.screens.adapters"
    )
    assert "textual" in mods  # the probe really loaded the app
    assert mods.isdisjoint({"mlx", "mlx_lm", "llama_cpp"})
    assert "clawd" not in mods  # so not clawd.engines either: the TUI speaks JSON over HTTP


def test_only_the_client_knows_urls():
    route = re.compile(r"[\"'](/clawd/|/v1/)")
    holders = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tui").rglob("*.py") if route.search(p.read_text())}
    assert holders == {"tui/client.py"}
