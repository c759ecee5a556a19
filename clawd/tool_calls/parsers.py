"""Incremental parsers: the model's reply text in, content and tool calls out.

One parser per chat-template family, all with the same face: `feed(text)` as pieces are
released and `finish()` at the end, each returning a list of events (Content or Call). The
non-streamed reply runs the very same parser over its whole text, so the two can never
disagree. Markup is held back while it might still be a call, and whatever does not parse
as a call is released as plain content: a malformed call is the model's text, not an error.

A call is emitted whole, once its closing markup (or the end of the reply) is seen: its
arguments are parsed and re-serialised, so `function.arguments` is always one JSON object
as a string (api.py then streams it as the standard header chunk plus argument fragments).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class Call:
    index: int
    id: str
    name: str
    arguments: str  # a JSON object, as a string

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def deltas(self, fragment: int = 32) -> list[dict]:
        """The call as streamed `delta.tool_calls` entries: index, id, type and name first
        (with empty arguments), then the arguments in fragments that clients join per index."""
        head = {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": ""},
        }
        args = self.arguments
        return [head] + [
            {"index": self.index, "function": {"arguments": args[i : i + fragment]}}
            for i in range(0, len(args), fragment)
        ]


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call_from(obj, args_keys: tuple[str, ...], known: set[str] | None) -> tuple[str, str] | None:
    """(name, arguments JSON) from a parsed call object, or None when it is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if known is not None and obj["name"] not in known:
        return None  # a call of a tool the client did not offer is text, not a call
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class _Base:
    def __init__(self, tools: set[str] | None = None):
        self.known = tools
        self.calls = 0

    def _call(self, name: str, arguments: str) -> Call:
        call = Call(self.calls, new_call_id(), name, arguments)
        self.calls += 1
        return call


class PlainParser(_Base):
    """No tool format (or tool_choice none): everything is content."""

    def feed(self, text: str) -> list:
        return [Content(text)] if text else []

    def finish(self) -> list:
        return []


class TaggedJsonParser(_Base):
    """Qwen2.5 / Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
    any number of them, possibly after some content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, tools: set[str] | None = None):
        super().__init__(tools)
        self._buf = ""
        self._inside = False

    def feed(self, text: str) -> list:
        self._buf += text
        out: list = []
        while True:
            if not self._inside:
                at = self._buf.find(self.OPEN)
                if at < 0:
                    keep = _held_prefix(self._buf, self.OPEN)
                    self._content(out, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                self._content(out, self._buf[:at])
                self._buf, self._inside = self._buf[at:], True
            end = self._buf.find(self.CLOSE)
            if end < 0:
                return out
            block = self._buf[: end + len(self.CLOSE)]
            self._buf, self._inside = self._buf[len(block) :], False
            self._block(out, block)

    def finish(self) -> list:
        out: list = []
        if self._inside:  # the reply ended inside a call: a call if its JSON is whole
            self._block(out, self._buf)
        else:
            self._content(out, self._buf)
        self._buf = ""
        return out

    def _content(self, out: list, text: str) -> None:
        if self.calls and not text.strip():
            return  # the whitespace between calls is not an answer
        if text:
            out.append(Content(text))

    def _block(self, out: list, block: str) -> None:
        inner = block[len(self.OPEN) :]
        inner = inner[: -len(self.CLOSE)] if inner.endswith(self.CLOSE) else inner
        try:
            parsed = _call_from(json.loads(inner), ("arguments", "parameters"), self.known)
        except ValueError:
            parsed = None
        if parsed is None:
            out.append(Content(block))  # malformed: the model's text as it is
        else:
            out.append(self._call(*parsed))


class BareJsonParser(_Base):
    """Llama 3.x JSON tool calling: the whole reply is `{"name": ..., "parameters": {...}}`
    (after an optional `<|python_tag|>`), several separated by `;`. A reply that starts with
    anything else is content and streams as such; one that starts with `{` is held to the
    end, since only the end tells a call from a JSON answer."""

    TAG = "<|python_tag|>"

    def __init__(self, tools: set[str] | None = None):
        super().__init__(tools)
        self._buf = ""
        self._mode: str | None = None  # None: undecided; "content" | "call"

    def feed(self, text: str) -> list:
        if self._mode == "content":
            return [Content(text)] if text else []
        self._buf += text
        head = self._buf.lstrip()
        if not head or (self.TAG.startswith(head) and len(head) < len(self.TAG)):
            return []
        self._mode = "call" if head.startswith(("{", self.TAG)) else "content"
        if self._mode == "content":
            text, self._buf = self._buf, ""
            return [Content(text)]
        return []

    def finish(self) -> list:
        text, self._buf = self._buf, ""
        if self._mode != "call":
            return [Content(text)] if text else []
        body = text.strip().removeprefix(self.TAG).strip()
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        try:
            while pos < len(body):
                obj, pos = decoder.raw_decode(body, pos)
                parsed = _call_from(obj, ("parameters", "arguments"), self.known)
                if parsed is None:
                    return [Content(text)]
                calls.append(parsed)
                pos = len(body) - len(body[pos:].lstrip().removeprefix(";").lstrip())
        except ValueError:
            return [Content(text)]
        return [self._call(*c) for c in calls] if calls else [Content(text)]
