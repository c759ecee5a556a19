"""The TUI on the embedded Gemma 3 270M model (slow): a question typed into the Chat screen
comes back streamed token by token, and the reply shown is the turn the daemon logged."""

from __future__ import annotations

import httpx
import pytest

from clawd.models import EMBEDDED_ID, ensure_embedded_model
from clawd.paths import ensure_dirs, resolve_paths
from tests.conftest import make_env, start_daemon
from tests.test_tui_app import SIZE, replies, until
from tui.app import ClawdApp
from tui.client import DaemonClient
from tui.widgets.messages import ReplyMessage

pytestmark = pytest.mark.slow


@pytest.fixture
def greedy_daemon(tmp_path):
    """The embedded model, sampling greedily by default (the TUI sends no temperature)."""
    from clawd.engines.llamacpp import Engine

    paths = resolve_paths(make_env(tmp_path))
    ensure_dirs(paths)
    engine = Engine(ensure_embedded_model(paths), n_ctx=1024, n_threads=2, model_id=EMBEDDED_ID)
    d = start_daemon(tmp_path, engine, {"CLAWD_GENERATION_TEMPERATURE": 0, "CLAWD_GENERATION_MAX_TOKENS": 48})
    yield d
    d.stop()


async def test_chat_streams_a_real_reply(greedy_daemon):
    d = greedy_daemon
    app = ClawdApp(DaemonClient(d.url), poll_s=1.0)
    seen: list[str] = []  # the reply's text as drawn, sampled while it streams
    async with app.run_test(size=SIZE) as pilot:
        prompt = app.screen.query_one("#prompt")
        prompt.value = "What is the capital of France?"
        await prompt.action_submit()  # Enter's action (pilot.press would wait out the whole reply)

        def streamed() -> bool:
            rs = replies(app)
            if rs:
                seen.append(rs[-1].markdown.source)
            return bool(rs) and rs[-1].state != "streaming"

        await until(pilot, streamed, timeout=120, what="the reply")
        reply: ReplyMessage = replies(app)[-1]
        assert reply.state == "done" and "Paris" in reply.text
        assert reply.text.startswith("The")  # the model's opening space is not shown (issue #20)
        partial = {s for s in seen if s and s != reply.text}
        assert partial, "the reply appeared all at once: it was not streamed"
        assert all(reply.text.startswith(s.rstrip()) or s.rstrip() in reply.text for s in partial)
        turn = httpx.get(f"{d.url}/clawd/turns/{reply.turn_id}").json()
        assert turn["response_text"] == reply.text and turn["model"] == app.status["model"]
