"""A fake engine for fast tests of the code around engines (`model.engine = "fake"`).

It is a real, self-consistent language model, only a silly one: tokens are UTF-8 bytes
(ids 0-255) plus BOS (256) and EOS (257); after a prompt whose last line is
"User: X" it intends to say "You said: X" then EOS, putting probability 0.9 on the
intended next token and spreading the rest uniformly. `generate` samples from that
distribution and `score` returns log-probs of the same distribution, so the two agree
exactly, as the contract requires of real engines. An adapter prefixes the intended
reply with "[adapter-id] ", which makes adapter switches visible.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from clawd.engines import base
from clawd.errors import AdapterError, ContextLengthExceeded, Preempted

BOS, EOS, VOCAB = 256, 257, 258
_SPECIAL = {b"<s>": BOS, b"</s>": EOS}
_SPECIAL_TEXT = {v: k for k, v in _SPECIAL.items()}
_SPECIAL_RE = re.compile(rb"(<s>|</s>)")
_P_INTENDED = 0.9


class Engine(base.Engine):
    name = "fake"
    max_top_logprobs = 20

    def __init__(
        self,
        model_path: Path | None = None,
        *,
        n_ctx: int = 2048,
        token_delay: float = 0.0,
        model_id: str = "fake-model",
        reply_prefix: str = "",
        **_ignored,
    ):
        self._info = base.ModelInfo(
            id=model_id,
            path=Path(model_path or "fake"),
            architecture="fake",
            n_ctx=n_ctx,
            n_ctx_train=n_ctx,
            n_vocab=VOCAB,
            chat_template=None,
            bos_token="<s>",
            eos_token="</s>",
            add_bos=True,
        )
        self._delay = token_delay
        # Real models often open a reply with whitespace (" The" after "Assistant:"); tests
        # of what clients are shown set this to " " to get the same.
        self._reply_prefix = reply_prefix
        self._adapters: dict[str, Path] = {}
        on = np.log(_P_INTENDED)
        off = np.log((1 - _P_INTENDED) / (VOCAB - 1))
        self._lp_on, self._lp_off, self._lp_uniform = float(on), float(off), float(-np.log(VOCAB))

    @property
    def info(self) -> base.ModelInfo:
        return self._info

    def tokenize(self, text: str, *, add_bos: bool, special: bool = True) -> list[int]:
        ids: list[int] = []
        # As real tokenizers do, special=True reads "<s>" / "</s>" in the text as BOS / EOS.
        for part in _SPECIAL_RE.split(text.encode("utf-8")) if special else [text.encode("utf-8")]:
            ids += [_SPECIAL[part]] if special and part in _SPECIAL else list(part)
        return [BOS, *ids] if add_bos else ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return b"".join(_SPECIAL_TEXT.get(t) or _piece(t) for t in ids).decode("utf-8", "replace")

    def _intended(self, prompt_ids: Sequence[int], adapter: str | None) -> list[int]:
        text = bytes(t for t in prompt_ids if t < 256).decode("utf-8", "replace")
        asked = ""
        for line in text.splitlines():
            if line.startswith("User: "):
                asked = line[len("User: ") :]
        reply = self._reply_prefix + (f"You said: {asked}" if asked else "Hello.")
        if adapter:
            reply = f"[{adapter}] {reply}"
        return [*reply.encode("utf-8"), EOS]

    def _check(self, n: int, adapter: str | None) -> None:
        if n >= self._info.n_ctx:
            raise ContextLengthExceeded(
                f"This model's context is {self._info.n_ctx} tokens and the request needs {n}: shorten the messages."
            )
        if adapter is not None and adapter not in self._adapters:
            raise AdapterError(f"adapter {adapter!r} is not loaded")

    def _logprobs_at(self, intended: list[int], produced: Sequence[int]) -> np.ndarray:
        """The full next-token distribution after `produced` response tokens."""
        j = len(produced)
        if j < len(intended) and list(produced) == intended[:j]:
            lp = np.full(VOCAB, self._lp_off)
            lp[intended[j]] = self._lp_on
            return lp
        return np.full(VOCAB, self._lp_uniform)

    def generate(self, prompt_ids, params, *, adapter=None, cancel=None, slot=0) -> Iterator[base.SampledToken]:
        self._check(len(prompt_ids), adapter)
        budget = min(params.max_tokens, self._info.n_ctx - len(prompt_ids))
        return self._generate(list(prompt_ids), params, adapter, budget, cancel)

    def _generate(self, prompt_ids, params, adapter, budget, cancel):
        rng = random.Random(params.seed)
        intended = self._intended(prompt_ids, adapter)
        produced: list[int] = []
        for _ in range(budget):
            if cancel is not None and cancel.is_set():
                return
            if self._delay:
                time.sleep(self._delay)
            lp = self._logprobs_at(intended, produced)
            if params.temperature <= 0:
                tok = int(np.argmax(lp))
            else:
                w = np.exp((lp - lp.max()) / params.temperature)
                tok = rng.choices(range(VOCAB), weights=w.tolist())[0]
            produced.append(tok)
            top = ()
            if params.top_logprobs:
                idx = np.argsort(-lp, kind="stable")[: params.top_logprobs]
                top = tuple(
                    base.Alternative(int(i), _SPECIAL_TEXT.get(int(i)) or _piece(int(i)), float(lp[i])) for i in idx
                )
            if tok == EOS:
                yield base.SampledToken(tok, b"", float(lp[tok]), is_end=True, top=top)
                return
            yield base.SampledToken(tok, _piece(tok), float(lp[tok]), top=top)

    def score(
        self, prompt_ids, target_ids, *, top_k=0, adapter=None, at_ids=None, cancel=None, slot=0, reuse_cache=True
    ) -> base.ScoreResult:  # no cache: always fresh
        if not prompt_ids or not target_ids:
            raise ValueError("score needs a non-empty prompt and target")
        if cancel is not None and cancel.is_set():
            raise Preempted("scoring was preempted by a user request")
        self._check(len(prompt_ids) + len(target_ids), adapter)
        intended = self._intended(prompt_ids, adapter)
        n = len(target_ids)
        out = np.empty(n, np.float32)
        top_ids = np.empty((n, top_k), np.int32)
        top_lps = np.empty((n, top_k), np.float32)
        at = base.check_at_ids(at_ids, n)
        at_lps = np.empty(at.shape, np.float32)
        for j, tok in enumerate(target_ids):
            lp = self._logprobs_at(intended, target_ids[:j])
            out[j] = lp[tok]
            at_lps[j] = lp[at[j]]
            if top_k:
                idx = np.argsort(-lp, kind="stable")[:top_k]
                top_ids[j], top_lps[j] = idx, lp[idx]
        return base.ScoreResult(out, top_ids, top_lps, at_lps)

    def load_adapter(self, adapter_id: str, path: Path) -> None:
        if not Path(path).is_file():
            raise AdapterError(f"adapter file {path} does not exist")
        self._adapters[adapter_id] = Path(path)

    def unload_adapter(self, adapter_id: str) -> None:
        self._adapters.pop(adapter_id, None)

    @property
    def loaded_adapters(self) -> list[str]:
        return list(self._adapters)


def _piece(tok: int) -> bytes:
    return bytes([tok]) if tok < 256 else b""
