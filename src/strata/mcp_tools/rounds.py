"""The rounds of one response: generate; when the model called MCP tools, call them (in the request's task),
append their results and generate on, up to `mcp.max_rounds` times.

The loop knows nothing of the engine: the service hands it a callable that opens one round (prepares the request,
takes the engine's turn, generates) and the request's `Toolset`; a request without MCP servers is one round."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, aclosing
from dataclasses import dataclass, field
from typing import Any

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
from strata.mcp_tools.toolset import Toolset
from strata.shutdown import ShutdownCut

RoundEvents = Callable[[ChatRequest, RequestProgress, int], AbstractAsyncContextManager[AsyncIterator[Event]]]
"""Opens one round of a response: the request prepared and the engine's turn taken, then the round's events (the
generation's own, with no generator between: they are the per-token path); leaving the block gives the turn back.
Its events end with one `Usage` and one `Finish`. The third argument is how many of the request's last messages
are tool results the model has not read yet: the preparation cuts them to fit the context
(`strata.mcp_tools.fitting`) rather than refuse a request whose tools have run."""


@dataclass
class _Call:
    """A tool call of the model, numbered across the response; `server` is the MCP server's label, or None for
    the client's own tools."""

    index: int
    id: str
    name: str
    server: str | None
    arguments: str = ""


@dataclass
class _Round:
    """What the model wrote in one round, its tool calls numbered across the response."""

    calls: list[_Call] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    usage: Usage = field(default_factory=lambda: Usage(0, 0, 0))
    finish: Finish = field(default_factory=lambda: Finish("error"))  # until the round's own

    def served(self) -> list[_Call]:
        """The calls an MCP server runs (the others are the client's own tools)."""
        return [call for call in self.calls if call.server is not None]

    def assistant_message(self) -> dict[str, Any]:
        """What the model wrote, as the assistant message the next round's prompt renders."""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.text)}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        message["tool_calls"] = [{"id": call.id, "type": "function",
                                  "function": {"name": call.name, "arguments": call.arguments}}
                                 for call in self.calls]
        return message


async def run_rounds(request: ChatRequest, round_events: RoundEvents, toolset: Toolset | None,
                     live: RequestProgress, *, max_rounds: int, sees_pictures: Callable[[], bool],
                     cut: ShutdownCut | None = None) -> AsyncGenerator[Event, None]:
    """Generate; when the model called MCP tools, call them (in this task: the request's), append their results
    and generate on, up to `max_rounds` times. The engine's turn is held only while generating, so a slow tool
    stalls no one else; the next round's prompt shares the previous one's KV prefix.

    The events of every round go out as they happen, tool calls numbered across the response, then one `Usage`
    (the sum of the rounds) and one `Finish`. A call of the client's own tools ends the response.

    Args:
        request: the request, its MCP tools among its tools.
        round_events: opens one round (see `RoundEvents`).
        toolset: the request's MCP tools; None without MCP servers.
        live: the request's progress row (its phase; its history row gets the totals).
        max_rounds: tool rounds one response may run (`mcp.max_rounds`).
        sees_pictures: whether the model is given the pictures a tool returns (asked at each call).
        cut: the service's shutdown cut, which ends a tool call still running when the shutdown's time runs out
            (None: never).
    """
    response = _Response(request, toolset, max_rounds, cut or ShutdownCut())
    while response.request is not None:
        this = _Round()
        text, reasoning = this.text, this.reasoning
        async with round_events(response.request, live, response.new_results) as events:
            async for event in events:
                if type(event) is TextDelta:  # per streamed token: the usual events, tested first
                    text.append(event.text)
                    yield event
                elif type(event) is ReasoningDelta:
                    reasoning.append(event.text)
                    yield event
                elif type(event) is TokenLogprob:
                    yield event
                else:
                    for shown in response.show(this, event):
                        yield shown
        async with aclosing(response.end_round(this, live, sees_pictures)) as results:
            async for result in results:
                yield result
    for event in response.totals(live.row):
        yield event


class _Response:
    """What a response keeps across its rounds: the next round's request (None once it ends), the calls'
    numbering, the tool rounds run, the token totals, and the listings not shown yet."""

    def __init__(self, request: ChatRequest, toolset: Toolset | None, max_rounds: int, cut: ShutdownCut):
        self.request: ChatRequest | None = request
        self._cut = cut
        self.finish = Finish("error")
        self.usage = Usage(0, 0, 0)  # the sum of the rounds
        self._toolset = toolset
        self._max_rounds = max_rounds
        self._rounds = 0  # tool rounds run
        self._n_calls = 0
        self._listings: list[McpToolList] = toolset.listings if toolset is not None else []
        self.new_results = 0  # the next round's tool results, last in its request's messages

    def show(self, this: _Round, event: Event) -> tuple[Event, ...]:
        """A round's event (other than its text, reasoning and logprobs) as the response shows it: the calls
        renamed to the response's numbering, with their MCP server; the first round's prompt size followed by the
        tool listings, the later rounds' not shown; the round's `Usage` and `Finish` kept for the totals."""
        if isinstance(event, ToolCallArgumentsDelta):  # per token of a call: tested first
            call = this.calls[event.index]
            call.arguments += event.text
            return (ToolCallArgumentsDelta(call.index, event.text),)
        if isinstance(event, ToolCallStart):
            server = self._toolset.server_of(event.name) if self._toolset is not None else None
            this.calls.append(_Call(self._n_calls, event.id, event.name, server))
            self._n_calls += 1
            return (ToolCallStart(self._n_calls - 1, event.id, event.name, server),)
        if isinstance(event, PromptProcessed):
            if self.usage.prompt_tokens:
                return ()  # the prompt a response starts with is the first round's
            # The listings follow the prompt's size (Anthropic's message_start carries it) and a prompt known to
            # fit (a refusal keeps its status).
            listings, self._listings = self._listings, []
            return (event, *listings)
        if isinstance(event, Usage):
            this.usage = event
            return ()
        if isinstance(event, Finish):
            this.finish = event
            return ()
        return (event,)

    async def end_round(self, this: _Round, live: RequestProgress, sees_pictures: Callable[[], bool]
                        ) -> AsyncGenerator[ToolResult, None]:
        """After a round: add its usage; run the MCP tools it called and give their results (or, past the
        response's tool rounds, say they were not run); then set `request` to the next round's, or to None with
        the response's `finish`."""
        request, self.request = self.request, None
        assert request is not None
        self.usage = _added(self.usage, this.usage)
        self.finish = this.finish
        served = this.served()
        if this.finish.reason != "tool_calls" or not served:
            return
        if self._rounds >= self._max_rounds:
            for result in self._not_run(served):
                yield result
            self.finish = Finish("tool_calls" if len(served) < len(this.calls) else "stop")
            return
        self._rounds += 1
        self.new_results = len(served)
        live.phase = "tool"
        messages = [this.assistant_message()]
        async with aclosing(self._call_tools(served, sees_pictures, messages)) as results:
            async for result in results:
                yield result
        if len(served) < len(this.calls):
            return  # the client's own tools were called too: the response ends, as any tool call does
        max_tokens = _tokens_left(request.max_tokens, self.usage.completion_tokens)
        if max_tokens is not None and max_tokens < 1:
            self.finish = Finish("length")
            return
        self.request = _next_request(request, messages, max_tokens)

    def _not_run(self, served: list[_Call]) -> list[ToolResult]:
        return [ToolResult(call.index, call.id, f"not run: this response reached its limit of {self._max_rounds} "
                           "tool rounds (mcp.max_rounds)", is_error=True) for call in served]

    async def _call_tools(self, served: list[_Call], sees_pictures: Callable[[], bool],
                          messages: list[dict[str, Any]]) -> AsyncGenerator[ToolResult, None]:
        """Run the calls, one after the other in this task (the request's), each result given as it comes and
        appended to `messages` for the next round's prompt."""
        assert self._toolset is not None
        for call in served:
            with self._cut.cutting():  # a tool still running when the shutdown's time runs out is cut
                output = await self._toolset.call(call.name, call.arguments, pictures=sees_pictures())
            yield ToolResult(call.index, call.id, output.text, output.is_error)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output.content})

    def totals(self, row: HistoryRow) -> tuple[Usage, Finish]:
        """The response's last events, its totals also written to its history row."""
        row.prompt_tokens, row.reused_tokens = self.usage.prompt_tokens, self.usage.cached_tokens
        row.finish = self.finish.reason
        return self.usage, Finish(self.finish.reason, self.finish.stop_sequence)


def _tokens_left(max_tokens: int | None, completion_tokens: int) -> int | None:
    """The next round's `max_tokens`: the last round's less the completion tokens of the response so far (None:
    the request sets none, the context is the limit); under 1, the response has spent its tokens."""
    return None if max_tokens is None else max_tokens - completion_tokens


def _next_request(request: ChatRequest, messages: list[dict[str, Any]], max_tokens: int | None) -> ChatRequest:
    """The next round's request: the round's assistant message and tool results appended to the conversation."""
    # A required or named tool choice was met by this round's calls: the next rounds choose freely.
    choice = request.tool_choice if request.tool_choice in (None, "auto", "none") else "auto"
    return dataclasses.replace(request, messages=request.messages + messages, max_tokens=max_tokens,
                               tool_choice=choice)


def _added(total: Usage, usage: Usage) -> Usage:
    def both(a: int | None, b: int | None) -> int | None:
        return None if a is None and b is None else (a or 0) + (b or 0)

    return Usage(total.prompt_tokens + usage.prompt_tokens, total.cached_tokens + usage.cached_tokens,
                 total.completion_tokens + usage.completion_tokens, total.reasoning_tokens + usage.reasoning_tokens,
                 both(total.accepted_prediction_tokens, usage.accepted_prediction_tokens),
                 both(total.rejected_prediction_tokens, usage.rejected_prediction_tokens))
