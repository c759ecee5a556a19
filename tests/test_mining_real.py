"""Mining on the embedded Gemma 3 270M (slow): a scripted conversation through the API
becomes the rewards METHOD.md §2 prescribes, and the user's correction becomes the
selected hint, with teacher arrays over the turn's own sampled tokens."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest

from clawd.models import EMBEDDED_ID, ensure_embedded_model
from clawd.paths import ensure_dirs, resolve_paths
from clawd.store import signals, turns
from tests.conftest import AUTH, make_env, start_daemon

pytestmark = pytest.mark.slow

RULES = {"CLAWD_MINING_ENABLED": 1, "CLAWD_MINING_JUDGE": "rules", "CLAWD_MINING_HINT_JUDGE": "rules"}


@pytest.fixture
def real_mining_daemon(tmp_path_factory):
    from clawd.engines.llamacpp import Engine

    home = tmp_path_factory.mktemp("real-mining-home")
    paths = resolve_paths(make_env(home))
    ensure_dirs(paths)
    engine = Engine(ensure_embedded_model(paths), n_ctx=1024, n_threads=2, model_id=EMBEDDED_ID)
    d = start_daemon(home, engine, env_extra=RULES)
    d.run(d.state.miner.stop())  # mined below, when the conversation is complete
    yield d
    d.stop()


def test_scripted_conversation_on_the_real_model(real_mining_daemon):
    d = real_mining_daemon
    http = httpx.Client(base_url=d.url, headers=AUTH, timeout=60)

    def ask(messages: list[dict]) -> tuple[str, str]:
        r = http.post(
            "/v1/chat/completions",
            json={"model": EMBEDDED_ID, "messages": messages, "temperature": 0, "max_tokens": 32},
        )
        assert r.status_code == 200, r.text
        return r.headers["x-clawd-turn-id"], r.json()["choices"][0]["message"]["content"]

    def exchange(first: str, then: str | None = None) -> str:
        msgs = [{"role": "user", "content": first}]
        tid, reply = ask(msgs)
        if then is not None:
            ask(msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": then}])
        return tid

    t0 = time.monotonic()
    thanked = exchange("What is the capital of France?", "Thanks, that's perfect!")
    corrected = exchange("Suggest a color for my living room.", "No, I meant a warm color like red or orange.")
    regenerated = exchange("Tell me a joke.")
    ask([{"role": "user", "content": "Tell me a joke."}])  # the regenerate button
    unrelated = exchange("Name a planet.", "What is the tallest mountain on Earth?")

    t1 = time.monotonic()
    d.run(d.state.miner.run_until_idle())
    print(f"\nchat {t1 - t0:.1f} s, mining {time.monotonic() - t1:.1f} s")
    got = {s["turn_id"]: s for s in http.get("/clawd/signals").json()}
    assert (got[thanked]["reward"], got[thanked]["reward_source"], got[thanked]["status"]) == (1, "rules", "ready")
    assert (got[corrected]["reward"], got[corrected]["reward_source"]) == (-1, "rules")
    assert (got[regenerated]["reward"], got[regenerated]["reward_source"]) == (-1, "requery")
    assert (got[unrelated]["reward"], got[unrelated]["status"]) == (0, "empty")

    s = got[corrected]
    assert s["hint"] == "I meant a warm color like red or orange."
    assert s["hints"][0]["source"] == "user" and s["teacher_arrays"] is True
    rec = d.run(turns.get_turn(d.state.db, corrected))
    sig = d.run(signals.get(d.state.db, corrected))
    n, k = len(rec.response_ids), 4
    assert n > 1
    assert sig.teacher_logprobs.shape == (n,) and sig.teacher_top_logprobs.shape == (n, k)
    assert sig.student_top_ids.shape == (n, k) and sig.student_top_logprobs.shape == (n, k)
    assert np.all(np.isfinite(sig.teacher_logprobs)) and np.all(sig.teacher_top_logprobs <= 0)
    assert np.all(np.diff(sig.student_top_logprobs, axis=1) <= 0)  # most likely first
    # Greedy sampling took the student's argmax at (almost) every position; the stored
    # sampled log-probs are the student's log-probs of those tokens, up to Q4_K's rounding
    # for other batch shapes (~0.1 nats: scoring decodes in chunks, generation one by one).
    top1 = sig.student_top_ids[:, 0] == np.asarray(rec.response_ids)
    assert top1.mean() >= 0.9
    np.testing.assert_allclose(sig.student_top_logprobs[top1, 0], rec.response_logprobs[top1], atol=0.15)
    assert 0 <= sig.hints[0]["overlap"] <= n * k
    print(
        f"\n270M: correction turn n={n}, overlap {sig.hints[0]['overlap']}/{n * k}, "
        f"top-1 = sampled at {top1.mean():.0%} of positions, "
        f"max|student top-1 - sampled logprob| {np.abs(sig.student_top_logprobs[top1, 0] - rec.response_logprobs[top1]).max():.2e}"
    )
    http.close()
