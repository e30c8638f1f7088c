"""`POST /v1/messages` and `/v1/messages/count_tokens` through a live hypercorn server: the official `anthropic`
client (sync and async, streaming and not) against a scripted engine whose model writes known text, raw SSE for
the exact event sequence, bad requests, and the real engine on a tiny generated model."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest
from conftest import live_server, server_config

from strata.api import sse

USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"name": "get", "description": "Fetch a thing.",
          "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}]
THINKING = {"type": "enabled", "budget_tokens": 1024}


def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_sync_client_text_and_thinking(serve_script, tokenizer):
    script = "<think>\nhm\n</think>\n\nHello!"
    with serve_script(script) as server, client(server) as api:
        message = api.messages.create(model="m", max_tokens=100, messages=USER, thinking=THINKING)
        again = api.messages.create(model="m", max_tokens=100, messages=USER, thinking=THINKING)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert (message.content[0].thinking, message.content[1].text) == ("hm", "Hello!")
    assert (message.stop_reason, message.role, message.type) == ("end_turn", "assistant", "message")
    assert message.id.startswith("msg_") and message.id != again.id
    assert message.usage.output_tokens == len(tokenizer.encode(script, special=True))
    assert message.usage.cache_read_input_tokens == 0
    # The same prompt again: all but its last token are read from the KV cache, and Anthropic counts those apart.
    assert again.usage.input_tokens == 1
    assert again.usage.cache_read_input_tokens == message.usage.input_tokens - 1


def test_sync_client_tool_use_and_the_round_trip(serve_script, tokenizer):
    with serve_script('<tool_call>\n{"name": "get", "arguments": {"a": 7}}\n</tool_call>') as server:
        with client(server) as api:
            message = api.messages.create(model="m", max_tokens=100, messages=USER, tools=TOOLS)
            follow_up = USER + [message.to_param(), {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": message.content[0].id, "content": "42"}]}]
            api.messages.create(model="m", max_tokens=100, messages=follow_up, tools=TOOLS)
        prompt = tokenizer.decode(server.service.engine.kv)
    call = message.content[0]
    assert (call.type, call.name, call.input) == ("tool_use", "get", {"a": 7})
    assert message.stop_reason == "tool_use"
    assert '"a": 7' in prompt and "<tool_response>\n42\n</tool_response>" in prompt


def test_sync_client_stream_matches_the_message(serve_script):
    script = '<think>\nhm\n</think>\n\nSure.<tool_call>\n{"name": "get", "arguments": {"a": 1}}\n</tool_call>'
    with serve_script(script) as server, client(server) as api:
        with api.messages.stream(model="m", max_tokens=100, messages=USER, tools=TOOLS, thinking=THINKING) as stream:
            text = "".join(stream.text_stream)
            streamed = stream.get_final_message()
        message = api.messages.create(model="m", max_tokens=100, messages=USER, tools=TOOLS, thinking=THINKING)
    assert text == "Sure."
    assert [block.type for block in streamed.content] == ["thinking", "text", "tool_use"]
    assert streamed.content[2].input == {"a": 1}
    assert streamed.stop_reason == "tool_use"
    # Block ids differ between the two requests; everything else is the same answer.
    assert _without_ids(streamed) == _without_ids(message)
    assert streamed.usage.output_tokens == message.usage.output_tokens


def _without_ids(message: anthropic.types.Message) -> list[dict[str, Any]]:
    return [{key: value for key, value in block.model_dump(exclude_none=True).items() if key != "id"}
            for block in message.content]


# The async client leaves its streaming async generators (its own and its HTTP library's) to the garbage
# collector, which trio reports as a ResourceWarning.
@pytest.mark.filterwarnings("ignore:Async generator:ResourceWarning")
async def test_async_client_streamed_and_not(serve_script):
    with serve_script("Bonjour") as server:
        async with anthropic.AsyncAnthropic(base_url=server.url, api_key="unused", max_retries=0) as api:
            async with api.messages.stream(model="m", max_tokens=100, messages=USER) as stream:
                text = "".join([piece async for piece in stream.text_stream])
                streamed = await stream.get_final_message()
            message = await api.messages.create(model="m", max_tokens=3, messages=USER)
            raw = await api.messages.create(model="m", max_tokens=100, messages=USER, stream=True)
            kinds = [event.type async for event in raw]
    assert text == "Bonjour" and streamed.stop_reason == "end_turn"
    assert streamed.usage.output_tokens == len("Bonjour")
    assert (message.content[0].text, message.stop_reason, message.usage.output_tokens) == ("Bon", "max_tokens", 3)
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]


def test_raw_event_sequence(serve_script):
    with serve_script("<think>\nab\n</think>\n\nHi") as server:
        with httpx.stream("POST", server.url + "/v1/messages", timeout=30, json={
                "model": "m", "max_tokens": 50, "messages": USER, "thinking": THINKING, "stream": True}) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = [(name, json.loads(data)) for name, data in sse.decode(b"".join(response.iter_bytes()))]
    assert all(name == data["type"] for name, data in events)
    # One byte-level token per character: each becomes one delta.
    assert [name for name, _ in events] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]
    assert [data["delta"] for name, data in events if name == "content_block_delta"] == [
        {"type": "thinking_delta", "thinking": "a"}, {"type": "thinking_delta", "thinking": "b"},
        {"type": "text_delta", "text": "H"}, {"type": "text_delta", "text": "i"}]
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}


def test_stop_sequences_cut_the_text(serve_script):
    with serve_script("one two three") as server, client(server) as api:
        message = api.messages.create(model="m", max_tokens=100, messages=USER, stop_sequences=[" three", "zzz"])
    assert message.content[0].text == "one two"


def test_system_and_thinking_off_reach_the_template(serve_script, tokenizer):
    empty_thinking = tokenizer.encode("<think>\n\n</think>\n\n", special=True)
    with serve_script("x") as server, client(server) as api:
        for options, disabled in [({}, True), ({"thinking": THINKING}, False)]:
            api.messages.create(model="m", max_tokens=10, messages=USER, system="Be brief.", **options)
            prompt = server.call(lambda: list(server.service.engine.kv[:-1]))  # the prompt, then "x"
            assert (prompt[-len(empty_thinking):] == empty_thinking) is disabled
    assert "Be brief." in tokenizer.decode(prompt)


def test_count_tokens_is_the_prompt_of_the_message(serve_script):
    with serve_script("x") as server, client(server) as api:
        counted = api.messages.count_tokens(model="m", messages=USER, system="Be brief.", tools=TOOLS)
        message = api.messages.create(model="m", max_tokens=10, messages=USER, system="Be brief.", tools=TOOLS)
        bare = api.messages.count_tokens(model="m", messages=USER)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert 0 < bare.input_tokens < counted.input_tokens


@pytest.mark.parametrize(("request_body", "status", "kind"), [
    ({"model": "m", "messages": USER}, 400, "invalid_request_error"),  # no max_tokens
    ({"model": "m", "max_tokens": "10", "messages": USER}, 400, "invalid_request_error"),
    ({"model": "m", "max_tokens": 10, "messages": [{"role": "system", "content": "x"}]}, 400,
     "invalid_request_error"),
    ({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, 400, "invalid_request_error"),
    ({"model": "m", "max_tokens": 10, "messages": USER, "tools": [{"type": "bash_20250124", "name": "bash"}]}, 400,
     "invalid_request_error"),
])
def test_bad_requests_get_anthropic_errors_and_the_server_keeps_serving(serve_script, request_body, status, kind):
    with serve_script("ok") as server:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            refused = http.post("/v1/messages", json=request_body)
            malformed = http.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
            counted = http.post("/v1/messages/count_tokens", json={"model": "m", "messages": [{"role": "x"}]})
        with client(server) as api:
            message = api.messages.create(model="m", max_tokens=10, messages=USER)
    assert refused.status_code == status
    assert refused.json()["type"] == "error" and refused.json()["error"]["type"] == kind
    assert malformed.status_code == 400 and malformed.json()["type"] == "error"
    assert counted.status_code == 400 and counted.json()["error"]["type"] == "invalid_request_error"
    assert message.content[0].text == "ok"


def test_official_client_raises_on_a_refused_request(serve_script):
    with serve_script("ok") as server, client(server) as api:
        with pytest.raises(anthropic.BadRequestError) as caught:
            # Current clients have no sampling arguments; the API (and older clients) still take them.
            api.messages.create(model="m", max_tokens=10, messages=USER, extra_body={"temperature": 3.0})
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in caught.value.body["error"]["message"]


# --- the real engine


def test_real_engine_streamed_equals_not_streamed(tiny_model):
    options = {"model": "m", "max_tokens": 8, "messages": USER, "extra_body": {"temperature": 0.0}}
    with live_server(server_config(model=str(tiny_model))) as server, client(server) as api:
        message = api.messages.create(**options)
        with api.messages.stream(**options) as stream:
            streamed = stream.get_final_message()
        counted = api.messages.count_tokens(model="m", messages=USER)
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= message.usage.output_tokens <= 8
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens
    # Greedy decoding: the same answer both ways (a random model may write anything, thinking included).
    assert _without_ids(streamed) == _without_ids(message)
    assert streamed.stop_reason == message.stop_reason
