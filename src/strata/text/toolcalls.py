"""The model's streamed text to events: reasoning, tool calls and plain text in the Hermes format (JSON tool calls
between a family's call markers, as Qwen3 writes them), the grammar of one such call, and stop strings.

Both classes are pure and incremental: they are fed text deltas as the detokeniser produces them and never emit
anything a later delta could still turn into something else (a partial tag, a partial stop string).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from strata.events import Event, ReasoningDelta, TextDelta, ToolCallArgumentsDelta, ToolCallStart
from strata.text.constraints import json_grammar, json_text
from strata.text.family import ModelFamily

_TEXT, _THINK, _CALL_HEADER, _CALL_ARGS, _CALL_TAIL, _CALL_BUFFERED = range(6)

# One JSON string, escapes included.
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallParser:
    """Splits streamed model text into `TextDelta`, `ReasoningDelta`, `ToolCallStart` and `ToolCallArgumentsDelta`.

    Format (the family's markers; Qwen3's shown): reasoning is `<think>…</think>`; a tool call is
    `<tool_call>\\n{"name": "…", "arguments": {…}}\\n</tool_call>`. Newlines next to these tags belong to the
    format and are dropped (the chat template strips them the same way when it renders the history back).

    A tool call is announced with `ToolCallStart` as soon as its name is known; the arguments object then streams
    as `ToolCallArgumentsDelta` pieces whose concatenation is exactly the model's JSON text of that object. From
    that moment the call is committed: if the model stops inside the arguments, the call keeps what streamed.
    A call whose body does not start as `{"name": "…", "arguments": {` (keys in another order, arguments as a
    JSON string) is buffered to its closing tag and parsed whole. Malformed tool-call JSON — a body that neither
    starts that way nor parses as a whole call by `</tool_call>` or the end of the text — is emitted unchanged,
    tags included, as text. So is a call naming a tool that was not declared: it is never reported as a call.

    Another call syntax keeps the reasoning and text handling and replaces the call body's: a subclass overrides
    `_step_header` (after the call marker), `_step_args` (the arguments) and `_whole_call` (a body parsed at once),
    as `strata.text.xml_toolcalls.XmlToolCallParser` does.

    Args:
        family: the model family, whose markers the text uses (`ModelFamily.stream_parser` makes one).
        starts_in_reasoning: the prompt already opened the reasoning block, so generation begins inside it.
        parse_tool_calls: False treats the call marker as ordinary text (a request without tools).
        tool_names: the declared tools' names (or a mapping from them, as `ModelFamily.stream_parser` passes); None
            accepts any name.
    """

    def __init__(self, family: ModelFamily, starts_in_reasoning: bool = False, parse_tool_calls: bool = True,
                 tool_names: Collection[str] | None = None) -> None:
        self._tool_names = tool_names
        self._state = _THINK if starts_in_reasoning else _TEXT
        self._pending = ""  # text received but not yet emitted or consumed
        self._skip_newlines = starts_in_reasoning  # drop newlines that follow a tag
        self._think_close, self._call_open, self._call_close = family.think_close, family.call_open, family.call_close
        think_open = family.think_open
        self._text_tags = (think_open, self._call_open) if parse_tool_calls else (think_open,)
        self._after_tag = {think_open: _THINK, self._think_close: _TEXT, self._call_open: _CALL_HEADER}
        self._n_calls = 0
        self._args = _ObjectScanner()

    @property
    def n_tool_calls(self) -> int:
        """How many tool calls have been announced so far."""
        return self._n_calls

    @property
    def in_reasoning(self) -> bool:
        """Whether the text so far ends inside the reasoning block."""
        return self._state == _THINK

    def feed(self, text: str) -> list[Event]:
        """Consume the next piece of model text; return the events it completes."""
        if (not self._pending and self._state in (_TEXT, _THINK) and not self._skip_newlines and "<" not in text
                and not text.endswith("\n")):
            # Per streamed token, the usual case: every tag starts with "<", and only a tag or trailing newlines
            # (which a tag after them would drop) are held back, so the state machine would emit it all.
            return [TextDelta(text) if self._state == _TEXT else ReasoningDelta(text)] if text else []
        self._pending += text
        events: list[Event] = []
        while self._pending and self._step(events):
            pass
        return events

    def finish(self) -> list[Event]:
        """The model has stopped: emit whatever is still held back."""
        events: list[Event] = []
        rest, self._pending = self._pending, ""
        if self._state == _TEXT and rest:
            events.append(TextDelta(rest))
        elif self._state == _THINK and rest:
            events.append(ReasoningDelta(rest))
        elif self._state in (_CALL_HEADER, _CALL_BUFFERED):
            events += self._whole_call(rest, closed=False)
        self._state = _TEXT
        return events

    # --- one step of the state machine: True when it consumed something and should run again

    def _step(self, events: list[Event]) -> bool:
        if self._state == _TEXT:
            return self._step_plain(events, self._text_tags, TextDelta)
        if self._state == _THINK:
            return self._step_plain(events, (self._think_close,), ReasoningDelta)
        if self._state == _CALL_HEADER:
            return self._step_header(events)
        if self._state == _CALL_ARGS:
            return self._step_args(events)
        if self._state == _CALL_TAIL:
            return self._step_tail()
        return self._step_buffered(events)

    def _step_plain(self, events: list[Event], tags: tuple[str, ...], kind: Callable[[str], Event]) -> bool:
        if self._skip_newlines:
            self._pending = self._pending.lstrip("\n")
            if not self._pending:
                return False
            self._skip_newlines = False
        found = _first_tag(self._pending, tags)
        if found is None:
            keep = _held_back(self._pending, tags)
            _emit(events, kind, self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
            return False
        at, tag = found
        _emit(events, kind, self._pending[:at].rstrip("\n"))
        self._pending = self._pending[at + len(tag):]
        self._state = self._after_tag[tag]
        self._skip_newlines = tag != self._call_open
        return True

    def _step_header(self, events: list[Event]) -> bool:
        # Invariant: only text before the first closing marker decides, so the outcome does not depend on how
        # the text was split into deltas.
        close = self._pending.find(self._call_close)
        outcome, name, args_at = _match_header(self._pending if close < 0 else self._pending[:close])
        if outcome == "more" and close < 0:
            return False
        if outcome != "ok" or not self._declared(name):
            self._state = _CALL_BUFFERED
            return True
        events.append(ToolCallStart(self._n_calls, new_call_id(), name))
        self._n_calls += 1
        self._pending = self._pending[args_at:]
        self._args = _ObjectScanner()
        self._state = _CALL_ARGS
        return True

    def _step_args(self, events: list[Event]) -> bool:
        end = self._args.scan(self._pending)
        upto = len(self._pending) if end is None else end
        _emit(events, lambda text: ToolCallArgumentsDelta(self._n_calls - 1, text), self._pending[:upto])
        self._pending = self._pending[upto:]
        if end is None:
            return False
        self._state = _CALL_TAIL
        return True

    def _step_tail(self) -> bool:
        # What follows the arguments object is the closing brace of the call and whitespace: skipped.
        close = self._call_close
        at = self._pending.find(close)
        if at < 0:
            self._pending = self._pending[-(len(close) - 1):]
            return False
        self._pending = self._pending[at + len(close):]
        self._state, self._skip_newlines = _TEXT, True
        return True

    def _step_buffered(self, events: list[Event]) -> bool:
        at = self._pending.find(self._call_close)
        if at < 0:
            return False
        body, self._pending = self._pending[:at], self._pending[at + len(self._call_close):]
        events += self._whole_call(body, closed=True)
        self._state, self._skip_newlines = _TEXT, True
        return True

    def _whole_call(self, body: str, closed: bool) -> list[Event]:
        """Events for a complete call body, or its raw text when the body is not a valid call."""
        call = _parse_call(body)
        if call is None or not self._declared(call[0]):
            return [TextDelta(self._call_open + body + (self._call_close if closed else ""))]
        name, arguments = call
        index, self._n_calls = self._n_calls, self._n_calls + 1
        return [ToolCallStart(index, new_call_id(), name), ToolCallArgumentsDelta(index, arguments)]

    def _declared(self, name: str) -> bool:
        return self._tool_names is None or name in self._tool_names


def _emit(events: list[Event], kind: Callable[[str], Event], text: str) -> None:
    if text:
        events.append(kind(text))


def _first_tag(text: str, tags: Iterable[str]) -> tuple[int, str] | None:
    """The earliest complete tag in `text`, as (position, tag)."""
    best = None
    for tag in tags:
        at = text.find(tag)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, tag)
    return best


def _held_back(text: str, tags: Iterable[str]) -> int:
    """How many trailing characters to hold: a suffix that could begin a tag, and the newlines just before it."""
    keep = _partial_suffix(text, tags)
    return len(text) - len(text[: len(text) - keep].rstrip("\n"))


class _ObjectScanner:
    """Finds where a JSON object that arrives in pieces ends (tracks nesting and strings, validates nothing)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def scan(self, text: str) -> int | None:
        """Feed `text`; return the index just past the object's closing brace, or None if it has not ended."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


# The start of a streamable call body, item by item: None is optional whitespace, "S" a JSON string (the name).
_HEADER = (None, "{", None, '"name"', None, ":", None, "S", None, ",", None, '"arguments"', None, ":", None)


def _match_header(text: str) -> tuple[str, str, int]:
    """Match `text` against `{"name": "…", "arguments": {`.

    Returns ("ok", name, index of the arguments' `{`), ("more", "", 0) when `text` is a prefix of such a header,
    or ("fail", "", 0) when it can no longer become one.
    """
    pos, name = 0, ""
    for item in _HEADER:
        if item is None:
            while pos < len(text) and text[pos].isspace():
                pos += 1
            continue
        rest = text[pos:]
        if item == "S":
            found = _JSON_STRING.match(rest)
            if found is None:
                return ("more", "", 0) if rest.startswith('"') or not rest else ("fail", "", 0)
            try:
                name = json.loads(found.group())
            except ValueError:
                return "fail", "", 0
            pos += found.end()
        elif rest.startswith(item):
            pos += len(item)
        else:
            return ("more", "", 0) if item.startswith(rest) else ("fail", "", 0)
    if pos == len(text):
        return "more", "", 0
    return ("ok", name, pos) if text[pos] == "{" else ("fail", "", 0)


def _parse_call(body: str) -> tuple[str, str] | None:
    """A whole call body to (name, arguments JSON text), or None when it is not a valid call."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def json_call_rule(function: Mapping[str, Any], strict: bool) -> tuple[str, str | None]:
    """The grammar piece of one Hermes call of a declared tool: `{"name": "<its name>", "arguments": {...}}`, the
    arguments in its parameters' schema (exactly when the tool is strict, else leniently: keywords llguidance lacks
    are ignored, since that schema binds nobody). Returns the Lark right-hand side and, for a strict tool, the
    call's JSON grammar alone (`strata.text.family.CallRule`)."""
    schema = {"type": "object", "properties": {"name": {"const": function["name"]},
                                               "arguments": function.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False}
    text = json_text(schema, lenient=not strict)
    return f"%json {text}", json_grammar(text) if strict else None


class StopMatcher:
    """Cuts streamed text at the first stop string.

    `feed` returns the text that is safe to emit: text that could still be the start of a stop string is held
    back until later text decides. Once a stop string is found (the one that starts first), the text before it is
    returned, the rest (the stop string included) is dropped and `stopped` becomes True.

    Args:
        stops: the stop strings; empty ones are ignored.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(stop for stop in stops if stop)
        self.stopped = False
        self._pending = ""

    def feed(self, text: str) -> str:
        if not self.stops:  # per streamed token: the usual request has no stop strings
            return text
        if self.stopped:
            return ""
        self._pending += text
        found = _first_tag(self._pending, self.stops)
        end = len(self._pending) if found is None else found[0]
        undecided = _first_partial(self._pending, self.stops, end)
        if undecided is not None:
            out, self._pending = self._pending[:undecided], self._pending[undecided:]
            return out
        out, self._pending = self._pending[:end], ("" if found is not None else self._pending[end:])
        self.stopped = found is not None
        return out

    def flush(self) -> str:
        """The text still held back, at the end of the generation (cut at a stop string it holds)."""
        if self.stopped:
            return ""
        found = _first_tag(self._pending, self.stops)
        out, self._pending = self._pending[: None if found is None else found[0]], ""
        self.stopped = found is not None
        return out


def _first_partial(text: str, stops: tuple[str, ...], end: int) -> int | None:
    """The first position before `end` where the rest of `text` is a proper prefix of a stop string."""
    longest = max((len(stop) for stop in stops), default=0)
    for at in range(max(0, len(text) - longest + 1), end):
        if any(stop.startswith(text[at:]) for stop in stops):
            return at
    return None


def _partial_suffix(text: str, tags: Iterable[str]) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    keep = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), keep, -1):
            if tag.startswith(text[-n:]):
                keep = n
                break
    return keep
