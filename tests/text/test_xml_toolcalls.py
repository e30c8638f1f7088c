"""Qwen3.5/3.6's XML tool calls: the family is chosen from the chat template, the streamed parser reads calls
however the text is split (values typed by the tools' schemas), and the grammar of a forced or strict call writes
the XML syntax with values that follow the schema (sampled from random logits, so valid by construction)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import jsonschema
import llguidance
import pytest
from test_constraints import run
from test_toolcalls import merged, random_chunks

from strata.events import Event, ReasoningDelta, TextDelta, ToolCallArgumentsDelta, ToolCallStart
from strata.text.constraints import AnswerFormat, GrammarError, Grammars, plan_constraint
from strata.text.families import QWEN3, QWEN35, family_of
from strata.text.xml_toolcalls import parameter_value

TEMPLATE = pathlib.Path(__file__).resolve().parents[2] / ".cache/llama.cpp-0.3.36/models/templates/Qwen3.5-4B.jinja"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "opts": {"type": "object"}, "ok": {"type": "boolean"}},
           "required": ["city"]}
SCHEMAS = {"get_weather": WEATHER, "ping": {"type": "object", "properties": {}}}
CITY = 'Zürich "centre"\nline two </param> <tool_call>'

# (model text, expected events with ids left out and deltas of one kind merged)
CASES = [
    ("Plain text with <b>tags</b> and a < sign.", [TextDelta("Plain text with <b>tags</b> and a < sign.")]),
    (
        "<think>\nFirst the weather.\n</think>\n\nLet me check.\n<tool_call>\n<function=get_weather>\n"
        f"<parameter=city>\n{CITY}\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=opts>\n"
        '{"unit": "°C", "hours": [1, 2]}\n</parameter>\n<parameter=ok>\nTrue\n</parameter>\n</function>\n'
        "</tool_call>",
        [ReasoningDelta("First the weather."), TextDelta("Let me check."), ToolCallStart(0, "", "get_weather"),
         ToolCallArgumentsDelta(0, json.dumps({"city": CITY, "days": 3, "opts": {"unit": "°C", "hours": [1, 2]},
                                               "ok": True}, ensure_ascii=False))],
    ),
    (
        "<tool_call>\n<function=ping>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nOslo\n</parameter>\n<parameter=days>\nmany\n</parameter>\n</function>\n</tool_call>",
        [ToolCallStart(0, "", "ping"), ToolCallArgumentsDelta(0, "{}"), ToolCallStart(1, "", "get_weather"),
         ToolCallArgumentsDelta(1, '{"city": "Oslo", "days": "many"}')],
    ),
    # A call to a tool that was not declared is text; so is a body that is no call.
    ("<tool_call>\n<function=rm>\n<parameter=path>\n/\n</parameter>\n</function>\n</tool_call>",
     [TextDelta("<tool_call>\n<function=rm>\n<parameter=path>\n/\n</parameter>\n</function>\n</tool_call>")]),
    ("<tool_call>\nnot a call\n</tool_call>", [TextDelta("<tool_call>\nnot a call\n</tool_call>")]),
    # The Hermes JSON form, which a model may still write, is read too.
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
     [ToolCallStart(0, "", "get_weather"), ToolCallArgumentsDelta(0, '{"city": "Rome"}')]),
    # Stopped inside a value: the arguments close with what came.
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nLim", [
        ToolCallStart(0, "", "get_weather"), ToolCallArgumentsDelta(0, '{"city": "Lim"}')]),
    ("<tool_call>\n<function=get_weather>\n<parameter=days>\n12\n</param", [
        ToolCallStart(0, "", "get_weather"), ToolCallArgumentsDelta(0, '{"days": 12}')]),
    ("<tool_call>\n<function=get_weather>\n<parameter=days>\n", [
        ToolCallStart(0, "", "get_weather"), ToolCallArgumentsDelta(0, '{"days": ""}')]),
]


def run_parser(chunks: list[str]) -> list[Event]:
    parser = QWEN35.stream_parser(tools=SCHEMAS)
    events: list[Event] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return events + parser.finish()


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_calls_however_the_text_is_split(text: str, expected: list[Event]) -> None:
    assert merged(run_parser([text])) == expected
    assert merged(run_parser(list(text))) == expected
    for seed in range(10):
        assert merged(run_parser(random_chunks(text, seed))) == expected
    for at in range(len(text) + 1):
        assert merged(run_parser([text[:at], text[at:]])) == expected, at


def test_text_values_stream_as_they_come_and_the_rest_when_closed() -> None:
    parser = QWEN35.stream_parser(tools=SCHEMAS)
    events = parser.feed("<tool_call>\n<function=get_weather>\n")
    assert [type(event) for event in events] == [ToolCallStart, ToolCallArgumentsDelta]
    assert events[1].text == "{"
    assert [e.text for e in parser.feed("<parameter=city>\nSão Pau")] == ['"city": "', "São Pau"]
    assert [e.text for e in parser.feed("lo\n")] == ["lo"]  # the newline may be the format's
    assert [e.text for e in parser.feed("</parameter>\n<parameter=days>\n1")] == ['"', ', "days": ']
    assert [e.text for e in parser.feed("4\n</parameter>\n</function>\n</tool_call>")] == ["14", "}"]
    assert parser.finish() == [] and parser.n_tool_calls == 1


@pytest.mark.parametrize(("text", "schema", "value"), [
    ("3", {"type": "string"}, "3"), ("3", {"type": "integer"}, 3), ("2.5", {"type": "number"}, 2.5),
    ("true", {"type": "boolean"}, True), ("False", {"type": "boolean"}, False), ("[1, 2]", {"type": "array"}, [1, 2]),
    ('{"a": null}', {"type": "object"}, {"a": None}), ("null", {"type": ["integer", "null"]}, None),
    ("{not json", {"type": "object"}, "{not json"), ("null", {"type": "string"}, "null"),
    ("7", None, "7"), ("7", {"description": "no type"}, "7"), ('"a"', {"enum": ["a", "b"]}, "a"),
])
def test_values_are_read_by_their_schemas_type(text: str, schema: Any, value: Any) -> None:
    assert parameter_value(text, schema) == value


# --- which family


def test_the_qwen35_template_chooses_the_xml_family(tokenizer) -> None:
    if not TEMPLATE.is_file():
        pytest.skip("llama.cpp's Qwen3.5 chat template is not in .cache/ (run scripts/fetch-llama-cpp.sh)")
    assert family_of(tokenizer) is QWEN3
    assert family_of(tokenizer, TEMPLATE.read_text("utf-8")) is QWEN35
    assert family_of(dataclasses.replace(tokenizer, chat_template=TEMPLATE.read_text("utf-8"))) is QWEN35


# --- the grammar of a call


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:
    return Grammars(tokenizer, QWEN35, tokenizer.n_vocab)


TOOLS = [{"type": "function", "function": {"name": "set_light", "strict": True, "parameters": {
    "type": "object", "properties": {"room": {"type": "string", "enum": ["hall", "attic"]},
                                     "level": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "on": {"type": "boolean"},
                                     "rgb": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                        "maximum": 9}, "maxItems": 3}},
    "required": ["room", "level", "on"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]


def plan(grammars: Grammars, **fields: Any):
    options: dict[str, Any] = dict(answer_format=None, tools=TOOLS, tool_choice="required", parallel_tool_calls=True,
                                   thinking=False, in_reasoning=False)
    return plan_constraint(tokens=grammars.tokens, **{**options, **fields})


def calls_of(tokenizer, ids: list[int]) -> tuple[str, list[tuple[str, Any]]]:
    events = run_parser_with(tokenizer.decode(ids), {tool["function"]["name"]: tool["function"]["parameters"]
                                                     for tool in TOOLS})
    text = "".join(event.text for event in events if isinstance(event, TextDelta))
    starts = [event.name for event in events if isinstance(event, ToolCallStart)]
    arguments = ["".join(e.text for e in events if isinstance(e, ToolCallArgumentsDelta) and e.index == i)
                 for i in range(len(starts))]
    return text, [(name, json.loads(args)) for name, args in zip(starts, arguments, strict=True)]


def run_parser_with(text: str, tools: dict[str, Any]) -> list[Event]:
    parser = QWEN35.stream_parser(tools=tools)
    return parser.feed(text) + parser.finish()


@pytest.mark.parametrize("seed", range(3))
def test_a_forced_call_of_a_strict_tool_is_xml_in_its_schema(grammars, tokenizer, seed) -> None:
    choice = {"type": "function", "function": {"name": "set_light"}}
    ids = run(grammars, plan(grammars, tool_choice=choice, parallel_tool_calls=False), seed)
    written = tokenizer.decode(ids)
    assert written.startswith("<tool_call>\n<function=set_light>\n<parameter=room>\n")
    text, calls = calls_of(tokenizer, ids)
    assert text == "" and [name for name, _ in calls] == ["set_light"]
    jsonschema.validate(calls[0][1], TOOLS[0]["function"]["parameters"])


def matcher(grammars: Grammars, grammar: str, tokenizer, text: str) -> Any:
    """llguidance's matcher of `grammar` after the tokens of `text` (None when it refuses them)."""
    found = llguidance.LLMatcher(grammars.ll_tokenizer(), grammar, log_level=0)
    ids = tokenizer.encode(text, special=True)
    return found if found.try_consume_tokens(ids) == len(ids) and not found.is_error() else None


@pytest.mark.parametrize(("body", "accepted"), [
    ("<parameter=text>\nif a < b:\n    print('</param')\n\n</parameter>\n", True),
    ("<parameter=text>\n\n</parameter>\n", True),
    ("<parameter=text>\ntwo\n</parameter>\nvalues\n</parameter>\n", False),
    ("<parameter=title>\nx\n</parameter>\n", False),
    ("", False),
])
def test_a_text_value_is_any_text_without_its_closing_tag(grammars, tokenizer, body: str, accepted: bool) -> None:
    choice = {"type": "function", "function": {"name": "note"}}
    the_plan = plan(grammars, tool_choice=choice, parallel_tool_calls=False)
    found = matcher(grammars, the_plan.answer, tokenizer, f"<tool_call>\n<function=note>\n{body}</function>\n"
                                                          "</tool_call>")
    assert (found is not None and found.is_accepting()) is accepted


def test_strict_values_follow_their_types(grammars, tokenizer) -> None:
    the_plan = plan(grammars, tool_choice={"type": "function", "function": {"name": "set_light"}})
    head = "<tool_call>\n<function=set_light>\n<parameter=room>\nhall\n</parameter>\n<parameter=level>\n"
    assert matcher(grammars, the_plan.answer, tokenizer, head + "7\n</parameter>\n") is not None
    assert matcher(grammars, the_plan.answer, tokenizer, head + "seven") is None
    assert matcher(grammars, the_plan.answer, tokenizer, head.replace("hall", "cellar")) is None


def test_a_strict_text_parameter_with_a_pattern_is_refused_naming_it(grammars) -> None:
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "pattern": "^/"}}, "required": ["path"]}}}
    with pytest.raises(GrammarError) as refused:
        plan(grammars, tools=[tool])
    assert str(refused.value).startswith("tools[0].function.parameters.properties.path.pattern: ")
    assert refused.value.param == "tools[0].function.parameters"
    assert plan(grammars, tools=[{"type": "function", "function": {**tool["function"], "strict": False}}])
    uri = {"type": "object", "properties": {"url": {"type": "string", "format": "uri"}}, "required": ["url"]}
    assert plan(grammars, tools=[{"type": "function", "function": {"name": "f", "strict": True, "parameters": uri}}])


def test_auto_with_a_strict_tool_constrains_the_call_the_model_starts(grammars, tokenizer) -> None:
    call_open = grammars.tokens.call_open
    the_plan = plan(grammars, tools=TOOLS[:1], tool_choice="auto", parallel_tool_calls=False)
    assert the_plan.call is not None and "<function=set_light>" in the_plan.call
    ids = run(grammars, the_plan, 5, bias={call_open: 12.0, grammars.eos_ids[0]: 3.0})
    assert ids.count(call_open) == 1
    _, calls = calls_of(tokenizer, ids)
    assert [name for name, _ in calls] == ["set_light"]
    jsonschema.validate(calls[0][1], TOOLS[0]["function"]["parameters"])


def test_a_json_answer_or_an_xml_call(grammars, tokenizer) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 5}},
              "required": ["n"], "additionalProperties": False}
    the_plan = plan(grammars, tools=TOOLS[:1], tool_choice="auto",
                    answer_format=AnswerFormat("json_schema", json.dumps(schema)))
    for seed, bias in ((1, {grammars.tokens.call_open: 30.0}), (2, {grammars.tokens.call_open: -30.0})):
        ids = run(grammars, the_plan, seed, bias=bias)
        text, calls = calls_of(tokenizer, ids)
        if calls:
            assert text == "" and [name for name, _ in calls] == ["set_light"]
        else:
            jsonschema.validate(json.loads(text), schema)


# --- the template's own rendering, read back


TRICKY = ["Zürich", "a < b && c > d", "</param", "line one\nline two", "\nleading newline", "trailing newline\n",
          'quotes " and \\ backslash', "<tool_call> inside", "  spaces  ", "<parameter=x>", "", "😀 emoji"]
ROUND_TRIP = {"type": "object", "properties": {
    "text": {"type": "string"}, "count": {"type": "integer"}, "ratio": {"type": "number"}, "flag": {"type": "boolean"},
    "items": {"type": "array"}, "config": {"type": "object"}}}


def random_arguments(rng: Any) -> dict[str, Any]:
    values = {"text": rng.choice(TRICKY), "count": rng.randint(-5, 10**6), "ratio": rng.choice([0.5, -2.25, 1e-3]),
              "flag": rng.random() < 0.5, "items": [rng.choice(TRICKY), rng.randint(0, 9)],
              "config": {"path": rng.choice(TRICKY), "deep": {"n": [1, {"m": None}]}}}
    return {key: values[key] for key in rng.sample(sorted(values), rng.randint(0, len(values)))}


@pytest.mark.parametrize("seed", range(25))
def test_calls_the_template_renders_read_back_to_their_arguments(seed: int) -> None:
    import random

    from strata.text.prompt import render_chat

    if not TEMPLATE.is_file():
        pytest.skip("llama.cpp's Qwen3.5 chat template is not in .cache/ (run scripts/fetch-llama-cpp.sh)")
    rng = random.Random(seed)
    calls = [("tool_" + str(i), random_arguments(rng)) for i in range(rng.randint(1, 3))]
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": rng.choice(["", "Sure."]),
                "tool_calls": [{"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": args}}
                               for i, (name, args) in enumerate(calls)]}]
    rendered = render_chat(TEMPLATE.read_text("utf-8"), messages, add_generation_prompt=False)
    answer = rendered.rpartition("<|im_start|>assistant\n")[2].removesuffix("<|im_end|>\n")
    parser = QWEN35.stream_parser(tools={name: ROUND_TRIP for name, _ in calls})
    events: list[Event] = []
    for chunk in random_chunks(answer, seed):
        events += parser.feed(chunk)
    events += parser.finish()
    starts = [event.name for event in events if isinstance(event, ToolCallStart)]
    arguments = [json.loads("".join(e.text for e in events if isinstance(e, ToolCallArgumentsDelta) and e.index == i))
                 for i in range(len(starts))]
    assert list(zip(starts, arguments, strict=True)) == calls, answer
