"""What a model on disk is, from its headers only: a GGUF file's key/values, an MLX / HF model
directory's config.json, its architecture, whether clawd can train it, a split GGUF's parts.

Boundary: the ground floor. It imports nothing from clawd and never loads weights; the gguf
package is imported inside the functions that read a GGUF file, so importing this is free.
Every other reader of model headers (doctor, the registry, the CLI, the trainer, the engines)
asks here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

# What the GGUF -> MLX bridge and mlx-lm train: GGUF general.architecture -> mlx-lm model_type.
MODEL_TYPES = {"gemma3": "gemma3_text", "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# The same, read the other way: an MLX / HF directory's model_type -> GGUF architecture.
ARCH_BY_MODEL_TYPE = {v: k for k, v in MODEL_TYPES.items()}

# A split GGUF's part: `NAME-00001-of-00003.gguf`.
SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


def gguf_parts(path):
    """All files of a split GGUF (`…-00001-of-00003.gguf`), or just `path`."""
    m = SHARD.search(path.name)
    if not m:
        return [path]
    stem = path.name[: m.start()]
    return [path.with_name(f"{stem}-{i:05d}-of-{m.group(2)}.gguf") for i in range(1, int(m.group(2)) + 1)]


# ---- GGUF ------------------------------------------------------------------------------------


def open_gguf(path: Path):
    """The gguf package's GGUFReader on `path` (memory-mapped; parsing it reads the whole
    key/value header, vocabulary included). Raises OSError when the file cannot be opened,
    ValueError when it is not a GGUF file or its header is damaged."""
    with Path(path).open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError("bad magic: not a GGUF file")
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:  # the reader raises many kinds on a damaged header
        raise ValueError(str(e) or type(e).__name__) from e


def gguf_value(reader, key: str) -> Any:
    """One header value from an open reader; None when the key is absent."""
    field = reader.fields.get(key)
    return field.contents() if field is not None else None


def reader_architecture(reader) -> str:
    """general.architecture of an open reader; raises ValueError when it has none."""
    arch = gguf_value(reader, "general.architecture")
    if arch is None:
        raise ValueError("no general.architecture key")
    return str(arch)


def gguf_architecture(path: Path) -> str:
    """general.architecture from the GGUF header; raises OSError or ValueError when unreadable."""
    return reader_architecture(open_gguf(path))


# ---- MLX / HF model directories ----------------------------------------------------------------


def read_model_config(path: Path) -> Any:
    """An MLX / HF model directory's config.json, parsed (not checked to be an object).
    Raises OSError when it cannot be read, ValueError when it is not JSON."""
    return json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))


# ---- trainability ------------------------------------------------------------------------------


def why_untrainable(path: Path) -> str | None:
    """None when the trainer can build the model at `path` (a GGUF file or an MLX/HF model
    directory), else one sentence saying why not."""
    path = Path(path)
    try:
        if path.is_dir():
            config = read_model_config(path)
            kind, known = (config.get("model_type") if isinstance(config, dict) else None), MODEL_TYPES.values()
        else:
            kind, known = gguf_architecture(path), MODEL_TYPES.keys()
    except (OSError, ValueError) as e:
        return f"cannot read {path.name}'s architecture ({e})"
    if kind in known:
        return None
    return f"{path.name} is a {kind!r} model, and clawd trains {', '.join(sorted(known))} models only"
