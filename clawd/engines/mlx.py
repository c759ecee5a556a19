"""MLX engine: mlx-lm models served with per-token log-probs, scoring and runtime LoRA.

Models: an MLX / HF model directory (what `mlx_lm.load` reads; quantized or not) or a GGUF file
through clawd's GGUF -> MLX bridge (clawd/training/weights.py), which is also what the trainer
builds, so the log-probs served here are the trainer's pi_old up to float noise.

Boundary: mlx and mlx-lm are imported only when an Engine is built (after clawd's BLAS shim on
Linux, clawd/training/blas.py), never by `import clawd.engines.mlx`. The forward pass, KV cache
and sampling loop are ours rather than mlx-lm's generate_step: the contract needs the raw
model's log-prob of every sampled token, a cancel check between tokens and prefill chunks,
two prompt-cache slots, and adapters swapped in place (clawd/engines/mlx_lora.py).
"""

from __future__ import annotations

import logging
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from clawd.engines import base
from clawd.engines.sampling import log_softmax_at, make_rng, sample, top_alternatives
from clawd.errors import AdapterError, ContextLengthExceeded, EngineError, ModelLoadError, Preempted
from clawd.modelfile import ARCH_BY_MODEL_TYPE, read_model_config

log = logging.getLogger(__name__)

# Tokens per forward pass between cancel checks, as in the llama.cpp engine: a user waits at
# most one chunk for background work (slot 1 takes smaller ones), and score() keeps at most
# _SCORE_CHUNK full-vocab logits rows (64 x 262k x 4 B = 64 MiB) alive at once.
_PREFILL_CHUNK = 128
_SCORE_CHUNK = 64
_BACKGROUND_CHUNK = 32
# mlx-lm model types whose Model.__call__ is exactly head(model.model(x)): for these the LM head
# (70% of the compute on a 262k vocabulary, STACK.md) runs only on the rows whose logits we need.
_SPLIT_HEAD_TYPES = frozenset({"llama", "qwen2", "qwen3", "gemma3_text", "mistral"})


def _import_mlx(cache_dir: Path | None):
    """mlx.core, with clawd's BLAS shim loaded first on Linux (60x faster fp32 matmuls)."""
    if "mlx.core" not in sys.modules:
        from clawd.training import blas

        choice = blas.enable(Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / "clawd-cache")
        log.info("mlx engine BLAS: %s (%s)", choice.name, choice.detail)
    import mlx.core as mx

    return mx


@dataclass
class _Slot:
    """One prompt cache: per-layer K/V for exactly `tokens`, computed under `adapter`."""

    layers: list | None = None
    tokens: list[int] = field(default_factory=list)
    adapter: str | None = None


class Engine(base.Engine):
    name = "mlx"
    max_top_logprobs = 20

    def __init__(
        self, model_path: Path, *, n_ctx: int = 4096, top_k: int = 40, model_id: str = "", cache_dir: Path | None = None
    ):
        """
        Args:
            model_path: an MLX / HF model directory, or a GGUF file.
            n_ctx: context window in tokens (capped at the model's training context).
            top_k: sample among the k most likely tokens (0 = all), as llama.cpp does.
            model_id: the id shown in /v1/models (default: the file or directory name).
            cache_dir: clawd's cache dir: the BLAS shim and dequantized GGUF weights live there.
        Raises:
            ModelLoadError: the model is missing, unreadable or of an unsupported kind.
        """
        self._mx = _import_mlx(cache_dir)
        from clawd.engines.mlx_lora import LoRASwitch

        model_path = Path(model_path)
        if model_path.is_dir():
            self._model, self._vocab, arch, n_ctx_train = _load_dir(model_path)
        elif model_path.is_file():
            self._model, self._vocab, arch, n_ctx_train = _load_gguf(model_path, cache_dir)
        else:
            raise ModelLoadError(
                f"model {model_path} does not exist: set model.path to a GGUF file or an MLX model directory"
            )
        self._n_vocab = int(self._model.args.vocab_size)
        model_type = getattr(self._model, "model_type", None)
        if model_type in _SPLIT_HEAD_TYPES and "model" in self._model:
            self._body = self._model.model
            self._head = self._model.lm_head if "lm_head" in self._model else self._model.model.embed_tokens.as_linear
        else:
            self._body = self._head = None
        self._top_k = top_k
        self._switch = LoRASwitch(self._model)
        self._adapters: dict = {}  # id -> mlx_lora.Adapter
        self._bound: str | None = None
        self._slots = {0: _Slot(), 1: _Slot()}
        self._slot = 0
        n_ctx = min(n_ctx, n_ctx_train) if n_ctx_train > 0 else n_ctx
        self._info = base.ModelInfo(
            id=model_id or (model_path.name if model_path.is_dir() else model_path.stem),
            path=model_path,
            architecture=arch,
            n_ctx=n_ctx,
            n_ctx_train=n_ctx_train or n_ctx,
            n_vocab=self._n_vocab,
            chat_template=self._vocab.chat_template,
            bos_token=self._vocab.bos_text,
            eos_token=self._vocab.eos_text,
            add_bos=self._vocab.add_bos,
            metadata=dict(self._vocab.metadata),
        )

    # ---- model facts and tokens ----------------------------------------------------------

    @property
    def info(self) -> base.ModelInfo:
        return self._info

    def tokenize(self, text: str, *, add_bos: bool, special: bool = True) -> list[int]:
        return self._vocab.encode(text, add_bos=add_bos, special=special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._vocab.decode(ids)

    # ---- adapters ------------------------------------------------------------------------------

    def load_adapter(self, adapter_id: str, path: Path) -> None:
        """`path`: an mlx-lm adapter directory, or a file inside one (adapters/<id>/adapter.gguf)."""
        adapter = self._switch.read(Path(path))  # checks everything before touching the model
        self._adapters[adapter_id] = adapter
        self._forget_adapter(adapter_id)
        if self._bound == adapter_id:
            self._switch.bind(adapter)

    def unload_adapter(self, adapter_id: str) -> None:
        if self._adapters.pop(adapter_id, None) is None:
            return
        if self._bound == adapter_id:
            self._bind(None)
        self._forget_adapter(adapter_id)

    @property
    def loaded_adapters(self) -> list[str]:
        return list(self._adapters)

    def _forget_adapter(self, adapter_id: str) -> None:
        """K/V computed under an adapter that is gone or replaced must never be reused."""
        for s in self._slots.values():
            if s.adapter == adapter_id:
                self._reset(s)

    def _bind(self, adapter_id: str | None) -> None:
        if adapter_id is not None and adapter_id not in self._adapters:
            raise AdapterError(f"adapter {adapter_id!r} is not loaded")
        if adapter_id != self._bound:
            self._switch.bind(self._adapters.get(adapter_id))
            self._bound = adapter_id

    # ---- the forward pass and the prompt caches -------------------------------------------------

    def _use(self, slot: int, adapter: str | None) -> _Slot:
        if slot not in self._slots:
            raise ValueError(f"slot must be 0 or 1, got {slot}")
        self._bind(adapter)
        self._slot = slot
        return self._slots[slot]

    def _chunk(self, foreground: int) -> int:
        return foreground if self._slot == 0 else min(foreground, _BACKGROUND_CHUNK)

    def _check_fits(self, n_tokens: int) -> None:
        if n_tokens >= self._info.n_ctx:
            raise ContextLengthExceeded(
                f"This model's context is {self._info.n_ctx} tokens and the request needs "
                f"{n_tokens}: shorten the messages (or raise model.n_ctx)."
            )

    def _new_cache(self) -> list:
        from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

        layers = make_prompt_cache(self._model)
        if all(type(c) in (KVCache, RotatingKVCache) for c in layers):
            # Full-length caches on sliding-window layers too (like llama.cpp's swa_full): the
            # window is still applied by the mask, and a shared prefix can be trimmed back to
            # wherever the next prompt diverges, which a rotating cache cannot do.
            return [KVCache() for _ in layers]
        return layers

    def _reset(self, s: _Slot) -> None:
        s.layers, s.tokens, s.adapter = None, [], self._bound

    def _reuse_prefix(self, s: _Slot, tokens: Sequence[int], limit: int) -> int:
        """Keep the cached K/V of the longest common prefix (at most `limit` tokens) computed
        under the bound adapter, drop the rest; return how many tokens are kept."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        if s.adapter != self._bound:
            self._reset(s)
        keep = 0
        for a, b in zip(s.tokens, tokens[:limit]):
            if a != b:
                break
            keep += 1
        if keep < len(s.tokens):
            if keep > 0 and can_trim_prompt_cache(s.layers):
                trim_prompt_cache(s.layers, len(s.tokens) - keep)
                del s.tokens[keep:]
            else:
                self._reset(s)
                keep = 0
        return keep

    def _run(self, s: _Slot, tokens: Sequence[int], logits_from: int | None) -> np.ndarray | None:
        """Append `tokens` to the slot's cache. Returns float32 logits (n, V) of the positions
        from `logits_from` (an index into `tokens`) on, or None when none are wanted."""
        mx = self._mx
        if s.layers is None:
            s.layers, s.adapter = self._new_cache(), self._bound
        try:
            x = mx.array([list(tokens)], dtype=mx.int32)
            if self._body is not None:
                hidden = self._body(x, cache=s.layers)
                logits = None if logits_from is None else self._head(hidden[:, logits_from:, :])
            else:
                out = self._model(x, cache=s.layers)
                logits = None if logits_from is None else out[:, logits_from:, :]
            if logits is None:
                # Lazy evaluation: only the K/V are computed, never the unused LM head.
                mx.eval([c.state for c in s.layers])
                rows = None
            else:
                rows = np.array(logits[0].astype(mx.float32))
        except (RuntimeError, ValueError) as e:
            self._reset(s)  # the cache may hold part of the chunk: forget it rather than guess
            raise EngineError(f"MLX forward pass failed: {e}") from e
        s.tokens.extend(tokens)
        return rows

    def _prefill(self, s: _Slot, tokens: list[int], cancel: threading.Event | None) -> np.ndarray | None:
        """Bring the cache to exactly `tokens`; return the last position's logits row, or None
        if cancelled between chunks (the cache then holds a prefix)."""
        keep = self._reuse_prefix(s, tokens, len(tokens) - 1)
        rest = tokens[keep:]
        size = self._chunk(_PREFILL_CHUNK)
        rows = None
        for start in range(0, len(rest), size):
            if cancel is not None and cancel.is_set():
                return None
            chunk = rest[start : start + size]
            last = start + size >= len(rest)
            rows = self._run(s, chunk, len(chunk) - 1 if last else None)
        return rows[-1]

    # ---- generation --------------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: base.SamplingParams,
        *,
        adapter: str | None = None,
        cancel: threading.Event | None = None,
        slot: int = 0,
    ) -> Iterator[base.SampledToken]:
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise ValueError("generate needs a non-empty prompt")
        self._check_fits(len(prompt_ids))
        self._use(slot, adapter)
        budget = min(params.max_tokens, self._info.n_ctx - len(prompt_ids))
        return self._generate(slot, adapter, prompt_ids, params, budget, cancel)

    def _generate(self, slot, adapter, prompt_ids, params, budget, cancel) -> Iterator[base.SampledToken]:
        s = self._use(slot, adapter)  # again: the iterator may start after other calls
        row = self._prefill(s, prompt_ids, cancel)
        if row is None:
            return
        rng = make_rng(params)
        for step in range(budget):
            if cancel is not None and cancel.is_set():
                return
            tok = sample(row, params, self._top_k, rng)
            logprob = float(log_softmax_at(row, tok))
            alts = ()
            if params.top_logprobs:
                ids, lps = top_alternatives(row, params.top_logprobs)
                alts = tuple(base.Alternative(int(i), self._vocab.piece(int(i)), float(lp)) for i, lp in zip(ids, lps))
            if self._vocab.is_end(tok):
                yield base.SampledToken(tok, b"", logprob, is_end=True, top=alts)
                return
            yield base.SampledToken(tok, self._vocab.piece(tok), logprob, top=alts)
            if step + 1 < budget:
                row = self._run(s, [tok], 0)[0]

    # ---- scoring -----------------------------------------------------------------------------

    def score(
        self,
        prompt_ids: Sequence[int],
        target_ids: Sequence[int],
        *,
        top_k: int = 0,
        adapter: str | None = None,
        at_ids: np.ndarray | None = None,
        cancel: threading.Event | None = None,
        slot: int = 0,
        reuse_cache: bool = True,
    ) -> base.ScoreResult:
        prompt_ids, target_ids = list(prompt_ids), list(target_ids)
        if not prompt_ids or not target_ids:
            raise ValueError("score needs a non-empty prompt and target")
        seq = prompt_ids + target_ids
        self._check_fits(len(seq) - 1)  # the last token is scored, never fed
        s = self._use(slot, adapter)
        n = len(target_ids)
        first = len(prompt_ids) - 1  # the position whose logits predict target 0
        at = base.check_at_ids(at_ids, n)
        logprobs = np.empty(n, np.float32)
        top_ids = np.empty((n, top_k), np.int32)
        top_lps = np.empty((n, top_k), np.float32)
        at_lps = np.empty(at.shape, np.float32)
        if not reuse_cache:
            self._reset(s)  # every position afresh, in the same chunks: bit-identical reruns
        pos = self._reuse_prefix(s, seq, first)
        while pos < len(seq) - 1:
            if cancel is not None and cancel.is_set():
                raise Preempted("scoring was preempted by a user request")
            if pos < first:  # plain prefill up to the first scored position
                end = min(pos + self._chunk(_PREFILL_CHUNK), first)
                self._run(s, seq[pos:end], None)
                pos = end
                continue
            end = min(pos + self._chunk(_SCORE_CHUNK), len(seq) - 1)
            rows = self._run(s, seq[pos:end], 0)
            for i, row in enumerate(rows):
                j = pos + i - first  # target index
                row = row.astype(np.float64)
                lse = row.max() + np.log(np.exp(row - row.max()).sum())
                logprobs[j] = row[target_ids[j]] - lse
                if top_k:
                    idx = np.argpartition(row, -top_k)[-top_k:]
                    idx = idx[np.argsort(-row[idx], kind="stable")]
                    top_ids[j] = idx
                    top_lps[j] = row[idx] - lse
                at_lps[j] = row[at[j]] - lse
            pos = end
        return base.ScoreResult(logprobs=logprobs, top_ids=top_ids, top_logprobs=top_lps, at_logprobs=at_lps)

    def close(self) -> None:
        if getattr(self, "_model", None) is not None:
            self._vocab.close()
            self._adapters.clear()
            self._slots = {0: _Slot(), 1: _Slot()}
            self._model = self._body = self._head = None


# ---- loading -------------------------------------------------------------------------------


def _load_gguf(path: Path, cache_dir: Path | None):
    """A GGUF file through clawd's bridge: the trainer's own float32 model and llama.cpp's tokenizer."""
    from clawd.engines.mlx_vocab import GGUFVocab
    from clawd.training.weights import load_model

    lm = load_model(path, cache_dir=cache_dir)
    vocab = GGUFVocab(path)
    n_ctx_train = int(vocab.metadata.get(f"{lm.arch}.context_length", 0) or 0)
    return lm.model, vocab, lm.arch, n_ctx_train


def _load_dir(path: Path):
    """An MLX / HF model directory. Architectures the trainer knows load through its bridge
    (same float32 weights and Gemma embedding scale, so served log-probs are the trainer's);
    others load with mlx-lm as they are, upcast to float32 on CPU (half precision skips BLAS)."""
    import mlx.core as mx
    from mlx_lm.utils import load, load_tokenizer

    from clawd.engines.mlx_vocab import HFVocab
    from clawd.training.weights import load_model

    try:
        config = read_model_config(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(
            f"{path} is not an MLX/HF model directory (no readable config.json: {e}); "
            "point model.path at one, or at a GGUF file"
        ) from e
    model_type = config.get("model_type")
    try:
        if model_type in ARCH_BY_MODEL_TYPE:
            model = load_model(path).model
            wrapper = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
        else:
            model, wrapper = load(str(path))  # a local path: mlx-lm never touches the network for it
            if sys.platform != "darwin":
                model.set_dtype(mx.float32)
    except ModelLoadError:
        raise
    except Exception as e:  # mlx-lm raises whatever its parsers raise on a broken directory
        raise ModelLoadError(f"mlx-lm cannot load {path}: {e}") from e
    n_ctx_train = int(config.get("max_position_embeddings") or 0)
    vocab = HFVocab(wrapper, config, int(model.args.vocab_size))
    return model, vocab, ARCH_BY_MODEL_TYPE.get(model_type, model_type), n_ctx_train
