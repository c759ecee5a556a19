"""The llama.cpp engine against an independent reference, plus its llama.cpp-only duties.

Reference: llama-cpp-python's high-level `Llama(..., logits_all=True)` evaluates the whole
sequence in one batch and keeps every row of logits; we take the log-softmax in NumPy
(float64). Our engine drives the low-level API itself (its own batches, KV-cache reuse,
runtime LoRA), so agreement means its positions, batching and adapter handling are right.

Tolerances, measured on the tiny F32 models (flash attention off in both):
- score() vs reference: same kernels and batch shape for the scored rows; measured max
  |Δ| <= 4.7e-7 (log-probs, top-k and with a LoRA alike). SCORE_ATOL = 1e-5.
- generate() vs reference: generate decodes one token per batch and ggml rounds differently
  per batch shape; worst seen 3.8e-4 (median ~5e-5); the reference fed one token at a time
  matches generate() to ~6e-6. GEN_ATOL = 1e-3.
- The tiny LoRA (rank 4, alpha 8) moves log-probs by 0.4-1.8 nats, far above both.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from clawd.engines.base import SamplingParams
from clawd.errors import AdapterError, ContextLengthExceeded, ModelLoadError
from tests.tiny_models import SUPPORTED_ARCHS, build_tiny_gguf, build_tiny_lora

llama_cpp = pytest.importorskip("llama_cpp")
from clawd.engines.llamacpp import Engine  # noqa: E402  (after the importorskip)

N_CTX = 256
SCORE_ATOL = 1e-5
GEN_ATOL = 1e-3
PROMPT = "The quick brown fox jumps over the lazy dog. Hello"
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _engine(path, **kw) -> Engine:
    # One thread: these models are tiny, and two spinning threads on a busy 2-core machine
    # turn milliseconds into seconds.
    return Engine(path, n_ctx=N_CTX, n_threads=1, model_id="tiny", **kw)


@pytest.fixture
def engine(tiny_gguf):
    e = _engine(tiny_gguf)
    yield e
    e.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_gguf):
    """arch -> tiny base model path (llama is the shared `tiny_gguf`)."""
    d = tmp_path_factory.mktemp("llamacpp-engine")
    return {a: tiny_gguf if a == "llama" else build_tiny_gguf(d / f"{a}.gguf", arch=a) for a in SUPPORTED_ARCHS}


class Reference:
    """High-level llama-cpp-python, optionally wearing one LoRA through the low-level calls."""

    def __init__(self, path):
        self.llm = llama_cpp.Llama(
            model_path=str(path), n_ctx=N_CTX, logits_all=True, verbose=False, n_threads=1, n_threads_batch=1
        )  # threads do not change the numbers
        self.adapters = []

    def set_lora(self, path) -> None:
        handle = llama_cpp.llama_adapter_lora_init(self.llm._model.model, str(path).encode())
        assert handle, "reference could not load the adapter"
        self.adapters.append(handle)
        arr = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(handle)
        scale = (ctypes.c_float * 1)(1.0)
        assert llama_cpp.llama_set_adapters_lora(self.llm._ctx.ctx, arr, 1, scale) == 0

    def clear_lora(self) -> None:
        assert llama_cpp.llama_set_adapters_lora(self.llm._ctx.ctx, None, 0, None) == 0

    def logprobs(self, tokens) -> np.ndarray:
        """(len(tokens) - 1, vocab) float64: row i = log p(. | tokens[: i + 1])."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.llm._ctx.ctx), True)
        self.llm.reset()  # no prompt-cache reuse across calls (or adapters)
        self.llm.eval(list(tokens))
        x = np.array(self.llm.scores[: len(tokens) - 1], dtype=np.float64)
        x -= x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))

    def score(self, prompt, targets, top_k):
        rows = self.logprobs(list(prompt) + list(targets))[len(prompt) - 1 :]
        lp = rows[np.arange(len(targets)), targets]
        top = np.argsort(-rows, axis=1, kind="stable")[:, :top_k]
        return lp, top, np.take_along_axis(rows, top, axis=1), rows

    def close(self) -> None:
        self.clear_lora()
        for h in self.adapters:
            llama_cpp.llama_adapter_lora_free(h)
        self.llm.close()


@pytest.fixture(scope="module")
def ref(tiny_gguf):
    r = Reference(tiny_gguf)
    yield r
    r.close()


def _max_abs(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


# ---- numbers against the reference ----------------------------------------------------


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_generate_logprobs_match_reference(models, arch):
    eng, rf = _engine(models[arch]), Reference(models[arch])
    try:
        prompt = eng.tokenize(PROMPT, add_bos=True)
        toks = list(eng.generate(prompt, SamplingParams(max_tokens=40, temperature=1.0, top_p=0.95, seed=7)))
        ids = [t.id for t in toks]
        _, _, _, rows = rf.score(prompt, ids, top_k=1)
        got = np.array([t.logprob for t in toks])
        want = rows[np.arange(len(ids)), ids]
        assert _max_abs(got, want) < GEN_ATOL, f"{arch}: generate vs reference max |Δ| {_max_abs(got, want):.2e}"
        # Every sampled token lies inside what top_k=40 / top_p=0.95 allow under the reference.
        for row, tok in zip(rows, ids):
            better = row > row[tok] + GEN_ATOL
            assert better.sum() < 40
            assert np.exp(row[better]).sum() < 0.95 + 1e-3
        # Greedy follows the reference's argmax.
        greedy = [t.id for t in eng.generate(prompt, SamplingParams(max_tokens=20, temperature=0))]
        rows = rf.logprobs(prompt + greedy)[len(prompt) - 1 :]
        assert greedy == rows.argmax(axis=1).tolist()[: len(greedy)]
    finally:
        eng.close()
        rf.close()


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("n_batch", [512, 16])
def test_score_matches_reference(models, arch, n_batch):
    """150 targets span three 64-row score chunks; n_batch=16 forces many small batches."""
    eng, rf = _engine(models[arch], n_batch=n_batch), Reference(models[arch])
    try:
        text = "The quick brown fox jumps over the lazy dog. " * 6
        seq = eng.tokenize(text, add_bos=True)
        assert len(seq) > 180
        prompt, targets = seq[:30], seq[30:180]
        res = eng.score(prompt, targets, top_k=8)
        lp, top_ids, top_lps, _ = rf.score(prompt, targets, top_k=8)
        diff = _max_abs(res.logprobs, lp)
        assert diff < SCORE_ATOL, f"{arch}: score vs reference max |Δ| {diff:.2e}"
        assert np.array_equal(res.top_ids, top_ids)
        assert _max_abs(res.top_logprobs, top_lps) < SCORE_ATOL
        # Scoring again reuses the cached prefix; the answer must not move.
        again = eng.score(prompt, targets, top_k=8)
        assert _max_abs(again.logprobs, lp) < SCORE_ATOL and np.array_equal(again.top_ids, top_ids)
    finally:
        eng.close()
        rf.close()


def test_fresh_score_is_bit_identical_whatever_ran_before(engine):
    """reuse_cache=False recomputes every position, so the numbers do not depend on what the
    cache held (a cached prefix computed in other batch shapes can move the last bits)."""
    seq = engine.tokenize("The quick brown fox jumps over the lazy dog. " * 4, add_bos=True)
    prompt, targets = seq[:20], seq[20:40]
    first = engine.score(prompt, targets, reuse_cache=False)
    for other in (seq[:25], seq[:7] + seq[30:35], seq[:3]):  # leave different prefixes cached
        engine.score(other, seq[40:44])
        again = engine.score(prompt, targets, reuse_cache=False)
        assert np.array_equal(again.logprobs, first.logprobs)


def test_generation_at_the_end_of_the_context(engine, ref):
    filler = engine.tokenize("Hello the world and the sea. " * 40, add_bos=True)
    for room in (1, 3):
        prompt = filler[: N_CTX - room]
        toks = list(engine.generate(prompt, SamplingParams(max_tokens=50, temperature=1.0, seed=room)))
        assert 1 <= len(toks) <= room
        want = ref.logprobs(prompt + [t.id for t in toks])[len(prompt) - 1 :]
        got = [t.logprob for t in toks]
        assert _max_abs(got, want[np.arange(len(toks)), [t.id for t in toks]]) < GEN_ATOL
    with pytest.raises(ContextLengthExceeded, match=str(N_CTX)):
        engine.generate(filler[:N_CTX], SamplingParams(max_tokens=1))
    # After filling the cache to the brim, a short request is still right.
    prompt = engine.tokenize(PROMPT, add_bos=True)
    res = engine.score(prompt, prompt[1:9])
    assert _max_abs(res.logprobs, ref.score(prompt, prompt[1:9], 1)[0]) < SCORE_ATOL


def test_score_fills_the_context_exactly(engine, ref):
    """Scoring decodes every token but the last, so prompt + target may fill n_ctx to the brim;
    one more token is too many."""
    filler = engine.tokenize("Hello the world and the sea. " * 40, add_bos=True)
    assert len(filler) > N_CTX
    seq = filler[:N_CTX]
    prompt, target = seq[:200], seq[200:]
    res = engine.score(prompt, target)
    assert len(res.logprobs) == N_CTX - 200
    assert _max_abs(res.logprobs, ref.score(prompt, target, 1)[0]) < SCORE_ATOL
    with pytest.raises(ContextLengthExceeded, match=str(N_CTX)):
        engine.score(prompt, filler[200 : N_CTX + 1])
    # Still right afterwards.
    prompt = engine.tokenize(PROMPT, add_bos=True)
    res = engine.score(prompt, prompt[1:9])
    assert _max_abs(res.logprobs, ref.score(prompt, prompt[1:9], 1)[0]) < SCORE_ATOL


# ---- runtime LoRA ------------------------------------------------------------------------


def test_lora_switching(engine, ref, tiny_lora):
    prompt = engine.tokenize(PROMPT, add_bos=True)
    targets = engine.tokenize(" and the quick brown fox", add_bos=False)
    base = engine.score(prompt, targets, top_k=5)

    engine.load_adapter("a", tiny_lora)
    assert engine.loaded_adapters == ["a"]
    with_a = engine.score(prompt, targets, top_k=5, adapter="a")
    assert _max_abs(with_a.logprobs, base.logprobs) > 0.05

    # The same adapter applied by the reference on its own context.
    ref.set_lora(tiny_lora)
    try:
        lp, top_ids, top_lps, _ = ref.score(prompt, targets, top_k=5)
        toks = list(engine.generate(prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=3), adapter="a"))
        ids = [t.id for t in toks]
        rows = ref.logprobs(prompt + ids)[len(prompt) - 1 :]
    finally:
        ref.clear_lora()
    assert _max_abs(with_a.logprobs, lp) < SCORE_ATOL, f"LoRA score vs reference {_max_abs(with_a.logprobs, lp):.2e}"
    assert np.array_equal(with_a.top_ids, top_ids) and _max_abs(with_a.top_logprobs, top_lps) < SCORE_ATOL
    assert _max_abs([t.logprob for t in toks], rows[np.arange(len(ids)), ids]) < GEN_ATOL

    # Back to the base model: bit-exact, both right after the adapter and after generating.
    for _ in range(2):
        again = engine.score(prompt, targets, top_k=5)
        assert np.array_equal(again.logprobs, base.logprobs)
        assert np.array_equal(again.top_ids, base.top_ids) and np.array_equal(again.top_logprobs, base.top_logprobs)
    assert np.array_equal(engine.score(prompt, targets, adapter="a").logprobs, with_a.logprobs)

    engine.unload_adapter("a")
    assert engine.loaded_adapters == []
    with pytest.raises(AdapterError, match="'a'"):
        engine.score(prompt, targets, adapter="a")
    with pytest.raises(AdapterError):
        engine.generate(prompt, SamplingParams(max_tokens=2), adapter="a")
    assert np.array_equal(engine.score(prompt, targets).logprobs, base.logprobs)

    engine.load_adapter("a", tiny_lora)  # reload works and gives the same numbers
    assert np.array_equal(engine.score(prompt, targets, adapter="a").logprobs, with_a.logprobs)
    engine.load_adapter("a", tiny_lora)  # re-loading an id replaces it
    assert engine.loaded_adapters == ["a"]
    assert np.array_equal(engine.score(prompt, targets, adapter="a").logprobs, with_a.logprobs)


def test_lora_for_another_arch_is_refused(engine, tiny_lora, tmp_path):
    qwen = build_tiny_gguf(tmp_path / "qwen2.gguf", arch="qwen2")
    qwen_lora = build_tiny_lora(tmp_path / "qwen2-lora.gguf", qwen)
    prompt = engine.tokenize(PROMPT, add_bos=True)
    targets = prompt[1:12]
    engine.load_adapter("a", tiny_lora)
    base = engine.score(prompt, targets)
    with_a = engine.score(prompt, targets, adapter="a")

    with pytest.raises(AdapterError, match="qwen2-lora.gguf"):
        engine.load_adapter("q", qwen_lora)
    assert engine.loaded_adapters == ["a"]
    with pytest.raises(AdapterError, match="qwen2-lora.gguf"):
        engine.load_adapter("a", qwen_lora)  # a failed reload keeps the old adapter
    assert engine.loaded_adapters == ["a"]
    assert np.array_equal(engine.score(prompt, targets).logprobs, base.logprobs)
    assert np.array_equal(engine.score(prompt, targets, adapter="a").logprobs, with_a.logprobs)


def test_bad_adapter_files(engine, tiny_gguf, tiny_lora, tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not an adapter\n" * 20)
    truncated = tmp_path / "truncated-lora.gguf"
    data = tiny_lora.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    prompt = engine.tokenize(PROMPT, add_bos=True)
    base = engine.score(prompt, prompt[1:10])
    for path in (tmp_path / "missing.gguf", garbage, truncated, tiny_gguf):  # the last: a model, not an adapter
        with pytest.raises(AdapterError) as e:
            engine.load_adapter("bad", path)
        assert str(path) in e.value.message and "\n" not in e.value.message
        assert e.value.status == 400
    assert engine.loaded_adapters == []
    assert np.array_equal(engine.score(prompt, prompt[1:10]).logprobs, base.logprobs)


# ---- loading ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["missing", "directory", "not-gguf", "empty", "truncated-half", "header-only"])
def test_model_load_errors(kind, tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    path = tmp_path / f"{kind}.gguf"
    if kind == "directory":
        path.mkdir()
    elif kind == "not-gguf":
        path.write_text("<html>404 Not Found</html>\n")
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncated-half":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "header-only":
        path.write_bytes(data[:100])
    with pytest.raises(ModelLoadError) as e:
        _engine(path)
    msg = e.value.message
    assert "\n" not in msg and str(path) in msg
    assert any(w in msg for w in ("fix model.path", "point model.path", "re-download")), msg
    # The process is fine: a good model still loads and runs.
    ok = _engine(tiny_gguf)
    try:
        assert len(list(ok.generate(ok.tokenize("Hi", add_bos=True), SamplingParams(max_tokens=2)))) >= 1
    finally:
        ok.close()


# ---- chat template -----------------------------------------------------------------------


def test_chat_template_is_reported(tmp_path):
    path = build_tiny_gguf(tmp_path / "chatml.gguf", chat_template=CHATML)
    long_tpl = "{# " + "a long comment " * 400 + "#}" + CHATML  # > 4 KiB, as real templates are
    long_path = build_tiny_gguf(tmp_path / "long.gguf", chat_template=long_tpl)
    for p, want in ((path, CHATML), (long_path, long_tpl)):
        e = _engine(p)
        try:
            assert e.info.chat_template == want
        finally:
            e.close()
