"""A hint's round trip (issue 15): the user's correction, as typed, becomes an instruction in the
mined signal, and the trainer's teacher prompt is the turn's own request with exactly that
instruction appended under METHOD §3's marker, nothing else changed.

Real parts: a real daemon over HTTP with the rules judges, real llama.cpp on the tiny GGUF,
the real miner and the trainer's own sample builder (jobs). The check is independent of the
code under test: the prompts are decoded by llama-cpp-python's own detokenizer, and the
expected teacher text is the student's text with the spec's marker and the hint spliced in
after the request."""

from __future__ import annotations

import httpx
import pytest

from clawd import jobs
from tests.conftest import AUTH
from tests.test_miner import Convo, api_signal, mine, mining_daemon, stored_signal

REQUEST = "Write a short note to my team about the meeting on Friday."
METHOD_MARKER = "\n\n[user's hint / instruction]\n"  # METHOD §3, as written there

# (the user's next message, the instruction the rules judge must make of it)
CORRECTIONS = [
    ("You forgot to sign off with Cheers at the end.", "Sign off with Cheers at the end."),
    ("Too long. Answer in one sentence please.", "Answer in one sentence."),
    ("Please write it in lowercase next time.", "Write it in lowercase next time."),
]


@pytest.fixture
def http():
    with httpx.Client(headers=AUTH, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def detokenize(tiny_gguf):
    from llama_cpp import Llama

    llm = Llama(model_path=str(tiny_gguf), vocab_only=True, verbose=False)
    yield lambda ids: llm.detokenize(ids, special=True).decode("utf-8")
    llm.close()


@pytest.mark.parametrize("correction,instruction", CORRECTIONS, ids=["signoff", "length", "lowercase"])
def test_a_correction_reaches_the_teacher_prompt_as_an_instruction(
    clawd_home, http, tiny_gguf, detokenize, correction, instruction
):
    from clawd.engines.llamacpp import Engine

    d = mining_daemon(clawd_home, Engine(tiny_gguf, n_ctx=512, n_threads=1, model_id="tiny"))
    try:
        c = Convo(d, http, model="tiny", headers={"X-Session-Id": "round-trip"}, max_tokens=12)
        t1 = c.say(REQUEST)
        c.say(correction)
        mine(d)
        s = api_signal(http, d, t1)
        assert (s["status"], s["reward"]) == ("ready", -1)
        assert s["hint"] == instruction  # the user's words restated as an instruction
        sample = d.run(jobs._sample(d.state.db, d.state.chat.model, stored_signal(d, t1), 512))
    finally:
        d.stop()

    assert sample is not None and sample.reward == -1
    student, teacher = detokenize(sample.prompt_ids), detokenize(sample.teacher_prompt_ids)
    assert student.count(REQUEST) == 1
    assert teacher == student.replace(REQUEST, REQUEST + METHOD_MARKER + instruction)
