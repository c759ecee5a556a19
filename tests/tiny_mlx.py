"""A tiny *real* MLX language model (random-init mlx-lm llama) for trainer tests.

Why: the trainer's correctness (positions, gradients through LoRA, loss signs) is only
visible on a real transformer; a 2-layer, 32-wide model with a 100-token vocabulary runs a
forward + backward in milliseconds. `TinyLM` has exactly the interface the trainer relies on
from clawd.training.weights.LoadedModel: `.model`, `.hidden(ids)`, `.logits(hidden)`.

Nothing here imports pytest.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

__all__ = ["TinyLM", "tiny_lm", "add_lora", "lora_params"]

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
    args = ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                     num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                     vocab_size=vocab, tie_word_embeddings=False)
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
    linear_to_lora_layers(model, len(model.layers),
                          {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(LORA_KEYS)})
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
