"""OpenAI tool calls and constrained output (clawd/tool_calls/, chat.py, api.py).

Two halves. The parsers, the format table and the request plan are pure functions, tested
per chat-template family: full-text parse, the same text fed in small pieces (no markup may
reach content), parallel calls, malformed output (content, never an error) and tool_choice
variants. Then real daemons on tiny real GGUF models through the `openai` SDK: a random-weight
model writes a valid call only when the grammar forces it, which is exactly what constrained
decoding must guarantee; the turn log keeps the calls and the very tokens sampled under the
grammar; and a tool result in the next request is mined as that turn's next state.
"""

from __future__ import annotations

import json
import time

import numpy as np
import openai
import pytest

from clawd.errors import InvalidRequest
from clawd.store import signals, turns
from clawd.tool_calls import formats
from clawd.tool_calls.parsers import BareJsonParser, Call, Content, Delta, PlainParser, TaggedJsonParser
from clawd.tool_calls.plan import plan
from clawd.tool_calls.schema_check import schema_errors
from tests.conftest import TEST_TOKEN, authed, start_daemon
from tests.tiny_models import build_tiny_gguf

# A Qwen2.5-style template (ChatML; tools in the system turn; calls in <tool_call> tags;
# results as <tool_response> in a user turn), as Qwen2.5-Instruct's GGUF carries it.
QWEN_TEMPLATE = """{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' }}

# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content or '' }}
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{{ m.content }}<|eot_id|>{% endfor %}{% if tools %}Respond in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}.'
    "{% endif %}<|start_header_id|>assistant<|end_header_id|>\n\n"
)
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{{ m.content }}<end_of_turn>\n{% endfor %}<start_of_turn>model\n"
)
SMOLLM2_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def run(parser, text: str, step: int | None = None) -> list:
    """Feed `text` whole (step None) or in pieces of `step` characters; merge the content."""
    pieces = [text] if step is None else [text[i : i + step] for i in range(0, len(text), step)]
    events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
    out: list = []
    for e in events:
        if isinstance(e, Content) and out and isinstance(out[-1], Content):
            out[-1] = Content(out[-1].text + e.text)
        else:
            out.append(e)
    return out


def calls_of(events) -> list[tuple[str, dict]]:
    return [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, Call)]


def content_of(events) -> str:
    return "".join(e.text for e in events if isinstance(e, Content))


# ---- the format table ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "want"),
    [
        (QWEN_TEMPLATE, "hermes"),
        (LLAMA3_TEMPLATE, "llama3-json"),
        (GEMMA3_TEMPLATE, None),  # Gemma 3's template renders no tools: no tool format
        (SMOLLM2_TEMPLATE, None),  # nor does SmolLM2's plain ChatML
        (None, None),  # no template (the embedded base model): clawd's transcript format
    ],
)
def test_the_family_is_read_off_the_chat_template(template, want):
    fmt = formats.detect(template)
    assert (fmt.name if fmt else None) == want


# ---- parsers, per family ------------------------------------------------------------------------

HERMES_TWO = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)


@pytest.mark.parametrize("step", [None, 1, 3, 7])
def test_hermes_parallel_calls_whole_and_streamed(step):
    events = run(TaggedJsonParser({"get_weather", "get_time"}), HERMES_TWO, step)
    assert calls_of(events) == [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "CET"})]
    assert content_of(events) == "Let me check.\n"  # no markup, no whitespace between calls
    assert [e.index for e in events if isinstance(e, Call)] == [0, 1]
    ids = [e.id for e in events if isinstance(e, Call)]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2


def test_hermes_under_a_grammar_streams_the_call_as_it_is_written():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris", "days": [2]}}\n</tool_call>'
    p = TaggedJsonParser({"get_weather"}, live=True)
    per_char = [p.feed(ch) for ch in text] + [p.finish()]
    flat = [e for evs in per_char for e in evs]
    assert not any(isinstance(e, Content) for e in flat)
    # The header goes out as soon as the name and the arguments key are read...
    first = next(i for i, evs in enumerate(per_char) if evs)
    assert text[: first + 1].endswith('"arguments": {')
    head = flat[0].entry
    assert head["function"] == {"name": "get_weather", "arguments": ""} and head["id"].startswith("call_")
    # ...then the arguments grow with the text (a brace inside a string does not end them).
    frags = [e.entry["function"]["arguments"] for e in flat[1:] if isinstance(e, Delta)]
    assert len(frags) > 10 and "".join(frags) == '{"city": "Pa}ris", "days": [2]}'
    (call,) = [e for e in flat if isinstance(e, Call)]
    assert (call.id, call.arguments) == (head["id"], "".join(frags))


def test_hermes_under_a_grammar_parses_a_whole_text_the_same_way():
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    whole = run(TaggedJsonParser({"get_time"}, live=True), text)
    streamed = run(TaggedJsonParser({"get_time"}, live=True), text, 1)
    assert calls_of(whole) == calls_of(streamed) == [("get_time", {"zone": "UTC"})]


def test_llama3_json_under_a_grammar_streams_each_call_as_it_is_written():
    text = '{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", "parameters": {"city": "Rome", "days": 1}}'
    p = BareJsonParser({"get_time", "get_weather"}, live=True)
    per_char = [p.feed(ch) for ch in text] + [p.finish()]
    flat = [e for evs in per_char for e in evs]
    assert not any(isinstance(e, Content) for e in flat)
    first = next(i for i, evs in enumerate(per_char) if evs)
    assert text[: first + 1] == '{"name": "get_time", "parameters": {'  # the header, before the arguments
    deltas = [e.entry for e in flat if isinstance(e, Delta)]
    heads = [d for d in deltas if "id" in d]
    assert [(h["index"], h["function"]["name"]) for h in heads] == [(0, "get_time"), (1, "get_weather")]
    joined = {i: "".join(d["function"]["arguments"] for d in deltas if d["index"] == i) for i in (0, 1)}
    assert joined == {0: '{"zone": "UTC"}', 1: '{"city": "Rome", "days": 1}'}
    assert len(deltas) > 10
    calls = [e for e in flat if isinstance(e, Call)]
    assert [(c.index, c.arguments) for c in calls] == [(0, joined[0]), (1, joined[1])]
    assert [c.id for c in calls] == [h["id"] for h in heads]


def test_without_parallel_calls_only_the_first_call_is_passed_on():
    for step in (None, 2):
        events = run(TaggedJsonParser({"get_weather", "get_time"}, max_calls=1), HERMES_TWO, step)
        assert calls_of(events) == [("get_weather", {"city": "Paris", "days": 2})]
        assert content_of(events) == "Let me check.\n"
    auto = make_plan(parallel_tool_calls=False).parser()
    assert auto.max_calls == 1 and make_plan().parser().max_calls is None


def test_hermes_holds_a_possible_tag_but_releases_plain_text_at_once():
    p = TaggedJsonParser({"get_weather"})
    assert p.feed("The answer is 4 <tool") == [Content("The answer is 4 ")]
    assert p.feed(" ok") == [Content("<tool ok")]  # not a tag after all: released
    assert p.finish() == []


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>',  # broken JSON
        '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>',  # not an offered tool
        '<tool_call>\n["get_weather"]\n</tool_call>',  # not a call object
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut off by max_tokens
    ],
)
@pytest.mark.parametrize("step", [None, 2])
def test_hermes_malformed_calls_are_content(text, step):
    events = run(TaggedJsonParser({"get_weather"}), text, step)
    assert calls_of(events) == [] and content_of(events) == text


def test_hermes_a_call_the_reply_ended_inside_still_counts_when_its_json_is_whole():
    events = run(TaggedJsonParser({"get_time"}), '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}')
    assert calls_of(events) == [("get_time", {"zone": "UTC"})]


@pytest.mark.parametrize("step", [None, 1, 5])
@pytest.mark.parametrize(
    ("text", "want"),
    [
        ('{"name": "get_time", "parameters": {"zone": "UTC"}}', [("get_time", {"zone": "UTC"})]),
        ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', [("get_time", {"zone": "CET"})]),
        (
            '{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", "parameters": '
            '{"city": "Rome", "days": 1}}',
            [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Rome", "days": 1})],
        ),
    ],
)
def test_llama3_json_calls(text, want, step):
    events = run(BareJsonParser({"get_weather", "get_time"}), text, step)
    assert calls_of(events) == want and content_of(events) == ""


@pytest.mark.parametrize(
    "text", ['{"answer": 4}', '{"name": "get_time", "parameters": {"zone": "UTC"', '{"name": "nope", "parameters": {}}']
)
def test_llama3_json_that_is_not_a_call_is_content(text):
    events = run(BareJsonParser({"get_time"}), text, 3)
    assert calls_of(events) == [] and content_of(events) == text


def test_llama3_prose_streams_as_content_immediately():
    p = BareJsonParser({"get_time"})
    assert p.feed("  ") == []  # undecided yet
    assert p.feed("It is noon.") == [Content("  It is noon.")]
    assert p.feed(" Bye") == [Content(" Bye")]


def test_plain_parser_passes_markup_through():
    assert run(PlainParser(), HERMES_TWO, 4) == [Content(HERMES_TWO)]


def test_a_call_streams_as_a_header_then_argument_fragments():
    call = Call(1, "call_abc", "get_weather", json.dumps({"city": "Paris", "days": 12345678901234567}))
    deltas = call.deltas(fragment=10)
    assert deltas[0] == {
        "index": 1,
        "id": "call_abc",
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert len(deltas) > 3 and all(set(d) == {"index", "function"} for d in deltas[1:])
    assert "".join(d["function"]["arguments"] for d in deltas) == call.arguments


# ---- the request plan -----------------------------------------------------------------------------


def fake_gbnf(schema: dict) -> str:
    return 'root ::= "{}"'


def make_plan(**kw):
    args = dict(
        tools_raw=TOOLS,
        tool_choice=None,
        parallel_tool_calls=None,
        response_format=None,
        fmt=formats.HERMES,
        to_gbnf=fake_gbnf,
        engine="llamacpp",
    )
    return plan(**{**args, **kw})


def test_plan_auto_parses_without_a_grammar_and_none_does_not_parse():
    auto = make_plan()
    assert auto.grammar is None and isinstance(auto.parser(), TaggedJsonParser)
    none = make_plan(tool_choice="none")
    assert none.grammar is None and isinstance(none.parser(), PlainParser)
    no_tools = make_plan(tools_raw=None)
    assert isinstance(no_tools.parser(), PlainParser)


def test_plan_forced_calls_get_the_family_grammar():
    g = make_plan(tool_choice="required").grammar
    assert g.startswith("root ::= tcall (") and '"<tool_call>\\n" tcall-json "\\n</tool_call>"' in g
    single = make_plan(tool_choice="required", parallel_tool_calls=False).grammar
    assert single.startswith("root ::= tcall\n")
    seen = []
    make_plan(
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        to_gbnf=lambda s: seen.append(s) or "root ::= x",
    )
    assert seen == [formats.HERMES.call_schema([("get_time", TIME)])]  # only the named tool


@pytest.mark.parametrize(
    ("kw", "param", "words"),
    [
        ({"tool_choice": "required", "fmt": None}, "tool_choice", "defines none"),
        ({"tool_choice": "required", "to_gbnf": None, "engine": "mlx"}, "tool_choice", "mlx engine"),
        ({"response_format": {"type": "json_object"}, "to_gbnf": None, "engine": "mlx"}, "response_format", "mlx"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among"),
        ({"tool_choice": "sometimes"}, "tool_choice", "must be"),
        ({"tool_choice": "required", "tools_raw": None}, "tool_choice", "needs tools"),
        ({"tools_raw": [{"type": "function"}]}, "tools[0]", "each tool"),
        ({"tools_raw": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name", "name"),
        ({"response_format": {"type": "xml"}}, "response_format", "not one of"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
        ({"response_format": {"type": "json_object"}, "tool_choice": "required"}, "tool_choice", "not both"),
    ],
)
def test_plan_refuses_what_cannot_be_served(kw, param, words):
    with pytest.raises(InvalidRequest) as e:
        make_plan(**kw)
    assert e.value.param == param and words in str(e.value)


def test_schema_check():
    assert schema_errors({"city": "Paris", "days": 2}, WEATHER) == []
    assert schema_errors({"city": "Oslo", "days": 2}, WEATHER)
    assert schema_errors({"city": "Paris"}, WEATHER)
    assert schema_errors({"city": "Paris", "days": True}, WEATHER)


# ---- real daemons ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_gguf(tmp_path_factory):
    return build_tiny_gguf(
        tmp_path_factory.mktemp("tiny-qwen") / "tiny-qwen.gguf",
        arch="qwen2",
        chat_template=QWEN_TEMPLATE,
        n_ctx_train=2048,
    )


@pytest.fixture
def qwen_daemon(clawd_home, qwen_gguf):
    from clawd.engines.llamacpp import Engine

    d = start_daemon(
        clawd_home,
        Engine(qwen_gguf, n_ctx=2048, n_threads=1, model_id="tiny-qwen"),
        env_extra={"CLAWD_MINING_ENABLED": 1, "CLAWD_MINING_JUDGE": "rules", "CLAWD_MINING_HINT_JUDGE": "rules"},
    )
    d.run(d.state.miner.stop())  # mined when the test says so
    yield d
    d.stop()


def sdk(d) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key=TEST_TOKEN, max_retries=0)


def check_calls(calls, names=None):
    assert calls, "no tool calls"
    for c in calls:
        assert c.id.startswith("call_") and c.type == "function"
        assert names is None or c.function.name in names
        assert schema_errors(json.loads(c.function.arguments), SCHEMAS[c.function.name]) == []


def test_models_say_whether_tool_calls_are_supported(qwen_daemon, tiny_daemon):
    card = sdk(qwen_daemon).models.list().data[0].model_dump()
    assert (card["tool_calls"], card["tool_format"]) == (True, "hermes")
    plain = sdk(tiny_daemon).models.retrieve("tiny").model_dump()
    assert (plain["tool_calls"], plain["tool_format"]) == (False, None)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_tool_call_non_streamed(qwen_daemon, seed):
    r = sdk(qwen_daemon).chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": "Weather in Paris for 2 days?"}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        seed=seed,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    check_calls(choice.message.tool_calls)


def test_named_tool_call_streamed(qwen_daemon):
    stream = sdk(qwen_daemon).chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": "What time is it?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=200,
        seed=5,
        stream=True,
        logprobs=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    deltas = [tc for ch in chunks for c in ch.choices for tc in c.delta.tool_calls or []]
    content = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
    assert content == ""  # no tool markup leaks into content
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_time"
    assert deltas[0].function.arguments == "" and all(d.index == 0 and d.id is None for d in deltas[1:])
    args = "".join(d.function.arguments or "" for d in deltas)
    assert schema_errors(json.loads(args), TIME) == []
    assert len(deltas) > 3  # the arguments streamed as they were sampled, not in one piece
    again = sdk(qwen_daemon).chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": "What time is it?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=200,
        seed=5,
    )
    assert again.choices[0].message.tool_calls[0].function.arguments == args  # same seed, same call
    finals = [c for ch in chunks for c in ch.choices if c.finish_reason]
    assert [c.finish_reason for c in finals] == ["tool_calls"]
    # The tokens behind the held-back markup still report their log-probs: one per sampled
    # token but the end token, as for any reply.
    lps = [t for ch in chunks for c in ch.choices if c.logprobs for t in c.logprobs.content]
    assert len(lps) == chunks[-1].usage.completion_tokens - 1


def test_response_format_json_schema_is_followed(qwen_daemon):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
        "required": ["ok", "n"],
    }
    for stream in (False, True):
        kw = dict(
            model="x",
            messages=[{"role": "user", "content": "Answer in JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
            max_tokens=100,
            seed=7,
        )
        if stream:
            text = "".join(
                c.choices[0].delta.content or ""
                for c in sdk(qwen_daemon).chat.completions.create(stream=True, **kw)
                if c.choices
            )
        else:
            text = sdk(qwen_daemon).chat.completions.create(**kw).choices[0].message.content
        assert schema_errors(json.loads(text), schema) == []


def test_forced_calls_are_refused_where_they_cannot_be_served(tiny_daemon, fake_daemon):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:  # no tool format in the template
        sdk(tiny_daemon).chat.completions.create(model="x", messages=msgs, tools=TOOLS, tool_choice="required")
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:  # the fake engine has no grammars
        sdk(fake_daemon).chat.completions.create(model="x", messages=msgs, response_format={"type": "json_object"})
    assert "fake engine cannot constrain" in e.value.body["message"]


def wait_signal(d, turn_id: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        d.run(d.state.miner.run_until_idle())
        sig = d.run(signals.get(d.state.db, turn_id))
        if sig is not None and sig.reward is not None:
            return sig
        time.sleep(0.05)
    raise AssertionError(f"turn {turn_id} was not mined")


@pytest.mark.parametrize(("result", "reward"), [("Error: no such city", -1), ('{"temp_c": 21}', 1)])
def test_a_tool_call_turn_is_logged_as_sampled_and_its_tool_result_is_mined(qwen_daemon, result, reward):
    d = qwen_daemon
    client = sdk(d)
    msgs = [{"role": "user", "content": "Weather in Rome for 3 days?"}]
    raw = client.chat.completions.with_raw_response.create(
        model="x",
        messages=msgs,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        seed=11,
    )
    turn_id = raw.headers["x-clawd-turn-id"]
    msg = raw.parse().choices[0].message
    rec = d.run(turns.get_turn(d.state.db, turn_id))
    # The log keeps the model's raw text and the calls the client got.
    assert rec.finish_reason == "tool_calls"
    assert rec.tool_calls == [c.model_dump() for c in msg.tool_calls]
    assert "<tool_call>" in rec.response_text and rec.sampling["grammar"].startswith("root ::=")
    shown = authed.get(f"{d.url}/clawd/turns/{turn_id}").json()
    assert shown["tool_calls"] == rec.tool_calls and shown["finish_reason"] == "tool_calls"
    # The stored ids are what was sampled under the grammar: they replay to the logged text
    # (the end token has no text), and their stored log-probs are the model's own: a re-score agrees.
    engine = d.state.model.engine
    assert engine.detokenize(rec.response_ids[:-1]) == rec.response_text
    res = d.run(d.state.model.runner.call(engine.score, rec.prompt_ids, rec.response_ids, reuse_cache=False))
    np.testing.assert_allclose(res.logprobs, rec.response_logprobs, atol=1e-3)

    # The client runs the tool and sends its result: that is the turn's next state.
    follow = msgs + [
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in msg.tool_calls]},
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": result},
    ]
    r = client.chat.completions.with_raw_response.create(model="x", messages=follow, tools=TOOLS, max_tokens=8)
    second = d.run(turns.get_turn(d.state.db, r.headers["x-clawd-turn-id"]))
    assert second.session_id == rec.session_id  # the same conversation
    # The history went through the template: the call as a <tool_call>, the result as a <tool_response>.
    call = msg.tool_calls[0]
    assert f'<tool_call>\n{{"name": "{call.function.name}", "arguments": ' in second.prompt_text
    assert f"<tool_response>\n{result}\n</tool_response>" in second.prompt_text
    sig = wait_signal(d, turn_id)
    assert (sig.next_role, sig.reward, sig.next_turn_id) == ("tool", reward, second.id)


@pytest.fixture
def llama3_daemon(clawd_home, tmp_path_factory):
    from clawd.engines.llamacpp import Engine

    path = build_tiny_gguf(
        tmp_path_factory.mktemp("tiny-llama3") / "tiny-llama3.gguf", chat_template=LLAMA3_TEMPLATE, n_ctx_train=2048
    )
    d = start_daemon(clawd_home, Engine(path, n_ctx=2048, n_threads=1, model_id="tiny-llama3"))
    yield d
    d.stop()


def test_llama3_json_calls_through_the_sdk(llama3_daemon):
    client = sdk(llama3_daemon)
    assert client.models.list().data[0].model_dump()["tool_format"] == "llama3-json"
    kw = dict(
        model="x",
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        seed=3,
    )
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    check_calls(r.choices[0].message.tool_calls)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [tc for ch in chunks for c in ch.choices for tc in c.delta.tool_calls or []]
    assert "".join(c.delta.content or "" for ch in chunks for c in ch.choices) == ""
    assert deltas[0].function.name in SCHEMAS
    assert len(deltas) > 3  # the arguments streamed as they were sampled
    args = json.loads("".join(d.function.arguments or "" for d in deltas))
    assert schema_errors(args, SCHEMAS[deltas[0].function.name]) == []
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_plan_json_object_is_any_object():
    seen = []
    p = make_plan(tools_raw=None, response_format={"type": "json_object"}, to_gbnf=lambda s: seen.append(s) or "g")
    assert (p.grammar, seen) == ("g", [{"type": "object"}])
    assert make_plan(response_format={"type": "text"}).grammar is None


def test_tool_choice_none_and_auto_on_a_real_daemon(qwen_daemon):
    client = sdk(qwen_daemon)
    msgs = [{"role": "user", "content": "hello"}]
    for choice in ("none", "auto"):
        r = client.chat.completions.create(
            model="x", messages=msgs, tools=TOOLS, tool_choice=choice, max_tokens=16, seed=1
        )
        # The random model writes no call: its words come back as content, unconstrained.
        assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)
        assert r.choices[0].finish_reason in ("stop", "length")


def test_a_forced_call_cut_by_max_tokens_ends_as_length(qwen_daemon):
    client = sdk(qwen_daemon)
    kw = dict(
        model="x",
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=12,
        seed=1,
    )
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "length"  # not "tool_calls": the call is unfinished
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_schema_the_grammar_cannot_express_is_a_400(qwen_daemon):
    client = sdk(qwen_daemon)
    remote = {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}
    with pytest.raises(openai.BadRequestError) as e:  # never fetched: a 400, not a request to the URL
        client.chat.completions.create(
            model="x",
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": remote}},
        )
    assert e.value.body["param"] == "response_format" and "grammar" in e.value.body["message"]
    bad_tool = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "quaternion"}}}},
        }
    ]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "hi"}], tools=bad_tool, tool_choice="required"
        )
    assert e.value.body["param"] == "tools"


@pytest.mark.parametrize(
    "make",
    [
        TaggedJsonParser,
        BareJsonParser,
        lambda known: TaggedJsonParser(known, live=True),
        lambda known: BareJsonParser(known, live=True),
    ],
)
def test_parsers_never_raise_and_lose_no_text_on_random_markup(make):
    """Random soup of markup fragments, fed in random splits: a parser never raises, and
    when it finds no call, the content is exactly the text (nothing held back or dropped)."""
    rng = np.random.default_rng(0)
    bits = ["<tool_call>", "</tool_call>", "<tool", "_call>", "{", "}", '"name"', ":", '"get_time"', ",", '"arguments"']
    bits += ['"parameters"', "[", "]", '"', "\\", "\\q", " ", "\n", ";", "<|python_tag|>", "hi", '{"zone": "UTC"}']
    for _ in range(300):
        text = "".join(rng.choice(bits, size=int(rng.integers(1, 30))))
        cuts = sorted(set(rng.integers(0, len(text) + 1, size=int(rng.integers(0, 8))).tolist()))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        p = make(None if rng.random() < 0.3 else {"get_time"})
        events = [e for piece in pieces for e in p.feed(piece)] + p.finish()
        if not any(isinstance(e, (Call, Delta)) for e in events):
            assert content_of(events) == text


# ---- bare calls under the Hermes format (Qwen2.5-Coder writes them without tags) ---------------------


@pytest.mark.parametrize("step", [None, 1, 4])
def test_hermes_a_reply_that_is_only_a_bare_call_is_a_call(step):
    text = '{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}'
    fenced = "```json\n" + text + "\n```"
    for reply in (text, "\n " + text + "\n", text + '\n{"name": "get_time", "arguments": {"zone": "UTC"}}', fenced):
        events = run(make_plan().parser(), reply, step)
        want = [("get_weather", {"city": "Rome", "days": 1})]
        if "get_time" in reply:
            want.append(("get_time", {"zone": "UTC"}))
        assert calls_of(events) == want and content_of(events) == ""


@pytest.mark.parametrize("step", [None, 2])
@pytest.mark.parametrize(
    "text",
    [
        '{"answer": 4}',  # JSON, not a call
        '{"name": "launch_rocket", "arguments": {}}',  # not an offered tool
        '{"name": "get_time", "arguments": {"zone": "UTC"}} and then some words',
        '```json\n{"answer": 4}\n```',  # a fenced JSON answer
        '```json\n{"name": "get_time", "arguments": {"zone": "UTC"}}',  # a fence never closed
    ],
)
def test_hermes_bare_json_that_is_not_a_call_is_content(text, step):
    events = run(make_plan().parser(), text, step)
    assert calls_of(events) == [] and content_of(events) == text


def test_hermes_prose_and_tagged_calls_still_stream_as_before():
    p = make_plan().parser()
    assert p.feed(" ") == [] and p.feed("It is") == [Content(" It is")]
    assert calls_of(run(make_plan().parser(), HERMES_TWO, 3)) == calls_of(run(TaggedJsonParser(None), HERMES_TWO))
    assert run(make_plan().parser(), "  \n") == [Content("  \n")]  # only whitespace: kept
    code = make_plan().parser()  # a fenced code answer streams once its first line is read
    assert code.feed("```py") == [] and code.feed("thon\nprint(1)") == [Content("```python\nprint(1)")]
    assert run(make_plan().parser(), "``") == [Content("``")]


def test_hermes_under_a_grammar_does_not_hold_a_bare_brace():
    # A forced call's grammar writes the tags; a live parser streams them at once.
    p = make_plan(tool_choice="required").parser()
    assert p.live and p.feed('<tool_call>\n{"name": "get_time", "arguments": {') != []
