"""The `openai` upstream engine against a REAL upstream: llama-cpp-python's server
(`python -m llama_cpp.server`) on the tiny GGUF. The reference is clawd's own llama.cpp engine
on the same file: the upstream must tokenize the same, sample the same greedy tokens with the
same log-probs, and score the same. What llama_cpp.server cannot do (token ids for text that is
not valid UTF-8 on its own, top-k scoring, runtime adapters) must fail with the documented error,
never with wrong numbers. A chat through a real daemon on this engine is logged with ids and
log-probs.

Tolerance: the server and clawd's engine run the same llama.cpp on the same F32 model, but in
different batch shapes (ggml rounds per shape; see test_engine_contract.py): ATOL = 1e-3.
"""

from __future__ import annotations

import math

import httpx
import numpy as np
import pytest

from clawd.engines.base import SamplingParams
from clawd.errors import AdapterError, ContextLengthExceeded, EngineError, ModelLoadError
from tests.conftest import AUTH, ServeProcess, authed, start_daemon
from tests.upstream import LlamaCppServer, free_port

N_CTX = 256
ATOL = 1e-3
PROMPT = "A short chat.\nUser: hello there, how are you today?\nAssistant:"


@pytest.fixture(scope="module")
def upstream(tiny_gguf):
    server = LlamaCppServer(tiny_gguf, N_CTX)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def engine(upstream):
    from clawd.engines.openai import Engine

    e = Engine(upstream, n_ctx=N_CTX)
    yield e
    e.close()


@pytest.fixture(scope="module")
def local(tiny_gguf):
    from clawd.engines.llamacpp import Engine

    e = Engine(tiny_gguf, n_ctx=N_CTX, n_threads=1)
    yield e
    e.close()


def test_info_comes_from_the_upstream(engine, upstream, tiny_gguf):
    info = engine.info
    assert info.id == str(tiny_gguf)  # llama_cpp.server names the model by its path
    assert info.n_ctx == N_CTX and info.add_bos is True
    assert info.metadata["tokenizer"] == "/extras/tokenize" and info.metadata["base_url"] == upstream
    assert info.chat_template is None  # llama_cpp.server publishes no /props: transcript format


@pytest.mark.parametrize("text", ["Hello the world", "  leading spaces\tand tabs\nnew line", "日本語 ünïcödé 🙂", ""])
def test_tokenize_matches_the_model_tokenizer(engine, local, text):
    for add_bos in (True, False):
        assert engine.tokenize(text, add_bos=add_bos) == local.tokenize(text, add_bos=add_bos)
    ids = engine.tokenize(text, add_bos=False)
    assert engine.detokenize(ids) == text


def _reference_greedy(local, prompt_ids, n):
    return list(local.generate(prompt_ids, SamplingParams(max_tokens=n, temperature=0)))


def test_greedy_generation_matches_llama_cpp(engine, local):
    prompt = engine.tokenize(PROMPT, add_bos=True)
    got = list(engine.generate(prompt, SamplingParams(max_tokens=24, temperature=0)))
    want = _reference_greedy(local, prompt, 24)
    assert len(got) == len(want) == 24
    known = 0
    for g, w in zip(got, want):
        assert abs(g.logprob - w.logprob) < ATOL, (g, w)
        try:
            w.piece.decode("utf-8")
            whole = bool(w.piece)
        except UnicodeDecodeError:
            whole = False
        if whole:  # text that names the token: its id is recovered exactly
            assert (g.id, g.piece) == (w.id, w.piece)
            known += 1
        else:  # llama_cpp.server drops invalid UTF-8 from token text: the id is unknown, never guessed
            assert (g.id, g.piece) == (-1, b"")
    assert known >= 5
    assert not any(t.is_end for t in got)


def test_max_tokens_seed_and_cancel(engine):
    import threading

    prompt = engine.tokenize(PROMPT, add_bos=True)
    for n in (1, 3):
        assert len(list(engine.generate(prompt, SamplingParams(max_tokens=n, temperature=0)))) == n
    a = [t.logprob for t in engine.generate(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=7))]
    b = [t.logprob for t in engine.generate(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=7))]
    c = [t.logprob for t in engine.generate(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=8))]
    assert a == b and a != c
    cancel = threading.Event()
    got = []
    for tok in engine.generate(prompt, SamplingParams(max_tokens=20, temperature=0), cancel=cancel):
        got.append(tok)
        if len(got) == 2:
            cancel.set()
    assert len(got) == 2
    assert len(list(engine.generate(prompt, SamplingParams(max_tokens=2, temperature=0)))) == 2  # still usable


def test_score_matches_llama_cpp_and_refuses_what_it_cannot(engine, local):
    prompt = engine.tokenize(PROMPT, add_bos=True)
    targets = engine.tokenize(" I am fine, thank you.", add_bos=False)
    got = engine.score(prompt, targets)
    want = local.score(prompt, targets)
    assert got.logprobs.shape == (len(targets),) and got.logprobs.dtype == np.float32
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=ATOL, rtol=0)
    with pytest.raises(EngineError, match="not supported by this upstream"):
        engine.score(prompt, targets, top_k=4)  # its top-k are keyed by text, several tokens share ""
    with pytest.raises(EngineError, match="not supported by this upstream"):
        engine.score(prompt, [-1, *targets])  # a token it never identified
    # ids that do not survive a text round trip: "h" "e" is not how the tokenizer spells "he"
    split = engine.tokenize("h", add_bos=False) + engine.tokenize("e", add_bos=False)
    assert split != engine.tokenize("he", add_bos=False)
    with pytest.raises(EngineError, match="not supported by this upstream"):
        engine.score(prompt, split)
    with pytest.raises(ContextLengthExceeded):
        engine.score(prompt, targets * 40)
    with pytest.raises(ValueError):
        engine.score([], targets)


def test_adapters_are_the_upstreams_business(engine, tmp_path):
    prompt = engine.tokenize(PROMPT, add_bos=True)
    with pytest.raises(AdapterError, match="--format peft"):
        engine.load_adapter("a1", tmp_path / "adapter.gguf")
    with pytest.raises(AdapterError):
        list(engine.generate(prompt, SamplingParams(max_tokens=2), adapter="a1"))
    with pytest.raises(AdapterError):
        engine.score(prompt, prompt[1:3], adapter="a1")
    assert engine.loaded_adapters == []
    engine.unload_adapter("a1")


def test_unreachable_or_wrong_upstream_is_one_actionable_line(upstream):
    from clawd.engines.openai import Engine

    with pytest.raises(ModelLoadError, match=r"cannot reach the upstream at .*start it, or fix model.base_url"):
        Engine(f"http://127.0.0.1:{free_port()}/v1")
    with pytest.raises(ModelLoadError, match="not 'nope': fix model.name"):
        Engine(upstream, model="nope")
    with pytest.raises(ModelLoadError, match="not an http"):
        Engine("127.0.0.1:8080")


def test_chat_through_the_daemon_is_logged_with_ids_and_logprobs(upstream, local, clawd_home):
    from clawd.engines.openai import Engine
    from clawd.store import turns

    d = start_daemon(clawd_home, Engine(upstream, n_ctx=N_CTX))
    try:
        with httpx.Client(headers=AUTH, timeout=60) as http:
            model = http.get(d.url + "/v1/models").json()["data"][0]["id"]
            body = {
                "model": model,
                "messages": [{"role": "user", "content": "hello there"}],
                "temperature": 0,
                "max_tokens": 12,
                "stream": True,
            }
            with http.stream("POST", d.url + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                turn_id = r.headers["x-clawd-turn-id"]
                events = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and len(events) > 3  # streamed, not one chunk
        rec = d.run(turns.get_turn(d.state.db, turn_id))
    finally:
        d.stop()
    assert rec.engine == "openai" and rec.model == model
    assert len(rec.response_ids) == len(rec.response_logprobs) == 12
    want = _reference_greedy(local, rec.prompt_ids, 12)  # same prompt ids, clawd's own engine
    np.testing.assert_allclose(rec.response_logprobs, [w.logprob for w in want], atol=ATOL, rtol=0)
    assert all(g in (w.id, -1) for g, w in zip(rec.response_ids, want))
    assert sum(g >= 0 for g in rec.response_ids) >= 3
    assert rec.prompt_ids == local.tokenize(rec.prompt_text, add_bos=True)


def test_clawd_serve_engine_openai(upstream, clawd_home):
    p = ServeProcess(
        clawd_home, "--engine", "openai", env_extra={"CLAWD_MODEL_BASE_URL": upstream, "CLAWD_MINING_ENABLED": 0}
    )
    try:
        url = p.wait_ready(120)
        status = authed.get(url + "/clawd/status", timeout=10).json()
        assert status["engine"] == "openai"
        r = authed.post(
            url + "/v1/chat/completions",
            timeout=60,
            json={"model": status["model"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        p.kill()

    missing = ServeProcess(clawd_home, "--engine", "openai")
    code, out = missing.finish(60)
    assert code == 1 and "model.engine = openai needs model.base_url" in out
    assert len([line for line in out.splitlines() if line.startswith("clawd: error")]) == 1


def test_end_of_answer_is_reported_without_a_made_up_logprob(engine):
    """llama_cpp.server does not stream the EOS token: clawd reports the end with id -1 (its EOS id
    is not published) and a NaN log-prob, so nothing downstream mistakes it for a measurement."""
    from clawd.engines.base import SampledToken

    end = SampledToken(-1, b"", math.nan, is_end=True)
    assert math.isnan(end.logprob)
    prompt = engine.tokenize(PROMPT, add_bos=True)
    toks = list(engine.generate(prompt, SamplingParams(max_tokens=200, temperature=1.0, seed=1)))
    if toks[-1].is_end:  # the tiny model may or may not end on its own within 200 tokens
        assert toks[-1].id == -1 and toks[-1].piece == b"" and math.isnan(toks[-1].logprob)
    assert not any(t.is_end for t in toks[:-1])
