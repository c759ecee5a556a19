"""The served model: one set of weights behind an EngineRunner, with its chat format and the
adapter it wears.

Boundary: everything that turns messages into the served model's token ids lives here, once:
the turn's prompt, the judge's prompt, the teacher's hinted prompt (METHOD §3) and the gate's
canaries are rendered and tokenized by the same rule (template, then BOS only where both the
template and the model want it), so student and teacher contexts can never drift apart.
It logs nothing: turns are ChatService's (chat.py). The adapter registry (adapters.py) is the
only writer of `active_adapter`.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import dataclasses
import re
import threading
from typing import NamedTuple

from clawd.engines.base import SamplingParams
from clawd.engines.runner import EngineRunner
from clawd.errors import ContextLengthExceeded, InvalidRequest
from clawd.protocol import Message
from clawd.stops import StopMatcher
from clawd.tool_calls import formats as tool_formats

# METHOD §3: the teacher sees the turn's own request with the hint appended to its last user
# message under this marker; the miner, the trainer's job and the dataset export all use it.
HINT_MARKER = "\n\n[user's hint / instruction]\n"


def teacher_messages(messages: list[dict], hint: str) -> list[Message]:
    """The turn's request with the hint appended to its last user message (METHOD §3)."""
    out = [Message.model_validate(m) for m in messages]
    for i in range(len(out) - 1, -1, -1):
        if out[i].role == "user":
            out[i] = out[i].model_copy(update={"content": out[i].text() + HINT_MARKER + hint})
            break
    return out


# Private-use characters: no tokenizer marker and no real message contains them as a pair.
_HOLE = re.compile("\ue000(\\d+)\ue001")


def _hole(i: int) -> str:
    return f"\ue000{i}\ue001"


def _forged_call(m: Message, forges) -> bool:
    return any(forges(c.function.name) or forges(c.function.arguments) for c in m.tool_calls or [])


class Prompt(NamedTuple):
    rendered: object  # the chat format's Rendered: prompt text, add_bos, stop strings
    ids: list[int]


class ServedModel:
    def __init__(self, runner: EngineRunner, chat_format):
        self.runner = runner
        self.format = chat_format
        self.active_adapter: str | None = None  # what new turns wear; set by adapters.Registry

    @property
    def engine(self):
        return self.runner.engine

    @property
    def info(self):
        return self.runner.engine.info

    @property
    def model_id(self) -> str:
        return self.runner.engine.info.id

    @property
    def tool_format(self) -> tool_formats.ToolFormat | None:
        """The call syntax the model's chat template teaches it; None when it has none (or
        is not served with its template: clawd's transcript format has no tool syntax)."""
        if self.format.name != "template":
            return None
        return tool_formats.detect(self.info.chat_template)

    def prompt(self, messages: list[Message], tools: list | None = None) -> Prompt:
        """The chat template's rendering of `messages` and its token ids."""
        rendered, ids = self._tokenize_prompt(self.format.render(messages, tools), messages, tools)
        return Prompt(rendered, ids)

    def _tokenize_prompt(self, rendered, messages: list[Message], tools: list | None) -> tuple[object, list[int]]:
        """Only the template's own markers become control tokens: text a client sent (any
        message's content) that spells one, e.g. "<start_of_turn>" or "<eos>", is tokenized as
        the plain text it is, so a user cannot forge a turn. Returns (rendered, ids)."""
        add_bos = rendered.add_bos and self.info.add_bos
        tok = self.engine.tokenize
        if not getattr(self.format, "markers_in_text", True):
            return rendered, tok(rendered.prompt, add_bos=add_bos, special=False)  # no marker in the text at all

        def forges(text: str | None) -> bool:
            return bool(text) and tok(text, add_bos=False, special=True) != tok(text, add_bos=False, special=False)

        forged = {i: m.text() for i, m in enumerate(messages) if forges(m.text())}
        if any(_forged_call(m, forges) for m in messages):
            raise InvalidRequest("a tool call contains the model's control-token text: remove it", param="messages")
        if not forged:  # the common case: one pass, exactly the tokenizer's own split
            return rendered, tok(rendered.prompt, add_bos=add_bos, special=True)
        # Render again with each forged content swapped for a hole, so the template's text and
        # the client's text are told apart exactly; the holes are then filled as plain text.
        holed = [m.model_copy(update={"content": _hole(i)}) if i in forged else m for i, m in enumerate(messages)]
        template_text = self.format.render(holed, tools).prompt
        parts = _HOLE.split(template_text)  # text, hole index, text, hole index, ..., text
        seen = [int(n) for n in parts[1::2]]
        if sorted(seen) != sorted(forged):
            raise InvalidRequest(
                "a message contains the model's control-token text (e.g. a turn marker) and the chat "
                "template rewrites it, so it cannot be sent safely: remove the marker text",
                param="messages",
            )
        ids: list[int] = []
        text: list[str] = []
        for k, part in enumerate(parts):
            special = k % 2 == 0
            piece = part if special else forged[int(part)]
            text.append(piece)
            if piece:
                ids += tok(piece, add_bos=add_bos and not ids, special=special)
        return dataclasses.replace(rendered, prompt="".join(text)), ids

    def prompt_ids(self, messages: list[Message], tools: list | None = None) -> list[int]:
        return self.prompt(messages, tools).ids

    def teacher_prompt_ids(self, request: dict, hint: str) -> list[int]:
        """The teacher's prompt tokens for a logged turn's request: same template and tools as
        the student's prompt, only the hint differs (METHOD §3). The trainer rescoring in MLX
        uses these very ids."""
        return self.prompt_ids(teacher_messages(request["messages"], hint), request.get("tools"))

    def reply_ids(self, text: str) -> list[int]:
        """A reply's tokens as the model would continue a prompt: no BOS, no control tokens."""
        return self.engine.tokenize(text, add_bos=False, special=False)

    def check_context(self, n_tokens: int, message: str) -> None:
        """Raise ContextLengthExceeded(message) when `n_tokens` do not fit the context."""
        if n_tokens >= self.info.n_ctx:
            raise ContextLengthExceeded(message)

    async def score(self, messages: list[Message], completion: str, adapter: str | None) -> dict:
        """Per-token log-probs of `completion` as the reply to `messages` (not logged)."""
        # Off the event loop: a long request must not stall health and the other streams.
        prompt_ids = await asyncio.to_thread(self.prompt_ids, messages)
        target = await asyncio.to_thread(self.reply_ids, completion)
        n_ctx = self.info.n_ctx
        self.check_context(
            len(prompt_ids) + len(target),
            f"prompt + completion need {len(prompt_ids) + len(target)} tokens; the context is {n_ctx}",
        )
        # From an empty cache, so the same weights always give the same number (a diagnostic
        # compares these across adapters and over time; cached-prefix reuse moves the last bits).
        res = await self.runner.call(self.engine.score, prompt_ids, target, adapter=adapter, reuse_cache=False)
        return {
            "adapter": adapter,
            "tokens": [self.engine.detokenize([t]) for t in target],
            "logprobs": res.logprobs.tolist(),
            "total": float(res.logprobs.sum()),
        }

    async def complete(
        self,
        messages: list[Message],
        params: SamplingParams,
        *,
        adapter: str | None = None,
        background: bool = True,
        until=None,
    ) -> str:
        """One reply as text, not logged as a turn: for judges and side-by-side answers.
        Background completions yield the engine to user requests (raising Preempted).
        Like a served chat reply, it is without the whitespace the model opens with, so the
        side-by-side answers read like the logged reply they are shown next to. `until(text)`,
        if given, ends the reply early once it returns True for the text so far (a judge's
        vote is given)."""
        rendered, prompt_ids = await asyncio.to_thread(self.prompt, messages)
        self.check_context(
            len(prompt_ids), f"the prompt needs {len(prompt_ids)} tokens; the context is {self.info.n_ctx}"
        )
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        stops = StopMatcher(rendered.stops)
        out: list[str] = []
        gen = self.runner.generate(prompt_ids, params, adapter=adapter, cancel=threading.Event(), background=background)
        async with contextlib.aclosing(gen):
            async for tok in gen:
                if tok.is_end:
                    break
                piece, hit = stops.feed(decoder.decode(tok.piece))
                out.append(piece)
                if hit or (until is not None and until("".join(out))):
                    return "".join(out).lstrip()
        return ("".join(out) + stops.feed(decoder.decode(b"", final=True))[0] + stops.flush()).lstrip()
