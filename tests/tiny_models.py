"""Tiny *real* GGUF models and LoRA adapters with random weights, for tests.

Why: clawd's serving, scoring and runtime-LoRA code paths go through llama.cpp. Mocking
llama.cpp hides the bugs that matter (tensor names, shapes, tokenizer quirks, adapter
switching), while the embedded Gemma 3 270M takes ~1 s just to load. These builders write
models of a few hundred KB that llama.cpp loads and evaluates in milliseconds.

- `build_tiny_gguf` writes a base model (arch "llama", "qwen2" or "gemma3") with a byte-level
  GPT-2 style BPE tokenizer, so any UTF-8 text tokenizes and detokenizes losslessly.
- `build_tiny_lora` writes a GGUF LoRA adapter for such a base, following CONVENTIONS.md §4.

Only `numpy` and `gguf` are needed; nothing here imports pytest or llama_cpp.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

__all__ = [
    "SUPPORTED_ARCHS",
    "BOS_TOKEN",
    "EOS_TOKEN",
    "bytes_to_unicode",
    "tiny_vocab",
    "build_tiny_gguf",
    "build_tiny_lora",
]

SUPPORTED_ARCHS = ("llama", "qwen2", "gemma3")

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"

# A few merges (in GPT-2's byte-to-unicode spelling, "Ġ" = space) so that common pairs become
# single tokens and the BPE merge path of llama.cpp is exercised, not just byte fallback.
_MERGES = (
    "Ġ t",
    "h e",
    "i n",
    "e r",
    "a n",
    "o n",
    "Ġ a",
    "r e",
    "Ġt he",
    "e n",
    "Ġ s",
    "o r",
    "l l",
    "H e",
    "He ll",
    "Hell o",
    "Ġ w",
    "e s",
    "a t",
    "i s",
)

# ggml token types (llama.h `llama_token_type`): 1 = normal, 3 = control.
_TOKEN_NORMAL = 1
_TOKEN_CONTROL = 3


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (as in HF tokenizers)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """Return (tokens, token_types, merges) of the tiny byte-level BPE tokenizer.

    Layout: 0 = ``<s>`` (BOS), 1 = ``</s>`` (EOS), 2..257 = the 256 byte tokens in byte order
    (token id = byte + 2), then one token per merge result.
    """
    tokens = [BOS_TOKEN, EOS_TOKEN]
    types = [_TOKEN_CONTROL, _TOKEN_CONTROL]
    b2u = bytes_to_unicode()
    for b in range(256):
        tokens.append(b2u[b])
        types.append(_TOKEN_NORMAL)
    seen = set(tokens)
    for merge in _MERGES:
        left, right = merge.split(" ")
        assert left in seen and right in seen, merge  # merge inputs must be tokens already
        merged = left + right
        if merged not in seen:
            tokens.append(merged)
            types.append(_TOKEN_NORMAL)
            seen.add(merged)
    return tokens, types, list(_MERGES)


def _tensor_specs(
    arch: str,
    n_layer: int,
    n_embd: int,
    n_head: int,
    n_head_kv: int,
    n_ff: int,
    n_vocab: int,
    head_dim: int,
) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape, kind) for every tensor of the arch; kind in {"embd", "out", "w", "norm", "bias"}.

    Numpy shapes are row-major (n_out, n_in); GGUF stores them as ggml ne = [n_in, n_out].
    """
    q_dim = n_head * head_dim
    kv_dim = n_head_kv * head_dim
    specs: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (n_vocab, n_embd), "embd")]
    for i in range(n_layer):
        p = f"blk.{i}."
        specs += [
            (p + "attn_norm.weight", (n_embd,), "norm"),
            (p + "attn_q.weight", (q_dim, n_embd), "w"),
            (p + "attn_k.weight", (kv_dim, n_embd), "w"),
            (p + "attn_v.weight", (kv_dim, n_embd), "w"),
            (p + "attn_output.weight", (n_embd, q_dim), "w"),
            (p + "ffn_norm.weight", (n_embd,), "norm"),
            (p + "ffn_gate.weight", (n_ff, n_embd), "w"),
            (p + "ffn_up.weight", (n_ff, n_embd), "w"),
            (p + "ffn_down.weight", (n_embd, n_ff), "w"),
        ]
        if arch == "qwen2":
            specs += [
                (p + "attn_q.bias", (q_dim,), "bias"),
                (p + "attn_k.bias", (kv_dim,), "bias"),
                (p + "attn_v.bias", (kv_dim,), "bias"),
            ]
        if arch == "gemma3":
            specs += [
                (p + "attn_q_norm.weight", (head_dim,), "norm"),
                (p + "attn_k_norm.weight", (head_dim,), "norm"),
                (p + "post_attention_norm.weight", (n_embd,), "norm"),
                (p + "post_ffw_norm.weight", (n_embd,), "norm"),
            ]
    specs.append(("output_norm.weight", (n_embd,), "norm"))
    # Real Gemma 3 ties the LM head to token_embd; llama.cpp accepts an explicit output.weight
    # too. A tied random head would make every token predict itself (entropy ~0), so untie.
    specs.append(("output.weight", (n_vocab, n_embd), "out"))
    return specs


def build_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    seed: int = 0,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_ctx_train: int = 512,
    chat_template: str | None = None,
    f16: bool = False,
    weight_deltas: Mapping[str, np.ndarray] | None = None,
    extra_tokens: Iterable[str] = (),
) -> Path:
    """Write a tiny random-weight GGUF model that llama.cpp loads and runs; return `path`.

    Weights are Gaussian with scales chosen so the residual stream stays O(1) and the
    next-token logits have a std of ~2: the next-token distribution is neither uniform nor
    one-hot (entropy roughly 2-4 nats over ~280 tokens). Same arguments and seed give a
    byte-identical file. `f16=True` stores the matrices as F16 (norms and biases stay F32).
    `weight_deltas` maps tensor names to arrays (numpy shape) added to the random weights
    before writing, e.g. a merged LoRA ``alpha / r * B @ A`` to compare against runtime LoRA.
    `extra_tokens` are control tokens appended to the vocabulary (a model whose vocabulary is
    not the others', e.g. to test that a teacher with another tokenizer is refused).
    """
    import gguf  # local import: keeps `import tests.tiny_models` cheap

    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported arch {arch!r}; expected one of {SUPPORTED_ARCHS}")
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must be divisible by n_head, and n_head by n_head_kv")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    tokens, token_types, merges = tiny_vocab()
    extra = list(extra_tokens)
    tokens, token_types = tokens + extra, token_types + [_TOKEN_CONTROL] * len(extra)
    n_vocab = len(tokens)
    head_dim = n_embd // n_head
    specs = _tensor_specs(arch, n_layer, n_embd, n_head, n_head_kv, n_ff, n_vocab, head_dim)
    unknown = set(weight_deltas or ()) - {n for n, _, _ in specs}
    if unknown:
        raise ValueError(f"weight_deltas for unknown tensors: {sorted(unknown)}")
    rng = np.random.default_rng(seed)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(n_vocab)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    if arch == "gemma3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        # Sliding-window attention on, like the real Gemma 3: with 2 layers and the pattern
        # below, layer 0 is SWA and layer 1 global, so both KV caches of the iSWA path exist.
        w.add_sliding_window(min(64, n_ctx_train))
        w.add_sliding_window_pattern(2)
        w.add_rope_freq_base_swa(10000.0)

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)

    # gemma3 multiplies the input embeddings by sqrt(n_embd); harmless, since every block
    # starts with an RMS norm.
    head_std = 2.0 / np.sqrt(n_embd)  # logits = rmsnorm(h) @ W.T  ->  std ~2
    for name, shape, kind in specs:
        if kind == "norm":
            arr = np.ones(shape, dtype=np.float32)
        elif kind == "bias":
            arr = (0.02 * rng.standard_normal(shape)).astype(np.float32)
        elif kind == "embd":
            arr = rng.standard_normal(shape).astype(np.float32)
        elif kind == "out":
            arr = (head_std * rng.standard_normal(shape)).astype(np.float32)
        else:  # projection matrix (n_out, n_in)
            arr = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
        if weight_deltas and name in weight_deltas:
            arr = (arr + np.asarray(weight_deltas[name], dtype=np.float32).reshape(shape)).astype(np.float32)
        if f16 and arr.ndim == 2:
            arr = arr.astype(np.float16)
        w.add_tensor(name, arr)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _read_str(reader, key: str) -> str | None:
    field = reader.get_field(key)
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def build_tiny_lora(
    path: Path,
    base_gguf: Path,
    *,
    rank: int = 4,
    alpha: float = 8.0,
    seed: int = 1,
    targets: Iterable[str] = ("attn_q", "attn_v"),
    scale_init: float = 0.5,
) -> Path:
    """Write a GGUF LoRA adapter for `base_gguf` (CONVENTIONS.md §4); return `path`.

    For every layer N and target T it writes `blk.N.T.weight.lora_a`, numpy shape
    (rank, n_in), and `.lora_b`, numpy shape (n_out, rank), both F32 with entries of std
    `scale_init / sqrt(fan_in)`. B is deliberately non-zero (a freshly initialised PEFT
    adapter has B = 0 and would be a no-op), so the adapter visibly changes the logits.
    Metadata: general.type=adapter, general.architecture=<base arch>, adapter.type=lora,
    adapter.lora.alpha=`alpha` (effective scale = user_scale * alpha / rank).
    """
    import gguf

    base_gguf = Path(base_gguf)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    targets = tuple(targets)
    if not targets:
        raise ValueError("targets must not be empty")

    reader = gguf.GGUFReader(str(base_gguf))
    arch = _read_str(reader, "general.architecture")
    if arch is None:
        raise ValueError(f"{base_gguf}: no general.architecture")
    # ggml ne order: shape[0] = n_in, shape[1] = n_out.
    base_shapes = {t.name: tuple(int(x) for x in t.shape) for t in reader.tensors}

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_name(f"tiny-{arch}-lora")
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))

    n_written = 0
    layer = 0
    while any(f"blk.{layer}.{t}.weight" in base_shapes for t in targets):
        for t in targets:
            name = f"blk.{layer}.{t}.weight"
            if name not in base_shapes:
                continue
            n_in, n_out = base_shapes[name][:2]
            a = scale_init * rng.standard_normal((rank, n_in)) / np.sqrt(n_in)
            b = scale_init * rng.standard_normal((n_out, rank)) / np.sqrt(rank)
            w.add_tensor(name + ".lora_a", a.astype(np.float32))
            w.add_tensor(name + ".lora_b", b.astype(np.float32))
            n_written += 1
        layer += 1
    if n_written == 0:
        raise ValueError(f"none of {targets} found in {base_gguf}")

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def build_student_and_teacher(d: Path) -> dict[str, Path]:
    """A tiny student and a bigger teacher with the same vocabulary (training.teacher = model:…)."""
    return {
        "student": build_tiny_gguf(d / "student.gguf", seed=0),
        "teacher": build_tiny_gguf(d / "teacher.gguf", seed=11, n_layer=3, n_embd=96, n_ff=192),
    }
