"""Samples teach what the user saw (issue 15): a turn's stored ids stay exactly as sampled, but
a training sample holds only the tokens the user received. A stop string's tokens ("\\nUser:")
were sampled and never shown; trained with r = −1 they taught the model not to end its turns.
A turn that ended with the template's end-of-turn token keeps it; a turn cut by max_tokens has
none. Real llama.cpp on tiny GGUF models, real templates, real HTTP and SQLite."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from clawd import jobs
from clawd.store import turns
from tests.conftest import start_daemon

# A real Jinja chat template whose turns end with the model's EOS token ("</s>", id 1), the way
# Gemma's end with <end_of_turn>.
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
EOS = 1
ARRAYS = ("teacher_logprobs", "student_top_ids", "student_top_logprobs", "teacher_top_logprobs")


@pytest.fixture(scope="module")
def template_gguf(tmp_path_factory):
    from tests.tiny_models import build_tiny_gguf

    return build_tiny_gguf(tmp_path_factory.mktemp("tiny-tpl") / "tiny-template.gguf", chat_template=TEMPLATE)


@pytest.fixture
def template_daemon(clawd_home, template_gguf):
    from clawd.engines.llamacpp import Engine

    d = start_daemon(clawd_home, Engine(template_gguf, n_ctx=256, n_threads=1, model_id="tiny"))
    yield d
    d.stop()


def ask(d, **body) -> dict:
    with d.client() as c:
        r = c.post(
            "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body}
        )
    assert r.status_code == 200, r.text
    return r.json()


def sample_of(d, turn_id: str, reward: int = -1):
    """The training sample build_job makes of this turn's signal, and the turn as stored."""
    model, db = d.state.chat.model, d.state.chat.db
    sig = SimpleNamespace(turn_id=turn_id, reward=reward, hint=None)
    return d.run(jobs._sample(db, model, sig, 256)), d.run(turns.get_turn(db, turn_id))


def test_a_sample_holds_no_stop_string_token(tiny_daemon):
    d = tiny_daemon
    detok = d.state.chat.model.engine.detokenize
    free = ask(d, temperature=0, max_tokens=24)["choices"][0]["message"]["content"]
    # A stop string the model really produces: three characters from the middle of its answer.
    k = next(i for i in range(4, len(free) - 3) if free.find(free[i : i + 3]) == i and free[i : i + 3].strip())
    stop = free[k : k + 3]
    out = ask(d, temperature=0, max_tokens=24, stop=[stop])
    shown = out["choices"][0]["message"]["content"]
    assert out["choices"][0]["finish_reason"] == "stop" and shown == free[:k]

    sample, turn = sample_of(d, out["id"])
    assert stop in detok(turn.response_ids)  # the log keeps every sampled token, the stop's too
    assert turn.response_seen < len(turn.response_ids)
    assert sample.response_ids == turn.response_ids[: turn.response_seen]
    assert stop not in detok(sample.response_ids)
    # Generation halted on the token completing the stop; the sample drops only the tokens that
    # carry the stop's characters (each token is at least one byte, so at most len(stop) of them).
    ids = turn.response_ids
    assert stop not in detok(ids[:-1])
    assert len(ids) - len(stop) <= len(sample.response_ids) < len(ids)
    # The dataset export (clawd signals export) holds the same tokens.
    from clawd.signal_datasets import trl_row

    sig = SimpleNamespace(reward=-1, reward_source="feedback", hint=None, top_k=4, **dict.fromkeys(ARRAYS))
    row = trl_row(sig, turn)
    assert row["completion_ids"] == sample.response_ids
    assert len(row["completion_logprobs"]) == len(sample.response_ids)
    # A turn logged before clawd counted (response_seen NULL) is measured against its text: never
    # the stop's tokens (a broken UTF-8 sequence, decoded token by token, may cost one more).
    turn.response_seen = None
    legacy = jobs.received_ids(d.state.chat.model, turn)
    assert legacy == sample.response_ids[: len(legacy)] and len(legacy) >= len(ids) - len(stop) - 1


def test_a_sample_ends_with_the_end_of_turn_token_when_the_turn_did(template_daemon):
    d = template_daemon
    ended = None
    for seed in range(100):  # sampled: some seeds end the turn with EOS within 32 tokens
        out = ask(d, temperature=1.0, max_tokens=32, seed=seed)
        if out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] > 1:
            ended = out
            break
    assert ended is not None, "no seed ended its turn with EOS"
    sample, turn = sample_of(d, ended["id"])
    assert turn.response_ids[-1] == EOS and turn.response_seen == len(turn.response_ids)
    assert sample.response_ids == turn.response_ids  # every token was received, the end one too
    assert sample.response_ids[-1] == EOS

    cut = ask(d, temperature=0, max_tokens=3)
    assert cut["choices"][0]["finish_reason"] == "length"
    sample, turn = sample_of(d, cut["id"])
    assert sample.response_ids == turn.response_ids and len(sample.response_ids) == 3
    assert EOS not in sample.response_ids  # cut by max_tokens: it ends without the end token
