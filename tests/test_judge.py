"""The LLM judges (METHOD.md §2-3): \\boxed{} and hint parsing, the majority vote, the
prompts (they carry the user's original request), LLMJudge over a scripted Completer,
OpenAICompleter against a real HTTP server on loopback (and its failures: closed port,
500, not JSON, too slow), the served-model completer and the judge setting's forms."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from clawd.engines.base import SamplingParams
from clawd.errors import ClawdError, ConfigError, Preempted
from clawd.judge import (
    JudgeInput,
    JudgeUnavailable,
    LLMJudge,
    answer_closed,
    evaluative_messages,
    hint_messages,
    majority,
    parse_boxed,
    parse_hint,
    parse_vote,
)
from clawd.judge_completers import OpenAICompleter, ServedModelCompleter, completer_for
from clawd.protocol import Message

BOXED = [
    ("The user thanked the assistant. \\boxed{1}", 1),
    ("\\boxed{-1}", -1),
    ("\\boxed{0}", 0),
    ("\\boxed{+1}", 1),
    ("\\boxed{ -1 }", -1),
    ("\\boxed{\n1\n}", 1),
    ("\\boxed {1}", 1),
    ("First I thought \\boxed{1}, but the user corrects it: \\boxed{-1}", -1),  # last wins
    ("Answer with \\boxed{1|-1|0}. The user moved on. \\boxed{1}", 1),  # format restated first
    ("\\boxed{1} ... on reflection \\boxed{yes}", None),  # the last one decides, even if junk
    ("\\boxed{2}", None),
    ("\\boxed{-2}", None),
    ("\\boxed{10}", None),
    ("\\boxed{1.0}", None),
    ("\\boxed{+-1}", None),
    ("\\boxed{yes}", None),
    ("\\boxed{}", None),
    ("\\boxed{ }", None),
    ("\\boxed{{1}}", None),
    ("\\boxed{\\text{1}}", None),
    ("\\boxed 1", None),
    ("\\boxed1", None),
    ("\\boxed{1", None),
    ("boxed{1}", None),
    ("The answer is 1.", None),
    ("", None),
]


@pytest.mark.parametrize("text,expected", BOXED, ids=[repr(t[0][-30:]) for t in BOXED])
def test_parse_boxed(text, expected):
    assert parse_boxed(text) == expected


# Votes written without \boxed, as instruct models answer (Qwen2.5-Coder: mostly a bare "1").
PLAIN = [
    ("1", 1),
    ("-1", -1),
    ("0", 0),
    ("+1", 1),
    (" **1** ", 1),
    ("1.", 1),
    ("`-1`", -1),
    ("$1$", 1),
    ("(1)", 1),
    ("-1\n\nThe user corrected the answer.", -1),  # the vote first, then why
    ("The user corrected the answer.\n-1", -1),  # why, then the vote
    ("Score: 1", 1),
    ("The final answer is -1.", -1),
    ("**Verdict:** 0", 0),
    ("The user thanked the assistant.\nScore: 1", 1),
    ("The answer is 1 of 3 options", None),  # a number inside a sentence is no vote
    ("1. The response is right\n2. But it is long", None),  # a numbered list
    ("The user asked 1 question", None),
    ("Rating: 1/5", None),
    ("score of 0.5", None),
    ("10", None),
    ("2", None),
    ("yes", None),
    ("", None),
    ("1 \\boxed{yes}", None),  # a box was written: it decides, even when broken
]


@pytest.mark.parametrize("text,expected", PLAIN, ids=[repr(t[0][-30:]) for t in PLAIN])
def test_parse_vote_reads_plain_votes_and_otherwise_the_box(text, expected):
    assert parse_vote(text) == expected


WRITTEN_BOXES = [case for case in BOXED if "\\boxed" in case[0]]


@pytest.mark.parametrize("text,expected", WRITTEN_BOXES, ids=[repr(t[0][-30:]) for t in WRITTEN_BOXES])
def test_parse_vote_agrees_with_parse_boxed_wherever_a_box_is_written(text, expected):
    assert parse_vote(text) == expected


MAJORITY = [
    ([1, 1, -1], 1),
    ([-1, -1, 1], -1),
    ([0, 0, 1], 0),
    ([1, -1, 0], 0),  # three-way tie
    ([1, -1], 0),
    ([1, -1, None], 0),
    ([1, None, None], 1),  # unparseable votes are dropped, not counted as 0
    ([None, None, None], 0),
    ([], 0),
    ([-1], -1),
    ([1, 1, -1, -1, 0], 0),
    ([0, 0, 0, 1, 1], 0),
]


@pytest.mark.parametrize("votes,expected", MAJORITY)
def test_majority(votes, expected):
    assert majority(votes) == expected


HINTS = [
    (
        "The user wanted Python.\n[HINT_START]Write the function in Python 3 with type hints.[HINT_END]\n\\boxed{1}",
        "Write the function in Python 3 with type hints.",
    ),
    ("\\boxed{1}\n[HINT_START]\n  Keep it under 50 words.  \n[HINT_END]", "Keep it under 50 words."),
    (
        "Format: [HINT_START]...[HINT_END]\n[HINT_START]Use Canberra, not Sydney.[HINT_END] \\boxed{+1}",
        "Use Canberra, not Sydney.",
    ),  # the last pair, not the echoed format line
    ("[HINT_START]Use Canberra.[HINT_END] \\boxed{-1}", None),  # boxed -1: no hint
    ("[HINT_START]Use Canberra.[HINT_END] \\boxed{0}", None),
    ("[HINT_START]Use Canberra.[HINT_END]", None),  # no boxed at all
    ("[HINT_START]Use Canberra.[HINT_END]\n1", "Use Canberra."),  # the vote written plainly
    ("[HINT_START]Use Canberra.[HINT_END] \\boxed{yes}", None),
    ("The user corrects the city. \\boxed{1}", None),  # no hint text
    ("[HINT_START]   [HINT_END] \\boxed{1}", None),  # empty hint
    ("[HINT_START]Use Canberra. \\boxed{1}", None),  # unterminated
    ("[HINT_END]Use Canberra.[HINT_START] \\boxed{1}", None),  # markers reversed
    ("", None),
]


@pytest.mark.parametrize("text,expected", HINTS, ids=[repr(t[0][-30:]) for t in HINTS])
def test_parse_hint(text, expected):
    assert parse_hint(text) == expected


# ---------------------------------------------------------------------------------------
# Prompts

INP = JudgeInput(
    request=[
        {"role": "system", "content": "You are a helpful travel assistant."},
        {"role": "user", "content": "I'm planning a trip to Australia."},
        {"role": "assistant", "content": "Great! How can I help?"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the capital of Australia?"},
                {"type": "image_url", "image_url": {"url": "data:..."}},
            ],
        },
    ],
    response="The capital of Australia is Sydney.",
    next_state="No, it's Canberra. Please double-check facts like that.",
    next_role="user",
)


def _all_text(messages: list[dict]) -> str:
    return "\n".join(m["content"] for m in messages)


def test_evaluative_messages_carry_request_response_and_next_state():
    msgs = evaluative_messages(INP)
    assert [m["role"] for m in msgs] == ["system", "user"]
    user = msgs[-1]["content"]
    for part in (
        "What is the capital of Australia?",
        "The capital of Australia is Sydney.",
        "No, it's Canberra. Please double-check facts like that.",
        "I'm planning a trip to Australia.",
    ):  # brief earlier context
        assert part in user
    # the original request comes before the response, which comes before the next state
    assert user.index("What is the capital") < user.index("is Sydney") < user.index("No, it's Canberra")
    text = _all_text(msgs)
    for needle in (
        "\\boxed{1}",
        "\\boxed{-1}",
        "\\boxed{0}",
        "change X to Y",
        "rephrases",
        "tool",
        "A request to change the response counts as -1",
    ):
        assert needle in text


def test_prompts_say_when_the_next_state_is_a_tool_result():
    tool = JudgeInput(
        request=[{"role": "user", "content": "List my files."}],
        response="[called ls]",
        next_state="ls: cannot access 'x': No such file or directory",
        next_role="tool",
    )
    assert "result of the tool" in evaluative_messages(tool)[-1]["content"]
    assert "user's next message" in evaluative_messages(INP)[-1]["content"]


def test_prompts_clip_long_texts_but_keep_head_and_tail():
    long = JudgeInput(
        request=[{"role": "user", "content": "START " + "x" * 20000 + " END"}],
        response="R" * 20000,
        next_state="thanks",
        next_role="user",
    )
    user = evaluative_messages(long)[-1]["content"]
    assert len(user) < 12000
    assert "START" in user and "END" in user and "characters omitted" in user


def test_hint_messages_ask_to_decide_first_and_use_the_markers():
    msgs = hint_messages(INP)
    text = _all_text(msgs)
    for needle in (
        "[HINT_START]",
        "[HINT_END]",
        "\\boxed{1}",
        "\\boxed{-1}",
        "1 to 3 sentences",
        "What is the capital of Australia?",
        "No, it's Canberra.",
    ):
        assert needle in text
    assert text.index("Decide that first") < text.index("[HINT_START]")


def test_a_request_without_a_user_message_still_renders():
    inp = JudgeInput(request=[{"role": "system", "content": "sys"}], response="r", next_state="n", next_role="user")
    assert "(no user message)" in evaluative_messages(inp)[-1]["content"]


# ---------------------------------------------------------------------------------------
# LLMJudge over a scripted completer


class ScriptedCompleter:
    """Returns canned outputs in order and records every call; an Exception in the
    script is raised instead."""

    source = "self"

    def __init__(self, *outputs):
        self.outputs = list(outputs)
        self.calls: list[dict] = []

    async def complete(self, messages, *, temperature, max_tokens, seed):
        self.calls.append({"messages": messages, "temperature": temperature, "max_tokens": max_tokens, "seed": seed})
        out = self.outputs.pop(0)
        if isinstance(out, BaseException):
            raise out
        return out


VERDICTS = [
    (["\\boxed{1}", "\\boxed{1}", "\\boxed{-1}"], 1, [1, 1, -1]),
    (["\\boxed{-1}", "Reasoning... \\boxed{-1}", "\\boxed{0}"], -1, [-1, -1, 0]),
    (["\\boxed{1}", "\\boxed{-1}", "\\boxed{0}"], 0, [1, -1, 0]),  # tie
    (["\\boxed{1}", "no idea", "\\boxed{2}"], 1, [1, None, None]),
    (["\\boxed{1}", "\\boxed{-1}", "garbage"], 0, [1, -1, None]),
    (["", "", ""], 0, [None, None, None]),
    (["1", "-1", "-1"], -1, [1, -1, -1]),  # bare votes count
    (["Score: 1", "\\boxed{1}", "I am not sure."], 1, [1, 1, None]),
]


@pytest.mark.parametrize("outputs,score,votes", VERDICTS)
async def test_llm_judge_majority(outputs, score, votes):
    c = ScriptedCompleter(*outputs)
    v = await LLMJudge(c).evaluate(INP)
    assert (v.score, v.votes, v.source) == (score, votes, "self")


async def test_llm_judge_votes_use_distinct_seeds_and_the_method_constants():
    c = ScriptedCompleter(*["\\boxed{1}"] * 5)
    v = await LLMJudge(c, votes=5, max_tokens=128).evaluate(INP)
    assert v.votes == [1] * 5
    seeds = [call["seed"] for call in c.calls]
    assert len(set(seeds)) == 5 and all(isinstance(s, int) for s in seeds)
    assert {call["temperature"] for call in c.calls} == {0.6}  # METHOD §6: T = 0.6
    assert {call["max_tokens"] for call in c.calls} == {128}
    assert all(call["messages"] == evaluative_messages(INP) for call in c.calls)
    # the same turn judged again draws the same seeds: reproducible votes
    c2 = ScriptedCompleter(*["\\boxed{1}"] * 5)
    await LLMJudge(c2, votes=5).evaluate(INP)
    assert [call["seed"] for call in c2.calls] == seeds


async def test_llm_judge_default_is_three_votes():
    c = ScriptedCompleter("\\boxed{-1}", "\\boxed{-1}", "\\boxed{-1}", "never asked for")
    assert (await LLMJudge(c).evaluate(INP)).votes == [-1, -1, -1]
    assert len(c.calls) == 3


def test_llm_judge_needs_at_least_one_vote():
    with pytest.raises(ConfigError):
        LLMJudge(ScriptedCompleter(), votes=0)


async def test_hints_keep_accepted_hints_longer_than_ten_characters():
    c = ScriptedCompleter(
        "[HINT_START]Say Canberra: it is the capital, not Sydney.[HINT_END] \\boxed{1}",
        "[HINT_START]Canberra.[HINT_END] \\boxed{1}",  # 9 characters: too short to be a hint
        "[HINT_START]Say Canberra: it is the capital, not Sydney.[HINT_END] \\boxed{1}",  # duplicate
        "No meaningful correction. \\boxed{-1}",
        "[HINT_START]Check capital cities before answering.[HINT_END] \\boxed{1}",
    )
    hints = await LLMJudge(c).hints(INP, votes=5)
    assert hints == ["Say Canberra: it is the capital, not Sydney.", "Check capital cities before answering."]
    assert len({call["seed"] for call in c.calls}) == 5
    assert all(call["messages"] == hint_messages(INP) for call in c.calls)


async def test_hints_default_to_one_vote_and_may_be_empty():
    c = ScriptedCompleter("The user just says thanks. \\boxed{-1}")
    assert await LLMJudge(c).hints(INP) == []
    assert len(c.calls) == 1


@pytest.mark.parametrize("exc", [RuntimeError("engine exploded"), ClawdError("engine busy"), TimeoutError()])
async def test_completer_failures_become_judge_unavailable(exc):
    judge = LLMJudge(ScriptedCompleter("\\boxed{1}", exc))
    with pytest.raises(JudgeUnavailable) as e:
        await judge.evaluate(INP)
    assert "'self' judge failed" in e.value.message and "rules" in e.value.message
    assert e.value.__cause__ is exc
    with pytest.raises(JudgeUnavailable):
        await LLMJudge(ScriptedCompleter(exc)).hints(INP)


@pytest.mark.parametrize("exc", [asyncio.CancelledError, Preempted])
async def test_preemption_propagates_unchanged(exc):
    # A user request took the engine: that is no judge failure (the miner retries soon
    # rather than backing off), so neither is turned into JudgeUnavailable.
    err = exc("a user request is waiting") if exc is Preempted else exc()
    with pytest.raises(exc):
        await LLMJudge(ScriptedCompleter("\\boxed{1}", err)).evaluate(INP)
    err = exc("a user request is waiting") if exc is Preempted else exc()
    with pytest.raises(exc):
        await LLMJudge(ScriptedCompleter(err)).hints(INP)


async def test_a_judge_task_can_be_cancelled_mid_vote():
    started = asyncio.Event()

    class Slow:
        source = "self"

        async def complete(self, messages, *, temperature, max_tokens, seed):
            started.set()
            await asyncio.sleep(30)
            return "\\boxed{1}"

    task = asyncio.create_task(LLMJudge(Slow()).evaluate(INP))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# ---------------------------------------------------------------------------------------
# OpenAICompleter against a real HTTP server on loopback


class FakeOpenAI:
    """A tiny OpenAI-compatible server (http.server on 127.0.0.1, port 0) whose behaviour
    the test sets: "ok", "500", "badjson", "noshape", "slow", "nomodels"."""

    def __init__(self):
        self.mode = "ok"
        self.reply = "The user thanked the assistant. \\boxed{1}"
        self.requests: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, body: bytes, ctype: str = "application/json"):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                outer.requests.append({"method": "GET", "path": self.path, "auth": self.headers.get("Authorization")})
                models = (
                    []
                    if outer.mode == "nomodels"
                    else [{"id": "judge-7b", "object": "model"}, {"id": "other", "object": "model"}]
                )
                self._send(200, json.dumps({"object": "list", "data": models}).encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(
                    {"method": "POST", "path": self.path, "body": body, "auth": self.headers.get("Authorization")}
                )
                if outer.mode == "500":
                    return self._send(500, b'{"error": {"message": "model crashed"}}')
                if outer.mode == "badjson":
                    return self._send(200, b"<html>not json</html>", "text/html")
                if outer.mode == "noshape":
                    return self._send(200, b'{"result": "ok"}')
                if outer.mode == "slow":
                    time.sleep(2)
                self._send(
                    200,
                    json.dumps(
                        {
                            "id": "chatcmpl-1",
                            "object": "chat.completion",
                            "model": body["model"],
                            "choices": [
                                {
                                    "index": 0,
                                    "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": outer.reply},
                                }
                            ],
                        }
                    ).encode(),
                )

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint():
    srv = FakeOpenAI()
    yield srv
    srv.close()


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


async def test_openai_completer_posts_a_chat_completion(endpoint):
    c = OpenAICompleter(endpoint.url + "/", model="judge-7b", api_key="sk-local")
    try:
        out = await c.complete([{"role": "user", "content": "hi"}], temperature=0.6, max_tokens=64, seed=7)
    finally:
        await c.aclose()
    assert out == endpoint.reply
    (req,) = endpoint.requests
    assert req["path"] == "/v1/chat/completions" and req["auth"] == "Bearer sk-local"
    assert req["body"] == {
        "model": "judge-7b",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.6,
        "max_tokens": 64,
        "stream": False,
        "seed": 7,
    }


async def test_openai_completer_picks_the_first_served_model_once(endpoint):
    c = OpenAICompleter(endpoint.url)
    try:
        for _ in range(2):
            await c.complete([{"role": "user", "content": "hi"}], temperature=0.6, max_tokens=8, seed=None)
    finally:
        await c.aclose()
    assert [(r["method"], r["path"]) for r in endpoint.requests] == [
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/chat/completions"),
    ]
    assert endpoint.requests[1]["body"]["model"] == "judge-7b"
    assert "seed" not in endpoint.requests[1]["body"] and endpoint.requests[0]["auth"] is None


async def test_llm_judge_over_a_real_endpoint(endpoint):
    c = OpenAICompleter(endpoint.url, model="judge-7b")
    try:
        v = await LLMJudge(c).evaluate(INP)
    finally:
        await c.aclose()
    assert (v.score, v.votes, v.source) == (1, [1, 1, 1], "openai")
    seeds = [r["body"]["seed"] for r in endpoint.requests]
    assert len(set(seeds)) == 3
    assert "What is the capital of Australia?" in endpoint.requests[0]["body"]["messages"][-1]["content"]


FAILURES = [
    ("500", ["HTTP 500", "model crashed", "/v1/chat/completions"]),
    ("badjson", ["not JSON", "OpenAI-compatible"]),
    ("noshape", ["OpenAI chat completion", "/v1"]),
    ("nomodels", ["lists no models", "#MODEL"]),
]


@pytest.mark.parametrize("mode,needles", FAILURES)
async def test_openai_completer_failures_say_what_to_do(endpoint, mode, needles):
    endpoint.mode = mode
    c = OpenAICompleter(endpoint.url, model="" if mode == "nomodels" else "judge-7b")
    t0 = time.monotonic()
    try:
        with pytest.raises(JudgeUnavailable) as e:
            await c.complete([{"role": "user", "content": "hi"}], temperature=0.6, max_tokens=8, seed=1)
    finally:
        await c.aclose()
    assert time.monotonic() - t0 < 2
    assert endpoint.url in e.value.message
    for needle in needles:
        assert needle in e.value.message


async def test_unreachable_endpoint_fails_fast_with_a_fix():
    url = f"http://127.0.0.1:{closed_port()}/v1"
    c = OpenAICompleter(url, model="m")
    t0 = time.monotonic()
    try:
        with pytest.raises(JudgeUnavailable) as e:
            await c.complete([{"role": "user", "content": "hi"}], temperature=0.6, max_tokens=8, seed=1)
    finally:
        await c.aclose()
    assert time.monotonic() - t0 < 2
    assert url in e.value.message and "Cannot reach" in e.value.message and "ollama serve" in e.value.message
    # through LLMJudge it is the same error, not wrapped twice
    c = OpenAICompleter(url, model="m")
    try:
        with pytest.raises(JudgeUnavailable, match="Cannot reach"):
            await LLMJudge(c).evaluate(INP)
    finally:
        await c.aclose()


async def test_a_slow_endpoint_times_out_instead_of_hanging(endpoint):
    endpoint.mode = "slow"
    c = OpenAICompleter(endpoint.url, model="judge-7b", timeout=0.3)
    t0 = time.monotonic()
    try:
        with pytest.raises(JudgeUnavailable, match="did not answer within 0.3 s"):
            await c.complete([{"role": "user", "content": "hi"}], temperature=0.6, max_tokens=8, seed=1)
    finally:
        await c.aclose()
    assert time.monotonic() - t0 < 1.5


@pytest.mark.parametrize(
    "text,closed",
    [
        ("It fits the request. \\boxed{1}", False),  # one more piece may continue a listing
        ("It fits the request. \\boxed{1}\n", True),
        ("Wrong language. \\boxed{-1} The user", True),
        ("\\boxed{ +1 }.", True),
        ("I will end with \\boxed{1}, \\boxed{-1} or \\boxed{0}. First", False),  # the format, restated
        ("I will end with \\boxed{1}, \\boxed{-1} or \\boxed{0}.\nIt was a correction: \\boxed{-1}\n", True),
        ("\\boxed{1}, ", False),
        ("\\boxed{yes}.", False),
        ("\\boxed{-1", False),
        ("No verdict yet, still thinking", False),
    ],
)
def test_answer_closed_once_the_vote_is_given(text, closed):
    assert answer_closed(text) is closed
    if closed:  # stopping there keeps the vote the full answer would have given
        assert parse_boxed(text) is not None


# ---------------------------------------------------------------------------------------
# The served model, and the judge setting


class FakeChat:
    """Stands in for ServedModel.complete, recording what the judge asks of it."""

    def __init__(self, reply: str = "\\boxed{-1}"):
        self.reply = reply
        self.calls: list[dict] = []

    async def complete(self, messages, params, *, adapter=None, background=True, until=None):
        self.calls.append(
            {"messages": messages, "params": params, "adapter": adapter, "background": background, "until": until}
        )
        return self.reply


async def test_served_model_completer_uses_base_weights_at_background_priority():
    chat = FakeChat()
    c = ServedModelCompleter(chat)
    out = await c.complete(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], temperature=0.6, max_tokens=256, seed=42
    )
    assert out == "\\boxed{-1}" and c.source == "self"
    (call,) = chat.calls
    assert all(isinstance(m, Message) for m in call["messages"])
    assert [(m.role, m.text()) for m in call["messages"]] == [("system", "s"), ("user", "u")]
    assert call["params"] == SamplingParams(max_tokens=256, temperature=0.6, top_p=1.0, seed=42)
    assert call["adapter"] is None and call["background"] is True
    assert call["until"] is answer_closed  # generation stops once the vote is given


async def test_llm_judge_over_the_served_model():
    chat = FakeChat("The user corrects the answer. \\boxed{-1}")
    v = await LLMJudge(ServedModelCompleter(chat)).evaluate(INP)
    assert (v.score, v.source, len(chat.calls)) == (-1, "self", 3)


def test_completer_for_each_form():
    chat, loaded = FakeChat(), []

    def loader(path):
        loaded.append(path)
        return FakeChat()

    assert completer_for("rules") is None
    selfc = completer_for("self", chat=chat)
    assert isinstance(selfc, ServedModelCompleter) and selfc.chat is chat and selfc.source == "self"
    o = completer_for("openai:http://127.0.0.1:11434/v1#qwen3:4b")
    assert isinstance(o, OpenAICompleter) and (o.base_url, o.model, o.source) == (
        "http://127.0.0.1:11434/v1",
        "qwen3:4b",
        "openai",
    )
    o = completer_for(" openai:http://127.0.0.1:8080/v1 ", api_key="k")
    assert (o.base_url, o.model, o.api_key) == ("http://127.0.0.1:8080/v1", "", "k")
    g = completer_for("gguf:/models/judge.gguf", gguf_loader=loader)
    assert isinstance(g, ServedModelCompleter) and g.source == "gguf" and loaded == ["/models/judge.gguf"]


@pytest.mark.parametrize(
    "spec,kw",
    [
        ("gpt4", {}),
        ("", {}),
        ("openai:", {}),
        ("openai:127.0.0.1:8080", {}),
        ("gguf:", {}),
        ("self", {}),
        ("gguf:/m.gguf", {}),
        ("RULES", {}),
    ],
)
def test_completer_for_rejects_what_it_cannot_build(spec, kw):
    with pytest.raises(ConfigError) as e:
        completer_for(spec, **kw)
    assert "rules" in e.value.message
