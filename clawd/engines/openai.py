"""The `openai` upstream engine: serve through an OpenAI-compatible server the user already
runs (vLLM, SGLang, llama-server, llama-cpp-python's server, Ollama); clawd stays the proxy
that renders the prompt, logs every turn, mines and exports.

Boundary: HTTP to one upstream, nothing else. No request leaves the machine unless
`model.base_url` names a server. clawd keeps rendering prompts with its own chat format and
sends the text to the upstream's legacy `/completions` endpoint (not `/chat/completions`), so
the prompt the upstream evaluates is exactly the logged `prompt_text` / `prompt_ids`.

What an upstream can give, probed once at start-up (`capabilities`):
- tokenize / detokenize: llama-server and vLLM `POST /tokenize` `/detokenize`, llama-cpp-python
  `POST /extras/tokenize` `/extras/detokenize`. Without one clawd cannot log token ids, so the
  engine refuses to start and says which endpoints it tried.
- per-token log-probs: `logprobs` on `/completions` (every server above). The sampled token's
  id: llama-server reports it (`id`), vLLM with `return_tokens_as_token_ids`; otherwise clawd
  maps the token's text back through the upstream tokenizer, and a token whose text does not
  map to exactly one id (llama-cpp-python drops invalid UTF-8 from token text) is logged with
  id -1 ("unknown"), never a guess. When the upstream ends the answer itself, an end token is
  reported with the EOS id when known (else -1) and log-prob NaN: servers do not stream the
  EOS token or its log-prob.
- model facts: n_ctx, vocabulary size, chat template and BOS/EOS text only where the server
  publishes them (llama-server /props and /v1/models meta, vLLM max_model_len); n_vocab 0 and
  empty BOS/EOS text mean "not published", and without a template clawd's transcript format is used.
- scoring: prompt echo with log-probs (`echo: true`, `max_tokens: 1`). The upstream re-reads
  text, so a score is only returned when the text re-tokenizes to exactly the given ids;
  otherwise, and for top-k / at_ids when the upstream does not name token ids, EngineError
  says it is not supported by this upstream.
- adapters: none at runtime. clawd exports adapters (`clawd adapters export ID --format peft`
  for vLLM / SGLang `POST /v1/load_lora_adapter`, `--format gguf` for `llama-server --lora`);
  loading them is the upstream's business, so load_adapter raises AdapterError saying so.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from clawd.engines import base
from clawd.errors import AdapterError, ContextLengthExceeded, EngineError, ModelLoadError

log = logging.getLogger(__name__)

UNKNOWN_ID = -1  # a token whose id the upstream did not tell and its text cannot pin down
_TEXT_CACHE = 64  # recent tokenize() results: generate() sends the exact text clawd rendered


def _root(base_url: str) -> str:
    """The server root (tokenize endpoints live beside /v1, not under it)."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class _Tokenizer:
    """One server family's tokenize / detokenize endpoints."""

    name = ""

    def __init__(self, http: httpx.Client, root: str, model: str):
        self.http, self.root, self.model = http, root, model

    def _post(self, path: str, body: dict) -> dict:
        r = self.http.post(self.root + path, json=body)
        r.raise_for_status()
        return r.json()


class _LlamaServerOrVllm(_Tokenizer):
    # llama-server reads content/add_special/parse_special, vLLM reads prompt/add_special_tokens;
    # each ignores the other's keys, so one body serves both.
    name = "/tokenize"

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        out = self._post(
            "/tokenize",
            {
                "content": text,
                "prompt": text,
                "model": self.model,
                "add_special": add_special,
                "add_special_tokens": add_special,
                "parse_special": True,
            },
        )
        return [t if isinstance(t, int) else t["id"] for t in out["tokens"]]

    def detokenize(self, ids: Sequence[int]) -> str:
        out = self._post("/detokenize", {"tokens": list(ids), "model": self.model})
        return out.get("content", out.get("prompt", ""))


class _LlamaCppPython(_Tokenizer):
    # Always adds BOS (when the model uses one) and always parses special-token text.
    name = "/extras/tokenize"

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        return list(self._post("/extras/tokenize", {"input": text, "model": self.model})["tokens"])

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._post("/extras/detokenize", {"tokens": list(ids), "model": self.model})["text"]


class Engine(base.Engine):
    name = "openai"

    def __init__(
        self,
        base_url: str,
        *,
        model: str = "",
        api_key: str = "",
        n_ctx: int = 4096,
        top_k: int = 40,
        timeout_s: float = 600.0,
        model_id: str = "",
        **_ignored,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ModelLoadError(
                f"model.base_url {base_url!r} is not an http(s) URL: set it to the upstream's "
                "OpenAI base URL, e.g. http://127.0.0.1:8080/v1"
            )
        self._base = base_url.rstrip("/")
        self._top_k = top_k
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout_s, connect=5.0))
        self._model = self._pick_model(model)
        meta = self._server_meta()
        self._tok = self._find_tokenizer()
        empty = self._tok.tokenize("", True)
        self._bos_id = empty[0] if empty else None
        self._eos_id = meta.get("eos_id")
        self._texts: OrderedDict[tuple[int, ...], str] = OrderedDict()
        self._piece_ids: dict[bytes, int] = {}
        n_ctx = min(n_ctx, meta["n_ctx"]) if meta.get("n_ctx") else n_ctx
        self._info = base.ModelInfo(
            id=model_id or self._model,
            path=Path(self._base),
            architecture=meta.get("architecture", "upstream"),
            n_ctx=n_ctx,
            n_ctx_train=max(n_ctx, meta.get("n_ctx_train") or 0),
            n_vocab=meta.get("n_vocab") or 0,
            chat_template=meta.get("chat_template"),
            bos_token=meta.get("bos_token", ""),
            eos_token=meta.get("eos_token", ""),
            add_bos=self._bos_id is not None,
            metadata={"base_url": self._base, "upstream_model": self._model, "tokenizer": self._tok.name},
        )
        self.capabilities = {
            "tokenize": self._tok.name,
            "token_ids": "probed per response",
            "score": "echo + logprobs, exact text round trips only",
            "adapters": "none at runtime",
        }

    # ---- start-up probes -------------------------------------------------------------

    def _get(self, url: str) -> httpx.Response:
        try:
            return self._http.get(url)
        except httpx.HTTPError as e:
            raise ModelLoadError(
                f"cannot reach the upstream at {self._base} ({e or type(e).__name__}): start it, or fix model.base_url"
            ) from e

    def _pick_model(self, wanted: str) -> str:
        r = self._get(self._base + "/models")
        if r.status_code != 200:
            raise ModelLoadError(
                f"{self._base}/models answered HTTP {r.status_code}: is model.base_url the "
                "upstream's OpenAI base (ending in /v1), and model.api_key right?"
            )
        ids = [m["id"] for m in r.json().get("data", [])]
        if wanted:
            if wanted not in ids:
                raise ModelLoadError(
                    f"the upstream serves {', '.join(ids) or 'no models'}, not {wanted!r}: fix model.name"
                )
            return wanted
        if not ids:
            raise ModelLoadError(f"the upstream at {self._base} lists no models: load one there first")
        return ids[0]

    def _server_meta(self) -> dict[str, Any]:
        """Model facts from servers that publish them (llama-server /props and /v1/models meta)."""
        meta: dict[str, Any] = {}
        r = self._get(self._base + "/models")
        for m in r.json().get("data", []):
            if m.get("id") == self._model and isinstance(m.get("meta"), dict):
                meta.update(n_vocab=m["meta"].get("n_vocab"), n_ctx_train=m["meta"].get("n_ctx_train"))
            if m.get("id") == self._model and m.get("max_model_len"):  # vLLM
                meta["n_ctx"] = m["max_model_len"]
        r = self._get(_root(self._base) + "/props")
        if r.status_code == 200:
            props = r.json()
            meta["n_ctx"] = (props.get("default_generation_settings") or {}).get("n_ctx") or meta.get("n_ctx")
            for key in ("chat_template", "bos_token", "eos_token"):
                if isinstance(props.get(key), str) and props[key]:
                    meta[key] = props[key]
        return meta

    def _find_tokenizer(self) -> _Tokenizer:
        tried = []
        for cls in (_LlamaServerOrVllm, _LlamaCppPython):
            tok = cls(self._http, _root(self._base), self._model)
            try:
                if tok.tokenize("a", False) and tok.detokenize(tok.tokenize("a", False)) is not None:
                    return tok
            except (httpx.HTTPError, KeyError, TypeError, ValueError) as e:
                tried.append(f"{cls.name} ({type(e).__name__})")
        raise ModelLoadError(
            f"the upstream at {_root(self._base)} has no tokenize endpoint (tried "
            f"{', '.join(tried)}); clawd logs token ids, so it needs llama-server, vLLM, "
            "SGLang or llama-cpp-python's server"
        )

    # ---- facts and tokens ------------------------------------------------------------

    @property
    def info(self) -> base.ModelInfo:
        return self._info

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except httpx.HTTPError as e:
            raise EngineError(f"the upstream at {self._base} failed ({e or type(e).__name__})") from e

    def tokenize(self, text: str, *, add_bos: bool, special: bool = True) -> list[int]:
        # special=False cannot be asked of every server (llama-cpp-python always parses
        # special-token text); for ordinary text the two agree.
        ids = self._call(self._tok.tokenize, text, True)
        if self._bos_id is not None and ids[:1] == [self._bos_id]:
            ids = ids[1:]  # the BOS the server always adds (tokenize("") is [BOS]), not one in the text
        if add_bos and self._bos_id is not None:
            ids = [self._bos_id, *ids]
        self._texts[tuple(ids)] = text
        self._texts.move_to_end(tuple(ids))
        while len(self._texts) > _TEXT_CACHE:
            self._texts.popitem(last=False)
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        head = ""
        if self._bos_id is not None and ids[:1] == [self._bos_id]:
            # Rendered here: llama-cpp-python's server drops the space after a leading BOS.
            head, ids = self._info.bos_token, ids[1:]
        return head + (self._call(self._tok.detokenize, ids) if ids else "")

    def _text_of(self, ids: Sequence[int]) -> str:
        """The text to send for `ids`, without the BOS the upstream adds by itself."""
        key = tuple(ids)
        if key in self._texts:
            return self._texts[key]
        body = list(ids)
        if self._bos_id is not None and body[:1] == [self._bos_id]:
            body = body[1:]
        return self.detokenize(body)

    def _known_id(self, entry: dict, piece: bytes) -> int | None:
        """The token's id if it is known without asking the upstream, else None."""
        if isinstance(entry.get("id"), int) or str(entry.get("token", "")).startswith("token_id:") or not piece:
            return self._id_of(entry, piece)
        return self._piece_ids.get(piece)

    def _id_of(self, entry: dict, piece: bytes) -> int:
        if isinstance(entry.get("id"), int):
            return entry["id"]  # llama-server
        tok = entry.get("token")
        if isinstance(tok, str) and tok.startswith("token_id:"):
            return int(tok.split(":", 1)[1])  # vLLM return_tokens_as_token_ids
        if not piece:
            return UNKNOWN_ID
        if piece not in self._piece_ids:
            ids = self.tokenize(piece.decode("utf-8", "replace"), add_bos=False)
            self._piece_ids[piece] = ids[0] if len(ids) == 1 else UNKNOWN_ID
        return self._piece_ids[piece]

    def _check_fits(self, n: int) -> None:
        if n >= self._info.n_ctx:
            raise ContextLengthExceeded(
                f"This model's context is {self._info.n_ctx} tokens and the request "
                f"needs {n}: shorten the messages (or raise model.n_ctx)."
            )

    # ---- generation --------------------------------------------------------------------

    def generate(self, prompt_ids, params, *, adapter=None, cancel=None, slot=0) -> Iterator[base.SampledToken]:
        if adapter is not None:
            raise AdapterError(
                f"adapter {adapter!r} is not loaded: the openai engine cannot load adapters into the upstream"
            )
        # One context cell stays free: llama_cpp.server fails (and shuts down) when prompt + max_tokens
        # reaches n_ctx exactly, and servers may count the prompt one token differently (BOS).
        self._check_fits(len(prompt_ids) + 1)
        budget = min(params.max_tokens, self._info.n_ctx - 1 - len(prompt_ids))
        body = {
            "model": self._model,
            "prompt": self._text_of(prompt_ids),
            "max_tokens": budget,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stream": True,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            # The same sampler as the llamacpp engine: no penalties or min-p that servers
            # default to (llama-cpp-python: repeat_penalty 1.1, min_p 0.05).
            "top_k": self._top_k,
            "min_p": 0.0,
            "repeat_penalty": 1.0,
            "repetition_penalty": 1.0,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        return self._stream(body, budget, cancel)

    def _stream(self, body: dict, budget: int, cancel: threading.Event | None) -> Iterator[base.SampledToken]:
        if cancel is not None and cancel.is_set():
            return
        # A token whose id must be looked up is held back until the stream ends: some servers
        # (llama-cpp-python) interrupt a running generation when any other request arrives.
        held: list[tuple[dict, bytes, float]] = []
        produced, ended = 0, False
        try:
            with self._http.stream("POST", self._base + "/completions", json=body) as r:
                if r.status_code >= 400:
                    raise self._upstream_error(r)
                for chunk in _sse(r.iter_lines()):
                    choice = (chunk.get("choices") or [{}])[0]
                    for entry, piece, logprob in self._entries(choice):
                        if cancel is not None and cancel.is_set():
                            return  # leaving the `with` closes the connection: the upstream stops
                        known = self._known_id(entry, piece)
                        if held or known is None:
                            held.append((entry, piece, logprob))
                        else:
                            yield base.SampledToken(known, piece, logprob)
                        produced += 1
                        if produced >= budget:
                            break  # some servers (llama-cpp-python) stream one token past max_tokens
                    if produced >= budget or choice.get("finish_reason"):
                        ended = choice.get("finish_reason") == "stop" and produced < budget
                        break
        except httpx.HTTPError as e:
            raise EngineError(f"the upstream at {self._base} failed mid-stream ({e or type(e).__name__})") from e
        for entry, piece, logprob in held:
            if cancel is not None and cancel.is_set():
                return
            yield base.SampledToken(self._id_of(entry, piece), piece, logprob)
        if ended:
            yield base.SampledToken(
                self._eos_id if self._eos_id is not None else UNKNOWN_ID, b"", math.nan, is_end=True
            )

    def _entries(self, choice: dict) -> Iterator[tuple[dict, bytes, float]]:
        """(entry, piece bytes, log-prob) per token of one streamed choice."""
        lp = choice.get("logprobs")
        if lp is None:
            if choice.get("text"):
                raise EngineError(
                    "the upstream returned no log-probs; clawd logs them per token: enable "
                    "logprobs on the upstream (vLLM: --max-logprobs)"
                )
            return
        if "content" in lp:  # chat-style entries (llama-server): token, logprob, bytes, id
            entries = lp["content"] or []
        else:  # legacy completions: parallel lists
            entries = [
                {"token": t, "logprob": p} for t, p in zip(lp.get("tokens") or [], lp.get("token_logprobs") or [])
            ]
        for e in entries:
            piece = bytes(e["bytes"]) if e.get("bytes") is not None else str(e.get("token", "")).encode("utf-8")
            if str(e.get("token", "")).startswith("token_id:"):
                piece = choice.get("text", "").encode("utf-8") if len(entries) == 1 else b""
            yield e, piece, float(e["logprob"])

    def _upstream_error(self, r: httpx.Response) -> Exception:
        r.read()
        try:
            err = r.json().get("error")
            msg = err.get("message") if isinstance(err, dict) else str(err)
        except (ValueError, AttributeError):
            msg = r.text[:300]
        if r.status_code == 400 and "context" in (msg or "").lower():
            return ContextLengthExceeded(f"the upstream says: {msg}")
        return EngineError(f"the upstream answered HTTP {r.status_code}: {msg}")

    # ---- scoring -----------------------------------------------------------------------

    def score(
        self, prompt_ids, target_ids, *, top_k=0, adapter=None, at_ids=None, cancel=None, slot=0, reuse_cache=True
    ) -> base.ScoreResult:
        prompt_ids, target_ids = list(prompt_ids), list(target_ids)
        if not prompt_ids or not target_ids:
            raise ValueError("score needs a non-empty prompt and target")
        if adapter is not None:
            raise AdapterError(
                f"adapter {adapter!r} is not loaded: the openai engine cannot load adapters into the upstream"
            )
        seq = prompt_ids + target_ids
        self._check_fits(len(seq) - 1)
        if UNKNOWN_ID in seq:
            raise EngineError(
                "cannot score tokens the upstream did not identify (id -1): not supported by this upstream"
            )
        n = len(target_ids)
        at = base.check_at_ids(at_ids, n)
        text = self.detokenize(seq[1:] if self._bos_id is not None and seq[0] == self._bos_id else seq)
        if self.tokenize(text, add_bos=seq[0] == self._bos_id) != seq:
            raise EngineError(
                "scoring exact token ids is not supported by this upstream: it re-reads text, and "
                "these ids do not survive the round trip (use vLLM or llama-server, or "
                "mining.judge = rules)"
            )
        body = {
            "model": self._model,
            "prompt": text,
            "max_tokens": 1,
            "temperature": 0.0,
            "echo": True,
            "logprobs": max(top_k, 1),
            "repeat_penalty": 1.0,
            "repetition_penalty": 1.0,
        }
        r = self._call(self._http.post, self._base + "/completions", json=body)
        if r.status_code >= 400:
            raise self._upstream_error(r)
        lp = r.json()["choices"][0].get("logprobs") or {}
        echoed = lp.get("token_logprobs") or []
        tops = lp.get("top_logprobs") or []
        first = len(seq) - n - (1 if seq[0] == self._bos_id else 0)  # index of target 0 in the echo
        if len(echoed) < first + n or any(v is None for v in echoed[first : first + n]):
            raise EngineError(
                "the upstream's prompt echo has no log-probs for these tokens: scoring is not "
                "supported by this upstream"
            )
        logprobs = np.asarray(echoed[first : first + n], np.float32)
        top_ids = np.empty((n, top_k), np.int32)
        top_lps = np.empty((n, top_k), np.float32)
        at_lps = np.empty(at.shape, np.float32)
        if top_k or at.shape[1]:
            for j in range(n):
                by_id = self._ids_of_top(tops[first + j] or {})
                ranked = sorted(by_id.items(), key=lambda kv: -kv[1])[:top_k]
                if len(ranked) < top_k or any(int(a) not in by_id for a in at[j]):
                    raise EngineError(
                        "top-k scoring needs token ids the upstream does not report: not supported by this upstream"
                    )
                top_ids[j] = [i for i, _ in ranked]
                top_lps[j] = [v for _, v in ranked]
                at_lps[j] = [by_id[int(a)] for a in at[j]]
        return base.ScoreResult(logprobs, top_ids, top_lps, at_lps)

    def _ids_of_top(self, top: dict[str, float]) -> dict[int, float]:
        out: dict[int, float] = {}
        for key, value in top.items():
            tid = int(key.split(":", 1)[1]) if key.startswith("token_id:") else self._id_of({}, key.encode("utf-8"))
            if tid == UNKNOWN_ID or tid in out:
                continue  # text that names no single token, or two tokens with one text
            out[tid] = float(value)
        return out

    # ---- adapters ----------------------------------------------------------------------

    def load_adapter(self, adapter_id: str, path: Path) -> None:
        raise AdapterError(
            f"the openai engine cannot load adapter {path} into the upstream at runtime: export it "
            "(`clawd adapters export ID --format peft` for vLLM / SGLang `POST /v1/load_lora_adapter`, "
            "`--format gguf` for `llama-server --lora FILE`) and load it there"
        )

    def unload_adapter(self, adapter_id: str) -> None:
        return None  # nothing is ever loaded

    @property
    def loaded_adapters(self) -> list[str]:
        return []

    def close(self) -> None:
        self._http.close()


def _sse(lines: Iterator[str]) -> Iterator[dict]:
    """JSON payloads of an OpenAI server-sent-event stream, up to [DONE]."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        if data:
            yield json.loads(data)
