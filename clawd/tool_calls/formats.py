"""The tool-call syntax of each chat-template family, as a table.

Each family says how its calls look (its parser) and how to wrap a call's JSON in that
syntax as a GBNF grammar (for `tool_choice: required` / a named function). The family is
read off the served model's chat template: the template is what teaches the model its call
syntax, so a template that never mentions tools defines no format, and the API says so.

Families (what their templates define):
- `hermes` — Qwen2.5 and Hermes-style templates: calls are
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several allowed; a reply that
  is only the bare call object (no tags) counts too, as Qwen2.5-Coder's small models write it.
- `llama3-json` — Llama 3.1 / 3.2 / 3.3 templates: the reply is `{"name": ..., "parameters":
  {...}}` (the built-in-tool form after `<|python_tag|>` is parsed too).
- Gemma 3 and SmolLM2: their templates render no tools and define no call syntax, so they
  get no format (tool_calls: false in /v1/models); so does clawd's transcript format.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from clawd.tool_calls.parsers import BareJsonParser, HermesParser


@dataclass(frozen=True)
class ToolFormat:
    name: str
    parser: Callable  # (known tool names) -> a parser (parsers.py)
    args_key: str  # the call object's key for the arguments
    wrap: Callable[[str, bool], str]  # (GBNF whose `root` is one call's JSON, parallel) -> GBNF

    def call_schema(self, tools: list[tuple[str, dict]]) -> dict:
        """The JSON schema of one call object of any of `tools` ((name, parameters) pairs)."""
        options = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, self.args_key: params},
                "required": ["name", self.args_key],
            }
            for name, params in tools
        ]
        return options[0] if len(options) == 1 else {"anyOf": options}


def _rename_root(gbnf: str, name: str) -> str:
    return re.sub(r"^root ::=", f"{name} ::=", gbnf, flags=re.M)


def _wrap_tagged(call_gbnf: str, parallel: bool) -> str:
    more = ' ("\\n" tcall)*' if parallel else ""
    return f'root ::= tcall{more}\ntcall ::= "<tool_call>\\n" tcall-json "\\n</tool_call>"\n' + _rename_root(
        call_gbnf, "tcall-json"
    )


def _wrap_bare(call_gbnf: str, parallel: bool) -> str:
    more = ' ("; " tcall-json)*' if parallel else ""
    return f"root ::= tcall-json{more}\n" + _rename_root(call_gbnf, "tcall-json")


HERMES = ToolFormat("hermes", HermesParser, "arguments", _wrap_tagged)
LLAMA3_JSON = ToolFormat("llama3-json", BareJsonParser, "parameters", _wrap_bare)
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON)}


def detect(chat_template: str | None) -> ToolFormat | None:
    """The tool format a chat template teaches its model, or None when it defines none."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return HERMES
    if "<|python_tag|>" in chat_template or ("<|start_header_id|>" in chat_template and "parameters" in chat_template):
        return LLAMA3_JSON
    return None
