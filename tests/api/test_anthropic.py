"""The Anthropic Messages dialect without HTTP: request translation and errors, and the rendered message and event
stream checked against the official `anthropic` client's own types and stream accumulator."""

from __future__ import annotations

import base64
import copy
import json
import random

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from pydantic import TypeAdapter

from strata.api import anthropic
from strata.api.errors import ApiError, anthropic_error_body
from strata.events import (
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallStart,
    Usage,
)

STREAM_EVENT = TypeAdapter(RawMessageStreamEvent)

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def body(**fields):
    return {"model": "strata", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}], **fields}


# --- requests

def test_a_tool_conversation_becomes_openai_chat_messages():
    request = anthropic.parse_request(body(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should ask the tool.", "signature": "opaque"},
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]},
                {"type": "text", "text": "And tomorrow?"},
            ]},
        ],
        tools=[WEATHER_TOOL],
    ))
    assert request.messages == [
        {"role": "system", "content": "Be brief.\n\nUse tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "I should ask the tool.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert request.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_TOOL["input_schema"]}}]
    assert request.route == "messages"


@pytest.mark.parametrize("system", [
    [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0.70.a1b; cc_entrypoint=cli; cch=8f3e2;"},
     {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}],
    "x-anthropic-billing-header: cc_version=1.0.70; cch=00aa1;\nYou are an agent.",
])
def test_the_billing_header_line_is_left_out_and_cache_control_is_accepted(system):
    request = anthropic.parse_request(body(system=system, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}]))
    assert request.messages[0] == {"role": "system", "content": "You are an agent."}


def test_text_before_a_tool_result_keeps_its_place():
    request = anthropic.parse_request(body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "first"},
        {"type": "tool_result", "tool_use_id": "t1", "content": "result"},
        {"type": "tool_result", "tool_use_id": "t2"},
    ]}]))
    assert request.messages == [
        {"role": "user", "content": "first"},
        {"role": "tool", "tool_call_id": "t1", "content": "result"},
        {"role": "tool", "tool_call_id": "t2", "content": ""},
    ]


def test_generation_settings():
    request = anthropic.parse_request(body(
        max_tokens=100, stop_sequences=["END", "\n\n"], temperature=0.25, top_p=0.9, top_k=40,
        metadata={"user_id": "u"}, stream=True,
    ))
    assert request.max_tokens == 100
    assert request.stop == ["END", "\n\n"]
    assert (request.sampling.temperature, request.sampling.top_p, request.sampling.top_k) == (0.25, 0.9, 40)


def test_server_sampling_defaults_fill_what_the_client_leaves_out():
    request = anthropic.parse_request(body(top_k=5), sampling_defaults={"temperature": 0.0, "top_k": 20})
    assert (request.sampling.temperature, request.sampling.top_k) == (0.0, 5)


@pytest.mark.parametrize(("thinking", "enabled"), [
    (None, False),
    ({"type": "enabled", "budget_tokens": 2048}, True),
    ({"type": "adaptive"}, True),
    ({"type": "disabled"}, False),
])
def test_thinking(thinking, enabled):
    fields = {} if thinking is None else {"thinking": thinking}
    assert anthropic.parse_request(body(**fields)).enable_thinking is enabled


@pytest.mark.parametrize(("choice", "expected"), [
    ({"type": "auto"}, "auto"),
    ({"type": "any"}, "required"),
    ({"type": "none"}, "none"),
    ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
])
def test_tool_choice(choice, expected):
    assert anthropic.parse_request(body(tools=[WEATHER_TOOL], tool_choice=choice)).tool_choice == expected


def test_count_tokens_request_needs_no_max_tokens():
    request_body = body()
    del request_body["max_tokens"]
    request = anthropic.parse_count_tokens_request(request_body)
    assert request.messages == anthropic.parse_request(body()).messages
    assert MessageTokensCount.model_validate(anthropic.render_count(17)).input_tokens == 17


def _without(key):
    request_body = body()
    del request_body[key]
    return request_body


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


@pytest.mark.parametrize(("request_body", "param"), [
    ([], "body"),
    (_without("max_tokens"), "max_tokens"),
    (_without("model"), "model"),
    (_without("messages"), "messages"),
    (body(max_tokens="64"), "max_tokens"),
    (body(max_tokens=True), "max_tokens"),
    (body(max_tokens=0), "max_tokens"),
    (body(messages=[]), "messages"),
    (body(messages=[{"role": "system", "content": "x"}]), "messages[0].role"),
    (body(messages=[{"role": "user"}]), "messages[0].content"),
    (body(messages=[{"role": "user", "content": 3}]), "messages[0].content"),
    (body(messages=[{"role": "user", "content": [{"type": "video"}]}]), "messages[0].content[0].type"),
    (body(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages[0].content[0].text"),
    (body(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                       "input": "[]"}]}]), "messages[0].content[0].input"),
    (body(messages=[{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "@@"}}]}]), "messages[0].content[0].source.data"),
    (body(messages=[{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/tiff", "data": "AA=="}}]}]),
     "messages[0].content[0].source.media_type"),
    (body(messages=[{"role": "user", "content": [{"type": "image"}]}]), "messages[0].content[0].source"),
    (body(system=5), "system"),
    (body(system=[{"type": "image"}]), "system[0].type"),
    (body(temperature=1.5), "temperature"),
    (body(temperature="hot"), "temperature"),
    (body(top_k=-1), "top_k"),
    (body(stop_sequences="END"), "stop_sequences"),
    (body(stop_sequences=["END", 3]), "stop_sequences[1]"),
    (body(stream="yes"), "stream"),
    (body(tools=[{"name": "f"}]), "tools[0].input_schema"),
    (body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type"),
    (body(tools=[WEATHER_TOOL, WEATHER_TOOL]), "tools[1].name"),
    (body(tools=[WEATHER_TOOL], tool_choice={"type": "tool", "name": "nope"}), "tool_choice.name"),
    (body(tool_choice={"type": "sometimes"}), "tool_choice.type"),
    (body(thinking={"type": "enabled"}), "thinking.budget_tokens"),
    (body(thinking={"type": "on"}), "thinking.type"),
])
def test_bad_requests_name_the_field(request_body, param):
    with pytest.raises(ApiError) as caught:
        anthropic.parse_request(request_body)
    assert (caught.value.status, caught.value.param) == (400, param)
    assert param in caught.value.message
    ErrorResponse.model_validate(anthropic_error_body(caught.value))


def test_pictures_become_image_parts_in_place():
    url_image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    request = anthropic.parse_request(body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "Look:"}, IMAGE,
        {"type": "tool_result", "tool_use_id": "t", "content": [url_image]}]}]))
    user, tool = request.messages
    assert [part["type"] for part in user["content"]] == ["text", "text", "image"]
    picture = user["content"][2]["image"]
    assert picture.data == base64.b64decode(IMAGE["source"]["data"]) and not picture.in_tool_result
    assert picture.param == "messages[0].content[1].source.data"
    shown = tool["content"][0]["image"]
    assert (shown.url, shown.in_tool_result) == ("https://example.com/a.png", True)


# --- responses

TOOL_TURN = [
    ReasoningDelta("The user wants "), ReasoningDelta("the weather."),
    TextDelta("Checking"), TextDelta(" now."),
    ToolCallStart(0, "call_a", "get_weather"),
    ToolCallArgumentsDelta(0, '{"city": '), ToolCallArgumentsDelta(0, '"Paris"}'),
    ToolCallStart(1, "call_b", "get_weather"),
    ToolCallArgumentsDelta(1, '{"city": "Rome"}'),
    Usage(prompt_tokens=120, cached_tokens=100, completion_tokens=31),
    Finish("tool_calls"),
]


def test_rendered_message_matches_the_client_type():
    message = Message.model_validate(anthropic.MessageRenderer(model="strata", request_id="abc").whole(TOOL_TURN))
    assert message.id == "msg_abc"
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert message.content[0].thinking == "The user wants the weather."
    assert message.content[1].text == "Checking now."
    assert (message.content[2].id, message.content[2].input) == ("call_a", {"city": "Paris"})
    assert (message.content[3].id, message.content[3].input) == ("call_b", {"city": "Rome"})
    assert message.stop_reason == "tool_use"
    # Anthropic counts cache reads apart from the other input tokens.
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens) == (20, 100)
    assert message.usage.output_tokens == 31


@pytest.mark.parametrize(("reason", "stop_reason"), [
    ("stop", "end_turn"), ("length", "max_tokens"), ("tool_calls", "tool_use"),
])
def test_stop_reasons(reason, stop_reason):
    events = [TextDelta("x"), Usage(3, 0, 1), Finish(reason)]
    message = anthropic.MessageRenderer(model="m", request_id="r").whole(events)
    assert message["stop_reason"] == stop_reason
    assert message["usage"]["input_tokens"] == 3


@pytest.mark.parametrize(("reason", "status"), [("error", 500), ("cancel", 503)])
def test_a_generation_that_did_not_finish_is_an_error(reason, status):
    with pytest.raises(ApiError) as caught:
        anthropic.MessageRenderer(model="m", request_id="r").whole([TextDelta("x"), Finish(reason)])
    assert caught.value.status == status


def _stream(events, **kwargs):
    stream = anthropic.MessageRenderer(model="strata", request_id="abc", **kwargs)
    out = stream.start()
    for event in events:
        out += stream.feed(event)
    return out


def _accumulate(sse_events):
    """The message the official client builds from a stream; every event must parse as the client's type."""
    snapshot, json_bufs = None, {}
    for name, data in sse_events:
        assert data["type"] == name
        if name == "ping":
            continue
        event = STREAM_EVENT.validate_python(data)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=json_bufs)
    return snapshot


def test_stream_sequence():
    names = [name for name, _ in _stream(TOOL_TURN)]
    block = ["content_block_start", "content_block_delta", "content_block_delta", "content_block_stop"]
    assert names == (["message_start", "ping"] + block * 3
                     + ["content_block_start", "content_block_delta", "content_block_stop"]
                     + ["message_delta", "message_stop"])


@pytest.mark.parametrize("reason", ["stop", "length", "tool_calls"])
def test_stream_accumulates_to_the_rendered_message(reason):
    events = [*TOOL_TURN[:-1], Finish(reason)]
    streamed = _accumulate(_stream(events))
    rendered = Message.model_validate(anthropic.MessageRenderer(model="strata", request_id="abc").whole(events))
    assert streamed.model_dump(exclude_none=True) == rendered.model_dump(exclude_none=True)


def test_stream_of_randomly_split_deltas():
    rng = random.Random(0)
    text = "Hello, wörld! 你好 " * 5
    reasoning = "step by step " * 4
    arguments = json.dumps({"city": "Zürich", "days": [1, 2, 3]})
    events = [*_split(ReasoningDelta, reasoning, rng), *_split(TextDelta, text, rng),
              ToolCallStart(0, "call_z", "get_weather"),
              *(ToolCallArgumentsDelta(0, piece.text) for piece in _split(TextDelta, arguments, rng)),
              Usage(10, 0, 50), Finish("tool_calls")]
    message = _accumulate(_stream(events))
    assert message.content[0].thinking == reasoning
    assert message.content[1].text == text
    assert message.content[2].input == {"city": "Zürich", "days": [1, 2, 3]}


def _split(kind, text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), 5))
    return [kind(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_stream_of_an_empty_answer():
    message = _accumulate(_stream([Usage(5, 0, 1), Finish("stop")]))
    assert (message.content, message.stop_reason, message.usage.input_tokens) == ([], "end_turn", 5)


def test_stream_without_explicit_start_opens_by_itself():
    stream = anthropic.MessageRenderer(model="m", request_id="r")
    first = stream.feed(TextDelta("a"))
    assert [name for name, _ in first] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert stream.start() == []


def test_a_failed_stream_ends_with_an_error_event():
    out = _stream([TextDelta("partial"), Finish("error")])
    assert [name for name, _ in out[-2:]] == ["content_block_stop", "error"]
    ErrorResponse.model_validate(out[-1][1])


def test_stream_events_are_fresh_objects():
    # The server may serialise events later; none may change afterwards.
    stream = anthropic.MessageRenderer(model="m", request_id="r")
    first = stream.feed(TextDelta("a"))
    snapshot = copy.deepcopy(first)
    stream.feed(TextDelta("b"))
    stream.feed(Finish("stop"))
    assert first == snapshot
