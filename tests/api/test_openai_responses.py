"""The OpenAI Responses dialect without HTTP: request translation and errors, and the rendered response and event
stream checked against the official `openai` client's own types and stream state machine."""

from __future__ import annotations

import json
import random

import pytest
from openai._types import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from strata.api import openai_responses
from strata.api.errors import ApiError, openai_error_body
from strata.events import (
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallStart,
    Usage,
)

STREAM_EVENT = TypeAdapter(ResponseStreamEvent)

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def body(**fields):
    return {"model": "strata", "input": "Hi", **fields}


# --- requests

def test_a_string_input_is_one_user_message():
    request = openai_responses.parse_request(body(instructions="Be brief."))
    assert request.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert request.route == "responses"


def test_input_items_become_openai_chat_messages():
    request = openai_responses.parse_request(body(
        input=[
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                             {"type": "input_text", "text": "Paris?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "Ask the tool."}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
            {"type": "function_call_output", "call_id": "call_2",
             "output": [{"type": "input_text", "text": "21 C"}]},
        ],
        tools=[WEATHER_TOOL],
    ))
    assert request.messages == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Ask the tool.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "21 C"},
    ]
    # strict unless the tool says otherwise: the Responses API's default
    assert request.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_TOOL["parameters"],
        "strict": True}}]


def test_reasoning_starts_a_new_assistant_message():
    request = openai_responses.parse_request(body(input=[
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a1"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
        {"role": "assistant", "content": "a2"},
    ]))
    assert request.messages[1:] == [{"role": "assistant", "content": "a1"},
                                    {"role": "assistant", "content": "a2", "reasoning_content": "think"}]


def test_generation_settings():
    request = openai_responses.parse_request(body(max_output_tokens=50, temperature=1.5, top_p=0.5, stream=True,
                                                  store=False, metadata={"k": "v"}, parallel_tool_calls=False))
    assert request.max_tokens == 50
    assert (request.sampling.temperature, request.sampling.top_p) == (1.5, 0.5)


def test_server_sampling_defaults_fill_what_the_client_leaves_out():
    request = openai_responses.parse_request(body(top_p=0.5), sampling_defaults={"temperature": 0.0, "top_p": 0.9})
    assert (request.sampling.temperature, request.sampling.top_p) == (0.0, 0.5)


@pytest.mark.parametrize(("reasoning", "enabled"), [
    (None, True),
    ({"effort": "none"}, False),
    ({"effort": "minimal"}, False),
    ({"effort": "low"}, True),
    ({"effort": "high", "summary": "auto"}, True),
])
def test_reasoning_effort(reasoning, enabled):
    fields = {} if reasoning is None else {"reasoning": reasoning}
    assert openai_responses.parse_request(body(**fields)).enable_thinking is enabled


@pytest.mark.parametrize(("choice", "expected"), [
    ("auto", "auto"),
    ("none", "none"),
    ("required", "required"),
    ({"type": "function", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
])
def test_tool_choice(choice, expected):
    request = openai_responses.parse_request(body(tools=[WEATHER_TOOL], tool_choice=choice))
    assert request.tool_choice == expected


IMAGE = {"type": "input_image", "image_url": "https://example.com/cat.png", "detail": "auto"}


@pytest.mark.parametrize(("request_body", "param"), [
    ("text", "body"),
    ({"model": "strata"}, "input"),
    ({"input": "hi"}, "model"),
    (body(input=5), "input"),
    (body(input=[]), "input"),
    (body(input=["hi"]), "input[0]"),
    (body(input=[{"role": "tool", "content": "x"}]), "input[0].role"),
    (body(input=[{"role": "user"}]), "input[0].content"),
    (body(input=[{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]), "input[0].content[0].type"),
    (body(input=[{"role": "user", "content": [{"type": "input_text"}]}]), "input[0].content[0].text"),
    (body(input=[{"role": "user", "content": [{"type": "input_image", "detail": "auto"}]}]),
     "input[0].content[0].file_id"),
    (body(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]), "input[0].content[0]"),
    (body(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]), "input[0].arguments"),
    (body(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]), "input[0].arguments"),
    (body(input=[{"type": "function_call_output", "output": "x"}]), "input[0].call_id"),
    (body(input=[{"type": "item_reference", "id": "msg_1"}]), "input[0]"),
    (body(input=[{"type": "web_search_call", "id": "ws"}]), "input[0].type"),
    (body(previous_response_id="resp_1"), "previous_response_id"),
    (body(conversation="conv_1"), "conversation"),
    (body(store=True), "store"),
    (body(background=True), "background"),
    (body(instructions=["x"]), "instructions"),
    (body(tools=[{"type": "web_search"}]), "tools[0].type"),
    (body(tools=[{"type": "function"}]), "tools[0].name"),
    (body(tools=[WEATHER_TOOL, WEATHER_TOOL]), "tools[1].name"),
    (body(tool_choice="sometimes"), "tool_choice"),
    (body(tools=[WEATHER_TOOL], tool_choice={"type": "function", "name": "nope"}), "tool_choice.name"),
    (body(tool_choice={"type": "web_search"}), "tool_choice.type"),
    (body(reasoning={"effort": "extreme"}), "reasoning.effort"),
    (body(max_output_tokens=0), "max_output_tokens"),
    (body(temperature=2.5), "temperature"),
    (body(top_p=False), "top_p"),
    (body(text={"format": {"type": "json_schema"}}), "text.format.schema"),
    (body(text={"format": {"type": "sound"}}), "text.format.type"),
    (body(stream=1), "stream"),
])
def test_bad_requests_name_the_field(request_body, param):
    with pytest.raises(ApiError) as caught:
        openai_responses.parse_request(request_body)
    assert (caught.value.status, caught.value.param) == (400, param)
    assert param in caught.value.message
    assert openai_error_body(caught.value)["error"]["param"] == param


def test_pictures_become_image_parts_in_place():
    request = openai_responses.parse_request(body(input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Look:"}, IMAGE]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": [IMAGE]}]))
    user, _, tool = request.messages
    assert user["content"][0] == {"type": "text", "text": "Look:"}
    assert (user["content"][1]["image"].url, user["content"][1]["image"].in_tool_result) == (IMAGE["image_url"], False)
    assert tool["content"][0]["image"].in_tool_result


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


def _request():
    return openai_responses.parse_request(body(tools=[WEATHER_TOOL], temperature=0.5, max_output_tokens=99))


def test_rendered_response_matches_the_client_type():
    response = Response.model_validate(openai_responses.ResponseRenderer(
        model="strata", request_id="abc", request=_request()).whole(TOOL_TURN))
    assert (response.id, response.status, response.model) == ("resp_abc", "completed", "strata")
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call", "function_call"]
    assert response.output[0].content[0].text == "The user wants the weather."
    assert response.output_text == "Checking now."
    calls = [(item.call_id, item.name, json.loads(item.arguments)) for item in response.output[2:]]
    assert calls == [("call_a", "get_weather", {"city": "Paris"}), ("call_b", "get_weather", {"city": "Rome"})]
    assert len({item.id for item in response.output}) == 4
    usage = response.usage
    assert (usage.input_tokens, usage.input_tokens_details.cached_tokens) == (120, 100)
    assert (usage.output_tokens, usage.total_tokens) == (31, 151)
    assert (response.temperature, response.max_output_tokens, response.tools[0].name) == (0.5, 99, "get_weather")


def test_a_cut_answer_is_incomplete():
    response = Response.model_validate(openai_responses.ResponseRenderer(
        model="m", request_id="r").whole([TextDelta("abc"), Usage(3, 0, 1), Finish("length")]))
    assert (response.status, response.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert response.usage.input_tokens == 3
    assert response.output[0].status == "incomplete"


def _stream(events, request=None):
    stream = openai_responses.ResponseRenderer(model="strata", request_id="abc", request=request)
    out = stream.start()
    for event in events:
        out += stream.feed(event)
    return out


def _replay(sse_events):
    """Feed a stream through the official client's state machine; every event must parse as the client's type."""
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for name, data in sse_events:
        assert data["type"] == name
        state.handle_event(STREAM_EVENT.validate_python(data))
    return state


def test_stream_sequence():
    sse_events = _stream(TOOL_TURN)
    assert [data["sequence_number"] for _, data in sse_events] == list(range(len(sse_events)))
    text_item = ["response.output_item.added", "response.content_part.added"]
    assert [name for name, _ in sse_events] == [
        "response.created", "response.in_progress",
        *text_item, "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        *text_item, "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]


def test_stream_completes_to_the_rendered_response():
    request = _request()
    state = _replay(_stream(TOOL_TURN, request))
    rendered = Response.model_validate(openai_responses.ResponseRenderer(
        model="strata", request_id="abc", request=request).whole(TOOL_TURN))
    streamed = state._completed_response
    assert streamed is not None
    assert [item.model_dump(exclude_none=True) for item in streamed.output] == \
        [item.model_dump(exclude_none=True) for item in rendered.output]
    assert streamed.usage == rendered.usage


@pytest.mark.parametrize("reason", ["stop", "length", "tool_calls"])
def test_the_last_stream_event_holds_the_rendered_response(reason):
    events = [*TOOL_TURN[:-1], Finish(reason)]
    last = _stream(events)[-1][1]["response"]
    rendered = openai_responses.ResponseRenderer(model="strata", request_id="abc").whole(events)
    assert {**last, "created_at": 0} == {**rendered, "created_at": 0}


def test_stream_of_randomly_split_deltas():
    rng = random.Random(0)
    text = "Hello, wörld! 你好 " * 5
    arguments = json.dumps({"city": "Zürich", "days": [1, 2, 3]})
    events = [*_split(TextDelta, text, rng), ToolCallStart(0, "call_z", "get_weather"),
              *(ToolCallArgumentsDelta(0, piece.text) for piece in _split(TextDelta, arguments, rng)),
              Usage(10, 0, 50), Finish("tool_calls")]
    response = _replay(_stream(events))._completed_response
    assert response.output_text == text
    assert json.loads(response.output[1].arguments) == {"city": "Zürich", "days": [1, 2, 3]}


def _split(kind, text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), 5))
    return [kind(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_a_stream_cut_by_the_token_limit_ends_incomplete():
    sse_events = _stream([TextDelta("abc"), Usage(3, 0, 1), Finish("length")])
    name, data = sse_events[-1]
    assert (name, data["response"]["status"]) == ("response.incomplete", "incomplete")
    item = _replay(sse_events)._completed_output[0]
    assert (item.status, item.content[0].text) == ("incomplete", "abc")


def test_a_failed_stream_ends_with_response_failed():
    sse_events = _stream([TextDelta("abc"), Finish("error")])
    name, data = sse_events[-1]
    assert (name, data["response"]["status"], data["response"]["error"]["code"]) == \
        ("response.failed", "failed", "server_error")
    _replay(sse_events)


def test_an_error_event_mid_stream():
    stream = openai_responses.ResponseRenderer(model="m", request_id="r")
    sse_events = stream.feed(TextDelta("a")) + stream.error(ApiError(503, "shutting down", kind="server_error"))
    _replay(sse_events)
    assert sse_events[-1][1]["message"] == "shutting down"
