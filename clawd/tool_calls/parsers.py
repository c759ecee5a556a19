"""Incremental parsers: the model's reply text in, content and tool calls out.

One parser per chat-template family, all with the same face: `feed(text)` as pieces are
released and `finish()` at the end, each returning a list of events: Content (text for the
client), Delta (one `delta.tool_calls` entry for a stream) and Call (a finished call, for
`message.tool_calls` and the turn log). The non-streamed reply runs the very same parser
over its whole text, so the two can never disagree. Markup is held back while it might
still be a call, and whatever does not parse as a call is released as plain content: a
malformed call is the model's text, not an error.

When a call streams. Unconstrained (`tool_choice: auto`), a call is emitted whole once its
closing markup (or the end of the reply) is seen, its arguments parsed and re-serialised:
only then is it known to be a call at all, and a stream cannot take back a header it sent.
Under a grammar (`live=True`: the output is a well-formed call by construction) the
parsers stream as the model writes: the header (index, id, name) as soon as the name is
read, then the arguments' text as it grows.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class Delta:
    entry: dict  # one element of a chunk's delta.tool_calls


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
        return [head] + [_args_delta(self.index, args[i : i + fragment]) for i in range(0, len(args), fragment)]


def _args_delta(index: int, text: str) -> dict:
    return {"index": index, "function": {"arguments": text}}


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


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')


_NEXT_CALL = re.compile(r"\s*\}\s*;")  # the end of a call object and the separator of the next


@dataclass
class _Live:
    """A call being streamed: its header is out; `sent` is how far its arguments are."""

    call_index: int
    id: str
    name: str
    start: int  # where the arguments begin in the parser's buffer
    sent: int
    scan: int
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    end: int | None = None  # just after the arguments' closing bracket, once seen


class _Base:
    def __init__(self, tools: set[str] | None = None, live: bool = False, max_calls: int | None = None):
        self.known = tools
        self.live = live
        # parallel_tool_calls false: a call after the first is not passed on (it stays in the
        # logged raw text); under a grammar the grammar itself allows one call only.
        self.max_calls = max_calls
        self.calls = 0
        self._live: _Live | None = None

    def _call(self, name: str, arguments: str) -> list:
        """A whole call: the Call, then its stream deltas (header, argument fragments)."""
        if self.max_calls is not None and self.calls >= self.max_calls:
            return []
        call = Call(self.calls, new_call_id(), name, arguments)
        self.calls += 1
        return [call, *(Delta(d) for d in call.deltas())]

    def _finish_live(self, out: list, buf: str, end: int) -> None:
        """The streamed call is over: its last argument text, then the Call itself."""
        live, self._live = self._live, None
        args_end = live.end if live.end is not None else end
        if live.sent < args_end:  # the arguments' last text, if the scan stopped short of it
            out.append(Delta(_args_delta(live.call_index, buf[live.sent : args_end])))
        out.append(Call(live.call_index, live.id, live.name, buf[live.start : args_end].strip()))

    def _stream_from(self, out: list, buf: str, at: int, limit: int) -> None:
        """Under a grammar: send the header once the name is read (a call object starting at
        `at`), then the arguments' text up to `limit`."""
        if self._live is None:
            m = _HEAD.match(buf, at)
            if m is None or m.end() > limit or (self.known is not None and m.group(1) not in self.known):
                return
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:  # a bad escape in the name: not a call we can stream
                return
            live = _Live(self.calls, new_call_id(), name, m.end(), m.end(), m.end())
            self.calls += 1
            self._live = live
            out.append(Delta(Call(live.call_index, live.id, live.name, "").deltas()[0]))
        live = self._live
        while live.end is None and live.scan < limit:
            ch = buf[live.scan]
            live.scan += 1
            if live.in_string:
                if live.escaped:
                    live.escaped = False
                elif ch == "\\":
                    live.escaped = True
                elif ch == '"':
                    live.in_string = False
            elif ch == '"':
                live.in_string = True
            elif ch in "{[":
                live.depth += 1
            elif ch in "}]":
                live.depth -= 1
                if live.depth == 0:
                    live.end = live.scan
        upto = live.end if live.end is not None else live.scan
        if upto > live.sent:
            out.append(Delta(_args_delta(live.call_index, buf[live.sent : upto])))
            live.sent = upto


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

    def __init__(self, tools: set[str] | None = None, live: bool = False, max_calls: int | None = None):
        super().__init__(tools, live, max_calls)
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
            if self.live:
                self._stream(out, len(self._buf) if end < 0 else end)
            if end < 0:
                return out
            block = self._buf[: end + len(self.CLOSE)]
            self._end_block(out, block, end)
            self._buf, self._inside = self._buf[len(block) :], False

    def finish(self) -> list:
        out: list = []
        if self._inside:  # the reply ended inside a call: a call if its JSON is whole
            if self.live:
                self._stream(out, len(self._buf))
            self._end_block(out, self._buf, len(self._buf))
        else:
            self._content(out, self._buf)
        self._buf = ""
        return out

    def _end_block(self, out: list, block: str, end: int) -> None:
        if self._live is None:
            self._block(out, block)
        else:
            self._finish_live(out, block, end)

    def _stream(self, out: list, limit: int) -> None:
        self._stream_from(out, self._buf, len(self.OPEN), limit)

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
            out.extend(self._call(*parsed))


class BareJsonParser(_Base):
    """Llama 3.x JSON tool calling: the whole reply is `{"name": ..., "parameters": {...}}`
    (after an optional `<|python_tag|>`), several separated by `;`. A reply that starts with
    anything else is content and streams as such; one that starts with `{` is held to the
    end, since only the end tells a call from a JSON answer."""

    TAG = "<|python_tag|>"

    def __init__(self, tools: set[str] | None = None, live: bool = False, max_calls: int | None = None):
        super().__init__(tools, live, max_calls)
        self._buf = ""
        self._mode: str | None = None  # None: undecided; "content" | "call"
        self._pos = 0  # live: where the next call may start
        self._between = False  # live: a call's arguments ended; the separator is awaited

    def feed(self, text: str) -> list:
        if self.live:
            return self._feed_live(text)
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

    def _feed_live(self, text: str) -> list:
        """Under a grammar the reply is calls only: `{call}` or `{call}; {call}; ...`."""
        self._buf += text
        out: list = []
        while True:
            if self._between:  # after a call: its closing brace and `;` come before the next
                m = _NEXT_CALL.match(self._buf, self._pos)
                if m is None:
                    return out
                self._pos, self._between = m.end(), False
            self._stream_from(out, self._buf, self._pos, len(self._buf))
            live = self._live
            if live is None or live.end is None:
                return out
            self._pos, self._between = live.end, True
            self._finish_live(out, self._buf, live.end)

    def finish(self) -> list:
        if self.live and self.calls:
            out: list = []
            if self._live is not None:
                self._finish_live(out, self._buf, len(self._buf))
            self._buf = ""
            return out
        if self.live:
            self._mode = "call" if self._buf.lstrip().startswith(("{", self.TAG)) else "content"
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
        return [e for c in calls for e in self._call(*c)] if calls else [Content(text)]


_FENCE_OPEN = re.compile(r"```[A-Za-z]*[ \t]*\n")
_FENCED = re.compile(r"\s*```[A-Za-z]*[ \t]*\n(.*?)\n?[ \t]*```\s*", re.S)


class HermesParser(TaggedJsonParser):
    """Hermes / Qwen2.5 calls as TaggedJsonParser reads them, and also a reply that is nothing
    but bare call objects (`{"name": ..., "arguments": {...}}`, no tags), bare or in one
    Markdown code fence: Qwen2.5-Coder's small instruct models answer a tool request that way
    more often than not (0.5B bare, 1.5B fenced), and llama.cpp's server accepts the same (its
    Hermes parser makes the tag optional and skips a ```json fence). A reply that starts with
    `{`, or with a fence whose first line starts with `{`, is held to its end, as
    BareJsonParser holds it; anything else (prose, a fenced code answer) streams as before.
    Under a grammar the tags are forced, so a live parser never looks for bare calls."""

    def __init__(self, tools: set[str] | None = None, live: bool = False, max_calls: int | None = None):
        super().__init__(tools, live, max_calls)
        self._held: str | None = None  # the whole reply, held: it may be bare calls
        self._head: str | None = None if live else ""  # None: decided

    def feed(self, text: str) -> list:
        if self._held is not None:
            self._held += text
            return []
        if self._head is None:
            return super().feed(text)
        self._head += text
        verdict = self._bare_or_not(self._head.lstrip())
        if verdict is None:
            return []
        text, self._head = self._head, None
        if verdict:
            self._held = text
            return []
        return super().feed(text)

    @staticmethod
    def _bare_or_not(head: str) -> bool | None:
        """True: the reply may be bare calls; False: it is not; None: too early to say."""
        if not head or "```".startswith(head):
            return None
        if head.startswith("{"):
            return True
        if not head.startswith("```"):
            return False
        fence = _FENCE_OPEN.match(head)
        if fence is None:  # the fence's first line is not over yet (or is not a fence's)
            return None if "\n" not in head and len(head) < 16 else False
        rest = head[fence.end() :].lstrip()
        return None if not rest else rest.startswith("{")

    def finish(self) -> list:
        if self._held is not None:
            text, self._held = self._held, None
            fenced = _FENCED.fullmatch(text)
            bare = BareJsonParser(self.known, max_calls=self.max_calls)
            events = bare.feed(fenced.group(1) if fenced else text) + bare.finish()
            return events if any(isinstance(e, Call) for e in events) else [Content(text)]
        if self._head is not None:  # the reply ended undecided (whitespace, a short fence)
            text, self._head = self._head, None
            return super().feed(text) + super().finish()
        return super().finish()
