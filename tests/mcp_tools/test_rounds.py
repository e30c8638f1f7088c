"""The rounds of a response, without a server or an engine: scripted rounds and a scripted toolset, and the exact
events that come out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

import pytest

from strata.activity import RequestProgress
from strata.events import (
    ChatRequest,
    Event,
    Finish,
    McpToolList,
    PromptProcessed,
    ReasoningDelta,
    TextDelta,
    TokenLogprob,
    ToolCallArgumentsDelta,
    ToolCallStart,
    ToolResult,
    Usage,
)
from strata.history import HistoryRow
from strata.mcp_tools import ToolOutput, run_rounds

WEB = McpToolList("web", ({"name": "search", "description": None, "input_schema": {"type": "object"}},))


class ScriptedRounds:
    """Round k's events are `scripts[k]`; each round's request is kept, and the phase it started in."""

    def __init__(self, *scripts: list[Event]):
        self.scripts = list(scripts)
        self.requests: list[ChatRequest] = []
        self.results: list[int] = []  # each round's count of tool results it may cut to fit
        self.open = False  # a round's block is open (the service holds the engine's turn there)

    @asynccontextmanager
    async def __call__(self, request: ChatRequest, live: RequestProgress,
                       results: int) -> AsyncIterator[AsyncIterator[Event]]:
        self.requests.append(request)
        self.results.append(results)
        script = self.scripts[len(self.requests) - 1]

        async def events() -> AsyncIterator[Event]:
            for event in script:
                yield event

        self.open = True
        try:
            async with aclosing(events()) as stream:
                yield stream
        finally:
            self.open = False


class ScriptedToolset:
    """MCP tools by name -> server label; each call answers `<name>: <arguments>`."""

    def __init__(self, rounds: ScriptedRounds, servers: dict[str, str], listings: list[McpToolList] | None = None):
        self._rounds, self._servers = rounds, servers
        self.listings = listings or []
        self.calls: list[tuple[str, str, bool, str]] = []  # name, arguments, pictures, phase during the call
        self.live: RequestProgress | None = None

    def server_of(self, name: str) -> str | None:
        return self._servers.get(name)

    async def call(self, name: str, arguments: str, *, pictures: bool) -> ToolOutput:
        assert not self._rounds.open, "a tool runs while the round holds the engine's turn"
        assert self.live is not None
        self.calls.append((name, arguments, pictures, self.live.phase))
        return ToolOutput(f"{name}: {arguments}", f"result of {name}", is_error=name == "broken")


def round_of(*events: Event, prompt: int = 10, cached: int = 0, completion: int = 3, reasoning: int = 0,
             finish: str = "stop") -> list[Event]:
    return [PromptProcessed(prompt, cached), *events, Usage(prompt, cached, completion, reasoning),
            Finish(finish)]  # type: ignore[arg-type]


def calling(index: int, name: str, arguments: str, call_id: str | None = None) -> list[Event]:
    return [ToolCallStart(index, call_id or f"call_{name}", name), ToolCallArgumentsDelta(index, arguments)]


async def respond(request: ChatRequest, rounds: ScriptedRounds, toolset: ScriptedToolset | None = None,
                  max_rounds: int = 8, pictures: bool = False) -> tuple[list[Event], RequestProgress]:
    live = RequestProgress(HistoryRow(id="r", route="chat", start=0.0))
    if toolset is not None:
        toolset.live = live
    events = [event async for event in run_rounds(request, rounds, toolset, live,  # type: ignore[arg-type]
                                                  max_rounds=max_rounds, sees_pictures=lambda: pictures)]
    return events, live


def ask(**fields: Any) -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": "hi"}], **fields)


async def test_one_round_without_tools_passes_its_events_through():
    logprob = TokenLogprob("a", (97,), -0.5)
    rounds = ScriptedRounds(round_of(ReasoningDelta("hm"), logprob, TextDelta("a"), prompt=7, cached=2,
                                     completion=2, reasoning=1))
    events, live = await respond(ask(), rounds)
    assert events == [PromptProcessed(7, 2), ReasoningDelta("hm"), logprob, TextDelta("a"), Usage(7, 2, 2, 1),
                      Finish("stop")]
    assert (live.row.prompt_tokens, live.row.reused_tokens, live.row.finish) == (7, 2, "stop")


async def test_a_client_tool_call_ends_the_response_as_it_is():
    rounds = ScriptedRounds(round_of(*calling(0, "mine", "{}"), finish="tool_calls"))
    events, _ = await respond(ask(), rounds)
    assert events == [PromptProcessed(10, 0), ToolCallStart(0, "call_mine", "mine"), ToolCallArgumentsDelta(0, "{}"),
                      Usage(10, 0, 3), Finish("tool_calls")]
    assert len(rounds.requests) == 1


async def test_mcp_calls_run_between_rounds_numbered_across_the_response():
    rounds = ScriptedRounds(
        round_of(ReasoningDelta("look"), TextDelta("Let me see."), *calling(0, "search", '{"q":'),
                 ToolCallArgumentsDelta(0, '"x"}'), *calling(1, "fetch", "{}"), prompt=10, completion=5,
                 reasoning=2, finish="tool_calls"),
        round_of(*calling(0, "search", "{}", "call_2"), prompt=30, cached=25, completion=4, finish="tool_calls"),
        round_of(TextDelta("done"), prompt=50, cached=45, completion=1))
    toolset = ScriptedToolset(rounds, {"search": "web", "fetch": "web"}, [WEB])
    events, live = await respond(ask(tool_choice="required", max_tokens=100), rounds, toolset, pictures=True)
    assert events == [
        PromptProcessed(10, 0), WEB, ReasoningDelta("look"), TextDelta("Let me see."),
        ToolCallStart(0, "call_search", "search", "web"), ToolCallArgumentsDelta(0, '{"q":'),
        ToolCallArgumentsDelta(0, '"x"}'), ToolCallStart(1, "call_fetch", "fetch", "web"),
        ToolCallArgumentsDelta(1, "{}"),
        ToolResult(0, "call_search", 'search: {"q":"x"}'), ToolResult(1, "call_fetch", "fetch: {}"),
        ToolCallStart(2, "call_2", "search", "web"), ToolCallArgumentsDelta(2, "{}"),  # the later prompts: not shown
        ToolResult(2, "call_2", "search: {}"),
        TextDelta("done"), Usage(90, 70, 10, 2), Finish("stop")]
    assert toolset.calls == [("search", '{"q":"x"}', True, "tool"), ("fetch", "{}", True, "tool"),
                             ("search", "{}", True, "tool")]
    assert (live.row.prompt_tokens, live.row.reused_tokens, live.row.finish) == (90, 70, "stop")
    second = rounds.requests[1]
    assert second.messages[1:] == [
        {"role": "assistant", "content": "Let me see.", "reasoning_content": "look", "tool_calls": [
            {"id": "call_search", "type": "function", "function": {"name": "search", "arguments": '{"q":"x"}'}},
            {"id": "call_fetch", "type": "function", "function": {"name": "fetch", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_search", "content": "result of search"},
        {"role": "tool", "tool_call_id": "call_fetch", "content": "result of fetch"}]
    # A required tool choice was met: the next rounds choose freely. The budget is what the first round left.
    assert (second.tool_choice, second.max_tokens) == ("auto", 95)
    assert rounds.requests[0].tool_choice == "required"
    assert "reasoning_content" not in rounds.requests[2].messages[-2]
    assert rounds.results == [0, 2, 1]  # the results the model has not read yet may be cut to fit the context


async def test_mcp_and_client_calls_together_end_after_the_mcp_results():
    rounds = ScriptedRounds(round_of(*calling(0, "search", "{}"), *calling(1, "mine", "{}"), finish="tool_calls"))
    toolset = ScriptedToolset(rounds, {"search": "web"})
    events, live = await respond(ask(), rounds, toolset)
    assert events[-4:] == [ToolCallArgumentsDelta(1, "{}"), ToolResult(0, "call_search", "search: {}"),
                           Usage(10, 0, 3), Finish("tool_calls")]
    assert len(rounds.requests) == 1 and live.row.finish == "tool_calls"


@pytest.mark.parametrize(("client_call", "finish"), [(False, "stop"), (True, "tool_calls")])
async def test_calls_past_the_round_limit_are_not_run(client_call, finish):
    mine = calling(1, "mine", "{}") if client_call else []
    rounds = ScriptedRounds(round_of(*calling(0, "search", "{}"), finish="tool_calls"),
                            round_of(*calling(0, "search", "{}", "call_2"), *mine, finish="tool_calls"))
    toolset = ScriptedToolset(rounds, {"search": "web"})
    events, live = await respond(ask(), rounds, toolset, max_rounds=1)
    not_run = ToolResult(1, "call_2", "not run: this response reached its limit of 1 tool rounds (mcp.max_rounds)",
                         is_error=True)
    assert events[-3:] == [not_run, Usage(20, 0, 6), Finish(finish)]
    assert len(toolset.calls) == 1 and live.row.finish == finish


async def test_a_response_that_spent_its_tokens_ends_after_the_results():
    rounds = ScriptedRounds(round_of(*calling(0, "search", "{}"), completion=5, finish="tool_calls"))
    toolset = ScriptedToolset(rounds, {"search": "web"})
    events, _ = await respond(ask(max_tokens=5), rounds, toolset)
    assert events[-3:] == [ToolResult(0, "call_search", "search: {}"), Usage(10, 0, 5), Finish("length")]
    assert len(rounds.requests) == 1


async def test_a_failed_tool_is_an_error_result_and_the_rounds_go_on():
    rounds = ScriptedRounds(round_of(*calling(0, "broken", "{}"), finish="tool_calls"), round_of(TextDelta("ok")))
    toolset = ScriptedToolset(rounds, {"broken": "web"})
    events, _ = await respond(ask(), rounds, toolset)
    assert ToolResult(0, "call_broken", "broken: {}", is_error=True) in events
    assert events[-3:] == [TextDelta("ok"), Usage(20, 0, 6), Finish("stop")]


async def test_a_response_closed_early_leaves_its_round():
    rounds = ScriptedRounds(round_of(TextDelta("a"), TextDelta("b")))
    live = RequestProgress(HistoryRow(id="r", route="chat", start=0.0))
    events = run_rounds(ask(), rounds, None, live, max_rounds=8, sees_pictures=lambda: False)  # type: ignore[arg-type]
    assert await events.__anext__() == PromptProcessed(10, 0)
    assert rounds.open
    await events.aclose()
    assert not rounds.open  # the service gives the engine's turn back there
