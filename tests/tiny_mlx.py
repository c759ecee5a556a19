"""A tiny *real* MLX language model (random-init mlx-lm llama) for trainer tests.

Why: the trainer's correctness (positions, gradients through LoRA, loss signs) is only
visible on a real transformer; a 2-layer, 32-wide model with a 100-token vocabulary runs a
forward + backward in milliseconds. `TinyLM` has exactly the interface the trainer relies on
from clawd.training.weights.LoadedModel: `.model`, `.hidden(ids)`, `.logits(hidden)`.

For the mlx serving engine: `build_tiny_mlx_dir` writes an MLX/HF model directory (what
`mlx_lm.load` reads: config.json, model.safetensors, a byte-level BPE tokenizer.json) from a
tiny GGUF, float32 or quantized; `build_tiny_mlx_adapter` writes a random mlx-lm adapter
directory with clawd's own writer (clawd.training.export.save_mlx_adapter).

Nothing here imports pytest.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

__all__ = ["TinyLM", "tiny_lm", "add_lora", "lora_params", "build_tiny_mlx_dir", "build_tiny_mlx_adapter"]

VOCAB = 100
LORA_KEYS = ("self_attn.q_proj", "self_attn.v_proj")


class TinyLM:
    """The LoadedModel interface around an mlx-lm llama `Model`."""

    def __init__(self, model: nn.Module):
        self.model = model

    def hidden(self, input_ids: mx.array) -> mx.array:
        return self.model.model(input_ids)  # (B, T, d), after the final norm

    def logits(self, hidden: mx.array) -> mx.array:
        out = self.model.lm_head(hidden)
        # float32 like LoadedModel, but keep float64 when the whole model is float64
        return out if out.dtype == mx.float64 else out.astype(mx.float32)


def tiny_lm(seed: int = 0, dtype: mx.Dtype = mx.float32, vocab: int = VOCAB) -> TinyLM:
    from mlx_lm.models.llama import Model, ModelArgs

    mx.random.seed(seed)
    args = ModelArgs(
        model_type="llama",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        tie_word_embeddings=False,
    )
    model = Model(args)
    if dtype != mx.float32:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return TinyLM(model)


def add_lora(lm: TinyLM, seed: int = 1, rank: int = 4, scale: float = 2.0, b_std: float = 0.05) -> TinyLM:
    """Freeze the base, put LoRA on q/v of every layer, and randomise lora_b (mlx-lm inits it
    to zero, which would make the adapter a no-op and hide gradient bugs)."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = lm.model
    model.freeze()
    linear_to_lora_layers(
        model, len(model.layers), {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(LORA_KEYS)}
    )
    mx.random.seed(seed)
    dtype = model.model.embed_tokens.weight.dtype
    for _, m in model.named_modules():
        if hasattr(m, "lora_b"):
            m.lora_a = m.lora_a.astype(dtype)
            m.lora_b = (b_std * mx.random.normal(m.lora_b.shape)).astype(dtype)
    mx.eval(model.parameters())
    return lm


def lora_params(lm: TinyLM) -> dict[str, mx.array]:
    return dict(tree_flatten(lm.model.trainable_parameters()))


def _tiny_hf_tokenizer(out_dir: Path) -> None:
    """The tiny GGUF's vocabulary (tests/tiny_models.py) as a Hugging Face byte-level BPE
    tokenizer: <s> = 0 is BOS (added in front, like the GGUF's add_bos), </s> = 1 is EOS."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from tests.tiny_models import BOS_TOKEN, EOS_TOKEN, tiny_vocab

    tokens, _types, merges = tiny_vocab()
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BOS_TOKEN, special=True), AddedToken(EOS_TOKEN, special=True)])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, 0)]
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN).save_pretrained(out_dir)


def build_tiny_mlx_dir(out_dir: Path, gguf_path: Path, *, bits: int | None = None, group_size: int = 32) -> Path:
    """An MLX model directory with the weights of a tiny *llama* GGUF (float32, or quantized
    to `bits` like `mlx_lm.convert -q`); return `out_dir`."""
    from mlx_lm.utils import quantize_model, save_config

    from clawd.training.weights import load_model

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lm = load_model(Path(gguf_path))
    if lm.arch != "llama":
        raise ValueError("build_tiny_mlx_dir converts tiny llama GGUFs only")
    model = lm.model
    config = {**dataclasses.asdict(model.args), "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1}
    if bits is not None:
        model, config = quantize_model(model, config, group_size, bits)
    mx.save_safetensors(str(out_dir / "model.safetensors"), dict(tree_flatten(model.parameters())))
    save_config(config, out_dir / "config.json")
    _tiny_hf_tokenizer(out_dir)
    return out_dir


def build_tiny_mlx_adapter(
    out_dir: Path,
    model_path: Path,
    *,
    seed: int = 1,
    rank: int = 4,
    scale: float = 2.0,
    keys: tuple[str, ...] = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"),
    num_layers: int | None = None,
    b_std: float = 0.05,
    cache_dir: Path | None = None,
) -> Path:
    """A random LoRA adapter for the model at `model_path` (GGUF or MLX dir), written by
    clawd's trainer writer (mlx-lm's format); lora_b is random so the adapter is no no-op.
    `cache_dir`: clawd's weight cache, so a big GGUF is dequantized once."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from clawd.training.export import save_mlx_adapter
    from clawd.training.weights import load_model

    model = load_model(Path(model_path), cache_dir=cache_dir).model
    model.freeze()
    n = len(model.layers) if num_layers is None else num_layers
    linear_to_lora_layers(model, n, {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(keys)})
    mx.random.seed(seed)
    for _, m in model.named_modules():
        if hasattr(m, "lora_b"):
            m.lora_a = mx.random.normal(m.lora_a.shape) / m.lora_a.shape[0] ** 0.5
            m.lora_b = b_std * mx.random.normal(m.lora_b.shape)
    mx.eval(model.parameters())
    save_mlx_adapter(model, Path(out_dir), rank=rank, scale=scale, num_layers=n, keys=list(keys))
    return Path(out_dir)
