"""Checks that the tiny test models of `tiny_models` really work in llama.cpp.

Other tests rely on these models standing in for the embedded Gemma: if the tokenizer did not
round-trip, the logits were degenerate, or the LoRA did not load or did not change anything,
those tests would pass for the wrong reasons. These checks also pin down the llama-cpp-python
0.3.36 low-level calls clawd uses for runtime LoRA switching.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

try:  # tests/ may or may not be a package
    from tests.tiny_models import SUPPORTED_ARCHS, build_tiny_gguf, build_tiny_lora
except ImportError:  # pragma: no cover - depends on how pytest puts tests/ on sys.path
    from tiny_models import SUPPORTED_ARCHS, build_tiny_gguf, build_tiny_lora

llama_cpp = pytest.importorskip("llama_cpp")

PROMPT = "The quick brown fox jumps over the lazy dog. Hello"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="module", params=SUPPORTED_ARCHS)
def tiny(request, tiny_dir):
    """(arch, base path, lora path, Llama) per supported arch, loaded once per module."""
    arch = request.param
    base = build_tiny_gguf(tiny_dir / f"{arch}.gguf", arch=arch, chat_template="{{ bos_token }}x")
    lora = build_tiny_lora(tiny_dir / f"{arch}-lora.gguf", base)
    llm = llama_cpp.Llama(model_path=str(base), n_ctx=256, logits_all=True, verbose=False)
    yield arch, base, lora, llm
    llm.close()


def _last_logits(llm, text: str = PROMPT) -> np.ndarray:
    """Evaluate `text` from an empty KV cache and return the last position's logits.

    The memory is cleared explicitly (llama_memory_clear) and the high-level token counter
    reset, so no prompt-cache reuse can mix evaluations done under different adapters.
    """
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), True)
    llm.reset()
    tokens = llm.tokenize(text.encode("utf-8"), add_bos=True)
    llm.eval(tokens)
    return np.array(llm.scores[len(tokens) - 1], dtype=np.float32, copy=True)


def _set_loras(llm, adapters, scales) -> None:
    """llama_set_adapters_lora(ctx, llama_adapter_lora_p[n], n, c_float[n]); n=0 removes all."""
    n = len(adapters)
    if n == 0:
        rc = llama_cpp.llama_set_adapters_lora(llm._ctx.ctx, None, 0, None)
    else:
        arr = (llama_cpp.llama_adapter_lora_p_ctypes * n)(*adapters)
        sc = (ctypes.c_float * n)(*scales)
        rc = llama_cpp.llama_set_adapters_lora(llm._ctx.ctx, arr, n, sc)
    assert rc == 0


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


@pytest.mark.parametrize(
    "text",
    ["Hello, wörld! 123", "  leading spaces\tand tabs\nnew line", "日本語 ünïcödé 🙂", "<s> not special </s>", ""],
)
def test_tokenize_round_trip(tiny, text):
    """Byte-level BPE: any UTF-8 text survives tokenize -> detokenize unchanged."""
    _, _, _, llm = tiny
    toks = llm.tokenize(text.encode("utf-8"), add_bos=True)
    assert toks[0] == llm.token_bos() == 0
    assert llm.token_eos() == 1
    assert 0 not in toks[1:] and 1 not in toks[1:]  # "<s>" in text is plain text, not a control token
    assert llm.detokenize(toks[1:]).decode("utf-8") == text
    # llama-cpp-python quirk (a Llama-1 legacy in LlamaTokenizer.detokenize): when the first
    # token is BOS, ONE leading space of the decoded text is dropped. Detokenize without BOS.
    with_bos = llm.detokenize(toks).decode("utf-8")
    assert with_bos == (text[1:] if text.startswith(" ") else text)


def test_merges_are_used(tiny):
    """The merge table is live: " the" and "Hello" are one token each."""
    _, _, _, llm = tiny
    assert len(llm.tokenize(b" the", add_bos=False)) == 1
    assert len(llm.tokenize(b"Hello", add_bos=False)) == 1
    assert len(llm.tokenize(b"\xc3\xb6", add_bos=False)) == 2  # "ö" = two byte tokens


def test_metadata(tiny):
    """Arch and chat template are visible through llama-cpp-python's metadata."""
    arch, _, _, llm = tiny
    assert llm.metadata["general.architecture"] == arch
    assert llm.metadata["tokenizer.chat_template"] == "{{ bos_token }}x"
    assert llm.n_vocab() == llm.scores.shape[1]


def test_next_token_distribution_is_not_degenerate(tiny):
    """Random weights are scaled so the next-token distribution is spread but not uniform."""
    _, _, _, llm = tiny
    logits = _last_logits(llm)
    assert np.isfinite(logits).all()
    logp = _log_softmax(logits)
    p = np.exp(logp)
    entropy = float(-(p * logp).sum())
    assert 1.0 < entropy < np.log(len(p)) - 0.2, entropy
    assert p.max() < 0.9
    # Deterministic: the same prompt from a cleared cache gives bit-identical logits.
    assert np.array_equal(logits, _last_logits(llm))


def test_lora_runtime_switching(tiny):
    """The adapter loads at runtime, changes the logits, scales them, and removal restores the base exactly."""
    _, _, lora, llm = tiny
    base = _last_logits(llm)
    adapter = llama_cpp.llama_adapter_lora_init(llm._model.model, str(lora).encode())
    assert adapter, "llama_adapter_lora_init returned NULL"
    try:
        _set_loras(llm, [adapter], [1.0])
        with_lora = _last_logits(llm)
        assert np.abs(with_lora - base).max() > 1e-2

        _set_loras(llm, [adapter], [0.5])
        half = _last_logits(llm)
        assert not np.array_equal(half, with_lora) and not np.array_equal(half, base)

        _set_loras(llm, [adapter], [0.0])  # scale 0 = no adapter
        assert np.array_equal(_last_logits(llm), base)

        _set_loras(llm, [adapter], [1.0])
        assert np.array_equal(_last_logits(llm), with_lora)  # switching back is reproducible

        _set_loras(llm, [], [])  # remove all
        assert np.array_equal(_last_logits(llm), base)
    finally:
        _set_loras(llm, [], [])
        llama_cpp.llama_adapter_lora_free(adapter)


def test_lora_matches_merged_weights(tiny, tiny_dir):
    """Runtime LoRA at user scale s equals a base with W + s * alpha / r * B @ A merged in.

    This pins the adapter layout of CONVENTIONS.md §4 (A: (r, n_in), B: (n_out, r) in numpy
    order) and the effective scale alpha / r, which any converter to GGUF must respect.
    """
    import gguf

    arch, base_path, lora_path, llm = tiny
    user_scale = 0.7
    reader = gguf.GGUFReader(str(lora_path))
    alpha = float(reader.get_field("adapter.lora.alpha").contents())
    t = {x.name: np.array(x.data, dtype=np.float32) for x in reader.tensors}
    deltas = {}
    for name, a in t.items():
        if name.endswith(".lora_a"):
            w = name[: -len(".lora_a")]
            b = t[w + ".lora_b"]
            deltas[w] = user_scale * alpha / a.shape[0] * (b @ a)
    merged_path = build_tiny_gguf(tiny_dir / f"{arch}-merged.gguf", arch=arch, weight_deltas=deltas)
    merged = llama_cpp.Llama(model_path=str(merged_path), n_ctx=256, logits_all=True, verbose=False)
    try:
        want = _last_logits(merged)
    finally:
        merged.close()

    adapter = llama_cpp.llama_adapter_lora_init(llm._model.model, str(lora_path).encode())
    assert adapter
    try:
        _set_loras(llm, [adapter], [user_scale])
        got = _last_logits(llm)
    finally:
        _set_loras(llm, [], [])
        llama_cpp.llama_adapter_lora_free(adapter)
    base = _last_logits(llm)
    assert np.abs(got - want).max() < 1e-3 * max(1.0, np.abs(want - base).max())
    assert np.abs(got - base).max() > 1e-2


def test_lora_arch_mismatch_is_rejected(tiny_dir):
    """llama.cpp refuses an adapter written for another architecture (load returns NULL)."""
    llama_base = build_tiny_gguf(tiny_dir / "mm-llama.gguf", arch="llama")
    qwen_base = build_tiny_gguf(tiny_dir / "mm-qwen2.gguf", arch="qwen2")
    qwen_lora = build_tiny_lora(tiny_dir / "mm-qwen2-lora.gguf", qwen_base)
    llm = llama_cpp.Llama(model_path=str(llama_base), n_ctx=64, verbose=False)
    try:
        assert not llama_cpp.llama_adapter_lora_init(llm._model.model, str(qwen_lora).encode())
    finally:
        llm.close()


def test_build_is_deterministic_and_f16_loads(tiny_dir):
    """Same seed -> byte-identical file; f16 storage is accepted too."""
    a = build_tiny_gguf(tiny_dir / "det-a.gguf", seed=3)
    b = build_tiny_gguf(tiny_dir / "det-b.gguf", seed=3)
    assert a.read_bytes() == b.read_bytes()
    h = build_tiny_gguf(tiny_dir / "f16.gguf", seed=3, f16=True)
    assert h.stat().st_size < a.stat().st_size
    llm = llama_cpp.Llama(model_path=str(h), n_ctx=64, logits_all=True, verbose=False)
    try:
        assert np.isfinite(_last_logits(llm, "Hi")).all()
    finally:
        llm.close()
