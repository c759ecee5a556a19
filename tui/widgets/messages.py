"""The conversation's messages. A reply is focusable and, when focused, turns keys into
requests (rate, correct, regenerate) that it posts up to the chat screen."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Label, Markdown, Static


class UserMessage(Static):
    """What the user sent."""

    def __init__(self, text: str):
        super().__init__(text, markup=False)
        self.text = text


class ReplyMessage(Vertical, can_focus=True):
    """One assistant reply: Markdown body, and a line with its turn id and what happened to it."""

    BINDINGS = [
        Binding("u", "rate('up')", "Thumbs up"),
        Binding("d", "rate('down')", "Thumbs down"),
        Binding("c", "correct", "Correct"),
        Binding("r", "regenerate", "Regenerate"),
    ]

    class Rated(Message):
        def __init__(self, reply: ReplyMessage, rating: str):
            super().__init__()
            self.reply, self.rating = reply, rating

    class CorrectionWanted(Message):
        def __init__(self, reply: ReplyMessage):
            super().__init__()
            self.reply = reply

    class RegenerateWanted(Message):
        def __init__(self, reply: ReplyMessage):
            super().__init__()
            self.reply = reply

    def __init__(self, text: str = "", *, turn_id: str | None = None, streaming: bool = False):
        super().__init__()
        self.text = text
        self.turn_id = turn_id
        self.rating: str | None = None
        self.corrected = False
        self.state = "streaming" if streaming else "done"  # streaming | done | stopped | broken | failed

    def compose(self) -> ComposeResult:
        yield Markdown(self.text)
        yield Label(self._meta_line(), classes="reply-meta")

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    def _meta_line(self) -> str:
        parts = {
            "streaming": ["…"],
            "stopped": ["⏹ stopped: partial reply"],
            "broken": ["⚠ connection lost: partial reply"],
            "failed": ["⚠ failed"],
        }.get(self.state, [])
        if self.rating:
            parts.append("▲ thumbs up" if self.rating == "up" else "▼ thumbs down")
        if self.corrected:
            parts.append("✎ corrected")
        if self.turn_id:
            parts.append(self.turn_id)
        return "  ·  ".join(parts)

    def update_meta(self) -> None:
        self.set_class(self.state in ("stopped", "broken", "failed"), "-partial")
        if self.is_mounted:
            self.query_one(".reply-meta", Label).update(self._meta_line())

    def action_rate(self, rating: str) -> None:
        self.post_message(self.Rated(self, rating))

    def action_correct(self) -> None:
        self.post_message(self.CorrectionWanted(self))

    def action_regenerate(self) -> None:
        self.post_message(self.RegenerateWanted(self))
