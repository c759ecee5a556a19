"""The clawd TUI: four screens (modes) over one daemon client, and the daemon's status.

Boundary: a pure HTTP client of the daemon. It imports nothing of clawd's engines or
training (tests/test_tui_boundaries.py); tui/client.py is the only module that knows URLs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from textual import work
from textual.app import App
from textual.binding import Binding
from textual.reactive import reactive

from tui.client import DaemonClient, DaemonError
from tui.screens.adapters import AdaptersScreen
from tui.screens.chat import ChatScreen
from tui.screens.learning import LearningScreen
from tui.screens.modals import ConfirmModal
from tui.screens.training import TrainingScreen

START_TIMEOUT_S = 120.0  # loading the model can take a while on a cold disk


class ClawdApp(App):
    CSS_PATH = "app.tcss"
    TITLE = "clawd"
    MODES = {"chat": ChatScreen, "learning": LearningScreen, "training": TrainingScreen, "adapters": AdaptersScreen}
    DEFAULT_MODE = "chat"
    BINDINGS = [
        Binding("f1", "switch_mode('chat')", "Chat"),
        Binding("f2", "switch_mode('learning')", "Learning"),
        Binding("f3", "switch_mode('training')", "Training"),
        Binding("f4", "switch_mode('adapters')", "Adapters"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    status: reactive[dict | None] = reactive(None)  # the last GET /clawd/status; None = not reachable

    def __init__(self, client: DaemonClient, *, start_daemon: Callable[[], None] | None = None, poll_s: float = 2.0):
        """`start_daemon` launches `clawd serve` in the background (given by `clawd chat`);
        without it the app can only say how to start the daemon."""
        super().__init__()
        self.client = client
        self.start_daemon = start_daemon
        self.poll_s = poll_s
        self.offered_start = False
        self._start_offer: ConfirmModal | None = None  # the "Start clawd?" question while it is open

    def on_mount(self) -> None:
        self.refresh_status()
        self.set_interval(self.poll_s, self.refresh_status)

    async def on_unmount(self) -> None:
        await self.client.aclose()

    @work(group="status", exclusive=True)
    async def refresh_status(self) -> None:
        try:
            self.status = await self.client.status()
            if self._start_offer is not None:
                # The daemon came up by itself (a service, another terminal): the question is stale.
                offer, self._start_offer = self._start_offer, None
                if offer.is_attached:
                    offer.dismiss(False)
                self.notify("clawd is running.", title="clawd")
            self.offered_start = False  # should it go away again, offer again
        except DaemonError:
            self.status = None
            if not self.offered_start:
                self.offered_start = True
                self.offer_start()

    def offer_start(self) -> None:
        url = self.client.base_url
        if self.start_daemon is None:
            self.notify(
                f"clawd is not running at {url}: start it with `clawd serve`.",
                title="clawd",
                severity="error",
                timeout=15,
            )
            return

        def chosen(yes: bool | None) -> None:
            self._start_offer = None
            if yes:
                self.launch_daemon()

        self._start_offer = ConfirmModal(
            f"clawd is not running at {url}.\n\nStart it now (`clawd serve` in the background)?",
            confirm="Start clawd",
            cancel="Not now",
        )
        self.push_screen(self._start_offer, chosen)

    @work(group="launch", exclusive=True)
    async def launch_daemon(self) -> None:
        self.notify("Starting clawd…", title="clawd")
        try:
            await asyncio.to_thread(self.start_daemon)
        except OSError as e:
            self.notify(f"could not start clawd: {e}", title="clawd", severity="error", timeout=15)
            return
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if await self.client.is_up():
                self.notify("clawd is running.", title="clawd")
                self.refresh_status()
                refresh = getattr(self.screen, "action_refresh", None)
                if refresh is not None:
                    refresh()
                return
            await asyncio.sleep(0.5)
        self.notify(
            "clawd did not come up: see `clawd service logs` or run `clawd serve` to see why.",
            title="clawd",
            severity="error",
            timeout=15,
        )
