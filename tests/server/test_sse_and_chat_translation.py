"""Pure pieces without a server: SSE framing, and the OpenAI chat translation of requests and events."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from strata.api import openai_chat, sse
from strata.api.errors import ApiError
from strata.events import Finish, ReasoningDelta, TextDelta, ToolCallArgumentsDelta, ToolCallStart, Usage

EVENTS = [ReasoningDelta("think"), TextDelta("Hel"), TextDelta("lo"), ToolCallStart(0, "call_1", "get"),
          ToolCallArgumentsDelta(0, '{"a":'), ToolCallArgumentsDelta(0, " 1}"), Usage(10, 4, 6), Finish("tool_calls")]


def test_sse_framing_round_trips():
    frames = sse.encode({"text": "a\nb", "n": 1}, "message_delta") + sse.encode({"x": "é"}) + sse.DONE
    assert frames.startswith(b"event: message_delta\ndata: {")
    assert sse.decode(frames) == [("message_delta", '{"text":"a\\nb","n":1}'), (None, '{"x":"é"}'),
                                  (None, "[DONE]")]


def test_sse_data_is_what_json_dumps_writes():
    # The prebuilt encoder against the library's own compact, non-ASCII dumps.
    data = {"a": [1, -2.5, 1e-300, float("inf"), float("-inf"), None, True, False], "é\"\n": {"k": "日本\u2028\x00"},
            "n": 10**20, 3: "int key", "empty": {}, "list": []}
    expected = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    assert sse.encode(data) == f"data: {expected}\n\n".encode()
    assert sse.encode(data, "ping") == f"event: ping\ndata: {expected}\n\n".encode()


def test_parse_request_maps_every_field():
    body = {
        "model": "m", "messages": [
            {"role": "developer", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "q"}]},
            {"role": "assistant", "content": None, "reasoning_content": "r",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "out"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": "auto", "max_completion_tokens": 9, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
        "min_p": 0.1, "presence_penalty": 0.2, "frequency_penalty": 0.3, "seed": 7, "stop": "END",
        "reasoning_effort": "minimal", "chat_template_kwargs": {"x": 1}, "n": 1,
    }
    request = openai_chat.parse_request({**body, "repetition_penalty": 1.1})
    assert request.messages[2]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert request.messages[2]["reasoning_content"] == "r" and request.messages[3]["tool_call_id"] == "c1"
    assert request.tools[0]["function"]["name"] == "f" and request.tool_choice == "auto"
    sampling = request.sampling
    s = request.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.5, 0.9, 5, 0.1, 7)
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0.2, 0.3, 1.1)
    assert (request.max_tokens, request.stop, request.enable_thinking) == (9, ["END"], False)
    assert request.template_kwargs == {"x": 1} and request.route == "chat"


def test_tool_choice_none_hides_the_tools():
    body = {"messages": [{"role": "user", "content": "q"}], "tool_choice": "none",
            "tools": [{"type": "function", "function": {"name": "f"}}]}
    assert openai_chat.parse_request(body).tools == []


def test_whole_answer_is_a_valid_chat_completion():
    body = openai_chat.ChatRenderer(model="m", request_id="abc").whole(EVENTS)
    completion = ChatCompletion.model_validate(body)
    message = completion.choices[0].message
    assert message.content == "Hello" and message.model_extra["reasoning_content"] == "think"
    assert message.tool_calls[0].id == "call_1" and json.loads(message.tool_calls[0].function.arguments) == {"a": 1}
    assert completion.choices[0].finish_reason == "tool_calls"
    usage = completion.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (10, 6, 16)
    assert completion.usage.prompt_tokens_details.cached_tokens == 4


def test_failed_generation_is_a_500():
    with pytest.raises(ApiError) as caught:
        openai_chat.ChatRenderer(model="m", request_id="x").whole([Finish("error")])
    assert caught.value.status == 500


def test_chunk_stream_is_valid_chunks_in_order():
    stream = openai_chat.ChatRenderer(model="m", request_id="abc", include_usage=True)
    chunks = [data for event in EVENTS for name, data in stream.feed(event)]
    parsed = [ChatCompletionChunk.model_validate(chunk) for chunk in chunks]
    assert [chunk["choices"][0]["delta"] if chunk["choices"] else None for chunk in chunks] == [
        {"role": "assistant", "content": ""}, {"reasoning_content": "think"}, {"content": "Hel"}, {"content": "lo"},
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                         "function": {"name": "get", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]},
        {}, None]
    assert parsed[-2].choices[0].finish_reason == "tool_calls"
    assert parsed[-1].usage.prompt_tokens_details.cached_tokens == 4
    assert {chunk.id for chunk in parsed} == {"chatcmpl-abc"}


def test_chunk_stream_error_event_when_generation_fails():
    stream = openai_chat.ChatRenderer(model="m", request_id="abc")
    events = stream.feed(TextDelta("a")) + stream.feed(Finish("error"))
    assert events[-1][1]["error"]["type"] == "server_error"


def test_config_sampling_defaults_fill_what_the_client_left_out():
    from conftest import server_config

    from strata.api.app import _with_sampling_defaults

    config = server_config(sampling={"temperature": 0.2, "top_k": 40, "seed": 5})
    body = {"messages": [{"role": "user", "content": "q"}], "temperature": 0.9}
    sampling = _with_sampling_defaults(openai_chat.parse_request(body), body, config).sampling
    assert (sampling.temperature, sampling.top_k, sampling.seed, sampling.top_p) == (0.9, 40, 5, 1.0)
