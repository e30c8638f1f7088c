"""Streaming reasoning / tool-call parsing and stop strings, fed whole, one character at a time and in random
chunks: the events must say the same thing however the text was split."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable

import pytest

from strata.events import Event, ReasoningDelta, TextDelta, ToolCallArgumentsDelta, ToolCallStart
from strata.text.families import QWEN3
from strata.text.toolcalls import StopMatcher, ToolCallParser

WEATHER_ARGS = '{"city": "Zürich", "days": [1, 2], "opts": {"unit": "°C", "note": "a \\"}\\" </tool_call> b"}}'

# (model text, parser options, expected events with ids left out and deltas of one kind merged)
CASES = [
    ("Just text, with a < sign and <b>tags</b>.", {}, [TextDelta("Just text, with a < sign and <b>tags</b>.")]),
    (
        "<think>\nFirst, the weather.\n</think>\n\nLet me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": ' + WEATHER_ARGS + "}\n</tool_call>",
        {},
        [ReasoningDelta("First, the weather."), TextDelta("Let me check."),
         ToolCallStart(0, "", "get_weather"), ToolCallArgumentsDelta(0, WEATHER_ARGS)],
    ),
    (
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": '
        '{"x": null}}\n</tool_call>',
        {},
        [ToolCallStart(0, "", "a"), ToolCallArgumentsDelta(0, "{}"),
         ToolCallStart(1, "", "b"), ToolCallArgumentsDelta(1, '{"x": null}')],
    ),
    (
        "The answer is 4.\n</think>\n\nFour.",
        {"starts_in_reasoning": True},
        [ReasoningDelta("The answer is 4."), TextDelta("Four.")],
    ),
    (
        # keys in the other order: parsed whole at the closing tag
        '<tool_call>\n{"arguments": {"q": "x"}, "name": "search"}\n</tool_call>',
        {},
        [ToolCallStart(0, "", "search"), ToolCallArgumentsDelta(0, '{"q": "x"}')],
    ),
    (
        # arguments as a JSON string: parsed whole
        '<tool_call>\n{"name": "search", "arguments": "{\\"q\\": 1}"}\n</tool_call>',
        {},
        [ToolCallStart(0, "", "search"), ToolCallArgumentsDelta(0, '{"q": 1}')],
    ),
    (
        "Oops <tool_call>\n{not json}\n</tool_call> and on.",
        {},
        [TextDelta("Oops <tool_call>\n{not json}\n</tool_call> and on.")],
    ),
    (
        # the model stopped before the header was complete: the raw text comes back
        '<tool_call>\n{"name": "get_wea',
        {},
        [TextDelta('<tool_call>\n{"name": "get_wea')],
    ),
    (
        # the model stopped inside the arguments: the call keeps what streamed
        '<tool_call>\n{"name": "write", "arguments": {"text": "abc',
        {},
        [ToolCallStart(0, "", "write"), ToolCallArgumentsDelta(0, '{"text": "abc')],
    ),
    (
        'Text <tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>',
        {"parse_tool_calls": False},
        [TextDelta('Text <tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>')],
    ),
    (
        "<think>\n\n</think>\n\nNo thoughts, a partial tag at the end: </thi",
        {},
        [TextDelta("No thoughts, a partial tag at the end: </thi")],
    ),
    ("Unfinished thought <thin", {}, [TextDelta("Unfinished thought <thin")]),
    ("<think>cut off in the middle\n", {}, [ReasoningDelta("cut off in the middle\n")]),
]


def run_parser(chunks: Iterable[str], **options: bool) -> list[Event]:
    parser = ToolCallParser(QWEN3, **options)
    events: list[Event] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return events + parser.finish()


def merged(events: list[Event]) -> list[Event]:
    """Ids blanked, consecutive deltas of the same kind (and call) joined."""
    out: list[Event] = []
    for event in events:
        if isinstance(event, ToolCallStart):
            event = ToolCallStart(event.index, "", event.name)
        previous = out[-1] if out else None
        if isinstance(event, (TextDelta, ReasoningDelta)) and type(previous) is type(event):
            out[-1] = type(event)(previous.text + event.text)
        elif isinstance(event, ToolCallArgumentsDelta) and isinstance(previous, ToolCallArgumentsDelta) \
                and previous.index == event.index:
            out[-1] = ToolCallArgumentsDelta(event.index, previous.text + event.text)
        else:
            out.append(event)
    return out


def random_chunks(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    chunks, at = [], 0
    while at < len(text):
        size = rng.randint(1, 8)
        chunks.append(text[at:at + size])
        at += size
    return chunks


@pytest.mark.parametrize(("text", "options", "expected"), CASES)
def test_events_whole_and_char_by_char(text: str, options: dict, expected: list[Event]) -> None:
    assert merged(run_parser([text], **options)) == expected
    assert merged(run_parser(list(text), **options)) == expected
    for seed in range(20):
        assert merged(run_parser(random_chunks(text, seed), **options)) == expected


@pytest.mark.parametrize(("text", "options", "expected"), CASES)
def test_events_split_at_every_position(text: str, options: dict, expected: list[Event]) -> None:
    for at in range(len(text) + 1):
        assert merged(run_parser([text[:at], text[at:]], **options)) == expected, at


def test_streamed_arguments_are_the_models_json_text() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER_ARGS + "}\n</tool_call>"
    events = run_parser(list(text))
    pieces = [event.text for event in events if isinstance(event, ToolCallArgumentsDelta)]
    assert len(pieces) > 1
    assert json.loads("".join(pieces)) == json.loads(WEATHER_ARGS)


def test_the_call_starts_as_soon_as_its_name_is_known() -> None:
    parser = ToolCallParser(QWEN3)
    assert parser.feed('<tool_call>\n{"name": "get_weather", "argu') == []
    events = parser.feed('ments": {"ci')
    assert [type(event) for event in events] == [ToolCallStart, ToolCallArgumentsDelta]
    assert events[0].name == "get_weather" and events[1].text == '{"ci'
    assert parser.n_tool_calls == 1


def test_partial_tags_are_held_back() -> None:
    parser = ToolCallParser(QWEN3)
    assert parser.feed("Hello <tool") == [TextDelta("Hello ")]
    assert parser.feed("box>") == [TextDelta("<toolbox>")]
    assert parser.feed("\n\n") == []  # newlines might come right before a tag
    assert parser.feed("<thi") == []
    assert parser.feed("nk>\nhm") == [ReasoningDelta("hm")]


def test_call_ids_are_unique_and_well_formed() -> None:
    text = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>' * 3
    ids = [event.id for event in run_parser([text]) if isinstance(event, ToolCallStart)]
    assert len(set(ids)) == 3
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", call_id) for call_id in ids)


def reference_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    positions = [text.find(stop) for stop in stops if stop in text]
    return (text[:min(positions)], True) if positions else (text, False)


STOP_CASES = [
    ("Hello, world! Bye.", ["world"]),
    ("Hello, wor", ["world"]),
    ("xabcd", ["abc", "b"]),
    ("aaab", ["aab"]),
    ("no stop here", ["STOP", "\n\n"]),
    ("one\n\ntwo", ["STOP", "\n\n"]),
    ("ends with a partial STO", ["STOP"]),
]


@pytest.mark.parametrize(("text", "stops"), STOP_CASES)
def test_stop_strings_however_split(text: str, stops: list[str]) -> None:
    expected = reference_cut(text, stops)
    splits = [[text], list(text)] + [random_chunks(text, seed) for seed in range(10)]
    splits += [[text[:at], text[at:]] for at in range(len(text) + 1)]
    for chunks in splits:
        matcher = StopMatcher(stops)
        out = "".join(matcher.feed(chunk) for chunk in chunks)
        out += matcher.flush()
        assert (out, matcher.stopped) == expected, chunks


def test_stop_text_that_could_start_a_stop_is_held_back() -> None:
    matcher = StopMatcher(["world"])
    assert matcher.feed("Hello, wor") == "Hello, "
    assert matcher.feed("ld!") == ""
    assert matcher.stopped
    assert matcher.feed("more") == "" and matcher.flush() == ""


def test_no_stops_passes_text_through() -> None:
    matcher = StopMatcher(["", ""])
    assert matcher.feed("anything") == "anything"
    assert not matcher.stopped
