"""Generated token ids to events (`Output`), and tokens named for log-probabilities (`LogprobNames`), fed token by
token as the service feeds them."""

from __future__ import annotations

from typing import Any

from strata.events import ChatRequest, CompletionPrompt, Event, ReasoningDelta, TextDelta, TokenLogprob
from strata.text.families import QWEN3
from strata.text.output import LogprobNames, Output

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def feed(tokenizer: Any, request: ChatRequest, text: str, starts_in_reasoning: bool = False
         ) -> tuple[list[Event], Output]:
    output = Output(tokenizer, QWEN3, request, starts_in_reasoning)
    events: list[Event] = []
    for token in tokenizer.encode(text, special=True):
        events += output.push(token)
        if output.stopped:
            break
    return events + output.finish(), output


def merged(events: list[Event]) -> list[Event]:
    out: list[Event] = []
    for event in events:
        if out and type(event) is type(out[-1]) in (TextDelta, ReasoningDelta):
            out[-1] = type(event)(out[-1].text + event.text)  # type: ignore[union-attr]
        else:
            out.append(event)
    return out


def chat(**fields: Any) -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_reasoning_and_text_are_split(tokenizer):
    events, output = feed(tokenizer, chat(), "why</think>\n\nbecause", starts_in_reasoning=True)
    assert merged(events) == [ReasoningDelta("why"), TextDelta("because")]
    assert not output.in_reasoning and output.n_tool_calls == 0 and output.stop_sequence is None


def test_the_earliest_stop_string_ends_the_text(tokenizer):
    events, output = feed(tokenizer, chat(stop=["C", "B"]), "aaBbbCcc")
    assert merged(events) == [TextDelta("aa")]
    assert output.stopped and output.stop_sequence == "B"


def test_tool_calls_are_parsed_unless_the_choice_is_none(tokenizer):
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    _, output = feed(tokenizer, chat(tools=TOOLS), text)
    assert output.n_tool_calls == 1
    events, output = feed(tokenizer, chat(tools=TOOLS, tool_choice="none"), text)
    assert output.n_tool_calls == 0 and merged(events) == [TextDelta(text)]


def test_a_raw_completion_is_all_text(tokenizer):
    text = "<think>x</think>"
    events, output = feed(tokenizer, chat(completion=CompletionPrompt(text="p"), tools=TOOLS), text,
                          starts_in_reasoning=True)
    assert merged(events) == [TextDelta(text)] and not output.in_reasoning


def test_tokens_are_named_by_their_utf8_bytes():
    names = LogprobNames([b"a", "é".encode(), b"\xc3"])
    assert names.named(1) == ("é", (0xC3, 0xA9))
    assert names.named(2) == ("\ufffd", (0xC3,))  # half a character: its bytes are what counts
    assert names.named(7) == ("", ())  # past the vocabulary (a padded output row)
    assert names.logprob(0, (-0.25, [(0, -0.25), (1, -2.0)]), reasoning=True) == TokenLogprob(
        "a", (97,), -0.25, (("a", (97,), -0.25), ("é", (0xC3, 0xA9), -2.0)), True)


def test_an_echoed_prompt_starts_with_an_unscored_token():
    names = LogprobNames([b"a", b"b"])
    assert names.prompt_logprobs([1, 0], [(-1.0, [(0, -1.0)])]) == (
        TokenLogprob("b", (98,), None), TokenLogprob("a", (97,), -1.0, (("a", (97,), -1.0),)))
