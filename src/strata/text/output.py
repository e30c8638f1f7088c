"""Generated token ids to the events a response is made of: the text detokenised, cut at the request's stop
strings and split into reasoning, answer and tool calls (`Output`); and the sampled tokens' log-probabilities,
each token named as OpenAI names it (`LogprobNames`). No I/O, nothing of the engine: the service feeds tokens in
as they come."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from strata.events import ChatRequest, Event, TextDelta, TokenLogprob
from strata.text.family import ModelFamily
from strata.text.toolcalls import StopMatcher

# What the sampler records of a token: its log-probability and the top alternatives as (id, log-probability).
LogprobRecord = tuple[float, list[tuple[int, float]]]


class StreamParser(Protocol):
    """Streamed model text to events: the family's parser (`ModelFamily.stream_parser`), or plain text."""

    @property
    def n_tool_calls(self) -> int: ...

    @property
    def in_reasoning(self) -> bool: ...

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


class _PlainText:
    """The parser of a raw completion: all of the text is text."""

    n_tool_calls = 0
    in_reasoning = False

    def feed(self, text: str) -> list[Event]:
        return [TextDelta(text)] if text else []

    def finish(self) -> list[Event]:
        return []


class Output:
    """Generated token ids to events: detokenise, cut at stop strings, split reasoning and tool calls (in the
    model family's format)."""

    def __init__(self, tokenizer: Any, family: ModelFamily, request: ChatRequest, starts_in_reasoning: bool):
        self._decoder = tokenizer.stream_decoder()
        self._stops = StopMatcher(request.stop)
        self._text = ""  # everything the model wrote, to tell which stop string ended it
        tools = request.tools if request.tool_choice != "none" else []
        self._parser: StreamParser = family.stream_parser(
            starts_in_reasoning=starts_in_reasoning, parse_tool_calls=bool(tools),
            tools={tool["function"]["name"]: tool["function"].get("parameters") for tool in tools})
        if request.completion is not None:
            self._parser = _PlainText()  # a raw completion: tags are text

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    @property
    def n_tool_calls(self) -> int:
        return self._parser.n_tool_calls

    @property
    def in_reasoning(self) -> bool:
        return self._parser.in_reasoning

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the generation: the one found earliest in the text."""
        if not self._stops.stopped:
            return None
        found = [(self._text.find(stop), stop) for stop in self._stops.stops if stop in self._text]
        return min(found)[1] if found else None

    def push(self, token: int) -> list[Event]:
        text = self._decoder.push(token)
        if self._stops.stops:
            self._text += text
        return self._parser.feed(self._stops.feed(text))

    def finish(self) -> list[Event]:
        if not self._stops.stopped:
            events = self._parser.feed(self._stops.feed(self._decoder.flush()))
            events += self._parser.feed(self._stops.flush())
        else:
            events = []
        return events + self._parser.finish()


class LogprobNames:
    """Log-probabilities as events, each token named as OpenAI names it: its text and UTF-8 bytes.

    Args:
        id_bytes: what each token id decodes to (`Tokenizer.id_bytes`); an id past its end is named "".
    """

    def __init__(self, id_bytes: Sequence[bytes]):
        self._id_bytes = id_bytes

    def named(self, i: int) -> tuple[str, tuple[int, ...]]:
        """A token's text and UTF-8 bytes."""
        id_bytes = self._id_bytes
        data = id_bytes[i] if i < len(id_bytes) else b""
        return data.decode("utf-8", errors="replace"), tuple(data)

    def logprob(self, token: int, record: LogprobRecord, reasoning: bool = False) -> TokenLogprob:
        """A generated token's entry: its log-probability and the top alternatives, from the sampler's record."""
        logprob, top = record
        return TokenLogprob(*self.named(token), logprob, tuple((*self.named(i), value) for i, value in top),
                            reasoning)

    def prompt_logprobs(self, ids: list[int], records: list[LogprobRecord]) -> tuple[TokenLogprob, ...]:
        """An echoed prompt's entries: `records` are those of `ids[1:]`, as nothing predicts the first token."""
        first = TokenLogprob(*self.named(ids[0]), None)
        return (first, *(self.logprob(token, record) for token, record in zip(ids[1:], records, strict=True)))
