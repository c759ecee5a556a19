"""OpenAI tool calls on a local model: which call syntax the served model's chat template
teaches it (formats.py), pulling calls out of its output as it streams (parsers.py), what a
request asks for and the grammar that forces it (plan.py), and a small JSON-schema check for
the arguments that come back (schema_check.py).

Boundary: pure functions and small state machines over text; no engine, HTTP or database
here. chat.py feeds the released reply text through a parser; api.py turns its events into
`message.tool_calls` and `delta.tool_calls`.
"""
