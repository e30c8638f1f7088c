"""The shipped demo model through `strata serve` (hypercorn, the real engine and `strata-vision` process) with the
official clients: pictures, tool calls, tool results, prefix reuse and thinking in every dialect.

The expected answers are facts about the requests (the picture shows a red circle, the question names Paris);
the cold-run comparison uses the engine directly, with no server code."""

from __future__ import annotations

import base64
import importlib.resources
import io
import itertools
import json
import pathlib
from typing import Any

import anthropic
import openai
import pytest
from conftest import live_server, server_config
from PIL import Image, ImageDraw

from strata.modelgen.demo import data, evaluate
from strata.text.prompt import render_chat
from strata.text.tokenizer import Tokenizer

SHIPPED = pathlib.Path(str(importlib.resources.files("strata.models")))
MAX_TOKENS = 64
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name."}},
                   "required": ["city"]}}}
WEATHER_RESULT = json.dumps({"temperature": 18, "condition": "sunny"})


def red_circle_png() -> bytes:
    image = Image.new("RGB", (400, 300), "white")
    ImageDraw.Draw(image).ellipse((40, 110, 120, 190), fill=(230, 25, 25))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


PICTURE = base64.b64encode(red_circle_png()).decode()
DATA_URL = "data:image/png;base64," + PICTURE


@pytest.fixture(scope="module")
def server():
    # Greedy by default: the Anthropic client has no temperature parameter.
    config = server_config(model=str(SHIPPED / "demo.gguf"), context=1024, sampling={"temperature": 0.0},
                           vision={"mmproj": str(SHIPPED / "demo-mmproj.gguf"), "threads": 1})
    with live_server(config) as live:
        yield live


@pytest.fixture(scope="module")
def chat(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused") as client:
        yield client


@pytest.fixture(scope="module")
def messages_api(server):
    with anthropic.Anthropic(base_url=server.url, api_key="unused") as client:
        yield client


def chat_create(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(model="demo", max_tokens=MAX_TOKENS, **kwargs)


# --- pictures


def ask_openai_chat(chat) -> str:
    content = [{"type": "text", "text": "What is in the picture?"},
               {"type": "image_url", "image_url": {"url": DATA_URL}}]
    reply = chat_create(chat, messages=[{"role": "user", "content": content}], reasoning_effort="none")
    return reply.choices[0].message.content.lower()


def test_openai_chat_names_the_colour(chat) -> None:
    assert "red" in ask_openai_chat(chat)


def test_openai_chat_names_the_shape(chat) -> None:
    assert "red circle" in ask_openai_chat(chat)


def test_responses_names_the_colour(chat) -> None:
    content = [{"type": "input_text", "text": "What is in the picture?"},
               {"type": "input_image", "image_url": DATA_URL}]
    reply = chat.responses.create(model="demo", input=[{"role": "user", "content": content}], temperature=0,
                                  max_output_tokens=MAX_TOKENS)
    assert "red" in reply.output_text.lower()


def test_anthropic_names_the_colour(messages_api) -> None:
    content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PICTURE}},
               {"type": "text", "text": "What is in the picture?"}]
    reply = messages_api.messages.create(model="demo", max_tokens=MAX_TOKENS,
                                         messages=[{"role": "user", "content": content}])
    text = "".join(block.text for block in reply.content if block.type == "text")
    assert "red" in text.lower()


# --- tool calls


ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_openai_chat_calls_the_tool(chat) -> None:
    reply = chat_create(chat, messages=ASK_WEATHER, tools=[WEATHER])
    (call,) = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    chunks = list(chat_create(chat, messages=ASK_WEATHER, tools=[WEATHER], stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].tool_calls[0].function.name == "get_weather"
    arguments = "".join(d.tool_calls[0].function.arguments or "" for d in deltas)
    assert json.loads(arguments) == {"city": "Paris"}


def test_responses_calls_the_tool(chat) -> None:
    tool = {"type": "function", **WEATHER["function"]}
    reply = chat.responses.create(model="demo", input=ASK_WEATHER, tools=[tool], temperature=0,
                                  max_output_tokens=MAX_TOKENS)
    (call,) = [item for item in reply.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}

    events = list(chat.responses.create(model="demo", input=ASK_WEATHER, tools=[tool], temperature=0,
                                        max_output_tokens=MAX_TOKENS, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Paris"}


def test_anthropic_calls_the_tool(messages_api) -> None:
    tool = {"name": "get_weather", "description": WEATHER["function"]["description"],
            "input_schema": WEATHER["function"]["parameters"]}
    reply = messages_api.messages.create(model="demo", max_tokens=MAX_TOKENS, messages=ASK_WEATHER,
                                         tools=[tool])
    (use,) = [block for block in reply.content if block.type == "tool_use"]
    assert reply.stop_reason == "tool_use"
    assert use.name == "get_weather" and use.input == {"city": "Paris"}

    with messages_api.messages.stream(model="demo", max_tokens=MAX_TOKENS, messages=ASK_WEATHER,
                                      tools=[tool]) as stream:
        final = stream.get_final_message()
    (use,) = [block for block in final.content if block.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}


def test_a_tool_result_is_used_in_the_answer(chat) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
    messages = [*ASK_WEATHER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": WEATHER_RESULT}]
    reply = chat_create(chat, messages=messages, tools=[WEATHER], reasoning_effort="none")
    answer = reply.choices[0].message.content
    assert "sunny" in answer and "18" in answer and "Paris" in answer


# --- prefix reuse and thinking


def cold_answer(messages: list[dict[str, Any]], thinking: bool) -> str:
    """The greedy answer computed with the engine alone, on a fresh KV cache."""
    example = data.Example("follow_up", [*messages, {"role": "assistant", "content": ""}], None, thinking, {})
    (result,) = evaluate.evaluate(SHIPPED / "demo.gguf", SHIPPED / "demo-mmproj.gguf",
                                  [evaluate.Item("follow_up", example, None)], with_torch=False)
    return result.engine


def test_a_follow_up_reuses_the_prefix_and_answers_as_a_cold_run(chat) -> None:
    first = [{"role": "user", "content": "What is the capital of France?"}]
    reply = chat_create(chat, messages=first, reasoning_effort="none")
    assert "Paris" in reply.choices[0].message.content
    follow_up = [*first, {"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": "What is 2 plus 3?"}]
    warm = chat_create(chat, messages=follow_up, reasoning_effort="none")
    # The two prompts part at the first answer (its empty think block is not kept in the history). The demo is a
    # hybrid: its recurrent state resumes where the slot snapshotted it, at a message start, so the cache gives
    # everything up to the last message start the prompts share.
    tok = Tokenizer.from_gguf(SHIPPED / "demo.gguf")
    prompts = [tok.encode(render_chat(tok.chat_template, m, enable_thinking=False)) for m in (first, follow_up)]
    shared = sum(1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1], zip(*prompts, strict=False)))
    (turn_open,) = tok.encode("<|im_start|>")
    resumable = max(i for i, token in enumerate(prompts[1][:shared]) if token == turn_open)
    assert shared >= warm.usage.prompt_tokens_details.cached_tokens >= resumable > 0
    assert "5" in warm.choices[0].message.content
    _, cold = evaluate.split_thinking(cold_answer(follow_up, thinking=False))
    assert warm.choices[0].message.content == cold


def test_thinking_appears_as_reasoning_only_when_enabled(chat, messages_api) -> None:
    question = [{"role": "user", "content": "What is the capital of Japan?"}]
    thinking = chat_create(chat, messages=question).choices[0].message
    assert getattr(thinking, "reasoning_content", None) and "Tokyo" in thinking.content
    assert "<think>" not in thinking.content
    plain = chat_create(chat, messages=question, reasoning_effort="none").choices[0].message
    assert not getattr(plain, "reasoning_content", None) and "Tokyo" in plain.content

    off = messages_api.messages.create(model="demo", max_tokens=MAX_TOKENS, messages=question)
    assert [block.type for block in off.content] == ["text"]
    on = messages_api.messages.create(model="demo", max_tokens=MAX_TOKENS, messages=question,
                                      thinking={"type": "enabled", "budget_tokens": 1024})
    assert [block.type for block in on.content] == ["thinking", "text"]
    assert on.content[0].thinking and "Tokyo" in on.content[1].text
