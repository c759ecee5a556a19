"""The llama.cpp engine's two prompt caches: background work (slot 1) never evicts the
user's cached prompt (slot 0), and results do not depend on what the other slot holds."""

from __future__ import annotations

import numpy as np

from clawd.engines.base import SamplingParams
from clawd.engines.llamacpp import Engine


def test_background_slot_keeps_the_users_prompt_cache(tiny_gguf):
    e = Engine(tiny_gguf, n_ctx=256, n_threads=1)
    user = e.tokenize("User: hello there, how are you?\nAssistant:", add_bos=True)
    other = e.tokenize("Judge this answer please, carefully.", add_bos=True)
    greedy = SamplingParams(max_tokens=8, temperature=0)
    first = [t.id for t in e.generate(user, greedy)]
    cached = list(e._caches[0])
    assert cached[: len(user)] == user

    e.score(other, first, top_k=4, slot=1)  # background work in its own slot
    list(e.generate(other, greedy, slot=1))
    assert e._caches[0] == cached  # the user's prompt is still cached

    again = e.generate(user, greedy)
    assert [t.id for t in again] == first
    fresh = Engine(tiny_gguf, n_ctx=256, n_threads=1)
    ref = fresh.score(user, first, top_k=4)
    got = e.score(user, first, top_k=4)
    np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-5)
    np.testing.assert_array_equal(got.top_ids, ref.top_ids)


def test_full_cache_drops_the_other_slot_instead_of_failing(tiny_gguf):
    e = Engine(tiny_gguf, n_ctx=256, n_threads=1)
    n = int(e.info.n_ctx * 0.7)  # each fits alone; together they exceed the shared cells
    long_user = [2 + i % 250 for i in range(n)]
    long_bg = [3 + i % 250 for i in range(n)]
    e.score(long_user[:-10], long_user[-10:])
    res = e.score(long_bg[:-10], long_bg[-10:], slot=1)
    ref = Engine(tiny_gguf, n_ctx=256, n_threads=1).score(long_bg[:-10], long_bg[-10:])
    # Cells land elsewhere in the shared cache: attention sums in another order (~1e-5).
    np.testing.assert_allclose(res.logprobs, ref.logprobs, atol=1e-4)
    assert e._caches[0] == []  # the user's cache was the one given up


def test_a_user_prompt_dropped_for_background_work_comes_back_from_the_prefix_cache(tiny_gguf):
    """With model.prefix_cache_mb, the user's K/V that background work had to drop is parked
    first: the user's next turn restores it (only the new tokens are decoded) and scores as a
    fresh engine does."""
    e = Engine(tiny_gguf, n_ctx=256, n_threads=1, prefix_cache_mb=8)
    n = int(e.info.n_ctx * 0.7)
    long_user = [2 + i % 250 for i in range(n)]
    long_bg = [3 + i % 250 for i in range(n)]
    e.score(long_user[:-10], long_user[-10:])
    e.score(long_bg[:-10], long_bg[-10:], slot=1)
    assert e._caches[0] == [] and len(e.prefix_cache) == 1  # dropped, but parked first
    decoded = []
    inner = e._decode
    e._decode = lambda toks, pos, flags: (decoded.append(len(toks)), inner(toks, pos, flags))[1]
    got = e.score(long_user[:-10], long_user[-10:])
    assert sum(decoded) == 10 and e.prefix_cache.stats.hits == 1
    ref = Engine(tiny_gguf, n_ctx=256, n_threads=1).score(long_user[:-10], long_user[-10:])
    np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-4)
