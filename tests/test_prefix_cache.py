"""The prefix cache: saved K/V states in host memory, per adapter, LRU (engines/prefix_cache.py),
and the llama.cpp engine that parks and restores them.

The engine's answers with the cache must be the answers without it: every number is checked
against an independent reference (a fresh high-level `Llama` evaluation of the whole
sequence, tests/test_llamacpp_engine.py's Reference) and greedy tokens against an engine with
no cache. That it is a cache at all is checked by counting the tokens the engine decodes.
Tiny real GGUF models: llama (plain attention) and gemma3 (sliding-window layers, whose saved
state holds only the last window and so must never be cut back).
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from clawd.engines.base import SamplingParams
from clawd.engines.prefix_cache import PrefixCache, common_prefix
from tests.tiny_models import build_tiny_gguf

llama_cpp = pytest.importorskip("llama_cpp")
from clawd.engines.llamacpp import Engine  # noqa: E402  (after the importorskip)
from tests.test_llamacpp_engine import CHATML, GEN_ATOL, N_CTX, SCORE_ATOL, Reference  # noqa: E402

PREAMBLE = "You are a helpful agent. Tools: read_file, write_file, list_dir. " * 2
ASK_A = " User: open the file notes.txt and tell me the first line please"
ASK_B = " User: what is the weather like in Paris today my friend"
ASK_C = " User: list the folder and count the files in it"


# ---- the cache on its own ------------------------------------------------------------------


def test_common_prefix():
    a = np.array([1, 2, 3, 4], np.int32)
    assert common_prefix(a, np.array([1, 2, 9], np.int32)) == 2
    assert common_prefix(a, a[:3]) == 3
    assert common_prefix(a, np.array([], np.int32)) == 0
    assert common_prefix(a, np.array([5], np.int32)) == 0


def test_longest_usable_prefix_wins_and_hit_miss_are_counted():
    c = PrefixCache(1000)
    c.put(None, [1, 2, 3], "s123", 10, floor=0)
    c.put(None, [1, 2, 7, 8, 9], "s12789", 10, floor=0)
    entry, common = c.best(None, [1, 2, 7, 8, 5], limit=5)
    assert (entry.state, common) == ("s12789", 4)
    entry, common = c.best(None, [1, 2, 3, 4], limit=4)
    assert (entry.state, common) == ("s123", 3)
    assert c.best(None, [1, 2, 3, 4], limit=2)[1] == 2  # never past the limit
    assert c.best(None, [9, 9], limit=2) == (None, 0)
    assert (c.stats.hits, c.stats.misses) == (3, 1)


def test_floor_keeps_a_window_state_from_being_cut():
    c = PrefixCache(1000)
    c.put(None, [1, 2, 3, 4], "swa", 10, floor=4)
    assert c.best(None, [1, 2, 3, 9], limit=4) == (None, 0)  # would need cutting to 3
    assert c.best(None, [1, 2, 3, 4, 5], limit=5)[1] == 4  # extending it is fine


def test_cache_entries_are_per_adapter():
    c = PrefixCache(1000)
    c.put("a", [1, 2, 3], "under a", 10, floor=0)
    assert c.best(None, [1, 2, 3, 4], limit=4) == (None, 0)
    assert c.best("b", [1, 2, 3, 4], limit=4) == (None, 0)
    assert c.best("a", [1, 2, 3, 4], limit=4)[0].state == "under a"
    c.put(None, [1, 2, 3], "base", 10, floor=0)
    c.drop_adapter("a")
    assert [e.state for e in c.entries()] == ["base"]
    assert c.nbytes == 10


def test_least_recently_used_is_evicted_to_stay_under_the_bound():
    c = PrefixCache(30)
    for i in range(3):
        c.put(None, [i, 1, 2], f"s{i}", 10, floor=0)
    c.best(None, [0, 1, 2, 3], limit=4)  # s0 becomes the most recently used
    c.put(None, [7, 1, 2], "s7", 10, floor=0)
    assert [e.state for e in c.entries()] == ["s2", "s0", "s7"]  # s1 went
    assert c.nbytes == 30 and c.stats.evicted == 1
    c.put(None, [8, 1], "big", 25, floor=0)
    assert [e.state for e in c.entries()] == ["big"] and c.nbytes == 25
    assert not c.put(None, [9], "too big", 31, floor=0)  # never fits: not saved, nothing evicted
    assert [e.state for e in c.entries()] == ["big"]


def test_a_longer_state_replaces_the_prefixes_it_covers():
    c = PrefixCache(1000)
    c.put(None, [1, 2], "short", 10, floor=0)
    c.put(None, [1, 2, 3], "long", 10, floor=0)
    assert [e.state for e in c.entries()] == ["long"]
    assert c.covers(None, [1, 2], floor=0) and not c.covers("a", [1, 2], floor=0)
    # A window state (floor = its length) cannot stand in for its prefixes.
    c.put(None, [1, 2, 3, 4], "swa", 10, floor=4)
    assert [e.state for e in c.entries()] == ["long", "swa"]
    assert not c.covers(None, [1, 2, 3], floor=0) or c.best(None, [1, 2, 3, 9], limit=4)[0].state == "long"


def test_disabled_cache_saves_nothing():
    c = PrefixCache(0)
    assert not c.enabled
    assert not c.put(None, [1, 2, 3], "s", 1, floor=0)
    assert len(c) == 0


# ---- the llama.cpp engine with the cache ---------------------------------------------------

ARCHS = ("llama", "gemma3")


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_gguf):
    d = tmp_path_factory.mktemp("prefix-cache")
    return {a: tiny_gguf if a == "llama" else build_tiny_gguf(d / f"{a}.gguf", arch=a) for a in ARCHS}


def _engine(path, mb: float = 8.0) -> Engine:
    return Engine(path, n_ctx=N_CTX, n_threads=1, model_id="tiny", prefix_cache_mb=mb)


class Counting:
    """Counts the tokens an engine decodes (prefill and generation alike)."""

    def __init__(self, engine: Engine):
        self.n = 0
        inner = engine._decode

        def decode(tokens, start_pos, want_logits):
            self.n += len(tokens)
            return inner(tokens, start_pos, want_logits)

        engine._decode = decode

    def take(self) -> int:
        n, self.n = self.n, 0
        return n


def _greedy(engine, prompt, n=8, **kw):
    toks = list(engine.generate(prompt, SamplingParams(max_tokens=n, temperature=0), **kw))
    return [t.id for t in toks], np.array([t.logprob for t in toks])


def _check_against_reference(ref, prompt, ids, logprobs):
    rows = ref.logprobs(prompt + ids)[len(prompt) - 1 :]
    want = rows[np.arange(len(ids)), ids]
    assert float(np.abs(logprobs - want).max()) < GEN_ATOL
    assert ids == rows.argmax(axis=1).tolist()[: len(ids)]


@pytest.mark.parametrize("arch", ARCHS)
def test_switching_sessions_restores_the_parked_conversation(models, arch):
    """Session A, then B with the same preamble, then A's next turn: A's whole conversation
    comes back from the cache (only the new tokens are decoded) and the answer is the one a
    fresh evaluation gives."""
    eng, plain, ref = _engine(models[arch]), _engine(models[arch], mb=0), Reference(models[arch])
    try:
        count = Counting(eng)
        pre = eng.tokenize(PREAMBLE, add_bos=True)
        a1 = pre + eng.tokenize(ASK_A, add_bos=False)
        ids_a, _ = _greedy(eng, a1)
        b1 = pre + eng.tokenize(ASK_B, add_bos=False)
        _greedy(eng, b1)
        count.take()
        a2 = a1 + ids_a + eng.tokenize(ASK_C, add_bos=False)
        ids, lps = _greedy(eng, a2)
        new_tokens = len(a2) - len(a1) - len(ids_a) + 1  # + the last sampled token, never decoded
        assert count.take() == new_tokens + len(ids) - 1, "A's turn was not restored from the cache"
        assert eng.prefix_cache.stats.hits >= 1
        _check_against_reference(ref, a2, ids, lps)
        assert ids == _greedy(plain, a2)[0]
        # A third session with the same preamble starts from it, not from scratch.
        c1 = pre + eng.tokenize(ASK_C, add_bos=False)
        ids, lps = _greedy(eng, c1)
        assert count.take() <= len(c1) - len(pre) + len(ids) + 5
        _check_against_reference(ref, c1, ids, lps)
    finally:
        eng.close()
        plain.close()
        ref.close()


def test_a_miss_prefills_everything(models):
    eng = _engine(models["llama"])
    try:
        count = Counting(eng)
        one = eng.tokenize(PREAMBLE, add_bos=True)
        _greedy(eng, one, n=1)
        other = eng.tokenize(ASK_B * 3, add_bos=True)[1:]  # shares not even the BOS
        count.take()
        _greedy(eng, other, n=1)
        assert count.take() == len(other)
        assert eng.prefix_cache.stats.hits == 0 and eng.prefix_cache.stats.misses >= 1
    finally:
        eng.close()


def test_the_bound_holds_and_the_oldest_conversation_goes(models):
    eng = _engine(models["llama"])
    try:
        pre = eng.tokenize(PREAMBLE, add_bos=True)
        sessions = [pre + eng.tokenize(f"{i}{ASK_A}", add_bos=False) for i in range(4)]
        _greedy(eng, sessions[0], n=4)
        size = eng._lc.llama_state_seq_get_size(eng._ctx, 0)
        eng.prefix_cache.max_bytes = int(size * 2.5)  # room for two parked conversations
        for s in sessions[1:]:
            _greedy(eng, s, n=4)
        cache = eng.prefix_cache
        assert cache.nbytes <= cache.max_bytes and cache.stats.evicted == 1
        owners = [max(range(4), key=lambda i: common_prefix(e.tokens, np.array(sessions[i]))) for e in cache.entries()]
        assert owners == [1, 2]  # session 0 (the least recently used) went; 3 is live
    finally:
        eng.close()


def test_entries_are_per_adapter(tiny_gguf, tiny_lora):
    """A state saved under an adapter is never used without it (nor the base's under it),
    and loading a new file under the same adapter id forgets the old file's states."""
    eng, ref = _engine(tiny_gguf), Reference(tiny_gguf)
    try:
        eng.load_adapter("a", tiny_lora)
        count = Counting(eng)
        prompt = eng.tokenize(PREAMBLE + ASK_A, add_bos=True)
        targets = eng.tokenize(" and the quick brown fox", add_bos=False)
        with_a = eng.score(prompt, targets, adapter="a")
        base = eng.score(prompt, targets)  # parks a's state, must not use it
        assert eng.prefix_cache.stats.hits == 0
        assert [e.adapter for e in eng.prefix_cache.entries()] == ["a"]
        assert float(np.abs(base.logprobs - with_a.logprobs).max()) > 0.05
        assert float(np.abs(base.logprobs - ref.score(prompt, targets, 1)[0]).max()) < SCORE_ATOL
        count.take()
        again = eng.score(prompt, targets, adapter="a")  # a's own state comes back
        assert eng.prefix_cache.stats.hits == 1
        assert count.take() == len(targets)
        assert np.array_equal(again.logprobs, with_a.logprobs)
        assert sorted(e.adapter or "" for e in eng.prefix_cache.entries()) == ["", "a"]
        assert np.array_equal(eng.score(prompt, targets).logprobs, base.logprobs)  # the base's, restored
        assert eng.prefix_cache.stats.hits == 2
        eng.load_adapter("a", tiny_lora)  # a new file under the id: its old states are stale
        assert [e.adapter for e in eng.prefix_cache.entries()] == [None]
        count.take()
        fresh = eng.score(prompt, targets, adapter="a")
        assert count.take() == len(prompt) + len(targets) - 1
        assert np.array_equal(fresh.logprobs, with_a.logprobs)
    finally:
        eng.close()
        ref.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_scoring_is_unchanged_by_the_cache(models, arch):
    """Judges and teacher scoring share the engine (slot 1): they restore what user turns
    (slot 0) parked but never park their own prompts (the miner's many judge prompts would push
    users' conversations out); a restored prefix scores as the reference does; and
    reuse_cache=False stays bit-identical whatever the cache holds."""
    eng, plain, ref = _engine(models[arch]), _engine(models[arch], mb=0), Reference(models[arch])
    try:
        pre = eng.tokenize(PREAMBLE, add_bos=True)
        prompt = pre + eng.tokenize(ASK_A, add_bos=False)
        targets = eng.tokenize(" the first line says hello", add_bos=False)
        fresh = plain.score(prompt, targets, top_k=4, reuse_cache=False)
        for slot in (0, 1):
            saved = eng.prefix_cache.stats.saved
            first = eng.score(prompt, targets, top_k=4, slot=slot)
            eng.score(pre + eng.tokenize(ASK_B, add_bos=False), targets, slot=slot)  # another session
            again = eng.score(prompt, targets, top_k=4, slot=slot)
            # Bit-equal on llama (the same prefix, restored); gemma3 restores only the shared
            # preamble and prefills the rest in other batch shapes, which moves the last bits.
            assert float(np.abs(again.logprobs - first.logprobs).max()) < SCORE_ATOL
            assert np.array_equal(again.top_ids, fresh.top_ids)
            lp = ref.score(prompt, targets, 4)[0]
            assert float(np.abs(again.logprobs - lp).max()) < SCORE_ATOL
            assert np.array_equal(
                eng.score(prompt, targets, top_k=4, reuse_cache=False, slot=slot).logprobs, fresh.logprobs
            )
            assert (eng.prefix_cache.stats.saved > saved) == (slot == 0)
        # llama restores the whole scored prefix in both slots; gemma3 only the preamble, once,
        # into the empty slot 1 (its live slot already holds the preamble otherwise).
        assert eng.prefix_cache.stats.hits >= (2 if arch == "llama" else 1)
    finally:
        eng.close()
        plain.close()
        ref.close()


def test_a_restored_window_state_is_never_cut(models):
    """gemma3's SWA layers save only their last window: a restored state may be extended but
    a prompt that parts from it inside must be prefilled, not served from a cut state."""
    eng, ref = _engine(models["gemma3"]), Reference(models["gemma3"])
    try:
        assert eng._swa
        pre = eng.tokenize(PREAMBLE, add_bos=True)
        a = pre + eng.tokenize(ASK_A, add_bos=False)
        ids_a, _ = _greedy(eng, a, n=2)
        eng.score(eng.tokenize(ASK_B * 3, add_bos=True)[1:], [5, 6])  # evict slot 0 by another prompt
        hits = eng.prefix_cache.stats.hits
        _greedy(eng, a + ids_a + [7], n=1)  # restores a's state (floor = its length)
        assert eng.prefix_cache.stats.hits == hits + 1 and eng._floors[0] == len(a) + 1
        cut = a[: len(a) - 45] + eng.tokenize(ASK_C, add_bos=False)  # parts 45 tokens back
        ids, lps = _greedy(eng, cut)
        _check_against_reference(ref, cut, ids, lps)
        assert eng._floors[0] == 0  # prefilled afresh: no restored window left to protect
    finally:
        eng.close()
        ref.close()


def test_the_daemon_engine_gets_its_bound_from_config(tiny_gguf):
    from clawd.config import ModelSettings
    from clawd.models import ModelChoice, load_engine

    assert ModelSettings().prefix_cache_mb > 0 and ModelSettings().n_ctx >= 8192  # on, and room for agents
    eng = load_engine(
        ModelSettings(path=str(tiny_gguf), prefix_cache_mb=3, n_threads=1), ModelChoice("t", tiny_gguf, False)
    )
    try:
        assert eng.prefix_cache.max_bytes == 3 * 2**20
    finally:
        eng.close()


def test_through_the_daemon_sessions_share_the_preamble(clawd_home, tmp_path):
    """Over HTTP: session A, session B with the same system prompt, then A's next turn. A's
    conversation is restored, not re-read, and each logged turn's log-probs are what a fresh
    evaluation of its exact prompt gives."""
    from clawd.store import turns
    from tests.conftest import AUTH, start_daemon

    model = build_tiny_gguf(tmp_path / "chat.gguf", chat_template=CHATML)
    eng = Engine(model, n_ctx=512, n_threads=1, model_id="tiny", prefix_cache_mb=8)
    count = Counting(eng)
    d = start_daemon(clawd_home, eng)
    ref = Reference(model)
    ref.llm.close()  # the same reference, with room for a three-turn chat
    ref.llm = llama_cpp.Llama(model_path=str(model), n_ctx=512, logits_all=True, verbose=False, n_threads=1)
    try:
        system = {"role": "system", "content": PREAMBLE}

        def ask(session, messages):
            body = {"model": "tiny", "messages": messages, "session_id": session, "temperature": 0, "max_tokens": 6}
            r = httpx.post(d.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
            assert r.status_code == 200, r.text
            rec = d.run(turns.get_turn(d.state.db, r.json()["id"]))
            want = ref.logprobs(rec.prompt_ids + rec.response_ids)[len(rec.prompt_ids) - 1 :]
            got = np.asarray(rec.response_logprobs, np.float64)
            assert float(np.abs(got - want[np.arange(len(got)), rec.response_ids]).max()) < GEN_ATOL
            return r.json()["choices"][0]["message"]["content"], rec

        a = [system, {"role": "user", "content": ASK_A}]
        reply, _ = ask("a", a)
        ask("b", [system, {"role": "user", "content": ASK_B}])
        hits = eng.prefix_cache.stats.hits
        count.take()
        a += [{"role": "assistant", "content": reply}, {"role": "user", "content": ASK_C}]
        _, rec = ask("a", a)
        assert eng.prefix_cache.stats.hits == hits + 1
        assert count.take() < len(rec.prompt_ids) // 2  # the rest came back from the cache
    finally:
        d.stop()
        eng.close()
        ref.close()
