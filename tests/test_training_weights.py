"""clawd.training.weights: a GGUF file as an mlx-lm model whose log-probs match llama.cpp's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from clawd.errors import ModelLoadError  # noqa: E402
from clawd.training.weights import load_model, permute_rows, unpermute_rows  # noqa: E402
from tests.tiny_models import build_tiny_gguf  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


# ---- helpers shared with test_training_export.py ----------------------------------------------


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-train")


def tiny(tiny_dir: Path, arch: str, f16: bool = False) -> Path:
    path = tiny_dir / f"tiny-{arch}{'-f16' if f16 else ''}.gguf"
    return path if path.exists() else build_tiny_gguf(path, arch=arch, f16=f16)


def random_ids(n_vocab: int, n: int = 150, seed: int = 0) -> list[int]:
    """BOS + n random tokens: longer than the tiny gemma3's 64-token sliding window."""
    return [0] + np.random.default_rng(seed).integers(2, n_vocab, n).tolist()


def mlx_logprobs(lm, ids: list[int]) -> np.ndarray:
    """(T-1, V) log-softmax of the logits predicting ids[1:]."""
    logits = lm.logits(lm.hidden(mx.array([ids[:-1]])))[0]
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def llamacpp_logprobs(path: Path, ids: list[int]) -> np.ndarray:
    """llama.cpp's (T-1, V) log-probs with an F32 KV cache: clawd's engine keeps K/V in F16,
    which alone moves tiny-model log-probs by ~3e-3 and would hide real mapping errors."""
    import llama_cpp

    llm = llama_cpp.Llama(
        str(path), n_ctx=256, n_threads=1, logits_all=True, type_k=0, type_v=0, flash_attn=False, verbose=False
    )
    llm.eval(ids[:-1])
    lg = np.array(llm.scores[: len(ids) - 1], dtype=np.float64)
    m = lg.max(-1, keepdims=True)
    return lg - m - np.log(np.exp(lg - m).sum(-1, keepdims=True))


def compare(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float, float]:
    """(max |Δ|, mean |Δ|, top-1 agreement) over full distributions."""
    d = np.abs(ours - ref)
    return float(d.max()), float(d.mean()), float((ours.argmax(-1) == ref.argmax(-1)).mean())


def copy_gguf(
    src: Path, dst: Path, *, arch: str | None = None, extra: dict | None = None, drop: tuple[str, ...] = ()
) -> Path:
    """Rewrite an F32/F16 GGUF with another architecture name and/or extra tensors."""
    import gguf

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), arch or r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        key = key.replace(f"{r.fields['general.architecture'].contents()}.", f"{arch}.", 1) if arch else key
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub)
    for t in r.tensors:
        if t.name not in drop:
            w.add_tensor(t.name, np.array(t.data))
    for name, arr in (extra or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


# ---- parity with llama.cpp ---------------------------------------------------------------------


@pytest.mark.parametrize("f16", [False, True], ids=["f32", "f16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_logprobs_match_llamacpp(tiny_dir, arch, f16):
    path = tiny(tiny_dir, arch, f16)
    lm = load_model(path)
    assert lm.arch == arch and lm.source == path
    ids = random_ids(lm.model.args.vocab_size)
    mx_max, mx_mean, top1 = compare(mlx_logprobs(lm, ids), llamacpp_logprobs(path, ids))
    # Measured, F32: llama/qwen2 ~5e-6, gemma3 ~6e-4 (ggml's GELU goes through an fp16 table).
    # F16 ~5e-3: ggml rounds the activations to F16 before each F16 matmul, MLX does not.
    tol = 1e-2 if f16 else 1e-3
    msg = f"{arch} {'f16' if f16 else 'f32'}: max |Δ| {mx_max:.2e}, mean {mx_mean:.2e}, top-1 {top1:.3f}"
    print(msg)
    assert mx_max < tol and top1 >= 0.99, msg


def test_gemma3_sliding_window_layers_match(tiny_dir):
    """Tiny gemma3: window 64, pattern 2 (layer 0 SWA, layer 1 global). With every layer
    global MLX is far off after position 64: the parity above really checks the SWA layout."""
    path = tiny(tiny_dir, "gemma3")
    lm = load_model(path)
    ids = random_ids(lm.model.args.vocab_size)
    ref = llamacpp_logprobs(path, ids)
    assert lm.model.args.sliding_window == 64 and lm.model.args.sliding_window_pattern == 2
    lm.model.model.sliding_window_pattern = 1
    assert compare(mlx_logprobs(lm, ids), ref)[0] > 0.1


def test_gemma3_embedding_scale_is_float32_like_llamacpp(tmp_path):
    """sqrt(40) is not a bfloat16 number (sqrt(64) is, so the default tiny model can't tell):
    mlx-lm's own bf16-rounded scale is ~7x further from llama.cpp than ours."""
    from mlx_lm.models import gemma3_text

    path = build_tiny_gguf(tmp_path / "g40.gguf", arch="gemma3", n_embd=40)
    lm = load_model(path)
    ids = random_ids(lm.model.args.vocab_size)
    ref = llamacpp_logprobs(path, ids)
    ours = compare(mlx_logprobs(lm, ids), ref)[0]
    lm.model.model.__class__ = gemma3_text.Gemma3Model
    stock = compare(mlx_logprobs(lm, ids), ref)[0]
    assert ours < 1e-3 and stock > 3 * ours, (ours, stock)


def test_llama_rope_freq_factors_match(tiny_dir, tmp_path):
    """Llama 3.1+ GGUFs carry rope_freqs.weight (per-dimension frequency divisors)."""
    head_dim = 64 // 4
    factors = np.linspace(1.0, 8.0, head_dim // 2).astype(np.float32)
    path = copy_gguf(tiny(tiny_dir, "llama"), tmp_path / "rope.gguf", extra={"rope_freqs.weight": factors})
    lm = load_model(path)
    ids = random_ids(lm.model.args.vocab_size)
    ref = llamacpp_logprobs(path, ids)
    mx_max, _, top1 = compare(mlx_logprobs(lm, ids), ref)
    assert mx_max < 2e-3 and top1 >= 0.99, (mx_max, top1)
    # ...and the factors matter: the plain model is far from it
    assert compare(mlx_logprobs(load_model(tiny(tiny_dir, "llama")), ids), ref)[0] > 0.1


def test_llama_permutation_round_trips():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    assert np.array_equal(unpermute_rows(permute_rows(w, 8), 8), w)
    assert not np.array_equal(permute_rows(w, 8), w)


# ---- the model object --------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_hidden_then_logits_is_the_forward_and_differentiable(tiny_dir, arch):
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    lm = load_model(tiny(tiny_dir, arch))
    ids = mx.array([random_ids(lm.model.args.vocab_size, 40)])
    h = lm.hidden(ids)
    assert h.shape == (1, 41, lm.model.args.hidden_size)
    out = lm.logits(h)
    assert out.dtype == mx.float32
    assert mx.array_equal(out, lm.model(ids)).item()

    lm.model.freeze()
    linear_to_lora_layers(
        lm.model,
        len(lm.model.layers),
        {"rank": 2, "scale": 1.0, "dropout": 0.0, "keys": ["self_attn.q_proj", "mlp.down_proj"]},
    )

    def loss(params):
        lm.model.update(params)
        return lm.logits(lm.hidden(ids)[:, -5:]).sum()

    grads = dict(tree_flatten(mx.grad(loss)(lm.model.trainable_parameters())))
    assert grads and all(k.endswith(("lora_a", "lora_b")) for k in grads)
    assert any(mx.abs(g).max().item() > 0 for k, g in grads.items() if k.endswith("lora_b"))


def test_gguf_tensor_names(tiny_dir):
    import gguf

    lm = load_model(tiny(tiny_dir, "gemma3"))
    assert lm.gguf_tensor_name("model.layers.3.self_attn.q_proj") == "blk.3.attn_q.weight"
    assert lm.gguf_tensor_name("model.layers.0.mlp.down_proj") == "blk.0.ffn_down.weight"
    assert lm.gguf_tensor_name("model.layers.1.pre_feedforward_layernorm") == "blk.1.ffn_norm.weight"
    assert lm.gguf_tensor_name("model.embed_tokens") == "token_embd.weight"
    assert lm.gguf_tensor_name("lm_head") == "output.weight"
    with pytest.raises(ValueError):
        lm.gguf_tensor_name("model.layers.0.self_attn.rope")
    # every linear module of every arch names a tensor of its base file
    for arch in ("llama", "qwen2", "gemma3"):
        lm = load_model(tiny(tiny_dir, arch))
        names = {t.name for t in gguf.GGUFReader(str(lm.source)).tensors}
        linears = [p for p, m in lm.model.named_modules() if type(m).__name__ == "Linear"]
        assert linears and all(lm.gguf_tensor_name(p) in names for p in linears), arch


def test_tokenizer_ids_are_llamacpps(tiny_dir):
    from clawd.engines.llamacpp import Engine

    path = tiny(tiny_dir, "gemma3")
    lm = load_model(path)
    eng = Engine(path, n_ctx=256, n_threads=1)
    try:
        for text in ["Hello the world", "héllo wörld ✓ 日本", "<s>special</s> tokens", ""]:
            for bos in (True, False):
                ids = lm.tokenizer.encode(text, add_bos=bos)
                assert ids == eng.tokenize(text, add_bos=bos), (text, bos)
                assert lm.tokenizer.decode(ids) == eng.detokenize(ids)
        assert lm.tokenizer.decode(lm.tokenizer.encode("héllo ✓", add_bos=False)) == "héllo ✓"
        assert lm.tokenizer.eos_ids == {1}
    finally:
        eng.close()


# ---- cache ----------------------------------------------------------------------------------------


def test_cache_round_trip(tiny_dir, tmp_path, monkeypatch):
    import gguf

    src = tiny(tiny_dir, "llama", f16=True)
    path = tmp_path / "model.gguf"
    path.write_bytes(src.read_bytes())
    cache = tmp_path / "cache"
    first = load_model(path, cache_dir=cache)
    entries = list((cache / "mlx-weights").iterdir())
    assert len(entries) == 1 and {p.name for p in entries[0].iterdir()} == {"weights.safetensors", "config.json"}

    def no_reading(*a, **k):
        raise AssertionError("the GGUF was read again despite the cache")

    monkeypatch.setattr(gguf, "GGUFReader", no_reading)
    second = load_model(path, cache_dir=cache)
    monkeypatch.undo()
    from mlx.utils import tree_flatten

    a, b = dict(tree_flatten(first.model.parameters())), dict(tree_flatten(second.model.parameters()))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)
    ids = mx.array([random_ids(first.model.args.vocab_size, 30)])
    assert mx.array_equal(first.model(ids), second.model(ids)).item()

    # a changed file gets a fresh entry; the stale one is removed
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    load_model(path, cache_dir=cache)
    new = list((cache / "mlx-weights").iterdir())
    assert len(new) == 1 and new[0] != entries[0]
    # a damaged entry is rebuilt, not trusted
    (new[0] / "weights.safetensors").write_bytes(b"junk")
    again = load_model(path, cache_dir=cache)
    assert mx.array_equal(again.model(ids), first.model(ids)).item()


# ---- errors ------------------------------------------------------------------------------------------


def test_bad_files_raise_model_load_error(tiny_dir, tmp_path):
    good = tiny(tiny_dir, "qwen2")
    cases = {
        "missing": tmp_path / "nope.gguf",
        "not gguf": tmp_path / "text.gguf",
        "garbage after magic": tmp_path / "garbage.gguf",
        "truncated": tmp_path / "truncated.gguf",
        "not a model dir": tmp_path / "emptydir",
    }
    cases["not gguf"].write_text("hello")
    cases["garbage after magic"].write_bytes(b"GGUF" + os.urandom(4000))
    cases["truncated"].write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    cases["not a model dir"].mkdir()
    for what, path in cases.items():
        with pytest.raises(ModelLoadError) as e:
            load_model(path, cache_dir=tmp_path / "cache")
        assert str(path) in str(e.value), (what, str(e.value))
        assert "\n" not in str(e.value)

    other = copy_gguf(good, tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ModelLoadError, match="architecture 'gpt2' cannot be trained"):
        load_model(other)
    moe = {"blk.0.ffn_gate_exps.weight": np.ones((2, 2), np.float32)}
    unknown = copy_gguf(good, tmp_path / "extra.gguf", extra=moe)
    with pytest.raises(ModelLoadError, match="ffn_gate_exps"):
        load_model(unknown)


def test_model_dir_loads_with_its_tokenizer(tiny_dir, tmp_path):
    """An MLX model directory (as mlx_lm.convert writes it) loads offline, float32."""
    from mlx.utils import tree_flatten

    lm = load_model(tiny(tiny_dir, "qwen2"))
    d = tmp_path / "mlx-model"
    d.mkdir()
    mx.save_safetensors(str(d / "model.safetensors"), dict(tree_flatten(lm.model.parameters())))
    args = {k: v for k, v in vars(lm.model.args).items()}
    (d / "config.json").write_text(json.dumps(args))
    _write_hf_tokenizer(d)
    lm2 = load_model(d)
    assert lm2.arch == "qwen2" and lm2.source == d
    ids = mx.array([random_ids(lm.model.args.vocab_size, 20)])
    assert mx.allclose(lm2.logits(lm2.hidden(ids)), lm.model(ids), atol=1e-5).item()
    text = "Hello the world"  # same byte-level BPE and merges as the GGUF's, so the same ids
    assert lm2.tokenizer.encode(text, add_bos=False) == lm.tokenizer.encode(text, add_bos=False)
    assert lm2.tokenizer.decode(lm2.tokenizer.encode("Hello world", add_bos=False)) == "Hello world"


def _write_hf_tokenizer(d: Path) -> None:
    """The tiny byte-level BPE as a tokenizers.json, so transformers loads it from disk."""
    from tests.tiny_models import tiny_vocab

    tokens, _, merges = tiny_vocab()
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, t in enumerate(tokens[:2])
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": vocab,
            "merges": merges,
        },
    }
    (d / "tokenizer.json").write_text(json.dumps(tok))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"})
    )


# ---- the real embedded model ------------------------------------------------------------------------

_REAL_CHILD = r"""
import json, sys, time
from pathlib import Path
from clawd.training import blas
blas.enable(Path(sys.argv[2]))  # before mlx: the trainer's BLAS, ~50x faster than the wheel's
t0 = time.perf_counter()
from clawd.training.weights import load_model
import mlx.core as mx
path, cache = Path(sys.argv[1]), Path(sys.argv[2])
t1 = time.perf_counter(); load_model(path, cache_dir=cache); first = time.perf_counter() - t1
t1 = time.perf_counter(); lm = load_model(path, cache_dir=cache); cached = time.perf_counter() - t1
ids = json.loads(sys.argv[3])
lg = lm.logits(lm.hidden(mx.array([ids[:-1]])))[0]
lp = mx.take_along_axis(lg, mx.array(ids[1:])[:, None], -1)[:, 0] - mx.logsumexp(lg, -1)
print(json.dumps({"first": first, "cached": cached, "logprobs": lp.tolist(),
                  "top": mx.argmax(lg, -1).tolist(), "ids": lm.tokenizer.encode(sys.argv[4], add_bos=True)}))
"""

_REAL_TEXT = (
    "The following is a conversation between a helpful assistant and a user.\n\n"
    "User: What is the capital of France?\nAssistant: The capital of France is Paris. Paris is known for "
    "the Eiffel Tower, the Louvre museum and its cafes. The city sits on the river Seine.\n"
    "User: Tell me about photosynthesis.\nAssistant: Photosynthesis is the process by which green plants "
    "use sunlight, water and carbon dioxide to make glucose and oxygen. It happens mostly in the leaves, "
    "inside chloroplasts that contain chlorophyll. The light reactions capture energy, and the Calvin "
    "cycle fixes carbon into sugars that the plant uses to grow.\n"
    "User: What is the boiling point of water?\nAssistant: At sea level, water boils at 100 degrees "
    "Celsius, or 212 degrees Fahrenheit. At higher altitudes it boils at a lower temperature.\n"
    "User: Who wrote Romeo and Juliet?\nAssistant: William Shakespeare wrote Romeo and Juliet, a tragedy "
    "about two young lovers from feuding families in Verona."
)


@pytest.mark.slow
def test_real_model_matches_llamacpp(tmp_path_factory):
    """Gemma 3 270M Q4_K_M: MLX on the dequantized weights vs llama.cpp's quantized matmuls."""
    from clawd.engines.llamacpp import Engine
    from clawd.models import ensure_embedded_model
    from clawd.paths import ensure_dirs, resolve_paths
    from tests.conftest import make_env

    home = tmp_path_factory.mktemp("real-home")
    paths = resolve_paths(make_env(home))
    ensure_dirs(paths)
    path = ensure_embedded_model(paths)
    eng = Engine(path, n_ctx=1024, n_threads=2)
    try:
        ids = eng.tokenize(_REAL_TEXT, add_bos=True)
        res = eng.score(ids[:1], ids[1:], top_k=1)
    finally:
        eng.close()
    proc = subprocess.run(
        [sys.executable, "-c", _REAL_CHILD, str(path), str(paths.cache_dir), json.dumps(ids), _REAL_TEXT],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ids"] == ids  # the trainer's tokenizer gives the served model's ids
    d = np.abs(np.array(out["logprobs"]) - res.logprobs)
    top1 = float((np.array(out["top"]) == res.top_ids[:, 0]).mean())
    msg = (
        f"270M over {len(d)} positions: mean |Δ| {d.mean():.4f}, max {d.max():.3f}, top-1 {top1:.3f}; "
        f"load {out['first']:.1f} s first, {out['cached']:.2f} s cached"
    )
    print(msg)
    assert len(d) >= 190
    assert d.mean() < 0.1 and d.max() < 1.0 and top1 >= 0.9, msg
    assert out["cached"] < 2.0, msg  # < 1 s on an idle machine; CI neighbours make it noisy
