"""Prompt rendering: our Qwen3-format chat template (expected texts written out from the format) and the jinja2
environment (against the renderer in transformers)."""

from __future__ import annotations

import copy
from importlib.resources import files

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from strata.text import prompt
from strata.text.prompt import PromptError, render_chat

QWEN3 = (files("strata.modelgen") / "qwen3_chat_template.jinja").read_text(encoding="utf-8")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


def test_plain_conversation() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Again"},
    ]
    assert render_chat(QWEN3, messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("role", ["system", "developer"])
def test_billing_header_lines_never_reach_the_prompt_in_any_dialect(role) -> None:
    header = "x-anthropic-billing-header: cc_version=1.0.70; cch=00aa1;"
    clean = render_chat(QWEN3, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    for content in (f"{header}\nBe brief.", [{"type": "text", "text": header}, {"type": "text", "text": "Be brief."}]):
        assert render_chat(QWEN3, [{"role": role, "content": content}, {"role": "user", "content": "Hi"}]) == clean
    # only the system prompt's: a user may quote the line
    assert header in render_chat(QWEN3, [{"role": "user", "content": header}])


def test_generation_prompt_is_optional() -> None:
    text = render_chat(QWEN3, [{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert text == "<|im_start|>user\nHi<|im_end|>\n"


def test_thinking_off_opens_an_empty_think_block() -> None:
    text = render_chat(QWEN3, [{"role": "user", "content": "Hi"}], enable_thinking=False)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_tools_follow_the_system_message() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]
    assert render_chat(QWEN3, messages, tools=[WEATHER_TOOL]) == (
        "<|im_start|>system\nBe brief.\n\n" + TOOLS_PREAMBLE
        + "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tools_without_a_system_message() -> None:
    text = render_chat(QWEN3, [{"role": "user", "content": "Weather?"}], tools=[WEATHER_TOOL])
    assert text == (
        "<|im_start|>system\n" + TOOLS_PREAMBLE + "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("arguments", [{"city": "Zürich"}, '{"city": "Zürich"}'])
def test_tool_calls_and_results(arguments: object) -> None:
    messages = [
        {"role": "user", "content": "Weather in Zürich and Bern?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Bern"}}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_3", "type": "function", "function": {"name": "get_weather", "arguments": {}}},
        ]},
        {"role": "tool", "tool_call_id": "call_3", "content": "fog"},
    ]
    assert render_chat(QWEN3, messages, add_generation_prompt=False) == (
        "<|im_start|>user\nWeather in Zürich and Bern?<|im_end|>\n"
        "<|im_start|>assistant\nChecking.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
        "<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nfog\n</tool_response><|im_end|>\n"
    )


def test_reasoning_is_kept_only_after_the_last_user_message() -> None:
    messages = [
        {"role": "user", "content": "A?"},
        {"role": "assistant", "content": "<think>\nold thought\n</think>\n\nA.", "reasoning_content": None},
        {"role": "user", "content": "B?"},
        {"role": "assistant", "reasoning_content": "\nneed a tool\n", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "X"}}},
        ]},
        {"role": "tool", "content": "hot"},
        {"role": "assistant", "content": "<think>\nnew thought\n</think>\n\nHot."},
    ]
    assert render_chat(QWEN3, messages, add_generation_prompt=False) == (
        "<|im_start|>user\nA?<|im_end|>\n<|im_start|>assistant\nA.<|im_end|>\n"
        "<|im_start|>user\nB?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nneed a tool\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "X"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nhot\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nnew thought\n</think>\n\nHot.<|im_end|>\n"
    )


def test_a_final_assistant_turn_gets_a_think_block() -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    assert render_chat(QWEN3, messages, add_generation_prompt=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHel<|im_end|>\n"
    )


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "image", "source": {"type": "base64", "data": "AAAA"}},
    {"type": "input_image", "image_url": "https://example.com/a.png"},
])
def test_image_parts_become_vision_placeholders(part: dict) -> None:
    content = [{"type": "text", "text": "What is "}, part, {"type": "text", "text": "?"}]
    text = render_chat(QWEN3, [{"role": "user", "content": content}], add_generation_prompt=False)
    assert text == "<|im_start|>user\nWhat is <|vision_start|><|image_pad|><|vision_end|>?<|im_end|>\n"


def test_unknown_role_is_a_prompt_error() -> None:
    with pytest.raises(PromptError, match="unknown message role: narrator"):
        render_chat(QWEN3, [{"role": "narrator", "content": "Once"}])


def test_template_syntax_error_is_a_prompt_error() -> None:
    with pytest.raises(PromptError, match="does not compile"):
        render_chat("{% for m in messages %}", [])


@pytest.mark.parametrize("template", ["{{ 'a' + 1 }}", "{{ [] | first | tojson }}{{ {}['k'] }}",
                                      "{{ raise_exception('no system message') }}"])
def test_errors_in_template_code_are_prompt_errors(template: str) -> None:
    with pytest.raises(PromptError, match="chat template error"):
        render_chat(template, [])


def test_sandbox_refuses_unsafe_access() -> None:
    with pytest.raises(PromptError, match="chat template error"):
        render_chat("{{ messages.__class__.__mro__ }}", [])


def test_callers_messages_are_not_changed() -> None:
    messages = [
        {"role": "user", "content": None},
        {"role": "assistant", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]},
    ]
    before = copy.deepcopy(messages)
    render_chat("{{ messages | tojson }}", messages)
    assert messages == before
    normalised = prompt.normalise_messages(messages + [{"role": "assistant", "tool_calls": [{"name": "g"}]}])
    assert normalised[0]["content"] == ""
    assert normalised[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert normalised[2]["tool_calls"][0]["arguments"] == {}


def test_developer_role_renders_as_system() -> None:
    text = render_chat(QWEN3, [{"role": "developer", "content": "Rules."}], add_generation_prompt=False)
    assert text == "<|im_start|>system\nRules.<|im_end|>\n"


def test_compiled_templates_are_cached() -> None:
    template = "{{ messages | length }} cached"
    render_chat(template, [])
    hits = prompt._compile.cache_info().hits
    assert render_chat(template, [{"role": "user", "content": "a"}]) == "1 cached"
    assert prompt._compile.cache_info().hits == hits + 1


# A template exercising the environment: whitespace control, tojson on non-ASCII text, the helper functions.
ENV_TEMPLATE = """
{%- if messages | length == 0 %}{{ raise_exception('no messages') }}{% endif %}
{% for m in messages %}
  {% if m.role == 'user' %}
    [{{ m.content | tojson }}]
  {% else %}
    {{ m | tojson(indent=2) }}
  {% endif %}
{% endfor %}
{% if tools %}{{ tools | tojson }}{% endif %}
{{ strftime_now('%Y') | length }}
{%- if add_generation_prompt %}GO{{ flavour }}{% endif %}
"""


@pytest.mark.parametrize("template", [QWEN3, ENV_TEMPLATE])
def test_rendering_matches_transformers(template: str) -> None:
    messages = [
        {"role": "system", "content": "Système"},
        {"role": "user", "content": "Grüße 🚀"},
        {"role": "assistant", "content": "ok", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京"}}},
        ]},
        {"role": "tool", "content": "晴れ"},
    ]
    ours = render_chat(template, messages, tools=[WEATHER_TOOL], flavour="!")
    rendered, _ = render_jinja_template([messages], tools=[WEATHER_TOOL], chat_template=template,
                                        add_generation_prompt=True, enable_thinking=True, flavour="!")
    assert ours == rendered[0]
