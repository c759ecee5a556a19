"""Redraw the TUI screenshots in this folder (120x40 SVG) from fixed daemon answers.

    .venv/bin/python docs/screens/make_screens.py

They are the same pictures the snapshot tests check (tests/test_tui_snapshots.py), so a
change to the TUI shows up in both.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repo root: tests.tui_fixtures holds the fixed answers

from tests.tui_fixtures import SCREENS, fixed_client  # noqa: E402
from tui.app import ClawdApp  # noqa: E402


async def draw(name: str) -> Path:
    app = ClawdApp(fixed_client(), poll_s=3600)
    async with app.run_test(size=(120, 40)) as pilot:
        await SCREENS[name](pilot)
        return Path(app.save_screenshot(f"{name}.svg", str(HERE)))


def main() -> None:
    os.environ["TZ"] = "UTC"  # the adapters' times, as in the snapshot tests
    time.tzset()
    for name in SCREENS:
        print(asyncio.run(draw(name)).relative_to(HERE.parents[1]))


if __name__ == "__main__":
    main()
