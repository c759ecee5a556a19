"""The TUI driven headless by Textual's pilot against a real daemon (fake engine): chat with
streamed replies, stop, regenerate, thumbs and corrections reaching /clawd/feedback, veto
and forget reaching the signals, and errors as notifications, never crashes."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest

from clawd.store import feedback as feedback_rows
from clawd.store import signals
from tests.conftest import TEST_TOKEN, authed, start_daemon
from tui.app import ClawdApp
from tui.client import DaemonClient
from tui.screens.modals import ConfirmModal, CorrectionModal
from tui.widgets.messages import ReplyMessage

SIZE = (120, 40)
# The TUI sends no temperature, so the daemon's default applies: greedy here, so the fake
# engine's reply is exactly "You said: ..." (at the default 0.7 it sometimes samples noise).
GREEDY = {"CLAWD_GENERATION_TEMPERATURE": 0}


@pytest.fixture
def fake_daemon(clawd_home):
    from clawd.engines.fake import Engine

    d = start_daemon(clawd_home, Engine(n_ctx=512), GREEDY)
    yield d
    d.stop()


@pytest.fixture
def slow_fake_daemon(clawd_home):
    """20 ms per token, so a stop lands mid-reply."""
    from clawd.engines.fake import Engine

    d = start_daemon(clawd_home, Engine(n_ctx=512, token_delay=0.02), GREEDY)
    yield d
    d.stop()


async def until(pilot, predicate, timeout: float = 40.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.05)


async def until_correction_modal_takes_keys(pilot) -> None:
    """The modal is on screen a frame before its input has focus; keys typed in between are lost."""
    app = pilot.app
    await until(
        pilot,
        lambda: isinstance(app.screen, CorrectionModal) and app.focused is app.screen.query_one("#correction"),
        what="the correction modal's input to take keys",
    )


def replies(app) -> list[ReplyMessage]:
    return list(app.screen.query(ReplyMessage))


async def say(pilot, text: str) -> ReplyMessage:
    """Type a message into the prompt, send it, and wait for its reply to finish."""
    app = pilot.app
    before = len(replies(app))
    app.screen.query_one("#prompt").focus()
    await pilot.press(*text, "enter")
    await until(pilot, lambda: len(replies(app)) > before and replies(app)[-1].state != "streaming", what="the reply")
    return replies(app)[-1]


def feedback_of(d, turn_id: str) -> list[tuple[str, str | None]]:
    return [(f.kind, f.text) for f in d.run(feedback_rows.for_turn(d.state.db, turn_id))]


def notifications(app) -> list[str]:
    return [n.message for n in app._notifications]


@pytest.fixture
def app_for(request):
    """ClawdApp factory on a daemon URL; closes nothing itself (the app closes its client)."""

    def make(url: str, **kw) -> ClawdApp:
        return ClawdApp(DaemonClient(url, token=TEST_TOKEN), poll_s=0.5, **kw)

    return make


async def test_send_a_message_and_see_the_streamed_reply(fake_daemon, app_for):
    d = fake_daemon
    app = app_for(d.url)
    async with app.run_test(size=SIZE) as pilot:
        reply = await say(pilot, "hello there")
        assert reply.state == "done" and reply.text == "You said: hello there"
        assert reply.turn_id.startswith("chatcmpl-")
        # The daemon logged exactly that turn, in the TUI's session, and the list shows the session.
        turn = authed.get(f"{d.url}/clawd/turns/{reply.turn_id}").json()
        assert turn["response_text"] == reply.text and turn["session_id"] == app.screen.session_id
        await until(pilot, lambda: len(app.screen.query("SessionItem")) == 1, what="the session list")
        # The conversation goes on: the second request carries the first exchange.
        second = await say(pilot, "and again")
        turn = authed.get(f"{d.url}/clawd/turns/{second.turn_id}").json()
        assert [m["content"] for m in turn["request_messages"]] == ["hello there", "You said: hello there", "and again"]
        await until(pilot, lambda: app.status is not None and app.status["turns"] == 2, what="status")


async def test_thumbs_and_correction_reach_feedback(fake_daemon, app_for):
    d = fake_daemon
    app = app_for(d.url)
    async with app.run_test(size=SIZE) as pilot:
        reply = await say(pilot, "what is two plus two")
        await pilot.press("shift+tab")  # from the prompt to the last reply
        assert app.focused is reply
        await pilot.press("u")
        await until(pilot, lambda: feedback_of(d, reply.turn_id) == [("up", None)], what="thumbs up")
        await pilot.press("d")
        await until(pilot, lambda: ("down", None) in feedback_of(d, reply.turn_id), what="thumbs down")
        assert reply.rating == "down"

        await pilot.press("c")
        await until_correction_modal_takes_keys(pilot)
        await pilot.press(*"four", "enter")
        await until(pilot, lambda: len(replies(app)) == 2 and replies(app)[-1].state == "done", what="next reply")
        assert ("correction", "four") in feedback_of(d, reply.turn_id)
        assert reply.corrected
        # ... and the correction went on as the next message of the same session.
        nxt = authed.get(f"{d.url}/clawd/turns/{replies(app)[-1].turn_id}").json()
        assert nxt["request_messages"][-1] == {"role": "user", "content": "four"}
        assert replies(app)[-1].text == "You said: four"


async def test_regenerate_replaces_the_last_reply(fake_daemon, app_for):
    d = fake_daemon
    app = app_for(d.url)
    async with app.run_test(size=SIZE) as pilot:
        first = await say(pilot, "tell me a joke")
        await pilot.press("ctrl+r")
        await until(
            pilot,
            lambda: replies(app) and replies(app)[-1] is not first and replies(app)[-1].state == "done",
            what="the regenerated reply",
        )
        assert len(replies(app)) == 1
        again = authed.get(f"{d.url}/clawd/turns/{replies(app)[-1].turn_id}").json()
        assert again["requery_of"] == first.turn_id  # the daemon saw the re-ask


async def test_stop_keeps_the_partial_reply(slow_fake_daemon, app_for):
    d = slow_fake_daemon  # 20 ms a token
    app = app_for(d.url)
    async with app.run_test(size=SIZE) as pilot:
        prompt = app.screen.query_one("#prompt")
        prompt.value = "please repeat this rather long sentence back to me"
        # Enter's action without pilot.press, which waits for the app to go idle (the whole reply).
        await prompt.action_submit()
        await until(pilot, lambda: replies(app) and len(replies(app)[-1].markdown.source) > 5, what="tokens")
        await pilot.press("escape")
        reply = replies(app)[-1]
        await until(pilot, lambda: reply.state != "streaming", what="the stop")
        assert reply.state == "stopped" and 0 < len(reply.text) < len("You said: please repeat this")
        assert "stopped" in reply.query_one(".reply-meta").content
        turn = await asyncio.to_thread(_wait_turn, d.url, reply.turn_id)
        assert turn["finish_reason"] == "cancelled"


def _wait_turn(url: str, turn_id: str) -> dict:
    for _ in range(100):
        r = authed.get(f"{url}/clawd/turns/{turn_id}")
        if r.status_code == 200:
            return r.json()
        time.sleep(0.05)
    raise AssertionError("turn never recorded")


async def test_veto_and_forget_reach_the_signals(fake_daemon, app_for):
    d = fake_daemon
    app = app_for(d.url)
    async with app.run_test(size=SIZE) as pilot:
        reply = await say(pilot, "remember this")
        d.run(signals.create_missing(d.state.db))  # what the miner does for each main turn
        await pilot.press("f2")
        await until(pilot, lambda: app.screen.signals, what="the signals table")
        assert app.screen.selected["turn_id"] == reply.turn_id
        await pilot.press("v")
        await until(pilot, lambda: authed.get(f"{d.url}/clawd/signals/{reply.turn_id}").json()["vetoed"], what="veto")
        await pilot.press("v")
        await until(
            pilot, lambda: not authed.get(f"{d.url}/clawd/signals/{reply.turn_id}").json()["vetoed"], what="unveto"
        )

        session = app.screen.selected["session_id"]
        await pilot.press("f")
        await until(pilot, lambda: isinstance(app.screen, ConfirmModal), what="the confirmation")
        await pilot.pause(0.2)
        await pilot.click("#cancel")
        await pilot.pause()
        assert authed.get(f"{d.url}/clawd/sessions").json()[0]["id"] == session  # cancelled: kept
        await pilot.press("f")
        await until(pilot, lambda: isinstance(app.screen, ConfirmModal), what="the confirmation")
        await pilot.pause(0.2)
        await pilot.click("#confirm")
        await until(pilot, lambda: authed.get(f"{d.url}/clawd/sessions").json() == [], what="forget")
        assert authed.get(f"{d.url}/clawd/signals/{reply.turn_id}").status_code == 404


async def test_failed_actions_notify_and_never_crash(fake_daemon, app_for):
    d = fake_daemon  # the fake engine has no training and no adapters
    app = app_for(d.url)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f3")
        await until(
            pilot,
            lambda: "not available" in str(app.screen.query_one("#run-summary").content),
            what="training unavailable",
        )
        await pilot.press("s")
        await until(pilot, lambda: any("not available" in m for m in notifications(app)), what="a notification")
        await pilot.press("f4")
        await pilot.press("b")  # nothing active: says so
        await until(
            pilot, lambda: any("base model is already served" in m for m in notifications(app)), what="rollback notice"
        )
        assert app.is_running


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_daemon_not_running_offers_to_start_it(clawd_home, app_for):
    from clawd.engines.fake import Engine

    port = _free_port()
    started = []

    def start():  # what `clawd chat` passes: here a real daemon on that port
        started.append(start_daemon(clawd_home, Engine(n_ctx=512), {"CLAWD_SERVER_PORT": port, **GREEDY}))

    app = app_for(f"http://127.0.0.1:{port}", start_daemon=start)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: isinstance(app.screen, ConfirmModal), what="the offer")
            assert "not running" in app.screen.question
            await pilot.pause(0.2)  # laid out, so the click lands on the button
            await pilot.click("#confirm")
            await until(pilot, lambda: not isinstance(app.screen, ConfirmModal), what="the modal to close")
            await until(pilot, lambda: app.status is not None, timeout=60, what="the daemon")
            reply = await say(pilot, "are you up")
            assert reply.text == "You said: are you up"
    finally:
        for d in started:
            d.stop()


async def test_without_a_daemon_sending_fails_gracefully(app_for):
    app = app_for(f"http://127.0.0.1:{_free_port()}")  # no way to start one: just say so
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: any("clawd serve" in m for m in notifications(app)), what="the hint")
        app.screen.query_one("#prompt").focus()
        await pilot.press(*"hello", "enter")
        await until(pilot, lambda: replies(app) and replies(app)[-1].state == "failed", what="failed reply")
        assert app.is_running and app.screen.history == []


class _BrokenStream(httpx.AsyncByteStream):
    """A reply stream whose connection drops after two tokens."""

    async def __aiter__(self):
        head = '{"id":"chatcmpl-x","choices":[{"index":0,"delta":{"content":"%s"},"finish_reason":null}]}'
        for piece in ("Half ", "a reply"):
            yield f"data: {head % piece}\n\n".encode()
            await asyncio.sleep(0.01)
        raise httpx.ReadError("connection reset")


async def test_connection_lost_mid_stream_keeps_and_marks_the_partial_reply():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions":
            return httpx.Response(
                200, headers={"X-Clawd-Turn-Id": "chatcmpl-x", "X-Clawd-Session-Id": "s"}, stream=_BrokenStream()
            )
        if request.url.path == "/clawd/status":
            return httpx.Response(200, json={"model": "m", "engine": "fake"})
        return httpx.Response(200, json=[])

    app = ClawdApp(DaemonClient("http://clawd.test", transport=httpx.MockTransport(handler)), poll_s=60)
    async with app.run_test(size=SIZE) as pilot:
        reply = await say(pilot, "hi")
        assert reply.state == "broken" and reply.text == "Half a reply"
        assert "connection lost" in str(reply.query_one(".reply-meta").content)
        assert any("partial reply is kept" in m for m in notifications(app))
        assert app.screen.history[-1] == {"role": "assistant", "content": "Half a reply"}
