"""Chat: the sessions, the conversation with streamed Markdown replies, and feedback keys."""

from __future__ import annotations

import asyncio
import uuid

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Footer, Header, Input, Label, ListItem, ListView, Markdown

from tui.client import DaemonError, DaemonUnreachable, StreamFinished, StreamStarted
from tui.screens.base import ClawdScreen
from tui.screens.modals import CorrectionModal
from tui.widgets.messages import ReplyMessage, UserMessage
from tui.widgets.status_bar import StatusBar


class SessionItem(ListItem):
    def __init__(self, session: dict):
        label = Text(session.get("title") or session["id"])
        label.append(f"\n{session['turns']} turn{'s' if session['turns'] != 1 else ''}", style="dim")
        super().__init__(Label(label))
        self.session_id = session["id"]


class ChatScreen(ClawdScreen):
    BINDINGS = [
        Binding("ctrl+n", "new_session", "New session"),
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+r", "regenerate", "Regenerate"),
    ]

    def __init__(self):
        super().__init__()
        self.session_id: str | None = None
        self.history: list[dict] = []  # the conversation as the daemon gets it
        self.streaming: ReplyMessage | None = None

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        with Horizontal():
            with Vertical(id="sessions-pane"):
                yield Label("Sessions  [dim](ctrl+n new)[/dim]", classes="pane-title")
                yield ListView(id="sessions")
            with Vertical(id="conversation-pane"):
                yield VerticalScroll(id="messages")
                yield Input(
                    placeholder="Message clawd (Enter). shift+tab: the last reply, then u/d thumbs, "
                    "c correct, r regenerate",
                    id="prompt",
                )
        yield StatusBar(id="status-bar")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "Chat"
        self.query_one("#prompt", Input).focus()
        self.load_sessions()

    def action_refresh(self) -> None:
        self.load_sessions()

    @property
    def replies(self) -> list[ReplyMessage]:
        return list(self.query_one("#messages").query(ReplyMessage))

    # --- sessions ---------------------------------------------------------------------

    @work(group="sessions", exclusive=True)
    async def load_sessions(self) -> None:
        sessions = await self.attempt(self.client.sessions())
        if sessions is None:
            return
        view = self.query_one("#sessions", ListView)
        await view.clear()
        await view.extend(SessionItem(s) for s in sessions)
        for i, s in enumerate(sessions):
            if s["id"] == self.session_id:
                view.index = i

    @on(ListView.Selected, "#sessions")
    def _session_chosen(self, event: ListView.Selected) -> None:
        if isinstance(event.item, SessionItem) and event.item.session_id != self.session_id:
            self.open_session(event.item.session_id)

    @work(group="open", exclusive=True)
    async def open_session(self, session_id: str) -> None:
        turns = await self.attempt(self.client.turns(session_id))
        if turns is None:
            return
        self.action_stop()
        await self._clear_conversation()
        self.session_id = session_id
        box = self.query_one("#messages")
        for t in turns:
            if t.get("requery_of") and self.replies and self.replies[-1].turn_id == t["requery_of"]:
                await self.replies[-1].remove()  # a regenerate replaces the reply it re-asked
            else:
                await box.mount(UserMessage(_last_user_text(t["request_messages"])))
            reply = ReplyMessage(t["response_text"], turn_id=t["id"])
            reply.state = "stopped" if t["finish_reason"] == "cancelled" else "done"
            await box.mount(reply)
            reply.update_meta()
        if turns:
            last = turns[-1]
            self.history = [*last["request_messages"], {"role": "assistant", "content": last["response_text"]}]
        box.scroll_end(animate=False)

    async def _clear_conversation(self) -> None:
        await self.query_one("#messages").remove_children()
        self.history = []

    async def action_new_session(self) -> None:
        self.action_stop()
        await self._clear_conversation()
        self.session_id = None
        self.query_one("#sessions", ListView).index = None
        self.query_one("#prompt", Input).focus()

    # --- sending ----------------------------------------------------------------------

    @on(Input.Submitted, "#prompt")
    def _submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if self.send(text):
            event.input.clear()

    def send(self, text: str) -> bool:
        """Send a user message in this session; False (with a notice) while a reply streams."""
        if self.streaming is not None:
            self.notify("A reply is still streaming: wait, or press Esc to stop it.", severity="warning")
            return False
        self.session_id = self.session_id or "tui-" + uuid.uuid4().hex[:12]
        self.history.append({"role": "user", "content": text})
        box = self.query_one("#messages")
        box.mount(UserMessage(text))
        reply = ReplyMessage(streaming=True)
        box.mount(reply)
        self._stream(reply, list(self.history))
        return True

    @work(group="stream", exclusive=True)
    async def _stream(self, reply: ReplyMessage, messages: list[dict]) -> None:
        self.streaming = reply
        box = self.query_one("#messages")
        box.anchor()  # follow the reply as it grows
        stream = Markdown.get_stream(reply.markdown)
        pieces: list[str] = []
        try:
            model = await self._model()
            async for event in self.client.stream_chat(model, messages, self.session_id):
                if isinstance(event, StreamStarted):
                    reply.turn_id, self.session_id = event.turn_id, event.session_id
                    reply.update_meta()
                elif isinstance(event, StreamFinished):
                    reply.state = "done"
                else:
                    pieces.append(event)
                    await stream.write(event)
            reply.state = "done"
        except asyncio.CancelledError:
            reply.state = "stopped"
            raise
        except DaemonUnreachable as e:
            reply.state = "broken" if pieces else "failed"
            self.notify(f"{e}. The partial reply is kept.", title="clawd", severity="error", timeout=8)
        except DaemonError as e:
            reply.state = "failed"
            self.notify(str(e), title="clawd", severity="error", timeout=8)
        finally:
            await stream.stop()
            reply.text = "".join(pieces)
            reply.update_meta()
            if reply.turn_id:  # the daemon logged the turn, partial or not: the conversation goes on from it
                self.history.append({"role": "assistant", "content": reply.text})
            elif self.history and self.history[-1]["role"] == "user":
                self.history.pop()  # never reached the daemon: forget it
            self.streaming = None
            self.load_sessions()

    async def _model(self) -> str:
        status = self.app.status or await self.client.status()
        return status["model"]

    def action_stop(self) -> None:
        if self.streaming is not None:
            self.workers.cancel_group(self, "stream")

    # --- feedback ---------------------------------------------------------------------

    @on(ReplyMessage.Rated)
    async def _rated(self, event: ReplyMessage.Rated) -> None:
        reply = event.reply
        if not reply.turn_id:
            self.notify("This reply has no turn id yet.", severity="warning")
            return
        if await self.attempt(self.client.feedback(reply.turn_id, rating=event.rating)) is not None:
            reply.rating = event.rating
            reply.update_meta()

    @on(ReplyMessage.CorrectionWanted)
    def _correct(self, event: ReplyMessage.CorrectionWanted) -> None:
        reply = event.reply
        if not reply.turn_id:
            self.notify("This reply has no turn id yet.", severity="warning")
            return

        async def corrected(text: str | None) -> None:
            if not text:
                return
            if await self.attempt(self.client.feedback(reply.turn_id, correction=text)) is None:
                return
            reply.corrected = True
            reply.update_meta()
            if self.send(text):  # and the conversation goes on from the correction
                # Focus follows the conversation: the next `u` / `d` rates the answer to the
                # correction, not the reply already corrected.
                self.replies[-1].focus()

        self.app.push_screen(CorrectionModal(reply.text), corrected)

    @on(ReplyMessage.RegenerateWanted)
    def _regenerate_reply(self, event: ReplyMessage.RegenerateWanted) -> None:
        self.regenerate(event.reply)

    def action_regenerate(self) -> None:
        replies = self.replies
        if replies:
            self.regenerate(replies[-1])

    def regenerate(self, reply: ReplyMessage) -> None:
        """Ask the last question again: the daemon sees the repeat and links the new turn to it."""
        if self.streaming is not None:
            self.notify("A reply is still streaming: wait, or press Esc to stop it.", severity="warning")
            return
        if reply is not self.replies[-1]:
            self.notify("Only the last reply can be regenerated.", severity="warning")
            return
        if self.history and self.history[-1]["role"] == "assistant":
            self.history.pop()
        if not self.history:
            return
        box = self.query_one("#messages")
        reply.remove()
        fresh = ReplyMessage(streaming=True)
        box.mount(fresh)
        self._stream(fresh, list(self.history))


def _last_user_text(messages: list[dict]) -> str:
    for m in reversed(messages):
        if m.get("role") == "user":
            content = m.get("content")
            if isinstance(content, list):
                return "".join(p.get("text") or "" for p in content if p.get("type") == "text")
            return content or ""
    return ""
