"""What users of Ollama, LM Studio and llama.cpp's server expect of an OpenAI-compatible
daemon (issue #20, item 8), through the real `openai` SDK against a real daemon: any model
name is served; `logprobs` / `top_logprobs` come back in OpenAI's shape with the very numbers
stored for training; parts the model cannot read are a 400, never dropped; /v1/completions
serves raw prompts and is never mined; chat replies are shown without the model's leading
whitespace while the stored tokens stay exact. Most tests run the fake engine; the
`tiny_daemon` ones run llama.cpp on a tiny real GGUF model."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import openai
import pytest

from clawd.config import MiningSettings
from clawd.engines.base import SamplingParams
from clawd.engines.fake import EOS
from clawd.engines.fake import Engine as FakeEngine
from clawd.miner import Miner
from clawd.protocol import Message
from clawd.store import signals, turns
from tests.conftest import TEST_TOKEN, authed, start_daemon
from tui.client import DaemonClient, StreamFinished, StreamStarted

SERVED = "fake-model"


def sdk(d) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key=TEST_TOKEN, max_retries=0)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def turn_row(d, turn_id: str) -> turns.TurnRecord:
    rec = d.run(turns.get_turn(d.state.db, turn_id))
    assert rec is not None, f"no turn row for {turn_id}"
    return rec


def stored_logprobs(rec: turns.TurnRecord) -> list[float]:
    """The stored log-probs of the text tokens (the end token is no text, and not reported)."""
    lps = rec.response_logprobs.tolist()
    return lps[:-1] if rec.finish_reason == "stop" and rec.response_ids[-1] == EOS else lps


def f32(values) -> list[float]:
    return np.asarray(values, np.float32).tolist()


def daemon_with(home, engine):
    return start_daemon(home, engine)


# --- model names --------------------------------------------------------------------------------


def test_any_model_name_is_served_and_named_as_served(fake_daemon):
    """One model is served, so any name reaches it (llama.cpp's server and LM Studio do the
    same); the reply names the model that really answered."""
    client = sdk(fake_daemon)
    for name in ("gpt-4o", "llama3.2:latest", "local-model"):
        c = client.chat.completions.create(model=name, messages=[user("hi")], temperature=0)
        assert c.choices[0].message.content == "You said: hi"
        assert c.model == SERVED
    chunks = list(client.chat.completions.create(model="gpt-4o", messages=[user("yo")], temperature=0, stream=True))
    assert {c.model for c in chunks} == {SERVED}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "You said: yo"
    # The model list still says what is served, and an unknown id is no model card.
    assert [m.id for m in client.models.list()] == [SERVED]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


# --- logprobs -----------------------------------------------------------------------------------


def test_logprobs_non_stream_are_the_stored_ones(fake_daemon):
    d = fake_daemon
    raw = sdk(d).chat.completions.with_raw_response.create(
        model=SERVED, messages=[user("hello")], temperature=0, logprobs=True, top_logprobs=3
    )
    c = raw.parse()
    choice = c.choices[0]
    content = choice.logprobs.content
    rec = turn_row(d, raw.headers["x-clawd-turn-id"])
    assert "".join(t.token for t in content) == choice.message.content == "You said: hello"
    assert [bytes(t.bytes) for t in content] == [bytes([i]) for i in rec.response_ids[:-1]]
    assert f32([t.logprob for t in content]) == stored_logprobs(rec)
    # the top alternatives: 3 each, most likely first, and the engine's own ranking
    runner = d.state.model.runner
    scored = d.run(runner.call(runner.engine.score, rec.prompt_ids, rec.response_ids, top_k=3))
    for j, t in enumerate(content):
        assert len(t.top_logprobs) == 3
        assert [bytes(a.bytes) for a in t.top_logprobs] == [bytes([i]) for i in scored.top_ids[j]]
        assert f32([a.logprob for a in t.top_logprobs]) == scored.top_logprobs[j].tolist()
        assert t.top_logprobs[0].token == t.token  # greedy: the sampled token is the most likely

    plain = sdk(d).chat.completions.create(model=SERVED, messages=[user("hello")], temperature=0)
    assert plain.choices[0].logprobs is None  # not asked: not sent
    only = sdk(d).chat.completions.create(model=SERVED, messages=[user("hello")], temperature=0, logprobs=True)
    assert all(t.top_logprobs == [] for t in only.choices[0].logprobs.content)


def test_logprobs_stream_are_the_stored_ones(fake_daemon):
    d = fake_daemon
    raw = sdk(d).chat.completions.with_raw_response.create(
        model=SERVED, messages=[user("stream me")], temperature=0.7, seed=3, logprobs=True, top_logprobs=2, stream=True
    )
    chunks = list(raw.parse())
    rec = turn_row(d, raw.headers["x-clawd-turn-id"])
    entries = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == rec.response_text
    assert "".join(t.token for t in entries) == text
    assert f32([t.logprob for t in entries]) == stored_logprobs(rec)
    assert all(len(t.top_logprobs) == 2 for t in entries)
    # each chunk carries exactly the tokens of its own text
    for c in chunks:
        if c.choices and c.choices[0].logprobs:
            assert "".join(t.token for t in c.choices[0].logprobs.content) == c.choices[0].delta.content


def test_top_logprobs_range(fake_daemon):
    client = sdk(fake_daemon)
    c = client.chat.completions.create(
        model=SERVED, messages=[user("hi")], temperature=0, logprobs=True, top_logprobs=20, max_tokens=2
    )
    assert [len(t.top_logprobs) for t in c.choices[0].logprobs.content] == [20, 20]
    for bad in (21, -1):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=SERVED, messages=[user("hi")], logprobs=True, top_logprobs=bad)
        assert e.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:  # top_logprobs needs logprobs, as with OpenAI
        client.chat.completions.create(model=SERVED, messages=[user("hi")], top_logprobs=2)
    assert e.value.param == "top_logprobs"


class _NoAlternatives(FakeEngine):
    """An engine that reports sampled log-probs only (as the openai proxy engine does)."""

    max_top_logprobs = 0


def test_engine_without_alternatives_refuses_top_logprobs(clawd_home):
    d = daemon_with(clawd_home, _NoAlternatives(n_ctx=512))
    try:
        client = sdk(d)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=SERVED, messages=[user("hi")], logprobs=True, top_logprobs=1)
        assert e.value.param == "top_logprobs" and "log-probs only" in e.value.message
        c = client.chat.completions.create(model=SERVED, messages=[user("hi")], temperature=0, logprobs=True)
        assert "".join(t.token for t in c.choices[0].logprobs.content) == "You said: hi"
    finally:
        d.stop()


# --- parts the model cannot read ----------------------------------------------------------------


def test_image_and_audio_parts_are_refused(fake_daemon):
    d = fake_daemon
    client = sdk(d)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    for part, where in ((image, "messages[1].content[1]"), (audio, "messages[1].content[0]")):
        content = [{"type": "text", "text": "What is in this?"}, part] if part is image else [part]
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(
                    model=SERVED, messages=[{"role": "system", "content": "Be brief."}, user(content)], stream=stream
                )
            assert e.value.param == where
            assert part["type"] in e.value.message
    assert d.run(turns.count_turns(d.state.db)) == 0  # refused before the engine, nothing logged
    parts = [{"type": "text", "text": "two "}, {"type": "text", "text": "parts"}]
    c = client.chat.completions.create(model=SERVED, messages=[user(parts)], temperature=0)
    assert c.choices[0].message.content == "You said: two parts"


# --- /v1/completions ----------------------------------------------------------------------------

PROMPT = "Notes\nUser: raw prompt\n"


def test_completions_non_stream(fake_daemon):
    d = fake_daemon
    raw = sdk(d).completions.with_raw_response.create(model="gpt-3.5-turbo-instruct", prompt=PROMPT, temperature=0)
    c = raw.parse()
    assert c.object == "text_completion" and c.model == SERVED
    (choice,) = c.choices
    assert choice.text == "You said: raw prompt" and choice.finish_reason == "stop" and choice.logprobs is None
    rec = turn_row(d, raw.headers["x-clawd-turn-id"])
    engine = d.state.model.engine
    # no chat template: the prompt's own tokens, and nothing else
    assert rec.prompt_ids == engine.tokenize(PROMPT, add_bos=engine.info.add_bos)
    assert (rec.turn_type, rec.chat_format, rec.request) == ("side", "raw", {"prompt": PROMPT})
    assert c.usage.prompt_tokens == len(rec.prompt_ids) and c.usage.completion_tokens == len(rec.response_ids)

    # a list of one string, stop strings, max_tokens, legacy logprobs
    c = sdk(d).completions.create(model="x", prompt=[PROMPT], temperature=0, stop=["raw"], logprobs=2)
    assert c.choices[0].text == "You said: " and c.choices[0].finish_reason == "stop"
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == "You said: raw"  # the stop string's tokens were sampled too
    assert lp.text_offset == [len(PROMPT) + i for i in range(len(lp.tokens))]
    assert all(len(top) == 2 and tok in top for tok, top in zip(lp.tokens, lp.top_logprobs))
    c = sdk(d).completions.create(model="x", prompt=PROMPT, temperature=0, max_tokens=3)
    assert c.choices[0].text == "You" and c.choices[0].finish_reason == "length"


def test_completions_stream_and_logprobs(fake_daemon):
    d = fake_daemon
    raw = sdk(d).completions.with_raw_response.create(
        model="x",
        prompt=PROMPT,
        temperature=0.5,
        seed=1,
        stream=True,
        logprobs=1,
        stream_options={"include_usage": True},
    )
    events = list(raw.parse())
    rec = turn_row(d, raw.headers["x-clawd-turn-id"])
    assert all(e.object == "text_completion" and e.id == rec.id for e in events)
    texts = [e.choices[0].text for e in events if e.choices]
    assert len(texts) > 3  # streamed, not one chunk
    assert "".join(texts) == rec.response_text
    finishes = [e.choices[0].finish_reason for e in events if e.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == len(rec.response_ids)
    token_lps = [
        lp for e in events if e.choices and e.choices[0].logprobs for lp in e.choices[0].logprobs.token_logprobs
    ]
    assert f32(token_lps) == stored_logprobs(rec)

    # the wire itself: every event one data line, ending in [DONE]
    with authed.stream(
        "POST", d.url + "/v1/completions", json={"model": "x", "prompt": PROMPT, "stream": True}, timeout=30
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(json.loads(line[6:])["object"] == "text_completion" for line in lines[:-1])


def test_completions_bad_requests(fake_daemon):
    d = fake_daemon
    client = sdk(d)
    cases = [
        (dict(prompt=PROMPT, echo=True), "echo"),
        (dict(prompt=["one", "two"]), "prompt"),
        (dict(prompt=[1, 2, 3]), "prompt"),
        (dict(prompt=PROMPT, logprobs=6), "logprobs"),
        (dict(prompt=PROMPT, suffix="end"), "suffix"),
        (dict(prompt=PROMPT, n=2), "n"),
        (dict(prompt="x" * 600), "prompt"),  # longer than the context
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="x", **kw)
        assert e.value.param == param, kw
    r = authed.post(d.url + "/v1/completions", json={"model": "x"}, timeout=30)  # no prompt
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert d.run(turns.count_turns(d.state.db)) == 0


def test_completions_are_logged_but_never_mined(fake_daemon):
    """A raw completion is a side turn whatever the client says: the miner makes no signal of
    it, and it is no next state for the chat turn before it in the same session."""
    d = fake_daemon
    client = sdk(d)
    session = {"X-Session-Id": "s-mixed", "X-Turn-Type": "main"}
    chat = client.chat.completions.with_raw_response.create(
        model="x", messages=[user("hi")], temperature=0, extra_headers=session
    )
    chat_id = chat.headers["x-clawd-turn-id"]
    raw = client.completions.with_raw_response.create(
        model="x", prompt=PROMPT, temperature=0, extra_headers=session, extra_body={"turn_type": "main"}
    )
    raw_id = raw.headers["x-clawd-turn-id"]
    assert turn_row(d, raw_id).session_id == "s-mixed"

    miner = Miner(d.state.db, d.state.model, MiningSettings(judge="rules", hint_judge="rules", quiet_s=0))
    d.run(miner.run_until_idle())
    assert d.run(signals.get(d.state.db, raw_id)) is None
    chat_signal = d.run(signals.get(d.state.db, chat_id))
    assert chat_signal is not None  # the miner did run: the chat turn is waiting for its next state
    assert chat_signal.status == "waiting" and chat_signal.next_turn_id is None


# --- no leading whitespace ----------------------------------------------------------------------


def test_reply_without_leading_whitespace_tokens_kept(clawd_home):
    """A model that opens with whitespace (here two spaces, each its own token, so the first
    pieces are nothing but whitespace) is shown without it, streamed or not, in the turn rows
    the TUI reads and in the TUI's own stream; the stored tokens keep the spaces."""
    # Greedy by default: the TUI's request names no temperature, and the fake engine samples at
    # the default 0.7 (p 0.9 per intended token), which garbled its reply in about 1 run in 6.
    d = start_daemon(clawd_home, FakeEngine(n_ctx=512, reply_prefix="  "), {"CLAWD_GENERATION_TEMPERATURE": 0})
    try:
        client = sdk(d)
        raw = client.chat.completions.with_raw_response.create(
            model=SERVED, messages=[user("hi")], temperature=0, logprobs=True
        )
        c = raw.parse()
        assert c.choices[0].message.content == "You said: hi"
        rec = turn_row(d, raw.headers["x-clawd-turn-id"])
        assert rec.response_ids[:3] == [32, 32, ord("Y")] and rec.response_text == "You said: hi"
        # log-probs report the real tokens, spaces included
        assert [t.token for t in c.choices[0].logprobs.content][:3] == [" ", " ", "Y"]

        chunks = list(
            client.chat.completions.create(model=SERVED, messages=[user("again")], temperature=0, stream=True)
        )
        deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert deltas[0] == "Y" and "".join(deltas) == "You said: again"

        async def tui_view():
            tui = DaemonClient(d.url, token=TEST_TOKEN)
            try:
                shown, started = [], None
                async for ev in tui.stream_chat(SERVED, [user("from the tui")], "s-tui"):
                    if isinstance(ev, StreamStarted):
                        started = ev
                    elif not isinstance(ev, StreamFinished):
                        shown.append(ev)
                rows = await tui.turns(started.session_id)
                return "".join(shown), rows[-1]["response_text"]
            finally:
                await tui.aclose()

        streamed, reopened = asyncio.run(tui_view())
        assert streamed == reopened == "You said: from the tui"
        # side-by-side answers (review.py) and judges read replies the same way
        model = d.state.model
        answer = d.run(model.complete([Message(role="user", content="hi")], SamplingParams(temperature=0)))
        assert answer == "You said: hi"
    finally:
        d.stop()


def test_raw_completion_keeps_leading_whitespace(clawd_home):
    d = daemon_with(clawd_home, FakeEngine(n_ctx=512, reply_prefix=" "))
    try:
        c = sdk(d).completions.create(model="x", prompt=PROMPT, temperature=0)
        assert c.choices[0].text == " You said: raw prompt"
    finally:
        d.stop()


def test_side_reply_stops_where_until_says(fake_daemon):
    """A judge's reply ends once its vote is given (ServedModel.complete's `until`), not at
    max_tokens: what comes back is the text up to the piece that satisfied it."""
    model = fake_daemon.state.model
    seen: list[str] = []

    def until(text: str) -> bool:
        seen.append(text)
        return "said" in text

    msgs = [Message(role="user", content="hi there friend")]
    full = fake_daemon.run(model.complete(msgs, SamplingParams(temperature=0)))
    cut = fake_daemon.run(model.complete(msgs, SamplingParams(temperature=0), until=until))
    assert full == "You said: hi there friend"
    assert "said" in cut and full.startswith(cut) and len(cut) < len(full)
    assert seen[-1].lstrip() == cut  # asked after each piece, and not after it said stop


# --- a real model (llama.cpp, tiny GGUF) --------------------------------------------------------


def test_real_model_logprobs_and_top_logprobs(tiny_daemon):
    d = tiny_daemon
    client = sdk(d)
    runner = d.state.model.runner
    for stream in (False, True):
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[user("Hello there")], temperature=0, max_tokens=6, logprobs=True,
            top_logprobs=5, stream=stream,
        )  # fmt: skip
        if stream:
            chunks = list(raw.parse())
            entries = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
            assert {c.model for c in chunks} == {"tiny"}
        else:
            c = raw.parse()
            entries = c.choices[0].logprobs.content
            assert c.model == "tiny"
        rec = turn_row(d, raw.headers["x-clawd-turn-id"])
        n = len(entries)
        assert n >= 1 and n in (len(rec.response_ids), len(rec.response_ids) - 1)
        assert f32([t.logprob for t in entries]) == rec.response_logprobs[:n].tolist()
        engine = d.state.model.engine
        assert [bytes(t.bytes) for t in entries] == [engine._piece(i) for i in rec.response_ids[:n]]
        # An independent scoring of the stored tokens ranks the same alternatives.
        scored = d.run(runner.call(runner.engine.score, rec.prompt_ids, rec.response_ids[:n], top_k=5))
        for j, t in enumerate(entries):
            assert len(t.top_logprobs) == 5
            assert t.top_logprobs[0].token == t.token  # greedy
            assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-5
            got = [a.logprob for a in t.top_logprobs]
            assert got == sorted(got, reverse=True)
            np.testing.assert_allclose(got, scored.top_logprobs[j], atol=2e-3)
            assert bytes(t.top_logprobs[0].bytes) == engine._piece(int(scored.top_ids[j][0]), special=True)


def test_real_model_completions(tiny_daemon):
    d = tiny_daemon
    client = sdk(d)
    engine = d.state.model.engine
    prompt = "The capital of France is"
    c = client.completions.create(model="whatever", prompt=prompt, temperature=0, max_tokens=5, logprobs=3)
    rec = turn_row(d, c.id)
    assert rec.turn_type == "side"
    assert rec.prompt_ids == engine.tokenize(prompt, add_bos=engine.info.add_bos)  # no template
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text
    assert f32(lp.token_logprobs) == rec.response_logprobs[: len(lp.tokens)].tolist()
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)

    stream = list(client.completions.create(model="whatever", prompt=prompt, temperature=0, max_tokens=5, stream=True))
    assert "".join(e.choices[0].text for e in stream if e.choices) == c.choices[0].text  # greedy: the same text
    assert stream[-1].choices[0].finish_reason in ("stop", "length")
