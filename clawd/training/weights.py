"""The served model as an mlx-lm model: GGUF (or an MLX/HF model directory) -> float32 MLX weights.

Boundary: everything that knows how GGUF tensors, metadata and tokenizers map onto mlx-lm's
own model classes (llama, qwen2, qwen3, gemma3_text) lives here, including the two places
where llama.cpp and mlx-lm disagree (llama's permuted q/k rows, Gemma's +1 norms and embedding
scale). The trainer gets a `LoadedModel` whose log-probs match llama.cpp's on the same weights.

Dequantization uses `gguf.quants.dequantize` (bit-exact with ggml; `mx.load` of a GGUF file gets
Q4_K wrong and cannot read Q5_0, STACK.md). The result is cached as safetensors + JSON, so
only the first load of a model file pays for it (~25 s for the 270M model).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import gemma3_text
from mlx_lm.models.base import create_attention_mask

from clawd.errors import ModelLoadError
from clawd.modelfile import ARCH_BY_MODEL_TYPE, MODEL_TYPES, open_gguf, read_model_config

CACHE_VERSION = 1  # bump when the cached weights' meaning changes

# GGUF per-block tensor -> mlx-lm module path (relative to model.layers.N).
_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 3 has four norms per block; GGUF's ffn_norm is the *pre*-FFN one there.
_BLOCK_GEMMA3 = {
    **_BLOCK,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class Tokenizer(Protocol):
    eos_ids: frozenset[int]

    def encode(self, text: str, add_bos: bool) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class LoadedModel:
    model: nn.Module  # mlx_lm.models.<type>.Model, float32 weights
    arch: str  # GGUF spelling: gemma3 | llama | qwen2 | qwen3
    source: Path
    tokenizer: Tokenizer

    def hidden(self, input_ids: mx.array) -> mx.array:
        """(B, T) token ids -> (B, T, d) final hidden states, after the final norm."""
        return self.model.model(input_ids)

    def logits(self, hidden: mx.array) -> mx.array:
        """(..., d) -> (..., V) float32; `logits(hidden(x)) == model(x)`."""
        if "lm_head" in self.model:
            out = self.model.lm_head(hidden)
        else:  # tied head
            out = self.model.model.embed_tokens.as_linear(hidden)
        return out.astype(mx.float32)

    def gguf_tensor_name(self, module_path: str) -> str:
        """ "model.layers.3.self_attn.q_proj" -> "blk.3.attn_q.weight"."""
        return gguf_tensor_name(self.arch, module_path)


def gguf_tensor_name(arch: str, module_path: str) -> str:
    path = module_path.removesuffix(".weight")
    for g, m in _GLOBAL.items():
        if path == m:
            return f"{g}.weight"
    parts = path.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        rest = ".".join(parts[3:])
        for g, m in (_BLOCK_GEMMA3 if arch == "gemma3" else _BLOCK).items():
            if rest == m:
                return f"blk.{parts[2]}.{g}.weight"
    raise ValueError(f"no GGUF tensor for module {module_path!r} ({arch})")


def _mlx_name(arch: str, gguf_name: str) -> str | None:
    base, _, leaf = gguf_name.rpartition(".")  # leaf: weight | bias
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{leaf}"
    parts = base.split(".")
    table = _BLOCK_GEMMA3 if arch == "gemma3" else _BLOCK
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in table:
        return f"model.layers.{parts[1]}.{table[parts[2]]}.{leaf}"
    return None


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter (convert_hf_to_gguf.py LlamaModel.permute) on llama q/k rows:
    HF's rotate-half pairs (i, i + d/2) become adjacent rows (2i, 2i + 1) for ggml's rope."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute_rows`."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _Gemma3Model(gemma3_text.Gemma3Model):
    """gemma3_text's model, but the embedding scale is sqrt(d) in float32 like llama.cpp
    (mlx-lm rounds it through bfloat16: 25.25 instead of 25.298 for d = 640)."""

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None):
        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings
        h = h * mx.array(math.sqrt(self.args.hidden_size), mx.float32).astype(h.dtype)
        if cache is None:
            cache = [None] * len(self.layers)
        p = self.sliding_window_pattern
        global_mask = create_attention_mask(h, cache[p - 1])
        swa_mask = create_attention_mask(h, cache[0], window_size=self.window_size) if p > 1 else None
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            h = layer(h, global_mask if i % p == p - 1 else swa_mask, c)
        return self.norm(h)


class _FreqsRoPE(nn.Module):
    """RoPE with llama.cpp's per-dimension frequency factors (`rope_freqs.weight`, Llama 3.1+),
    exactly as ggml applies them: theta_i = pos * base^(-2i/d) / factor_i."""

    def __init__(self, dims: int, base: float, factors: np.ndarray):
        super().__init__()
        self.dims = dims
        periods = base ** (np.arange(0, dims, 2, dtype=np.float64) / dims) * factors.astype(np.float64)
        self._freqs = mx.array(periods.astype(np.float32))

    def __call__(self, x, offset: int = 0):
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._freqs)


# ---- GGUF ----------------------------------------------------------------------------------


def _fields(reader) -> dict:
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key != "tokenizer.ggml.tokens":
            continue
        if key == "tokenizer.ggml.tokens":
            out["n_vocab"] = len(field.data)
            continue
        try:
            out[key] = field.contents()
        except Exception:  # an odd field we never read
            continue
    return out


def _model_args(meta: dict, arch: str, path: Path) -> dict:
    """mlx-lm ModelArgs (as a dict) from GGUF metadata, the way llama.cpp reads it."""

    def get(key, default=None):
        v = meta.get(f"{arch}.{key}", default)
        if v is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}; re-convert the model")
        return v

    n_embd, n_head = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", n_embd // n_head))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ModelLoadError(f"{path}: partial rotary embeddings are not supported for training")
    args = {
        "model_type": MODEL_TYPES[arch],
        "hidden_size": n_embd,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(get("attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "vocab_size": int(meta.get("n_vocab") or 0),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
    }
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        args["rope_scaling"] = {"type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling != "none":
        raise ModelLoadError(f"{path}: rope scaling {scaling!r} is not supported for training")
    if arch == "qwen2" and head_dim != n_embd // n_head:
        raise ModelLoadError(f"{path}: qwen2 with head_dim != n_embd / n_head is not supported")
    if arch == "gemma3":
        n_layer = args["num_hidden_layers"]
        # llama.cpp: 1/sqrt(head_dim), except Gemma 3 27B (62 layers) uses 1/sqrt(n_embd/n_head).
        args["query_pre_attn_scalar"] = n_embd // n_head if n_layer == 62 else head_dim
        args["rope_local_base_freq"] = float(get("rope.freq_base_swa", 10000.0))
        window = int(meta.get(f"{arch}.attention.sliding_window") or 0)
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 6)  # llama.cpp's default
        if isinstance(pattern, list):  # per-layer "is SWA" flags; mlx-lm needs a period
            period = next((i + 1 for i, swa in enumerate(pattern) if not swa), len(pattern) + 1)
            if any(bool(swa) != ((i + 1) % period != 0) for i, swa in enumerate(pattern)):
                raise ModelLoadError(f"{path}: irregular sliding-window layer pattern is not supported")
            pattern = period
        if window <= 0:  # no SWA: every layer global
            window, pattern = args["max_position_embeddings"], 1
        args.update(sliding_window=window, sliding_window_pattern=int(pattern))
    return args


def _gguf_weights(reader, arch: str, args: dict, path: Path) -> tuple[dict[str, mx.array], np.ndarray | None]:
    """Dequantized float32 weights under mlx-lm names, and llama's rope factors if any."""
    from gguf.quants import dequantize

    weights, unknown, rope_factors = {}, [], None
    for t in reader.tensors:
        try:
            arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(
                f"{path}: cannot dequantize {t.name} ({t.tensor_type.name}): {e}; "
                "use a model quantized with a common type (Q4_K_M, Q8_0, F16)"
            ) from e
        arr = np.ascontiguousarray(arr.reshape(tuple(int(n) for n in reversed(t.shape))), dtype=np.float32)
        if t.name == "rope_freqs.weight":
            rope_factors = arr
            continue
        name = _mlx_name(arch, t.name)
        if name is None:
            unknown.append(t.name)
            continue
        if arch == "gemma3" and name.endswith("norm.weight"):
            arr = arr - np.float32(1.0)  # GGUF folds Gemma's (1 + w) into the stored norm weight
        elif arch == "llama" and name.split(".")[-2] in ("q_proj", "k_proj"):
            heads = args["num_attention_heads"] if ".q_proj." in name else args["num_key_value_heads"]
            arr = unpermute_rows(arr, heads)
        weights[name] = mx.array(arr)  # one tensor at a time: never two float32 copies of the model
    if unknown:
        raise ModelLoadError(
            f"{path}: tensors this trainer does not know: {', '.join(unknown[:5])}"
            f"{' ...' if len(unknown) > 5 else ''}; this model cannot be trained"
        )
    if rope_factors is not None and arch != "llama":
        raise ModelLoadError(f"{path}: rope_freqs is only supported for llama models")
    return weights, rope_factors


def _cache_entry(cache_dir: Path, path: Path) -> Path:
    st = path.stat()
    where = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    what = hashlib.sha256(f"{CACHE_VERSION}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir / "mlx-weights" / f"{where}-{what}"


def _write_cache(entry: Path, weights: dict[str, mx.array], config: dict) -> None:
    """Write the entry as a directory renamed into place, and drop stale entries for this path."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".tmp-"))
    try:
        mx.save_safetensors(str(tmp / "weights.safetensors"), weights)
        (tmp / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
        os.replace(tmp, entry)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race, or disk full
        return
    prefix = entry.name.split("-")[0] + "-"
    for old in entry.parent.iterdir():
        if old.name.startswith(prefix) and old != entry:
            shutil.rmtree(old, ignore_errors=True)


STALE_TMP_S = 600  # a .tmp-* cache write untouched this long belongs to a killed trainer


def _sweep_tmp(cache: Path, max_age_s: float = STALE_TMP_S) -> None:
    """Drop the full-size .tmp-* dirs a trainer killed mid-write left. One written to recently
    (the dir or a file in it) may be a live writer's (another trainer), so it is left alone."""
    if not cache.is_dir():
        return
    now = time.time()
    for tmp in cache.glob(".tmp-*"):
        try:
            touched = max([tmp.stat().st_mtime] + [f.stat().st_mtime for f in tmp.iterdir()])
        except OSError:
            continue  # gone already (its writer renamed or removed it)
        if now - touched > max_age_s:
            shutil.rmtree(tmp, ignore_errors=True)


def _read_gguf(path: Path, cache_dir: Path | None) -> tuple[str, dict, dict[str, mx.array]]:
    from clawd.engines.llamacpp import check_gguf_file

    check_gguf_file(path)
    entry = _cache_entry(cache_dir, path) if cache_dir is not None else None
    if entry is not None:
        _sweep_tmp(entry.parent)
    if entry is not None and (entry / "config.json").is_file():
        try:
            config = json.loads((entry / "config.json").read_text())
            return config["arch"], config, mx.load(str(entry / "weights.safetensors"))
        except (OSError, ValueError, KeyError, RuntimeError):
            shutil.rmtree(entry, ignore_errors=True)  # damaged cache: rebuild it

    try:
        reader = open_gguf(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(
            f"cannot read {path} as GGUF ({e}): the file is corrupt or truncated; re-download it"
        ) from e
    meta = _fields(reader)
    arch = meta.get("general.architecture")
    if arch not in MODEL_TYPES:
        raise ModelLoadError(
            f"{path}: architecture {arch!r} cannot be trained (supported: "
            f"{', '.join(MODEL_TYPES)}); serve it without learning or pick another model"
        )
    if not meta.get("n_vocab"):
        raise ModelLoadError(f"{path}: no tokenizer.ggml.tokens in the GGUF metadata; re-convert the model")
    args = _model_args(meta, arch, path)
    try:
        weights, rope_factors = _gguf_weights(reader, arch, args, path)
    except (ValueError, IndexError) as e:  # tensor data that does not fit its declared shape
        raise ModelLoadError(f"{path}: corrupt tensor data ({e}); re-download the model") from e
    config = {
        "arch": arch,
        "args": args,
        "source": str(path),
        "rope_factors": rope_factors.tolist() if rope_factors is not None else None,
    }
    if entry is not None:
        _write_cache(entry, weights, config)
    return arch, config, weights


def read_gguf_weights(path: Path, cache_dir: Path | None = None) -> tuple[str, dict, dict[str, mx.array]]:
    """(arch, {"args": mlx-lm ModelArgs dict, "rope_factors": ...}, float32 weights under mlx-lm
    names) for a GGUF file, from the trainer's cache when there is one: what `load_model` builds
    on, and what an mlx export writes out as a model folder (training/mlx_model_dir.py)."""
    return _read_gguf(Path(path), Path(cache_dir) if cache_dir is not None else None)


def _build(arch: str, config: dict, weights: dict[str, mx.array], path: Path) -> nn.Module:
    module = importlib.import_module(f"mlx_lm.models.{MODEL_TYPES[arch]}")
    args = dict(config["args"])
    args["tie_word_embeddings"] = "lm_head.weight" not in weights
    args["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in weights  # llama only
    model = module.Model(module.ModelArgs.from_dict(args))
    if arch == "gemma3":
        model.model.__class__ = _Gemma3Model
    if config.get("rope_factors") is not None:
        factors = np.asarray(config["rope_factors"], np.float32)
        for layer in model.layers:
            layer.self_attn.rope = _FreqsRoPE(args["head_dim"], args["rope_theta"], factors)
    weights = model.sanitize(dict(weights))
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(
            f"{path}: its tensors do not fit an mlx-lm {arch} model ({e}); this model cannot be trained"
        ) from e
    mx.eval(model.parameters())
    model.eval()
    return model


# ---- tokenizers ------------------------------------------------------------------------------


class GGUFTokenizer:
    """llama.cpp's own tokenizer for the GGUF file, so ids equal the served model's ids.
    Loaded on first use (0.65 s for a 262k vocab), which keeps a cached model load under 1 s."""

    def __init__(self, path: Path):
        self.path = path
        self._llm = None

    @property
    def llm(self):
        if self._llm is None:
            import llama_cpp

            try:
                self._llm = llama_cpp.Llama(str(self.path), vocab_only=True, verbose=False)
            except Exception as e:
                raise ModelLoadError(f"llama.cpp cannot load the tokenizer of {self.path}: {e}") from e
        return self._llm

    @property
    def eos_ids(self) -> frozenset[int]:
        import llama_cpp

        vocab = self.llm._model.vocab
        ids = {llama_cpp.llama_vocab_eos(vocab), llama_cpp.llama_vocab_eot(vocab)}
        return frozenset(i for i in ids if i >= 0)

    def encode(self, text: str, add_bos: bool) -> list[int]:
        # special=True: control tokens in the text are parsed, as clawd's engine does
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)

    def decode(self, ids: list[int]) -> str:
        import ctypes

        import llama_cpp

        vocab, out = self.llm._model.vocab, []
        buf = ctypes.create_string_buffer(256)
        for tok in ids:
            n = llama_cpp.llama_token_to_piece(vocab, int(tok), buf, len(buf), 0, True)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(vocab, int(tok), buf, len(buf), 0, True)
            out.append(buf.raw[:n])
        return b"".join(out).decode("utf-8", "replace")


class HFTokenizer:
    """mlx-lm's TokenizerWrapper behind the same three members."""

    def __init__(self, wrapper):
        self._tok = wrapper
        self.eos_ids = frozenset(wrapper.eos_token_ids)

    def encode(self, text: str, add_bos: bool) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_bos))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids))


# ---- entry point -----------------------------------------------------------------------------


def _load_dir(path: Path) -> LoadedModel:
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise ModelLoadError(
            f"{path} is not an MLX/HF model directory (config.json + *.safetensors); point at one, or at a GGUF file"
        )
    model_type = read_model_config(path).get("model_type")
    arch = ARCH_BY_MODEL_TYPE.get(model_type)
    if arch is None:
        raise ModelLoadError(
            f"{path}: model_type {model_type!r} cannot be trained (supported: {', '.join(MODEL_TYPES.values())})"
        )
    from mlx_lm.utils import load

    try:
        model, tok = load(str(path))  # a local path: mlx-lm never touches the network for it
    except Exception as e:
        raise ModelLoadError(f"mlx-lm cannot load {path}: {e}") from e
    model.set_dtype(mx.float32)  # float weights only; quantized ones stay as they are
    if arch == "gemma3":
        model.model.__class__ = _Gemma3Model
    return LoadedModel(model, arch, path, HFTokenizer(tok))


def load_model(source: Path, *, cache_dir: Path | None = None) -> LoadedModel:
    """The model at `source` (a GGUF file or an MLX/HF model directory) as a float32 mlx-lm
    model. GGUF weights are cached under `cache_dir` (keyed by path, size and mtime).
    Raises ModelLoadError, saying what to do, for a missing, unreadable or unsupported model."""
    source = Path(source)
    if source.is_dir():
        return _load_dir(source)
    arch, config, weights = _read_gguf(source, Path(cache_dir) if cache_dir is not None else None)
    return LoadedModel(_build(arch, config, weights, source), arch, source, GGUFTokenizer(source))
