"""Qwen3.5/3.6's XML tool calls through a live server and the official `openai` and `anthropic` clients, streamed and
not: a model served with Qwen3.5's real chat template (from llama.cpp's source archive: skipped, naming
`scripts/fetch-llama-cpp.sh`, when it is absent) is read in that family's syntax, and its calls render back into
the prompt the way the template writes them. With the real engine (the demo model's file rewritten with that
template), forced and strict calls come out in the XML syntax and in their schemas, and JSON answers still
validate."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from conftest import live_server, server_config
from fakes import ScriptedEngine
from gguf_rewrite import rewrite

import strata

TEMPLATE = pathlib.Path(__file__).resolve().parents[2] / ".cache/llama.cpp-0.3.36/models/templates/Qwen3.5-4B.jinja"
USER = [{"role": "user", "content": "Weather in Paris?"}]
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city"]}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": PARAMETERS}]
CITY = 'Paris "centre"\nrive gauche'
SCRIPT = ("<think>\nA tool.\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
          f"{CITY}\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
ARGUMENTS = {"city": CITY, "days": 3}


@pytest.fixture
def serve_qwen35(tokenizer):
    if not TEMPLATE.is_file():
        pytest.skip("llama.cpp's Qwen3.5 chat template is not in .cache/ (run scripts/fetch-llama-cpp.sh)")
    qwen35 = dataclasses.replace(tokenizer, chat_template=TEMPLATE.read_text("utf-8"))

    def start(text: str) -> Any:
        return live_server(server_config(), ScriptedEngine(qwen35, qwen35.encode(text, special=True)), qwen35)

    return start


def test_openai_client_streamed_and_not(serve_qwen35, tokenizer):
    with serve_qwen35(SCRIPT) as server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused") as client:
        assert server.service.family.name == "qwen35"
        stream = client.chat.completions.create(model="m", messages=USER, tools=OPENAI_TOOLS, stream=True)
        pieces = [chunk.choices[0] for chunk in stream if chunk.choices]
        reply = client.chat.completions.create(model="m", messages=USER, tools=OPENAI_TOOLS)
        message = reply.choices[0].message
        follow_up = [*USER, message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}]
        client.chat.completions.create(model="m", messages=follow_up, tools=OPENAI_TOOLS)
        prompt = tokenizer.decode(server.service.engine.kv)
    calls = [call for piece in pieces for call in piece.delta.tool_calls or []]
    assert [call.function.name for call in calls if call.function.name] == ["get_weather"]
    assert len(calls) > 3  # the arguments came in pieces
    assert json.loads("".join(call.function.arguments or "" for call in calls)) == ARGUMENTS
    assert "".join(piece.delta.content or "" for piece in pieces) == "Checking."
    assert pieces[-1].finish_reason == "tool_calls"
    assert (message.content, message.model_extra["reasoning_content"]) == ("Checking.", "A tool.")
    assert [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls] == [
        ("get_weather", ARGUMENTS)]
    # The call goes back into the prompt in the template's own syntax.
    assert (f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{CITY}\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n</function>\n</tool_call>") in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt


def test_anthropic_client_streamed_and_not(serve_qwen35):
    thinking = {"type": "enabled", "budget_tokens": 1024}
    with serve_qwen35(SCRIPT) as server, anthropic.Anthropic(base_url=server.url, api_key="unused",
                                                             max_retries=0) as api:
        with api.messages.stream(model="m", max_tokens=400, messages=USER, tools=ANTHROPIC_TOOLS,
                                 thinking=thinking) as stream:
            partial = [event.partial_json for event in stream if event.type == "input_json"]
            streamed = stream.get_final_message()
        message = api.messages.create(model="m", max_tokens=400, messages=USER, tools=ANTHROPIC_TOOLS,
                                      thinking=thinking)
    assert len(partial) > 1 and json.loads("".join(partial)) == ARGUMENTS
    for answer in (streamed, message):
        assert [block.type for block in answer.content] == ["thinking", "text", "tool_use"]
        assert (answer.content[2].name, answer.content[2].input) == ("get_weather", ARGUMENTS)
        assert answer.stop_reason == "tool_use"


# --- the real engine: the demo model served with Qwen3.5's template, its calls forced in the XML syntax

LIGHT = {"type": "object", "properties": {"room": {"type": "string", "enum": ["hall", "kitchen", "attic"]},
                                          "level": {"type": "integer", "minimum": 0, "maximum": 10},
                                          "on": {"type": "boolean"}},
         "required": ["room", "level", "on"], "additionalProperties": False}
FORCED_TOOLS = [{"type": "function", "function": {"name": "set_light", "strict": True, "parameters": LIGHT}},
                {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
                    "type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
                    "required": ["zone"], "additionalProperties": False}}}]
LIGHTS_ON = [{"role": "user", "content": "Turn the hall light on, level 3."}]


@pytest.fixture(scope="module")
def demo35(tmp_path_factory: pytest.TempPathFactory):
    if not TEMPLATE.is_file():
        pytest.skip("llama.cpp's Qwen3.5 chat template is not in .cache/ (run scripts/fetch-llama-cpp.sh)")
    demo = pathlib.Path(strata.__file__).parent / "models" / "demo.gguf"
    path = rewrite(demo, tmp_path_factory.mktemp("qwen35") / "demo35.gguf",
                   keys={"tokenizer.chat_template": TEMPLATE.read_text("utf-8")})
    with live_server(server_config(model=str(path), context=2048)) as live:
        yield live


def forced_chat(server, stream: bool, **request: Any) -> tuple[list[tuple[str, Any]], str, str]:
    """([(tool name, arguments)], finish_reason, the text the model wrote) of a chat completion, streamed or not."""
    request = {"model": "m", "max_tokens": 300, "messages": LIGHTS_ON, "tools": FORCED_TOOLS, **request}
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        if not stream:
            choice = client.chat.completions.create(**request).choices[0]
            calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
            return calls, choice.finish_reason, choice.message.content or ""
        named: dict[int, list[str]] = {}
        finish, text = "", ""
        for chunk in client.chat.completions.create(stream=True, **request):
            for choice in chunk.choices:
                text += choice.delta.content or ""
                for call in choice.delta.tool_calls or []:
                    name, arguments = named.setdefault(call.index, ["", ""])
                    named[call.index] = [call.function.name or name, arguments + (call.function.arguments or "")]
                finish = choice.finish_reason or finish
        return [(name, json.loads(arguments)) for name, arguments in named.values()], finish, text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_forced_calls_follow_the_schema_in_the_xml_syntax(demo35, stream):
    assert demo35.service.family.name == "qwen35"
    named = {"type": "function", "function": {"name": "set_light"}}
    for options in ({"tool_choice": named, "temperature": 0}, {"tool_choice": named, "temperature": 1.0, "seed": 4},
                    {"tool_choice": "required", "parallel_tool_calls": False, "temperature": 1.0, "seed": 7}):
        calls, finish, text = forced_chat(demo35, stream, reasoning_effort="none", **options)
        assert finish == "tool_calls" and len(calls) == 1 and text == "", options
        name, arguments = calls[0]
        jsonschema.validate(arguments, next(t["function"]["parameters"] for t in FORCED_TOOLS
                                            if t["function"]["name"] == name))


def test_anthropic_tool_choice_forces_an_xml_call(demo35):
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in FORCED_TOOLS]
    with anthropic.Anthropic(base_url=demo35.url, api_key="unused", max_retries=0) as api:
        message = api.messages.create(model="m", max_tokens=300, messages=LIGHTS_ON, tools=tools,
                                      tool_choice={"type": "tool", "name": "set_light"},
                                      extra_body={"temperature": 0})
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and [block.name for block in uses] == ["set_light"]
    jsonschema.validate(uses[0].input, LIGHT)


def test_structured_outputs_keep_working(demo35):
    schema = {"type": "object", "properties": {"capital": {"enum": ["Paris", "Rome"]}}, "required": ["capital"],
              "additionalProperties": False}
    with openai.OpenAI(base_url=demo35.url + "/v1", api_key="unused", max_retries=0) as client:
        reply = client.chat.completions.create(
            model="m", temperature=0, max_tokens=200, messages=[{"role": "user", "content": "Capital of France?"}],
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_the_model_writes_the_xml_syntax(demo35):
    """The tokens the forced call sampled (their log-probabilities name them) spell the XML call."""
    with openai.OpenAI(base_url=demo35.url + "/v1", api_key="unused", max_retries=0) as client:
        choice = client.chat.completions.create(
            model="m", max_tokens=300, messages=LIGHTS_ON, tools=FORCED_TOOLS, temperature=0, logprobs=True,
            reasoning_effort="none", tool_choice={"type": "function", "function": {"name": "set_light"}}).choices[0]
    written = "".join(entry.token for entry in choice.logprobs.content)
    assert written.startswith("<tool_call>\n<function=set_light>\n<parameter=room>\n"), written
    assert written.endswith("</function>\n</tool_call>"), written


def test_responses_api_streamed_and_not(serve_qwen35):
    tools = [{"type": "function", "name": "get_weather", "parameters": PARAMETERS, "strict": False}]
    with serve_qwen35(SCRIPT) as server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused") as client:
        response = client.responses.create(model="m", input="Weather in Paris?", tools=tools)
        events = list(client.responses.create(model="m", input="Weather in Paris?", tools=tools, stream=True))
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(call.name, json.loads(call.arguments)) for call in calls] == [("get_weather", ARGUMENTS)]
    deltas = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and json.loads("".join(deltas)) == ARGUMENTS
    done = [event.item for event in events if event.type == "response.output_item.done"]
    assert [json.loads(item.arguments) for item in done if item.type == "function_call"] == [ARGUMENTS]
