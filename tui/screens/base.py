"""What every main screen shares: the daemon client, and failures as notifications."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

from textual.screen import Screen
from textual.widgets import DataTable

from tui.client import DaemonClient, DaemonError

T = TypeVar("T")


class ClawdScreen(Screen):
    @property
    def client(self) -> DaemonClient:
        return self.app.client

    async def attempt(self, call: Awaitable[T], done: str | None = None) -> T | None:
        """Await a daemon call; a failure becomes an error notification and None (never a crash)."""
        try:
            result = await call
        except DaemonError as e:
            self.notify(str(e), title="clawd", severity="error", timeout=8)
            return None
        if done:
            self.notify(done, title="clawd")
        return result


def cursor_key(table: DataTable) -> str | None:
    """The key of the row under the table's cursor (None for an empty table)."""
    if not table.row_count:
        return None
    return table.coordinate_to_cell_key((table.cursor_row, 0)).row_key.value
