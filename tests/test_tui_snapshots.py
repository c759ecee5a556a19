"""SVG snapshots of each TUI screen at 120x40 on fixed daemon answers (tests/tui_fixtures.py).
Update them after a deliberate change with `pytest tests/test_tui_snapshots.py --snapshot-update`
and look at the pictures (the same ones as docs/screens/)."""

from __future__ import annotations

import os
import time

import pytest

from tests.tui_fixtures import SCREENS, fixed_client
from tui.app import ClawdApp


@pytest.fixture
def utc():
    """The adapters' times are shown in local time: pin it."""
    old = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    yield
    if old is None:
        os.environ.pop("TZ")
    else:
        os.environ["TZ"] = old
    time.tzset()


@pytest.mark.parametrize("screen", sorted(SCREENS))
def test_screen(screen, snap_compare, utc):
    app = ClawdApp(fixed_client(), poll_s=3600)
    assert snap_compare(app, terminal_size=(120, 40), run_before=SCREENS[screen])
