"""Tokenizers for the mlx engine: text <-> ids, token bytes, BOS/EOS and the chat template.

Boundary: the mlx engine serves two kinds of model and each keeps its own tokenizer, so ids
always equal what the model (and the trainer) were built with:
- GGUF files (through clawd's GGUF -> MLX bridge): llama.cpp's tokenizer loaded vocab-only
  (no weights), the same ids and metadata the llama.cpp engine and the trainer see;
- MLX / HF model directories: the Hugging Face tokenizer mlx-lm loads with the model.
Both expose the `Vocab` interface below; llama_cpp / transformers are imported only here.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from clawd.engines.llamacpp import vocab_piece, vocab_tokenize
from clawd.errors import ModelLoadError


class Vocab(Protocol):
    n_tokens: int
    bos_text: str
    eos_text: str
    add_bos: bool
    chat_template: str | None
    metadata: dict

    def encode(self, text: str, *, add_bos: bool, special: bool) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def piece(self, tok: int) -> bytes: ...

    def is_end(self, tok: int) -> bool: ...


class GGUFVocab:
    """llama.cpp's tokenizer and metadata of a GGUF file, without its weights."""

    def __init__(self, path: Path):
        from clawd.engines.llamacpp import _llama

        lc = self._lc = _llama()  # routes llama.cpp's C logging to Python logging once
        params = lc.llama_model_default_params()
        params.vocab_only = True
        self._model = lc.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            raise ModelLoadError(f"llama.cpp cannot read the tokenizer of {path}: re-download the model")
        self._vocab = lc.llama_model_get_vocab(self._model)
        self._buf = ctypes.create_string_buffer(256)
        self.n_tokens = lc.llama_vocab_n_tokens(self._vocab)
        self.add_bos = bool(lc.llama_vocab_get_add_bos(self._vocab))
        self.bos_text = self._special_text(lc.llama_vocab_bos(self._vocab))
        self.eos_text = self._special_text(lc.llama_vocab_eos(self._vocab))
        self.metadata = self._read_metadata()
        self.chat_template = self.metadata.get("tokenizer.chat_template")

    def _read_metadata(self) -> dict:
        lc, out = self._lc, {}
        key_buf = ctypes.create_string_buffer(4096)
        val_buf = ctypes.create_string_buffer(1 << 16)  # chat templates run to tens of KB
        for i in range(lc.llama_model_meta_count(self._model)):
            if lc.llama_model_meta_key_by_index(self._model, i, key_buf, len(key_buf)) < 0:
                continue
            key = key_buf.value.decode("utf-8", "replace")
            if key.startswith("tokenizer.ggml.") and key not in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
                continue  # token tables: huge and useless here
            if lc.llama_model_meta_val_str_by_index(self._model, i, val_buf, len(val_buf)) >= 0:
                out[key] = val_buf.value.decode("utf-8", "replace")
        return out

    def _special_text(self, tok: int) -> str:
        return "" if tok < 0 else self._token_bytes(tok, special=True).decode("utf-8", "replace")

    def _token_bytes(self, tok: int, *, special: bool) -> bytes:
        return vocab_piece(self._lc, self._vocab, tok, self._buf, special=special)

    def encode(self, text: str, *, add_bos: bool, special: bool) -> list[int]:
        return vocab_tokenize(self._lc, self._vocab, text, add_bos=add_bos, special=special)

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self._token_bytes(int(t), special=True) for t in ids).decode("utf-8", "replace")

    def piece(self, tok: int) -> bytes:
        return self._token_bytes(tok, special=False)  # control tokens have no text piece

    def is_end(self, tok: int) -> bool:
        return bool(self._lc.llama_vocab_is_eog(self._vocab, tok))

    def close(self) -> None:
        if self._model:
            self._lc.llama_model_free(self._model)
            self._model = None


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-unicode spelling of bytes (byte-level BPE vocabularies), inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback


class HFVocab:
    """The Hugging Face tokenizer of an MLX / HF model directory (from mlx-lm's loader)."""

    def __init__(self, wrapper, config: dict, n_tokens: int):
        tok = self._tok = wrapper  # mlx-lm's TokenizerWrapper: transformers' tokenizer, attributes passed through
        self.n_tokens = n_tokens
        self._bos = tok.bos_token_id
        # The model "uses" BOS when its tokenizer puts one in front by default, as llama.cpp's add_bos.
        self.add_bos = self._bos is not None and tok.encode("a", add_special_tokens=True)[:1] == [self._bos]
        self.bos_text = tok.bos_token or ""
        self.eos_text = tok.eos_token or ""
        self._ends = frozenset(int(i) for i in wrapper.eos_token_ids)
        self._specials = frozenset(tok.all_special_ids)
        self.chat_template = tok.chat_template if isinstance(tok.chat_template, str) else None
        self.metadata = {k: v for k, v in config.items() if isinstance(v, (str, int, float, bool))}
        decoder = type(tok.backend_tokenizer.decoder).__name__ if hasattr(tok, "backend_tokenizer") else ""
        self._bytes_of = _byte_decoder() if decoder == "ByteLevel" else None
        self._pieces: dict[int, bytes] = {}

    def encode(self, text: str, *, add_bos: bool, special: bool) -> list[int]:
        # BOS is added here, not by the tokenizer's post-processor, so `add_bos` alone decides it
        ids = list(self._tok.encode(text, add_special_tokens=False, split_special_tokens=not special))
        return ([self._bos] if add_bos and self.add_bos else []) + ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def piece(self, tok: int) -> bytes:
        got = self._pieces.get(tok)
        if got is None:
            got = self._pieces[tok] = self._piece(tok)
        return got

    def _piece(self, tok: int) -> bytes:
        if tok in self._specials:
            return b""
        text = self._tok.convert_ids_to_tokens(tok)
        if text is None:
            return b""
        if self._bytes_of is not None and all(c in self._bytes_of for c in text):
            return bytes(self._bytes_of[c] for c in text)
        m = _BYTE_TOKEN.fullmatch(text)
        if m:
            return bytes([int(m.group(1), 16)])
        return text.replace("\u2581", " ").encode("utf-8")  # SentencePiece's word-start mark

    def is_end(self, tok: int) -> bool:
        return tok in self._ends

    def close(self) -> None:
        pass
