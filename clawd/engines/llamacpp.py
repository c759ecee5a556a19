"""llama.cpp engine, driven through llama-cpp-python's low-level (ctypes) API.

Why low level: the high-level `Llama` only gives per-token log-probs with
`logits_all=True` (n_ctx x vocab floats) and takes one LoRA at construction. Here each
step's log-prob comes from the last logits row, and adapters are loaded once and
switched per call with `llama_set_adapters_lora` without reloading the model.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from clawd.engines import base
from clawd.engines.prefix_cache import PrefixCache, common_prefix
from clawd.engines.sampling import top_alternatives
from clawd.errors import AdapterError, ContextLengthExceeded, EngineError, ModelLoadError, Preempted

log = logging.getLogger(__name__)

_SCORE_CHUNK = 64  # rows of full-vocab logits per decode when scoring (64 x 262k x 4 B = 64 MiB)
# A user's prompt is decoded in chunks this long (capped at n_batch), with a cancel check
# between them (a client that hangs up). Without flash attention every chunk reads the whole
# KV cache, so small chunks cost quadratically more on long prompts: a 2000-token prefill of
# the 270M model on 2 cores took 66-78 s in 128-token chunks and 31-35 s in 512-token ones
# (llama-cpp-python's own eval: 35-38 s). Background work yields to users in smaller steps.
_PREFILL_CHUNK = 512
# Background work (slot 1) takes smaller steps still, so a user who arrives mid-judging
# waits ~50 ms rather than a whole chunk; it costs the miner ~25% throughput.
_BACKGROUND_CHUNK = 32
# A slot's K/V is parked in the prefix cache before it is dropped only when at least this
# many of its tokens would be lost: re-prefilling fewer costs less than the copy.
_PARK_MIN_TOKENS = 32
_backend_ready = False
_log_callback = None  # kept referenced: C holds a pointer to it
# What llama.cpp logs as errors when we abort a background decode on purpose, or when a
# saved prefix finds no room to be restored (handled: the other slot makes room, or a prefill).
_ABORT_NOISE = re.compile(
    rb"compute_async failed with error 1|failed to compute graph, compute status: 1|"
    rb"failed to decode, ret = 2|state_read_meta: failed to find \d+ available cells|"
    rb"error loading state: failed to restore kv cache"
)


def _llama():
    """Import llama_cpp once, route its C logging to Python logging, init the backend."""
    global _backend_ready, _log_callback
    import llama_cpp

    if not _backend_ready:
        # ggml levels: 1 debug, 2 info, 3 warn, 4 error, 5 continuation. llama.cpp warns
        # about harmless model quirks on every load, so only errors reach the user's log.
        @llama_cpp.llama_log_callback
        def _log_callback(level, text, _user):
            if level == 4 and not _ABORT_NOISE.search(text):
                log.error("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())
            elif log.isEnabledFor(logging.DEBUG):
                log.debug("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())

        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _backend_ready = True
    return llama_cpp


def check_gguf_file(path: Path, what: str = "model") -> None:
    """Fail early, with what to do, on a path that cannot be a GGUF file."""
    if not path.is_file():
        raise ModelLoadError(
            f"{what} file {path} does not exist: fix model.path in config.toml "
            "(or leave it empty to use the embedded model)"
        )
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(
            f"{path} is not a GGUF file (bad magic {magic!r}): point model.path at a .gguf file or re-download it"
        )


def vocab_tokenize(lc, vocab, text: str, *, add_bos: bool, special: bool) -> list[int]:
    """llama.cpp's tokenizer on `text` (a second call when the first buffer was too small)."""
    data = text.encode("utf-8")
    cap = len(data) + 8
    arr = (lc.llama_token * cap)()
    n = lc.llama_tokenize(vocab, data, len(data), arr, cap, add_bos, special)
    if n < 0:
        cap = -n
        arr = (lc.llama_token * cap)()
        n = lc.llama_tokenize(vocab, data, len(data), arr, cap, add_bos, special)
    return list(arr[:n])


def vocab_piece(lc, vocab, tok: int, buf, *, special: bool) -> bytes:
    """A token's bytes, into the reusable `buf` (a larger one when it does not fit)."""
    n = lc.llama_token_to_piece(vocab, tok, buf, len(buf), 0, special)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = lc.llama_token_to_piece(vocab, tok, buf, len(buf), 0, special)
    return buf.raw[:n]


class Engine(base.Engine):
    name = "llamacpp"
    max_top_logprobs = 20
    supports_grammar = True

    def __init__(
        self,
        model_path: Path,
        *,
        n_ctx: int = 4096,
        n_threads: int = 0,
        n_batch: int = 512,
        top_k: int = 40,
        model_id: str = "",
        prefix_cache_mb: float = 0.0,
    ):
        lc = _llama()
        self._lc = lc
        model_path = Path(model_path)
        check_gguf_file(model_path)
        mparams = lc.llama_model_default_params()
        self._model = lc.llama_model_load_from_file(str(model_path).encode(), mparams)
        if not self._model:
            raise ModelLoadError(
                f"llama.cpp could not load {model_path} (corrupt, truncated, or an architecture "
                "this llama.cpp does not know): re-download the file or pick another model"
            )
        self._vocab = lc.llama_model_get_vocab(self._model)
        self._n_vocab = lc.llama_vocab_n_tokens(self._vocab)
        n_ctx_train = lc.llama_model_n_ctx_train(self._model)
        n_ctx = min(n_ctx, n_ctx_train) if n_ctx_train > 0 else n_ctx
        threads = n_threads or max(1, (os.cpu_count() or 2))
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.n_seq_max = 2
        cparams.kv_unified = True
        # A full-size sliding-window cache lets us drop a suffix of the KV cache and
        # reuse the prefix (Gemma 3 uses SWA); it costs little on small models.
        cparams.swa_full = True
        # llama.cpp's default (auto) turns flash attention on. On CPU its result depends on how
        # a sequence is split into batches (up to ~2e-2 nats on an F32 model), so score()
        # stopped reproducing generate(). Off, they agree to <4e-4 and score() matches the
        # high-level Llama (the benchmark anchor, which also runs without it) to <1e-6.
        cparams.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self._ctx = lc.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            lc.llama_model_free(self._model)
            raise ModelLoadError(f"llama.cpp could not create a context for {model_path} (out of memory?)")
        self._n_batch = n_batch
        self._batch = lc.llama_batch_init(n_batch, 0, 1)
        # Background decodes can be aborted mid-graph (llama.cpp polls this callback), so a
        # user waits for neither a whole chunk nor a whole token of miner work.
        self._abort_when: threading.Event | None = None
        self._abort_cb = lc.ggml_abort_callback(lambda _data: bool(self._abort_when and self._abort_when.is_set()))
        self._abort_armed = False
        self._no_abort = lc.ggml_abort_callback()  # a NULL function pointer
        self._top_k = top_k
        # Two KV sequences: slot 0 for user turns, slot 1 for background work (judging,
        # scoring), so the miner never evicts the conversation's cached prompt. They share
        # the n_ctx cells (kv_unified); tokens whose K/V each slot holds, in order:
        self._caches: dict[int, list[int]] = {0: [], 1: []}
        self._slot = 0
        # K/V a slot drops is parked in host memory (engines/prefix_cache.py) and restored
        # for a later prompt that shares more of it: other sessions, other adapters.
        self._store = PrefixCache(int(prefix_cache_mb * 2**20))
        # A sliding-window model's saved state holds only the last window of its SWA layers,
        # so a restored one may be extended but not cut: the shortest prefix each slot's live
        # K/V may be cut back to (0 for everything computed here: swa_full keeps it all).
        self._swa = lc.llama_model_n_swa(self._model) > 0
        self._floors: dict[int, int] = {0: 0, 1: 0}
        self._adapters: dict[str, object] = {}
        self._applied: str | None = None
        self._piece_buf = ctypes.create_string_buffer(256)
        meta = self._read_metadata()
        template = lc.llama_model_chat_template(self._model, None)
        self._info = base.ModelInfo(
            id=model_id or model_path.stem,
            path=model_path,
            architecture=meta.get("general.architecture", "unknown"),
            n_ctx=lc.llama_n_ctx(self._ctx),
            n_ctx_train=n_ctx_train,
            n_vocab=self._n_vocab,
            chat_template=template.decode("utf-8", "replace") if template else None,
            bos_token=self._token_text(lc.llama_vocab_bos(self._vocab)),
            eos_token=self._token_text(lc.llama_vocab_eos(self._vocab)),
            add_bos=bool(lc.llama_vocab_get_add_bos(self._vocab)),
            metadata=meta,
        )

    # ---- model facts -------------------------------------------------------------

    @property
    def info(self) -> base.ModelInfo:
        return self._info

    def _read_metadata(self) -> dict:
        lc = self._lc
        out = {}
        buf = ctypes.create_string_buffer(4096)
        for i in range(lc.llama_model_meta_count(self._model)):
            n = lc.llama_model_meta_key_by_index(self._model, i, buf, len(buf))
            if n < 0:
                continue
            key = buf.value.decode("utf-8", "replace")
            if key.startswith("tokenizer.ggml.") and key not in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
                continue  # token tables: huge and useless here
            n = lc.llama_model_meta_val_str_by_index(self._model, i, buf, len(buf))
            if n >= 0:
                out[key] = buf.value.decode("utf-8", "replace")
        return out

    def _token_text(self, tok: int) -> str:
        if tok < 0:
            return ""
        return self._piece(tok, special=True).decode("utf-8", "replace")

    # ---- text <-> tokens -----------------------------------------------------------

    def tokenize(self, text: str, *, add_bos: bool, special: bool = True) -> list[int]:
        return vocab_tokenize(self._lc, self._vocab, text, add_bos=add_bos, special=special)

    def _piece(self, tok: int, *, special: bool = False) -> bytes:
        return vocab_piece(self._lc, self._vocab, tok, self._piece_buf, special=special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return b"".join(self._piece(t, special=True) for t in ids).decode("utf-8", "replace")

    # ---- evaluation ------------------------------------------------------------------

    def _check_fits(self, n_tokens: int) -> None:
        if n_tokens >= self._info.n_ctx:
            raise ContextLengthExceeded(
                f"This model's context is {self._info.n_ctx} tokens and the request needs "
                f"{n_tokens}: shorten the messages (or raise model.n_ctx)."
            )

    @property
    def _cached(self) -> list[int]:
        return self._caches[self._slot]

    def _use_slot(self, slot: int, cancel: threading.Event | None = None) -> None:
        if slot not in self._caches:
            raise ValueError(f"slot must be 0 or 1, got {slot}")
        self._slot = slot
        self._abort_when = cancel

    def _chunk(self, foreground: int) -> int:
        """Tokens per decode call between cancel checks, for the current slot."""
        return min(self._n_batch, foreground if self._slot == 0 else _BACKGROUND_CHUNK)

    def _forget_all(self) -> None:
        self._lc.llama_memory_clear(self._lc.llama_get_memory(self._ctx), True)
        for slot, cache in self._caches.items():
            cache.clear()
            self._floors[slot] = 0

    def _drop_slot(self, slot: int) -> None:
        self._lc.llama_memory_seq_rm(self._lc.llama_get_memory(self._ctx), slot, -1, -1)  # never fails
        self._caches[slot].clear()
        self._floors[slot] = 0

    @property
    def prefix_cache(self) -> PrefixCache:
        return self._store

    def _reuse_prefix(self, tokens: Sequence[int], limit: int) -> int:
        """Bring this slot to the longest common prefix of `tokens[:limit]` it can have: its
        own K/V, or a longer saved prefix restored from the prefix cache; drop the rest
        (parked first when worth it) and return how many tokens are kept."""
        lc = self._lc
        slot = self._slot
        keep = common_prefix(np.asarray(self._cached, np.int32), np.asarray(tokens[:limit], np.int32))
        if keep < self._floors[slot]:
            keep = 0  # a restored SWA state cut here would lack part of its window
        losing = len(self._cached) - keep >= _PARK_MIN_TOKENS
        entry, common = None, 0
        if self._store.enabled and limit > keep:
            entry, common = self._store.best(self._applied, tokens, limit, better_than=keep)
        if entry is not None:
            if losing:
                self._park(slot)
            keep = common if self._restore(entry, slot) else 0
        elif losing:
            self._park(slot)
        mem = lc.llama_get_memory(self._ctx)
        if keep < len(self._cached):
            if not lc.llama_memory_seq_rm(mem, slot, keep, -1):
                self._drop_slot(slot)
                keep = 0
        del self._cached[keep:]
        if keep == 0:
            self._floors[slot] = 0  # an empty slot holds no restored window state any more
        if losing and self._swa and keep >= _PARK_MIN_TOKENS:
            # Two prompts parted here: what they share (an agent's system prompt and tools)
            # is the prefix the next session will want, and an SWA state of the longer one
            # cannot be cut back to it later.
            self._park(slot)
        return keep

    def _park(self, slot: int) -> None:
        """Save `slot`'s K/V to the prefix cache (unless it is short or already saved). Only
        the user slot's: background work may restore a saved prefix but never saves its own,
        so the miner's many judge prompts cannot push users' conversations out."""
        tokens = self._caches[slot]
        if slot != 0 or not self._store.enabled or len(tokens) < _PARK_MIN_TOKENS:
            return
        floor = len(tokens) if self._swa else 0
        if self._store.covers(self._applied, tokens, floor):
            return
        lc = self._lc
        size = lc.llama_state_seq_get_size(self._ctx, slot)
        if not 0 < size <= self._store.max_bytes:
            return
        buf = (ctypes.c_uint8 * size)()
        if lc.llama_state_seq_get_data(self._ctx, buf, size, slot) == size:
            self._store.put(self._applied, tokens, buf, size, floor)

    def _restore(self, entry, slot: int) -> bool:
        """Replace `slot`'s K/V with a saved state; False (slot empty) if it does not fit."""
        lc = self._lc
        self._drop_slot(slot)
        other = 1 - slot
        if len(entry.tokens) + len(self._caches[other]) > self._info.n_ctx:
            self._park(other)  # cannot fit beside it: make room now rather than fail a copy
            self._drop_slot(other)
        ok = lc.llama_state_seq_set_data(self._ctx, entry.state, entry.nbytes, slot) == entry.nbytes
        if not ok and self._caches[other]:
            # No room beside the other slot's K/V: it is only a speed-up, park and drop it.
            self._drop_slot(slot)
            self._park(other)
            self._drop_slot(other)
            ok = lc.llama_state_seq_set_data(self._ctx, entry.state, entry.nbytes, slot) == entry.nbytes
        if not ok:
            self._drop_slot(slot)
            return False
        self._caches[slot][:] = entry.tokens.tolist()
        self._floors[slot] = entry.floor
        return True

    def _decode(self, tokens: Sequence[int], start_pos: int, want_logits: Sequence[bool]) -> None:
        """Decode one batch (len <= n_batch) at positions start_pos.., appending to the cache."""
        lc = self._lc
        b = self._batch
        n = len(tokens)
        for i, tok in enumerate(tokens):
            b.token[i] = tok
            b.pos[i] = start_pos + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = self._slot
            b.logits[i] = want_logits[i]
        b.n_tokens = n
        self._arm_abort(self._slot == 1 and self._abort_when is not None)
        rc = lc.llama_decode(self._ctx, b)
        if rc == 2:  # aborted for a user: this slot's cache holds part of the batch, drop it
            self._drop_slot(self._slot)
            raise Preempted("background work was preempted by a user request")
        other = 1 - self._slot
        if rc == 1 and self._caches[other]:
            # No free KV cells: the other slot's cache is only a speed-up, park and drop it, retry.
            self._park(other)
            self._drop_slot(other)
            rc = lc.llama_decode(self._ctx, b)
        if rc != 0:
            # The cache may now hold part of the batch: forget it all rather than guess.
            self._forget_all()
            raise EngineError(f"llama_decode failed with code {rc}")
        self._cached.extend(tokens)

    def _arm_abort(self, armed: bool) -> None:
        """Only background decodes carry the callback: it takes the GIL each time it runs."""
        if armed != self._abort_armed:
            self._lc.llama_set_abort_callback(self._ctx, self._abort_cb if armed else self._no_abort, None)
            self._abort_armed = armed

    def _logits_row(self, batch_index: int) -> np.ndarray:
        ptr = self._lc.llama_get_logits_ith(self._ctx, batch_index)
        return np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))

    def _prefill(self, tokens: Sequence[int], cancel: threading.Event | None) -> bool:
        """Bring the cache to exactly `tokens`, leaving logits for the last one.
        Returns False if cancelled between chunks (the cache then holds a prefix)."""
        keep = self._reuse_prefix(tokens, len(tokens) - 1)
        rest = tokens[keep:]
        log.debug("slot %d prompt: %d tokens, %d cached, %d to decode", self._slot, len(tokens), keep, len(rest))
        size = self._chunk(_PREFILL_CHUNK)
        for s in range(0, len(rest), size):
            if cancel is not None and cancel.is_set():
                return False
            chunk = rest[s : s + size]
            last = s + len(chunk) == len(rest)
            flags = [False] * len(chunk)
            flags[-1] = last
            self._decode(chunk, keep + s, flags)
        return True

    # ---- adapters ----------------------------------------------------------------------

    def load_adapter(self, adapter_id: str, path: Path) -> None:
        path = Path(path)
        if not path.is_file():
            raise AdapterError(f"adapter file {path} does not exist: check the adapter id, or re-export the adapter")
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise AdapterError(f"{path} is not a GGUF LoRA adapter file")
        handle = self._lc.llama_adapter_lora_init(self._model, str(path).encode())
        if not handle:
            raise AdapterError(
                f"llama.cpp refused adapter {path}: it does not fit {self._info.id} "
                "(wrong architecture, tensor names or shapes); retrain or re-export it for this model"
            )
        old = self._adapters.pop(adapter_id, None)
        if old is not None:
            self._free_adapter(adapter_id, old)
        self._store.drop_adapter(adapter_id)  # states saved under an old file of this id
        self._adapters[adapter_id] = handle

    def unload_adapter(self, adapter_id: str) -> None:
        handle = self._adapters.pop(adapter_id, None)
        if handle is not None:
            self._free_adapter(adapter_id, handle)
        self._store.drop_adapter(adapter_id)

    def _free_adapter(self, adapter_id: str, handle) -> None:
        if self._applied == adapter_id:
            self._apply(None)
        self._lc.llama_adapter_lora_free(handle)

    @property
    def loaded_adapters(self) -> list[str]:
        return list(self._adapters)

    def _apply(self, adapter_id: str | None) -> None:
        """Put exactly this adapter (or none) on the context; cached K/V computed under
        another adapter would silently mix the two, so a change drops the live cache
        (parked first, under the adapter it was computed with)."""
        if adapter_id == self._applied:
            return
        lc = self._lc
        if self._applied is None or self._applied in self._adapters:  # not while freeing one
            for slot in self._caches:
                self._park(slot)
        if adapter_id is None:
            rc = lc.llama_set_adapters_lora(self._ctx, None, 0, None)
        else:
            handle = self._adapters.get(adapter_id)
            if handle is None:
                raise AdapterError(f"adapter {adapter_id!r} is not loaded")
            arr = (lc.llama_adapter_lora_p_ctypes * 1)(handle)
            scales = (ctypes.c_float * 1)(1.0)
            rc = lc.llama_set_adapters_lora(self._ctx, arr, 1, scales)
        if rc != 0:
            raise EngineError(f"llama_set_adapters_lora failed with code {rc}")
        self._forget_all()
        self._applied = adapter_id

    # ---- generation --------------------------------------------------------------------

    def grammar_from_schema(self, schema: dict) -> str:
        from llama_cpp.llama_grammar import json_schema_to_gbnf

        return json_schema_to_gbnf(json.dumps(schema))

    def _sampler(self, params: base.SamplingParams):
        lc = self._lc
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        if params.grammar is not None:
            # First in the chain: what the grammar forbids is gone before top-k / top-p pick.
            grammar = lc.llama_sampler_init_grammar(self._vocab, params.grammar.encode(), b"root")
            if not grammar:
                lc.llama_sampler_free(chain)
                raise EngineError("llama.cpp could not parse the output grammar")
            lc.llama_sampler_chain_add(chain, grammar)
            if params.temperature <= 0:
                lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
                return chain
        if self._top_k > 0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_k(self._top_k))
        if params.top_p < 1.0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(params.top_p, 1))
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(params.temperature))
        seed = lc.LLAMA_DEFAULT_SEED if params.seed is None else params.seed & 0xFFFFFFFF
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(seed))
        return chain

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
        self._check_fits(len(prompt_ids))
        self._use_slot(slot, cancel)
        self._apply(adapter)
        budget = min(params.max_tokens, self._info.n_ctx - len(prompt_ids))
        return self._generate(prompt_ids, params, budget, cancel)

    def _generate(self, prompt_ids, params, budget, cancel) -> Iterator[base.SampledToken]:
        lc = self._lc
        if not self._prefill(prompt_ids, cancel):
            return
        # Greedy without a grammar needs no sampler (see below); a grammar always needs one.
        greedy = params.temperature <= 0 and params.grammar is None
        sampler = None if greedy else self._sampler(params)
        scratch = np.empty(self._n_vocab, np.float32)
        try:
            for step in range(budget):
                if cancel is not None and cancel.is_set():
                    return
                row = self._logits_row(-1)
                top = row.max()
                # Greedy needs no sampler: argmax picks the first maximum, as llama.cpp's
                # greedy sampler does, without building its 262k-candidate array.
                tok = int(row.argmax()) if greedy else lc.llama_sampler_sample(sampler, self._ctx, -1)
                np.subtract(row, top, out=scratch)
                np.exp(scratch, out=scratch)
                logprob = float(row[tok] - top - np.log(scratch.sum()))
                alts = self._alternatives(row, params.top_logprobs)
                if lc.llama_vocab_is_eog(self._vocab, tok):
                    yield base.SampledToken(tok, b"", logprob, is_end=True, top=alts)
                    return
                yield base.SampledToken(tok, self._piece(tok), logprob, top=alts)
                if step + 1 < budget:
                    self._decode([tok], len(self._cached), [True])
        finally:
            if sampler is not None:
                lc.llama_sampler_free(sampler)

    def _alternatives(self, row: np.ndarray, k: int) -> tuple[base.Alternative, ...]:
        """The k most likely tokens of this step (control tokens spelled out, e.g. "</s>")."""
        if k <= 0:
            return ()
        ids, lps = top_alternatives(row, k)
        return tuple(base.Alternative(int(i), self._piece(int(i), special=True), float(lp)) for i, lp in zip(ids, lps))

    # ---- scoring -----------------------------------------------------------------------

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
        self._use_slot(slot, cancel)
        if not prompt_ids or not target_ids:
            raise ValueError("score needs a non-empty prompt and target")
        seq = prompt_ids + target_ids
        self._check_fits(len(seq) - 1)  # the last token is scored, never decoded
        self._apply(adapter)
        n = len(target_ids)
        first = len(prompt_ids) - 1  # position whose logits predict target 0
        logprobs = np.empty(n, np.float32)
        top_ids = np.empty((n, top_k), np.int32)
        top_lps = np.empty((n, top_k), np.float32)
        at = base.check_at_ids(at_ids, n)
        at_lps = np.empty(at.shape, np.float32)
        keep = self._reuse_prefix(seq, first if reuse_cache else 0)
        pos = keep
        while pos < len(seq) - 1:  # the last token's logits predict nothing we need
            if cancel is not None and cancel.is_set():
                raise Preempted("scoring was preempted by a user request")
            if pos < first:  # plain prefill up to the first scored position
                end = min(pos + self._chunk(_PREFILL_CHUNK), first)
            else:
                end = min(pos + self._chunk(_SCORE_CHUNK), len(seq) - 1)
            chunk = seq[pos:end]
            flags = [first <= pos + i for i in range(len(chunk))]
            self._decode(chunk, pos, flags)
            for i, wanted in enumerate(flags):
                if not wanted:
                    continue
                j = pos + i - first  # target index
                row = self._logits_row(i).astype(np.float64)
                lse = row.max() + np.log(np.exp(row - row.max()).sum())
                logprobs[j] = row[target_ids[j]] - lse
                if top_k:
                    idx = np.argpartition(row, -top_k)[-top_k:]
                    idx = idx[np.argsort(-row[idx], kind="stable")]
                    top_ids[j] = idx
                    top_lps[j] = row[idx] - lse
                at_lps[j] = row[at[j]] - lse
            pos += len(chunk)
        return base.ScoreResult(logprobs=logprobs, top_ids=top_ids, top_logprobs=top_lps, at_logprobs=at_lps)

    def close(self) -> None:
        lc = self._lc
        if getattr(self, "_ctx", None):
            for handle in self._adapters.values():
                lc.llama_adapter_lora_free(handle)
            self._adapters.clear()
            lc.llama_batch_free(self._batch)
            lc.llama_free(self._ctx)
            lc.llama_model_free(self._model)
            self._ctx = None
