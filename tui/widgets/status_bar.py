"""A one-line status bar: daemon state, model, active adapter, engine and training state.
It follows the app's `status` (the last GET /clawd/status; None = not reachable)."""

from __future__ import annotations

from textual.widgets import Static


def describe(status: dict | None, url: str) -> str:
    if status is None:
        return f"○ clawd not reachable at {url}"
    training = (status.get("training") or {}).get("state", "unavailable")
    ready = (status.get("signals") or {}).get("ready", 0)
    engine = "busy" if status.get("busy") else "idle"
    return (
        f"● {status.get('model', '?')} on {status.get('engine', '?')} · "
        f"adapter {status.get('active_adapter') or 'none (base model)'} · engine {engine} · "
        f"training {training} · {ready} signals ready"
    )


class StatusBar(Static):
    def on_mount(self) -> None:
        self.watch(self.app, "status", self._show)

    def _show(self, status: dict | None) -> None:
        self.set_class(status is None, "-down")
        self.update(describe(status, self.app.client.base_url))
