"""The models an LLM judge asks: completers (a `clawd.judge.Completer` each) and the judge setting.

Boundary: one chat completion per call from an OpenAI-compatible endpoint ("openai:URL[#MODEL]")
or a model clawd runs itself ("self", "gguf:PATH"), and `completer_for`, which turns a judge
setting into one of them. Prompts, votes and verdicts are clawd/judge.py's business.

The endpoint completer keeps its own small async HTTP client rather than reusing
clawd/engines/openai.py: that engine is synchronous, speaks the legacy /completions endpoint
with token-level log-probs, and imports numpy; a judge needs one async /chat/completions call.
"""

from __future__ import annotations

import asyncio
import re

from clawd.errors import ConfigError
from clawd.judge import Completer, JudgeUnavailable, answer_closed


class OpenAICompleter:
    """Any OpenAI-compatible endpoint (Ollama, llama-server, vLLM, a hosted API).
    `base_url` is the API root that holds /chat/completions, usually ending in /v1."""

    source = "openai"

    def __init__(self, base_url: str, model: str = "", api_key: str = "", timeout: float = 60.0):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.timeout = timeout
        self._client = None

    def _http(self):
        import httpx  # deferred: only endpoint judges need it

        if self._client is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._client = httpx.AsyncClient(
                headers=headers, timeout=httpx.Timeout(self.timeout, connect=min(self.timeout, 10.0))
            )
        return self._client

    async def complete(self, messages: list[dict], *, temperature: float, max_tokens: int, seed: int | None) -> str:
        model = self.model or await self._first_model()
        body = {
            "model": model,
            "messages": messages,
            "temperature": temperature,
            "max_tokens": max_tokens,
            "stream": False,
        }
        if seed is not None:
            body["seed"] = seed
        data = await self._request("POST", "/chat/completions", body)
        try:
            content = data["choices"][0]["message"].get("content")
        except (KeyError, IndexError, TypeError, AttributeError):
            raise JudgeUnavailable(
                f"{self.base_url}/chat/completions did not answer with an OpenAI chat completion "
                f"(got {str(data)[:200]!r}). Point the judge at an OpenAI-compatible API root, usually ending in /v1."
            ) from None
        return content if isinstance(content, str) else ""

    async def _first_model(self) -> str:
        data = await self._request("GET", "/models", None)
        try:
            ids = [m["id"] for m in data["data"]]
        except (KeyError, TypeError):
            ids = None
        if not ids:
            raise JudgeUnavailable(
                f"{self.base_url}/models lists no models, so the judge cannot pick one. "
                f"Name it in the judge setting: openai:{self.base_url}#MODEL."
            )
        self.model = ids[0]
        return self.model

    async def _request(self, method: str, path: str, body: dict | None):
        import httpx

        url = self.base_url + path
        try:
            r = await self._http().request(method, url, json=body)
        except httpx.TimeoutException:
            raise JudgeUnavailable(
                f"The judge endpoint {url} did not answer within {self.timeout:g} s. Check that the server there "
                "is running and not overloaded, or raise the judge timeout."
            ) from None
        except httpx.HTTPError as e:
            raise JudgeUnavailable(
                f"Cannot reach the judge endpoint {url} ({type(e).__name__}: {e}). Start the server there "
                "(e.g. `ollama serve` or `llama-server`), or fix the URL in the judge setting."
            ) from None
        if r.status_code >= 400:
            what = {
                401: "check the API key",
                403: "check the API key",
                404: "check the URL (the API root, usually ending in /v1) and the model name",
            }
            raise JudgeUnavailable(
                f"The judge endpoint {url} answered HTTP {r.status_code}: {r.text[:200]!r}. "
                f"{what.get(r.status_code, 'Check the server logs there')}."
            )
        try:
            return r.json()
        except ValueError:
            raise JudgeUnavailable(
                f"The judge endpoint {url} answered with something that is not JSON ({r.text[:120]!r}). "
                "Point the judge at an OpenAI-compatible API root, usually ending in /v1."
            ) from None

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class ServedModelCompleter:
    """A model clawd runs itself: the served model ("self", base weights, no adapter, at
    background priority so users never wait on judging), or a second local GGUF ("gguf")."""

    def __init__(self, chat, source: str = "self"):
        self.chat = chat
        self.source = source

    async def aclose(self) -> None:
        """Free a second model this judge loaded; the served model is not the judge's to close."""
        if self.source == "gguf":
            await asyncio.get_running_loop().run_in_executor(None, self.chat.runner.close)

    async def logprob(self, messages: list[dict], completion: str) -> float:
        """log p(completion | messages) under the base weights, at background priority. The
        prompt is the background slot's cached prefix, so scoring several completions of one
        prompt evaluates the prompt once."""
        from clawd.protocol import Message

        prompt_ids = self.chat.prompt_ids([Message.model_validate(m) for m in messages])
        target = self.chat.reply_ids(completion)
        self.chat.check_context(
            len(prompt_ids) + len(target),
            f"the judge prompt needs {len(prompt_ids) + len(target)} tokens; the context is {self.chat.info.n_ctx}",
        )
        res = await self.chat.runner.call(self.chat.engine.score, prompt_ids, target, adapter=None, background=True)
        return float(res.logprobs.sum())

    async def complete(self, messages: list[dict], *, temperature: float, max_tokens: int, seed: int | None) -> str:
        # deferred: engines.base pulls in numpy, and `clawd --help` must stay light
        from clawd.engines.base import SamplingParams
        from clawd.protocol import Message

        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=1.0, seed=seed)
        msgs = [Message.model_validate(m) for m in messages]
        # adapter None: the judge is the frozen base model, not the policy being trained
        # Stop once the vote is given: the base model rarely ends its turn after \boxed{},
        # and every token after it is judge time the miner pays for nothing.
        return await self.chat.complete(msgs, params, adapter=None, background=True, until=answer_closed)


JUDGE_FORMS = (
    '"rules", "self", "openai:<base_url>[#model]", "gguf:<path to .gguf or name in clawd models list>", or "likelihood:self" / '
    '"likelihood:gguf:<path>" (the verdict scored, not sampled)'
)


def completer_for(spec: str, *, chat=None, gguf_loader=None, api_key: str = "") -> Completer | None:
    """The Completer a judge setting names; None for "rules" (no model needed).

    `chat` (a ServedModel) serves "self"; `gguf_loader(path)` builds a ServedModel for
    "gguf:PATH". Raises ConfigError for anything else, listing the valid forms."""
    s = (spec or "").strip()
    if s == "rules":
        return None
    if s == "self":
        if chat is None:
            raise ConfigError(
                'judge "self" needs the served model, which is not running here; use "rules" '
                f"or another judge ({JUDGE_FORMS})."
            )
        return ServedModelCompleter(chat)
    kind, _, rest = s.partition(":")
    if kind == "openai" and rest:
        url, _, model = rest.partition("#")
        if not re.match(r"https?://[^/\s]+", url):
            raise ConfigError(
                f"judge {spec!r}: the URL must start with http:// or https://, e.g. "
                f"openai:http://127.0.0.1:11434/v1#qwen3:4b (judges: {JUDGE_FORMS})."
            )
        return OpenAICompleter(url, model=model, api_key=api_key)
    if kind == "gguf" and rest.strip():
        if gguf_loader is None:
            raise ConfigError(f"judge {spec!r}: a second local model cannot be loaded here; use {JUDGE_FORMS}.")
        return ServedModelCompleter(gguf_loader(rest.strip()), source="gguf")
    raise ConfigError(f"judge {spec!r} is not a judge clawd knows; use {JUDGE_FORMS}.")
