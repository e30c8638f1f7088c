"""The renderer skeleton: each event kind reaches its own method, and every dialect's whole answer is the fold of
the stream a streaming client gets."""

from __future__ import annotations

import random
from typing import Any

import pytest

from strata.api import anthropic, openai_chat, openai_completions, openai_responses
from strata.api.errors import ApiError
from strata.api.render import Renderer, SseEvent, _joined
from strata.events import (
    Event,
    Finish,
    McpToolList,
    PromptLogprobs,
    PromptProcessed,
    ReasoningDelta,
    TextDelta,
    TokenLogprob,
    ToolCallArgumentsDelta,
    ToolCallStart,
    ToolResult,
    Usage,
)


def _records(name: str) -> Any:
    """A renderer method whose one SSE event is named `name`."""
    return lambda self, event: [(name, {})]


class Recorder(Renderer):
    """Names the method each event reaches."""

    def on_start(self, first: Event | None) -> list[SseEvent]:
        return [("start", {})]

    def fold(self, stream: Any) -> dict[str, Any]:
        return {"names": [name for name, _ in stream]}

    def on_error(self, error: ApiError) -> list[SseEvent]:
        return [("error", {})]

    on_text = _records("text")
    on_reasoning = _records("reasoning")
    on_tool_call = _records("tool_call")
    on_tool_arguments = _records("tool_arguments")
    on_logprob = _records("logprob")
    on_prompt_logprobs = _records("prompt_logprobs")
    on_prompt = _records("prompt")
    on_tool_list = _records("tool_list")
    on_tool_result = _records("tool_result")
    on_usage = _records("usage")
    on_finish = _records("finish")


def logprob(text: str, reasoning: bool = False) -> TokenLogprob:
    return TokenLogprob(text, tuple(text.encode()), -0.5, ((text, tuple(text.encode()), -0.5),), reasoning)


def test_each_event_kind_reaches_its_own_method():
    events = [PromptProcessed(3, 0), PromptLogprobs((logprob("p"),)), McpToolList("s", ()), logprob("a"),
              TextDelta("a"), ReasoningDelta("r"), ToolCallStart(0, "c", "f", "s"), ToolCallArgumentsDelta(0, "{}"),
              ToolResult(0, "c", "out"), Usage(3, 0, 2), Finish("stop")]
    recorder = Recorder()
    assert [name for event in events for name, _ in recorder.feed(event)] == [
        "start", "prompt", "prompt_logprobs", "tool_list", "logprob", "text", "reasoning", "tool_call",
        "tool_arguments", "tool_result", "usage", "finish"]
    assert recorder.start() == []


def test_a_generation_without_its_finish_failed():
    assert Recorder().whole([TextDelta("a")]) == {"names": ["start", "text", "finish"]}
    with pytest.raises(ApiError) as caught:
        openai_chat.ChatRenderer(model="m", request_id="r").whole([TextDelta("a")])
    assert caught.value.status == 500


def test_runs_of_text_join_around_their_logprobs():
    a, b, c = logprob("a"), logprob("b"), logprob("c")
    events = [TextDelta("echo"), a, TextDelta("a"), b, TextDelta(""), TextDelta("b"), c, TextDelta(""),
              ReasoningDelta("r1"), ReasoningDelta("r2"), Usage(1, 0, 3), TextDelta("x"), TextDelta("y")]
    # c had no text yet: it still waits for the next text, after the joined delta.
    assert _joined(events) == [TextDelta("echo"), a, b, TextDelta("ab"), c, ReasoningDelta("r1r2"),
                               Usage(1, 0, 3), TextDelta("xy")]


def _split(kind: type[TextDelta] | type[ReasoningDelta], text: str, rng: random.Random,
           logprobs: bool = False) -> list[Event]:
    cuts = sorted(rng.sample(range(1, len(text)), 6))
    out: list[Event] = []
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        if logprobs:
            out.append(logprob(text[start:end], reasoning=kind is ReasoningDelta))
        out.append(kind(text[start:end]))
    return out


def _answer(rng: random.Random, logprobs: bool, tools: bool) -> list[Event]:
    events: list[Event] = [PromptProcessed(40, 8), *_split(ReasoningDelta, "first this, then that", rng, logprobs),
                           *_split(TextDelta, "Hello, wörld! 你好", rng, logprobs)]
    if tools:
        events += [ToolCallStart(0, "call_a", "get"), ToolCallArgumentsDelta(0, '{"city": '),
                   ToolCallArgumentsDelta(0, '"Paris"}')]
    return [*events, Usage(40, 8, 30, 12), Finish("tool_calls" if tools else "stop")]


DIALECTS = {
    "chat": lambda: openai_chat.ChatRenderer(model="m", request_id="r", include_usage=True),
    "completions": lambda: openai_completions.CompletionRenderer(model="m", request_id="r", include_usage=True),
    "messages": lambda: anthropic.MessageRenderer(model="m", request_id="r"),
    "responses": lambda: openai_responses.ResponseRenderer(model="m", request_id="r"),
}


@pytest.mark.parametrize("logprobs", [False, True])
@pytest.mark.parametrize("dialect", DIALECTS)
def test_the_whole_answer_is_the_fold_of_the_stream_a_client_gets(dialect, logprobs, monkeypatch):
    monkeypatch.setattr("time.time", lambda: 1e9)
    events = _answer(random.Random(7), logprobs, tools=dialect != "completions")
    streamed = DIALECTS[dialect]()
    stream = [sse for event in events for sse in streamed.feed(event)]
    assert streamed.fold(stream) == DIALECTS[dialect]().whole(events)
