"""What a model on disk is, from its headers only: a GGUF file's key/values, an MLX / HF model
directory's config.json, its architecture, whether clawd can train it, a split GGUF's parts.

Boundary: the ground floor. It imports nothing from clawd and never loads weights; a GGUF
header is read by its own small parser (read_gguf_header), which skips the vocabulary, so
asking a model's architecture costs milliseconds (start-up, `clawd models`, doctor).
Every other reader of model headers (doctor, the registry, the CLI, the trainer, the engines)
asks here.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
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


# GGUF value types (ggml's gguf.h), and the struct format of the fixed-size ones.
_STRING, _ARRAY = 8, 9
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# Far beyond any real header (a 262k-token vocabulary is ~5 MB); a damaged count stops here.
_MAX_KV = 1 << 20


@dataclass(frozen=True)
class GGUFArray:
    """An array value, skipped rather than read (a vocabulary would be 100k+ Python objects):
    its element type and length only."""

    elem_type: int
    count: int


class _Cursor:
    """Little reads off a memory map, with the file's byte order; raises ValueError past the end."""

    def __init__(self, buf, order: str):
        self.buf, self.order, self.pos = buf, order, 0

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError("truncated header")
        (v,) = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += size
        return v

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError("truncated header")
        self.pos += n

    def string(self) -> str:
        n = self.take("Q")
        start = self.pos
        self.skip(n)
        return bytes(self.buf[start : self.pos]).decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype in _SCALAR:
            return self.take(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            elem, count = self.take("I"), self.take("Q")
            if elem in _SCALAR:
                self.skip(count * struct.calcsize(_SCALAR[elem]))
            elif elem == _STRING:
                for _ in range(count):  # only the lengths are read, never the text
                    self.skip(self.take("Q"))
            elif elem == _ARRAY:
                for _ in range(count):
                    self.value(_ARRAY)
            else:
                raise ValueError(f"unknown GGUF array element type {elem}")
            return GGUFArray(elem, count)
        raise ValueError(f"unknown GGUF value type {vtype}")


def read_gguf_header(
    path: Path, want: frozenset[str] | set[str] | None = None, raw: Callable[[str, bytes], None] | None = None
) -> dict[str, Any]:
    """A GGUF file's key/value metadata, read from its header only: it stops before the tensor
    infos, and arrays (the tokenizer's vocabulary, scores, merges) are skipped by length and
    come back as GGUFArray. Milliseconds on any model, where the gguf package's reader builds
    the whole vocabulary. With `want`, it stops as soon as it has read those keys (writers put
    general.* first, before the vocabulary). Raises OSError when the file cannot be opened,
    ValueError when it is not a GGUF file or its header is damaged. `raw(key, bytes)` is handed
    every value's bytes as stored, arrays included, without decoding them (gguf_vocabulary)."""
    with Path(path).open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError("bad magic: not a GGUF file")
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:  # an empty file cannot be mapped
            raise ValueError("truncated header") from e
    with buf:
        # The version is small: read the wrong way round it has its low 16 bits zero (a big-endian file).
        (version,) = struct.unpack_from("<I", buf, 4) if len(buf) >= 8 else (0,)
        order = "<" if version & 0xFFFF else ">"
        cur = _Cursor(buf, order)
        cur.pos = 4
        version = cur.take("I")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        cur.take("Q")  # tensor count: the tensor infos that follow the key/values are not read
        n_kv = cur.take("Q")
        if n_kv > _MAX_KV:
            raise ValueError(f"implausible key/value count {n_kv}")
        out: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            vtype = cur.take("I")
            start = cur.pos
            out[key] = cur.value(vtype)
            if raw is not None:
                raw(key, bytes(buf[start : cur.pos]))
            if want is not None and want <= out.keys():
                break
        return out


# What makes two GGUFs' token ids mean the same: the tokenizer kind and every token's text, in
# order. (Special-token ids, chat templates and merges may differ between a family's models
# without changing what an id is.)
VOCABULARY_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.tokens")


@dataclass(frozen=True)
class Vocabulary:
    """A GGUF's vocabulary, by identity: equal iff the token ids mean the same tokens."""

    tokens: int  # how many
    digest: str  # sha256 over VOCABULARY_KEYS' stored bytes


def gguf_vocabulary(path: Path) -> Vocabulary:
    """The vocabulary of a GGUF, hashed from its header's bytes (~0.2 s for 150k tokens, most
    of it skipping strings; no token becomes a Python object). Raises OSError / ValueError as read_gguf_header, and
    ValueError when the file has no vocabulary."""
    h = hashlib.sha256()
    seen = {}

    def take(key: str, data: bytes) -> None:
        if key in VOCABULARY_KEYS:
            seen[key] = data

    header = read_gguf_header(path, raw=take)
    if "tokenizer.ggml.tokens" not in seen:
        raise ValueError("no tokenizer.ggml.tokens: the file has no vocabulary")
    for key in VOCABULARY_KEYS:
        h.update(key.encode() + b"\0" + seen.get(key, b""))
    return Vocabulary(header["tokenizer.ggml.tokens"].count, h.hexdigest())


def open_gguf(path: Path):
    """The gguf package's full GGUFReader on `path` (memory-mapped; parsing it builds the whole
    vocabulary: seconds on a real model), for the trainer's readers of tensors. Readers of
    header keys use read_gguf_header. Raises OSError when the file cannot be opened,
    ValueError when it is not a GGUF file or its header is damaged."""
    with Path(path).open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError("bad magic: not a GGUF file")
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:  # the reader raises many kinds on a damaged header
        raise ValueError(str(e) or type(e).__name__) from e


def gguf_value(header: dict[str, Any], key: str) -> Any:
    """One value of a read_gguf_header result; None when the key is absent."""
    return header.get(key)


def reader_architecture(header: dict[str, Any]) -> str:
    """general.architecture of a read header; raises ValueError when it has none."""
    arch = gguf_value(header, "general.architecture")
    if not isinstance(arch, str):
        raise ValueError("no general.architecture key")
    return str(arch)


def gguf_architecture(path: Path) -> str:
    """general.architecture from the GGUF header; raises OSError or ValueError when unreadable."""
    return reader_architecture(read_gguf_header(path, want={"general.architecture"}))


def gguf_architecture_whole_file(path: Path) -> str:
    """general.architecture, read with the full reader, which also walks every tensor and so
    notices a file cut short (doctor's check; seconds on a real model, where the header alone
    takes milliseconds). Raises OSError or ValueError."""
    field = open_gguf(path).fields.get("general.architecture")
    if field is None:
        raise ValueError("no general.architecture key")
    return str(field.contents())


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
