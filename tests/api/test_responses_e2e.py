"""`POST /v1/responses` through a live hypercorn server: the official `openai` client (sync and async, streaming
and not) against a scripted engine whose model writes known text, raw SSE for the exact event sequence, the
stateless refusals, bad requests, and the real engine on a tiny generated model."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from conftest import live_server, server_config

from strata.api import sse

TOOLS = [{"type": "function", "name": "get", "description": "Fetch a thing.",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_sync_client_reasoning_and_text(serve_script, tokenizer):
    script = "<think>\nhm\n</think>\n\nHello!"
    with serve_script(script) as server, client(server) as api:
        response = api.responses.create(model="m", input="hi", instructions="Be brief.")
        again = api.responses.create(model="m", input="hi", instructions="Be brief.")
        prompt = tokenizer.decode(server.call(lambda: list(server.service.engine.kv)))
    assert (response.status, response.object) == ("completed", "response")
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "hm"
    assert response.output_text == "Hello!"
    assert response.id.startswith("resp_") and response.id != again.id
    assert response.usage.output_tokens == len(tokenizer.encode(script, special=True))
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    # The same prompt again: all but its last token come from the KV cache.
    assert again.usage.input_tokens_details.cached_tokens == again.usage.input_tokens - 1
    assert "Be brief." in prompt


def test_sync_client_function_call_and_the_round_trip(serve_script, tokenizer):
    with serve_script('<tool_call>\n{"name": "get", "arguments": {"a": 7}}\n</tool_call>') as server:
        with client(server) as api:
            response = api.responses.create(model="m", input="hi", tools=TOOLS)
            call = response.output[0]
            follow_up = [{"role": "user", "content": "hi"}, *response.output,
                         {"type": "function_call_output", "call_id": call.call_id, "output": "42"}]
            api.responses.create(model="m", input=follow_up, tools=TOOLS)
        prompt = tokenizer.decode(server.call(lambda: list(server.service.engine.kv)))
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get", {"a": 7})
    assert call.call_id.startswith("call_")
    assert '"a": 7' in prompt and "<tool_response>\n42\n</tool_response>" in prompt


def test_sync_client_stream_matches_the_response(serve_script):
    script = '<think>\nhm\n</think>\n\nSure.<tool_call>\n{"name": "get", "arguments": {"a": 1}}\n</tool_call>'
    with serve_script(script) as server, client(server) as api:
        with api.responses.stream(model="m", input="hi", tools=TOOLS) as stream:
            kinds = [event.type for event in stream]
            streamed = stream.get_final_response()
        response = api.responses.create(model="m", input="hi", tools=TOOLS)
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"
    assert [item.type for item in streamed.output] == ["reasoning", "message", "function_call"]
    assert streamed.output_text == "Sure."
    assert json.loads(streamed.output[2].arguments) == {"a": 1}
    # Item ids differ between the two requests; everything else is the same answer.
    assert _without_ids(streamed) == _without_ids(response)
    assert streamed.usage.output_tokens == response.usage.output_tokens


def _without_ids(response: Any) -> list[dict[str, Any]]:
    return [{key: value for key, value in item.model_dump(exclude_none=True).items()
             if key not in ("id", "call_id", "parsed_arguments")} for item in response.output]


# The async client leaves its streaming async generators (its own and its HTTP library's) to the garbage
# collector, which trio reports as a ResourceWarning.
@pytest.mark.filterwarnings("ignore:Async generator:ResourceWarning")
async def test_async_client_streamed_and_not(serve_script):
    with serve_script("Bonjour") as server:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as api:
            stream = await api.responses.create(model="m", input="hi", stream=True, reasoning={"effort": "none"})
            text = "".join([event.delta async for event in stream if event.type == "response.output_text.delta"])
            response = await api.responses.create(model="m", input="hi", max_output_tokens=3)
    assert text == "Bonjour"
    assert (response.status, response.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert (response.output_text, response.usage.output_tokens) == ("Bon", 3)


def test_raw_event_sequence(serve_script):
    with serve_script("<think>\na\n</think>\n\nHi") as server:
        with httpx.stream("POST", server.url + "/v1/responses", timeout=30,
                          json={"model": "m", "input": "hi", "stream": True}) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = [(name, json.loads(data)) for name, data in sse.decode(b"".join(response.iter_bytes()))]
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    # One byte-level token per character: each becomes one delta.
    assert [name for name, _ in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]
    final = events[-1][1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["usage"]["output_tokens"] > 0


def test_reasoning_effort_none_disables_thinking_in_the_template(serve_script, tokenizer):
    empty_thinking = tokenizer.encode("<think>\n\n</think>\n\n", special=True)
    with serve_script("x") as server, client(server) as api:
        for options, disabled in [({"reasoning": {"effort": "none"}}, True),
                                  ({"reasoning": {"effort": "minimal"}}, True),
                                  ({"reasoning": {"effort": "high"}}, False), ({}, False)]:
            api.responses.create(model="m", input="hi", **options)
            prompt = server.call(lambda: list(server.service.engine.kv[:-1]))  # the prompt, then "x"
            assert (prompt[-len(empty_thinking):] == empty_thinking) is disabled


@pytest.mark.parametrize(("request_body", "param"), [
    ({"model": "m"}, "input"),
    ({"model": "m", "input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"model": "m", "input": "hi", "store": True}, "store"),
    ({"model": "m", "input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"model": "m", "input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "auto"}]}]}, "input[0].content[0]"),
    ({"model": "m", "input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(serve_script, request_body, param):
    with serve_script("ok") as server:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            refused = http.post("/v1/responses", json=request_body)
            malformed = http.post("/v1/responses", content=b"{not json", headers={"content-type": "application/json"})
        with client(server) as api:
            response = api.responses.create(model="m", input="hi")
    assert refused.status_code == 400
    assert refused.json()["error"]["type"] == "invalid_request_error"
    assert refused.json()["error"]["param"] == param
    assert malformed.status_code == 400 and "error" in malformed.json()
    assert response.output_text == "ok"


def test_official_client_raises_on_a_refused_request(serve_script):
    with serve_script("ok") as server, client(server) as api:
        with pytest.raises(openai.BadRequestError) as caught:
            api.responses.create(model="m", input="hi", previous_response_id="resp_123")
    assert caught.value.param == "previous_response_id"


# --- the real engine


def test_real_engine_streamed_equals_not_streamed(tiny_model):
    options = {"model": "m", "input": "hi", "max_output_tokens": 8, "temperature": 0.0}
    with live_server(server_config(model=str(tiny_model))) as server, client(server) as api:
        response = api.responses.create(**options)
        stream = api.responses.create(**options, stream=True)
        final = list(stream)[-1]
    assert response.status in ("completed", "incomplete")
    assert 1 <= response.usage.output_tokens <= 8
    # Greedy decoding: the same answer both ways (a random model may write anything, reasoning included).
    assert final.response.status == response.status
    assert _without_ids(final.response) == _without_ids(response)
