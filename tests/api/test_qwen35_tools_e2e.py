"""Qwen3.5/3.6's XML tool calls through a live server and the official `openai` and `anthropic` clients, streamed and
not: a model served with Qwen3.5's real chat template (from llama.cpp's source archive: skipped, naming
`scripts/fetch-llama-cpp.sh`, when it is absent) is read in that family's syntax, and its calls render back into
the prompt the way the template writes them."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import anthropic
import openai
import pytest
from conftest import live_server, server_config
from fakes import ScriptedEngine

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
