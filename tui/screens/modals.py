"""Modal dialogs: confirm a destructive action, type a correction."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static


class ConfirmModal(ModalScreen[bool]):
    """Yes or no: dismisses with True only when the confirm button (or `y`) is chosen."""

    BINDINGS = [Binding("escape,n", "dismiss(False)", "Cancel"), Binding("y", "dismiss(True)", "Confirm")]

    def __init__(self, question: str, confirm: str = "Confirm", cancel: str = "Cancel"):
        super().__init__()
        self.question, self.confirm, self.cancel = question, confirm, cancel

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self.question, classes="question", markup=False)
            with Horizontal(classes="buttons"):
                yield Button(self.confirm, variant="warning", id="confirm")
                yield Button(self.cancel, id="cancel")

    def on_mount(self) -> None:
        self.query_one("#cancel", Button).focus()  # a stray Enter must not confirm

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "confirm")


class CorrectionModal(ModalScreen[str | None]):
    """What the reply should have said; sent as feedback and as the next message."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, reply_text: str):
        super().__init__()
        self.reply_text = reply_text

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Correct this reply (Enter sends it as feedback and as your next message):")
            yield Static(self.reply_text[:400] or "(empty reply)", classes="quoted", markup=False)
            yield Input(placeholder="What it should have said…", id="correction")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        self.dismiss(text or None)
