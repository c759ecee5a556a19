"""What a chat request asks of tools and output shape, checked, and the grammar that forces it.

`plan()` reads `tools`, `tool_choice`, `parallel_tool_calls` and `response_format`, refuses
what the served model cannot do with a 400 (before any token is sampled), and returns the
parser for the reply and, where output must be constrained, a GBNF grammar:
- `tool_choice: required` or a named function: one (or, with parallel calls, several) calls
  in the family's syntax, each call's JSON generated from the tools' parameter schemas;
- `response_format` `json_object` (any JSON object) or `json_schema` (that schema).
`auto` is not constrained: the model may answer in words, and the parser finds any calls.
The schema -> GBNF conversion is the engine's (`to_gbnf`): clawd does not carry a converter
of its own, and an engine without grammars (None) makes these requests a clear 400.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from clawd.errors import InvalidRequest
from clawd.tool_calls.formats import ToolFormat
from clawd.tool_calls.parsers import PlainParser

ANY_JSON_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    format: ToolFormat | None  # None: calls are not parsed (no format, no tools, or tool_choice none)
    tools: dict[str, dict] = field(default_factory=dict)  # name -> parameters schema
    grammar: str | None = None  # GBNF the reply must match, or None
    choice: str = "auto"  # none | auto | required | named
    parallel: bool = True  # parallel_tool_calls

    def parser(self):
        if self.format is None:
            return PlainParser()
        # A forced call is well-formed by its grammar, so it may stream as it is written.
        return self.format.parser(
            set(self.tools), live=self.choice in ("required", "named"), max_calls=None if self.parallel else 1
        )


def _tools(raw: list | None) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for i, t in enumerate(raw or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidRequest(
                'each tool must be {"type": "function", "function": {"name": ..., "parameters": {...}}}',
                param=f"tools[{i}]",
            )
        name, params = fn.get("name"), fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(name, str) or not name:
            raise InvalidRequest("a function tool needs a name (a string)", param=f"tools[{i}].function.name")
        if not isinstance(params, dict):
            raise InvalidRequest("parameters must be a JSON schema object", param=f"tools[{i}].function.parameters")
        out[name] = params
    return out


def _choice(raw, tools: dict[str, dict]) -> tuple[str, str | None]:
    """(kind, the named function or None)."""
    if raw is None:
        return ("auto" if tools else "none"), None
    if raw in ("none", "auto", "required"):
        if raw == "required" and not tools:
            raise InvalidRequest("tool_choice 'required' needs tools", param="tool_choice")
        return raw, None
    fn = raw.get("function") if isinstance(raw, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise InvalidRequest(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in tools:
        raise InvalidRequest(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return "named", name


def plan(
    *,
    tools_raw: list | None,
    tool_choice,
    parallel_tool_calls: bool | None,
    response_format: dict | None,
    fmt: ToolFormat | None,
    to_gbnf: Callable[[dict], str] | None,
    engine: str,
) -> ToolPlan:
    tools = _tools(tools_raw)
    kind, named = _choice(tool_choice, tools)
    schema = _response_schema(response_format)
    forced = kind in ("required", "named")
    if forced and schema is not None:
        raise InvalidRequest(
            "send either a forced tool_choice or a JSON response_format, not both", param="tool_choice"
        )
    if forced and fmt is None:
        raise InvalidRequest(
            f"tool_choice {kind!r} needs a tool-call format, and the served model's chat template defines none "
            "(see tool_calls in /v1/models): send tool_choice 'auto' or 'none'",
            param="tool_choice",
        )
    if (forced or schema is not None) and to_gbnf is None:
        raise InvalidRequest(
            f"the {engine} engine cannot constrain output to a grammar, so "
            + ("a forced tool_choice" if forced else "response_format json_object / json_schema")
            + " is not supported: use tool_choice 'auto' and a text response_format",
            param="tool_choice" if forced else "response_format",
        )
    grammar = None
    if forced:
        chosen = [(named, tools[named])] if named else list(tools.items())
        parallel = named is None and parallel_tool_calls is not False
        grammar = fmt.wrap(_convert(to_gbnf, fmt.call_schema(chosen), "tools"), parallel)
    elif schema is not None:
        grammar = _convert(to_gbnf, schema, "response_format")
    parse = fmt if (tools and kind != "none") else None
    return ToolPlan(parse, tools, grammar, kind, parallel_tool_calls is not False)


def _response_schema(rf: dict | None) -> dict | None:
    if rf is None:
        return None
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return ANY_JSON_OBJECT
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequest(
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                param="response_format.json_schema",
            )
        return schema
    raise InvalidRequest(
        f"response_format type {kind!r} is not one of text, json_object, json_schema", param="response_format"
    )


def _convert(to_gbnf: Callable[[dict], str], schema: dict, param: str) -> str:
    try:
        return to_gbnf(schema)
    except Exception as e:  # the converter raises plain errors on schemas it cannot express
        raise InvalidRequest(f"cannot turn this JSON schema into a grammar: {e}", param=param) from None


def dumps_calls(calls) -> str:
    return json.dumps([c.openai() for c in calls], ensure_ascii=False)
