"""Learning: the signals mined from each turn (reward, judge votes, hints), veto and forget."""

from __future__ import annotations

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import DataTable, Footer, Header, Static

from tui.screens.base import ClawdScreen, cursor_key
from tui.screens.modals import ConfirmModal
from tui.widgets.status_bar import StatusBar

COLUMNS = ("turn", "session", "status", "r", "source", "votes", "hint", "veto")


def short(turn_id: str) -> str:
    return turn_id.removeprefix("chatcmpl-")[:10]


def votes_text(votes: list) -> str:
    return " ".join("?" if v is None else f"{v:+d}" for v in votes) or "-"


def signal_row(s: dict) -> tuple:
    reward = "-" if s.get("reward") is None else f"{s['reward']:+d}"
    return (
        short(s["turn_id"]),
        s["session_id"][:12],
        s["status"],
        reward,
        s.get("reward_source") or "-",
        votes_text(s.get("votes") or []),
        "✓" if s.get("hint") else "",
        "VETOED" if s.get("vetoed") else "",
    )


def signal_detail(s: dict, turn: dict | None) -> Text:
    """The turn, its next state, how it was judged and the hint candidates (selected one marked)."""
    t = Text()
    t.append(f"turn {s['turn_id']}", style="bold")
    t.append(f"   session {s['session_id']}   status {s['status']}\n")
    if s.get("vetoed"):
        t.append("VETOED: this signal will never train (v to unveto)\n", style="bold red")
    if s.get("held_out"):
        # With few signals nothing is held out (training.holdout_min); say so when one is.
        t.append("held out: the eval gate judges adapters on it; it never trains\n", style="yellow")
    if turn is not None:
        asked = next((m.get("content") for m in reversed(turn["request_messages"]) if m.get("role") == "user"), "")
        t.append("\nuser  ", style="bold cyan")
        t.append(f"{asked if isinstance(asked, str) else '(parts)'}\n")
        t.append("reply ", style="bold green")
        t.append(f"{turn['response_text']}\n")
    t.append("\nnext state ", style="bold")
    if s.get("next_state") is None:
        t.append("(none yet: waiting for your next message)\n", style="dim")
    else:
        t.append(f"[{s.get('next_role') or '?'}] {s['next_state']}\n")
    reward = "not judged yet" if s.get("reward") is None else f"{s['reward']:+d}"
    t.append("\njudge score ", style="bold")
    t.append(f"{reward}  from {s.get('reward_source') or '-'}   votes {votes_text(s.get('votes') or [])}\n")
    if s.get("error"):
        t.append(f"last error: {s['error']}\n", style="yellow")
    t.append("\nhint candidates\n", style="bold")
    if not s.get("hints"):
        t.append("  (none)\n", style="dim")
    for h in s.get("hints") or []:
        chosen = h.get("text") == s.get("hint")
        t.append(" ✓ " if chosen else " · ", style="bold green" if chosen else "dim")
        t.append(h.get("text", ""), style="bold" if chosen else "")
        t.append(f"  ({h.get('source', '?')}, overlap {h.get('overlap', 0):.2f})\n", style="dim")
    return t


class LearningScreen(ClawdScreen):
    BINDINGS = [
        Binding("v", "toggle_veto", "Veto / unveto"),
        Binding("f", "forget", "Forget session"),
        Binding("ctrl+r", "refresh", "Refresh"),
    ]

    def __init__(self):
        super().__init__()
        self.signals: dict[str, dict] = {}

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        with Horizontal():
            yield DataTable(id="signals", cursor_type="row", zebra_stripes=True)
            with VerticalScroll(id="signal-pane"):
                yield Static("Select a signal.", id="signal-detail")
        yield StatusBar(id="status-bar")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "Learning"
        self.query_one(DataTable).add_columns(*((c, c) for c in COLUMNS))
        self.action_refresh()

    def on_screen_resume(self) -> None:
        if self.is_mounted:
            self.action_refresh()

    @property
    def selected(self) -> dict | None:
        return self.signals.get(cursor_key(self.query_one(DataTable)))

    @work(group="load", exclusive=True)
    async def action_refresh(self) -> None:
        rows = await self.attempt(self.client.signals())
        if rows is None:
            return
        table = self.query_one(DataTable)
        keep = self.selected["turn_id"] if self.selected else None
        self.signals = {s["turn_id"]: s for s in rows}
        table.clear()
        for s in rows:
            table.add_row(*signal_row(s), key=s["turn_id"])
        if keep in self.signals:
            table.move_cursor(row=table.get_row_index(keep))
        if not rows:
            self.query_one("#signal-detail", Static).update(
                "No signals yet: the miner makes one from each chat turn (if mining is on)."
            )

    @on(DataTable.RowHighlighted)
    def _highlighted(self, event: DataTable.RowHighlighted) -> None:
        sig = self.signals.get(event.row_key.value)
        if sig is not None:
            self.show_signal(sig)

    @work(group="detail", exclusive=True)
    async def show_signal(self, sig: dict) -> None:
        turn = await self.attempt(self.client.turn(sig["turn_id"]))
        self.query_one("#signal-detail", Static).update(signal_detail(sig, turn))

    async def action_toggle_veto(self) -> None:
        sig = self.selected
        if sig is None:
            return
        updated = await self.attempt(
            self.client.set_veto(sig["turn_id"], not sig.get("vetoed")),
            done=("vetoed " if not sig.get("vetoed") else "unvetoed ") + short(sig["turn_id"]),
        )
        if updated is not None:
            self.signals[sig["turn_id"]] = updated
            table = self.query_one(DataTable)
            table.update_cell(sig["turn_id"], "veto", "VETOED" if updated.get("vetoed") else "")
            self.show_signal(updated)

    def action_forget(self) -> None:
        sig = self.selected
        if sig is None:
            return
        session = sig["session_id"]

        async def confirmed(yes: bool | None) -> None:
            if yes and await self.attempt(self.client.forget(session), done=f"forgot session {session}"):
                self.action_refresh()

        self.app.push_screen(
            ConfirmModal(
                f"Forget session {session}?\n\nIts turns, feedback and signals are deleted, and any adapter "
                "trained on them is retired and its weights deleted. This cannot be undone.",
                confirm="Forget",
            ),
            confirmed,
        )
