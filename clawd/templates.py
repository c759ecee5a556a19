"""Chat formats: OpenAI messages -> one prompt string (+ the stop strings it implies).

Two kinds. A model whose GGUF carries `tokenizer.chat_template` uses it, rendered with
Jinja in a sandbox exactly as its authors intended. A base model without one (the
embedded Gemma 3 270M) gets clawd's plain transcript format; STACK.md found that turn
markers make that model loop, while a transcript with a one-line preamble answers, and
benchmarks/chat_formats.py found one fixed example exchange lifts its accuracy from 38%
to 65% on 40 prompts (13 formats compared) without leaking into answers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import date

from clawd.errors import ConfigError, InvalidRequest
from clawd.protocol import Message

TRANSCRIPT_PREAMBLE = "The following is a conversation between a helpful assistant and a user."
# One worked exchange shows a base model the turn-taking and answer length.
TRANSCRIPT_EXAMPLE = ("User: What is the capital of Italy?", "Assistant: The capital of Italy is Rome.")


@dataclass(frozen=True)
class Rendered:
    prompt: str
    add_bos: bool  # whether tokenizing should prepend BOS (templates often write it themselves)
    stops: list[str] = field(default_factory=list)


def _tool_calls_text(m: Message) -> str:
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls or []]
    return json.dumps(calls, ensure_ascii=False) if calls else ""


class TranscriptFormat:
    """'User: …' / 'Assistant: …' lines after a preamble; the model ends its turn by
    starting the next 'User:' line, which is the stop string."""

    name = "transcript"
    markers_in_text = False  # plain text only: every character is tokenized as text, none as a control token

    def __init__(self, add_bos: bool = True):
        self._add_bos = add_bos

    def render(self, messages: list[Message], tools: list | None = None) -> Rendered:
        system = [m.text().strip() for m in messages if m.role in ("system", "developer")]
        lines = [" ".join(system) if system else TRANSCRIPT_PREAMBLE, "", *TRANSCRIPT_EXAMPLE]
        for m in messages:
            if m.role in ("system", "developer"):
                continue
            if m.role == "user":
                lines.append(f"User: {m.text().strip()}")
            elif m.role == "assistant":
                text = m.text().strip() or _tool_calls_text(m)
                lines.append(f"Assistant: {text}")
            else:  # tool result
                lines.append(f"Tool result: {m.text().strip()}")
        if messages[-1].role == "assistant":
            raise InvalidRequest("the last message must not be from the assistant", param="messages")
        return Rendered("\n".join(lines) + "\nAssistant:", self._add_bos, ["\nUser:", "\nTool result:"])


class JinjaFormat:
    """The model's own chat template (HF / GGUF `tokenizer.chat_template`)."""

    name = "template"
    markers_in_text = True  # the template writes control tokens as text (served.py keeps clients' apart)

    def __init__(self, template: str, bos_token: str, eos_token: str):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise InvalidRequest(f"the model's chat template refused the messages: {message}", param="messages")

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: date.today().strftime(fmt))
        try:
            self._template = env.from_string(template)
        except jinja2.TemplateError as e:
            raise ConfigError(
                f'the model\'s chat template does not parse ({e}); set model.chat_format = "transcript"'
            ) from e
        self._bos, self._eos = bos_token, eos_token

    def render(self, messages: list[Message], tools: list | None = None) -> Rendered:
        msgs = []
        for m in messages:
            d = m.model_dump(exclude_none=True)
            d["role"] = "system" if m.role == "developer" else m.role
            d["content"] = m.text()
            if m.tool_calls:
                d["tool_calls"] = [
                    {
                        **c.model_dump(exclude_none=True),
                        "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)},
                    }
                    for c in m.tool_calls
                ]
            msgs.append(d)
        try:
            prompt = self._template.render(
                messages=msgs, tools=tools, add_generation_prompt=True, bos_token=self._bos, eos_token=self._eos
            )
        except InvalidRequest:
            raise
        except Exception as e:  # filters raise plain errors too (TypeError, OverflowError, ...):
            # whatever the template does with these messages, it is these messages it failed on
            raise InvalidRequest(
                f"the model's chat template failed on these messages: {type(e).__name__}: {str(e)[:200]}",
                param="messages",
            ) from e
        # The template writes BOS itself when it wants one; tokenizing must not add a second.
        starts_with_bos = bool(self._bos) and prompt.startswith(self._bos)
        return Rendered(prompt, add_bos=not starts_with_bos)


def _json_or_text(arguments: str):
    try:
        return json.loads(arguments)
    except (TypeError, ValueError, RecursionError):  # RecursionError: nesting deeper than json can walk
        return arguments


def choose_format(setting: str, chat_template: str | None, bos: str, eos: str, add_bos: bool):
    """`auto`: the model's own template if it has one, else the transcript format."""
    if setting == "transcript" or (setting == "auto" and not chat_template):
        return TranscriptFormat(add_bos=add_bos)
    if not chat_template:
        raise ConfigError(
            'model.chat_format = "template" but the model has no chat template; use "auto" or "transcript"'
        )
    return JinjaFormat(chat_template, bos, eos)
