"""Chat formats: OpenAI messages -> the exact prompt string, its BOS rule and stop strings;
bad messages are the client's 400, a bad template is the user's config error."""

from __future__ import annotations

import pytest

from clawd.errors import ConfigError, InvalidRequest
from clawd.protocol import Message
from clawd.templates import TRANSCRIPT_EXAMPLE, TRANSCRIPT_PREAMBLE, JinjaFormat, TranscriptFormat, choose_format


def msgs(*pairs) -> list[Message]:
    return [Message.model_validate(p) if isinstance(p, dict) else Message(role=p[0], content=p[1]) for p in pairs]


# --- transcript format (base models) ----------------------------------------------------


def test_transcript_renders_every_role():
    r = TranscriptFormat().render(
        msgs(
            ("system", "  Be brief. "),
            ("user", "What is 2+2?"),
            ("assistant", "4"),
            ("tool", '{"ok": true}'),
            ("user", " Thanks "),
        )
    )
    assert r.prompt == (
        "Be brief.\n"
        "\n"
        "User: What is the capital of Italy?\n"
        "Assistant: The capital of Italy is Rome.\n"
        "User: What is 2+2?\n"
        "Assistant: 4\n"
        'Tool result: {"ok": true}\n'
        "User: Thanks\n"
        "Assistant:"
    )
    assert r.prompt.endswith("\nAssistant:")
    assert "\nUser:" in r.stops
    assert r.add_bos is True


def test_transcript_default_preamble_and_add_bos_setting():
    r = TranscriptFormat(add_bos=False).render(msgs(("user", "hi")))
    example = "\n".join(TRANSCRIPT_EXAMPLE)
    assert r.prompt == f"{TRANSCRIPT_PREAMBLE}\n\n{example}\nUser: hi\nAssistant:"
    assert r.add_bos is False


def test_transcript_developer_is_system():
    r = TranscriptFormat().render(msgs(("developer", "Speak French."), ("user", "hi")))
    assert r.prompt.startswith("Speak French.\n\nUser: What is the capital of Italy?")
    assert TRANSCRIPT_PREAMBLE not in r.prompt


def test_transcript_content_parts():
    r = TranscriptFormat().render(
        msgs(
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Hello "},
                    {"type": "image_url", "image_url": {"url": "x"}},
                    {"type": "text", "text": "world"},
                ],
            }
        )
    )
    assert "User: Hello world\nAssistant:" in r.prompt


def test_transcript_assistant_tool_call_without_content():
    r = TranscriptFormat().render(
        msgs(
            ("user", "weather?"),
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        )
    )
    assert 'Assistant: [{"name": "get_weather", "arguments": "{\\"city\\":\\"Oslo\\"}"}]' in r.prompt
    assert r.prompt.endswith("Tool result: rain\nAssistant:")


def test_transcript_last_message_assistant_is_invalid_request():
    with pytest.raises(InvalidRequest) as ei:
        TranscriptFormat().render(msgs(("user", "hi"), ("assistant", "hello")))
    assert ei.value.status == 400
    assert ei.value.param == "messages"


# --- the model's own Jinja template -----------------------------------------------------

CHATML = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unsupported role ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_NO_BOS = CHATML[len("{{ bos_token }}") :]


def chatml(template: str = CHATML) -> JinjaFormat:
    return JinjaFormat(template, "<s>", "</s>")


def test_jinja_renders_chatml():
    r = chatml().render(msgs(("system", "Be brief."), ("user", "hi"), ("assistant", "hello"), ("user", "bye")))
    assert r.prompt == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nhello<|im_end|>\n"
        "<|im_start|>user\nbye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_jinja_bos_not_added_twice():
    assert chatml(CHATML).render(msgs(("user", "hi"))).add_bos is False
    r = chatml(CHATML_NO_BOS).render(msgs(("user", "hi")))
    assert r.add_bos is True
    assert r.prompt.startswith("<|im_start|>user\nhi")


def test_jinja_developer_becomes_system_and_parts_become_text():
    r = chatml(CHATML_NO_BOS).render(
        msgs(
            ("developer", "Rules."),
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        )
    )
    assert r.prompt == ("<|im_start|>system\nRules.<|im_end|>\n<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n")


def test_jinja_tool_call_arguments_are_parsed_for_the_template():
    tpl = (
        "{% for m in messages %}{% if m.tool_calls %}"
        "{% for c in m.tool_calls %}{{ c.function.name }}:{{ c.function.arguments.city }}|"
        "{{ c.function.arguments | tojson }}{% endfor %}{% endif %}{% endfor %}"
    )
    r = JinjaFormat(tpl, "", "").render(
        msgs(
            ("user", "w?"),
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "wx", "arguments": '{"city":"Oslo"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        )
    )
    assert r.prompt == 'wx:Oslo|{"city": "Oslo"}'


def test_jinja_raise_exception_is_invalid_request():
    strict = (
        "{% for m in messages %}{% if m.role == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}{{ m.content }}{% endfor %}"
    )
    with pytest.raises(InvalidRequest) as ei:
        JinjaFormat(strict, "", "").render(msgs(("system", "x"), ("user", "hi")))
    assert ei.value.status == 400
    assert "System role not supported" in ei.value.message
    assert ei.value.to_openai()["error"]["type"] == "invalid_request_error"


def test_jinja_runtime_template_error_is_invalid_request():
    with pytest.raises(InvalidRequest) as ei:
        JinjaFormat("{{ messages[0].content.nope() }}", "", "").render(msgs(("user", "hi")))
    assert ei.value.status == 400


@pytest.mark.parametrize(
    "template, cause",
    [
        ("{{ messages | items | list }}", TypeError),  # the filter raises a plain TypeError on a list
        ("{% for m in messages %}{{ 1 + m.content }}{% endfor %}", TypeError),  # int + str
        ("{{ messages[0].content | sum }}", TypeError),
        ("{% for i in range(0, messages | length, 0) %}{{ i }}{% endfor %}", ValueError),
        ("{{ (10 ** (400 * messages | length)) | float }}", OverflowError),  # issue 18: was a 500
        ("{{ 1 // (messages | length - 1) }}", ZeroDivisionError),
    ],
)
def test_jinja_plain_errors_on_the_messages_are_invalid_request(template, cause):
    """Filters and operators raise plain Python errors, not jinja2.TemplateError: still the
    client's 400, never a crash (500)."""
    with pytest.raises(InvalidRequest) as ei:
        JinjaFormat(template, "", "").render(msgs(("user", "hi")))
    assert ei.value.status == 400
    assert "chat template failed" in ei.value.message
    assert isinstance(ei.value.__cause__, cause)


def test_unparseable_template_is_config_error():
    with pytest.raises(ConfigError):
        JinjaFormat("{% for m in messages %}{{ m.content }", "<s>", "</s>")


# --- choosing -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "setting,template,expected",
    [
        ("auto", None, TranscriptFormat),
        ("auto", "", TranscriptFormat),
        ("auto", CHATML, JinjaFormat),
        ("transcript", CHATML, TranscriptFormat),
        ("template", CHATML, JinjaFormat),
    ],
)
def test_choose_format(setting, template, expected):
    fmt = choose_format(setting, template, "<s>", "</s>", True)
    assert isinstance(fmt, expected)
    assert fmt.name == ("transcript" if expected is TranscriptFormat else "template")


def test_choose_format_passes_add_bos_to_transcript():
    assert choose_format("auto", None, "<s>", "</s>", False).render(msgs(("user", "x"))).add_bos is False


def test_choose_template_without_one_is_config_error():
    with pytest.raises(ConfigError):
        choose_format("template", None, "<s>", "</s>", True)
