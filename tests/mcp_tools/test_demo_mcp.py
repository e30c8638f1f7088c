"""MCP tool rounds on the shipped demo model (the real engine, and the real `strata-vision` encoder for a tool's
picture) through hypercorn with the official clients, streamed and not: the model calls `get_weather`, the server
calls it on an MCP server, and the model answers from the result."""

from __future__ import annotations

import importlib.resources
import pathlib

import anthropic
import openai
import pytest
from conftest import live_server, server_config

from .conftest import stdio_server

SHIPPED = pathlib.Path(str(importlib.resources.files("strata.models")))
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    weather = stdio_server(env={"STRATA_TEST_TOOLS": "get_weather"})
    camera = stdio_server(env={"STRATA_TEST_TOOLS": "get_weather", "STRATA_TEST_WEATHER_PICTURE": "1"})
    config = server_config(model=str(SHIPPED / "demo.gguf"), context=1024, sampling={"temperature": 0.0},
                           vision={"mmproj": str(SHIPPED / "demo-mmproj.gguf"), "threads": 1},
                           mcp_servers={"weather": weather, "camera": camera})
    with live_server(config) as live:
        yield live


@pytest.fixture(scope="module")
def responses(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def messages(server):
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as client:
        yield client


WEATHER = [{"type": "mcp", "server_label": "weather", "require_approval": "never"}]


def test_responses_the_model_answers_from_the_tool(responses):
    reply = responses.responses.create(model="demo", input=ASK, tools=WEATHER, max_output_tokens=96,
                                       reasoning={"effort": "none"})
    (call,) = [item for item in reply.output if item.type == "mcp_call"]
    assert call.name == "get_weather" and '"Paris"' in call.arguments
    assert "sunny" in call.output
    assert "sunny" in reply.output_text and "18" in reply.output_text

    with responses.responses.stream(model="demo", input=ASK, tools=WEATHER, max_output_tokens=96,
                                    reasoning={"effort": "none"}) as stream:
        streamed = stream.get_final_response()
    assert [item.type for item in streamed.output] == [item.type for item in reply.output]
    assert streamed.output_text == reply.output_text


def test_anthropic_the_model_answers_from_the_tool(messages):
    options = {"model": "demo", "max_tokens": 96, "betas": ["mcp-client-2025-11-20"], "messages": ASK,
               "mcp_servers": [{"type": "url", "name": "weather"}]}
    reply = messages.beta.messages.create(**options)
    kinds = [block.type for block in reply.content]
    assert kinds[:3] == ["mcp_tool_listing", "mcp_tool_use", "mcp_tool_result"] and kinds[-1] == "text"
    assert reply.content[1].input == {"city": "Paris"}
    assert "sunny" in reply.content[-1].text and "18" in reply.content[-1].text
    with messages.beta.messages.stream(**options) as stream:
        streamed = stream.get_final_message()
    assert [block.type for block in streamed.content] == kinds
    assert streamed.content[-1].text == reply.content[-1].text


def test_a_tools_picture_goes_through_the_encoder(server, responses):
    before = server.call(lambda: server.service.vision.status())
    tools = [{"type": "mcp", "server_label": "camera", "require_approval": "never"}]
    reply = responses.responses.create(model="demo", input=ASK, tools=tools, max_output_tokens=96,
                                       reasoning={"effort": "none"})
    (call,) = [item for item in reply.output if item.type == "mcp_call"]
    assert call.output == "[image: image/png]"
    after = server.call(lambda: server.service.vision.status())
    assert after["encodes"] + after["cache_hits"] == before["encodes"] + before["cache_hits"] + 1
    assert reply.status == "completed"
