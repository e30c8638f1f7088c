"""The renderer skeleton every dialect fills in: one method per kind of generation event, each returning the
server-sent events that say what the event adds. A dialect's stream is those events; its whole (non-streamed)
answer is the fold of the same stream, so the two cannot drift apart. Pure, no I/O."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from itertools import groupby
from typing import Any, assert_never, cast

from strata.api.errors import ApiError
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

SseEvent = tuple[str, dict[str, Any]]
"""One server-sent event as a dialect renders it: (event name, JSON data)."""


class Renderer(ABC):
    """One generation rendered in one dialect: `feed` each event, get the SSE events it adds; or `whole` for
    the finished answer.

    Invariant: an event kind is one `case` in `feed` and one abstract `on_*` method here. A new kind added to
    `Event` without its `case` fails mypy at `assert_never`; a dialect that lacks the new method cannot be
    instantiated (mypy refuses the `@final` class). So a new kind is one edit per dialect, never forgotten.
    """

    def __init__(self) -> None:
        self._started = False
        self._finished = False
        self.failure: ApiError | None = None  # the error the stream ended with, if it ended with one
        # True while `whole` renders: the stream then leaves out nothing its fold needs (OpenAI's usage chunk,
        # which a streaming client gets only when it asks).
        self.folding = False

    def start(self, first: Event | None = None) -> list[SseEvent]:
        """The opening events (sent once; `feed` sends them first if nobody asked yet)."""
        if self._started:
            return []
        self._started = True
        return self.on_start(first)

    def feed(self, event: Event) -> list[SseEvent]:
        """The SSE events that say what `event` adds to the answer."""
        if not self._started:
            return self.start(event) + self.feed(event)
        # The per-token path: text first, then the other kinds by how often they come.
        match event:
            case TextDelta():
                return self.on_text(event)
            case TokenLogprob():
                return self.on_logprob(event)
            case ReasoningDelta():
                return self.on_reasoning(event)
            case ToolCallArgumentsDelta():
                return self.on_tool_arguments(event)
            case ToolCallStart():
                return self.on_tool_call(event)
            case ToolResult():
                return self.on_tool_result(event)
            case McpToolList():
                return self.on_tool_list(event)
            case PromptProcessed():
                return self.on_prompt(event)
            case PromptLogprobs():
                return self.on_prompt_logprobs(event)
            case Usage():
                return self.on_usage(event)
            case Finish():
                self._finished = True
                return self.on_finish(event)
            case _:
                assert_never(event)

    def error(self, error: ApiError) -> list[SseEvent]:
        """The events that end a stream the server cannot finish (its HTTP status went out long ago); the whole
        answer is the error itself."""
        self.failure = error
        return self.on_error(error)

    def whole(self, events: Iterable[Event]) -> dict[str, Any]:
        """The answer to a non-streamed request: the fold of the stream `events` render to.

        Args:
            events: everything the generation yielded; a generation without its `Finish` failed.

        Raises:
            ApiError: the error the stream ended with (a failed or cancelled generation, in the dialects that
                end such a stream with an error event), or one the fold meets.
        """
        self.folding = True
        stream = [sse for event in _joined(events) for sse in self.feed(event)]
        if not self._finished:
            stream += self.feed(Finish("error"))
        if self.failure is not None:
            raise self.failure
        return self.fold(stream)

    @abstractmethod
    def fold(self, stream: Iterable[SseEvent]) -> dict[str, Any]:
        """The whole answer a complete stream adds up to (as the dialect's official client accumulates it)."""

    @abstractmethod
    def on_start(self, first: Event | None) -> list[SseEvent]:
        """The opening events; `first` is the event that opens the stream, if one does."""

    @abstractmethod
    def on_text(self, event: TextDelta) -> list[SseEvent]: ...

    @abstractmethod
    def on_reasoning(self, event: ReasoningDelta) -> list[SseEvent]: ...

    @abstractmethod
    def on_tool_call(self, event: ToolCallStart) -> list[SseEvent]: ...

    @abstractmethod
    def on_tool_arguments(self, event: ToolCallArgumentsDelta) -> list[SseEvent]: ...

    @abstractmethod
    def on_logprob(self, event: TokenLogprob) -> list[SseEvent]: ...

    @abstractmethod
    def on_prompt_logprobs(self, event: PromptLogprobs) -> list[SseEvent]: ...

    @abstractmethod
    def on_prompt(self, event: PromptProcessed) -> list[SseEvent]: ...

    @abstractmethod
    def on_tool_list(self, event: McpToolList) -> list[SseEvent]: ...

    @abstractmethod
    def on_tool_result(self, event: ToolResult) -> list[SseEvent]: ...

    @abstractmethod
    def on_usage(self, event: Usage) -> list[SseEvent]: ...

    @abstractmethod
    def on_finish(self, event: Finish) -> list[SseEvent]: ...

    @abstractmethod
    def on_error(self, error: ApiError) -> list[SseEvent]: ...


def unfinished(finish: Finish) -> ApiError | None:
    """The error a generation that did not finish is: 500 when it failed, 503 when it was cancelled (the server
    is shutting down); None when it finished."""
    if finish.reason == "error":
        return ApiError(500, "generation failed", kind="server_error")
    if finish.reason == "cancel":
        return ApiError(503, "the request was cancelled", kind="server_error")
    return None


def openai_logprob(event: TokenLogprob) -> dict[str, Any]:
    """One token's entry in OpenAI's `logprobs.content` (chat) and Responses' `logprobs`."""
    return {"token": event.token, "logprob": event.logprob, "bytes": list(event.bytes),
            "top_logprobs": [{"token": token, "logprob": logprob, "bytes": list(data)}
                             for token, data, logprob in event.top]}


def _joined(events: Iterable[Event]) -> list[Event]:
    """`events` with each run of text (or of reasoning) and its tokens' logprobs as one delta: the run's text that
    came before its first logprob, the logprobs, the rest of its text, then the logprobs that came after its last
    text (they wait for the next text, as they did). A fold joins the texts and the logprob lists, so it does not
    depend on where the text was split; and one delta renders in the time of one token instead of hundreds."""
    out: list[Event] = []
    for kind, run in groupby(events, _run_kind):
        if kind is None:
            out.extend(run)
            continue
        leading: list[str] = []
        logprobs: list[Event] = []
        texts: list[str] = []
        pending: list[Event] = []  # logprobs since the last text
        for event in cast("Iterator[TextDelta | ReasoningDelta | TokenLogprob]", run):
            if isinstance(event, TokenLogprob):
                pending.append(event)
            elif event.text and not (logprobs or pending):
                leading.append(event.text)
            elif event.text:
                logprobs += pending
                pending = []
                texts.append(event.text)
        out += [kind("".join(leading))] if leading else []
        out += logprobs
        out += [kind("".join(texts))] if texts else []
        out += pending
    return out


def _run_kind(event: Event) -> type[TextDelta] | type[ReasoningDelta] | None:
    """The delta kind of the run `event` belongs to (a token's logprob belongs to its text's), or None."""
    if isinstance(event, TokenLogprob):
        return ReasoningDelta if event.reasoning else TextDelta
    if isinstance(event, (TextDelta, ReasoningDelta)):
        return type(event)
    return None
