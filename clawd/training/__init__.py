"""Training side of clawd: MLX LoRA on the served model's weights (trainer child process only).

Importing this package is cheap; the modules below import mlx, mlx_lm, gguf and llama_cpp.
`why_untrainable` reads model headers only, so the daemon can ask it.
"""

from __future__ import annotations

import json
from pathlib import Path

# What the GGUF -> MLX bridge and mlx-lm train: GGUF general.architecture -> mlx-lm model_type.
MODEL_TYPES = {"gemma3": "gemma3_text", "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def why_untrainable(path: Path) -> str | None:
    """None when the trainer can build the model at `path` (a GGUF file or an MLX/HF model
    directory), else one sentence saying why not."""
    path = Path(path)
    try:
        if path.is_dir():
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
            kind, known = (config.get("model_type") if isinstance(config, dict) else None), MODEL_TYPES.values()
        else:
            from clawd.doctor import gguf_architecture

            kind, known = gguf_architecture(path), MODEL_TYPES.keys()
    except (OSError, ValueError) as e:
        return f"cannot read {path.name}'s architecture ({e})"
    if kind in known:
        return None
    return f"{path.name} is a {kind!r} model, and clawd trains {', '.join(sorted(known))} models only"
