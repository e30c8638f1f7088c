"""Tool calls in the XML syntax that Qwen3.5/3.6's chat template renders (Qwen3-Coder's too): the streamed parser and
the grammar of one call.

A call is `<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>`.
A value is the model's raw text, read by the type the tool's JSON schema gives its parameter, as vLLM's
`qwen3_coder` parser reads it: a string parameter (or one whose schema names no type and no value) is the text as
written; any other is parsed as JSON and stays text when it does not parse. The template writes them back the same
way (strings as they are, objects and arrays as JSON).

The arguments stream to clients as the JSON object of those values: `{` once the function's name is known, a string
parameter's text as it comes (escaped), any other parameter once its closing tag arrives, `}` at `</function>`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from strata.events import Event, TextDelta, ToolCallArgumentsDelta, ToolCallStart
from strata.text.constraints import json_text
from strata.text.family import ModelFamily
from strata.text.toolcalls import (
    _CALL_ARGS,
    _CALL_BUFFERED,
    _CALL_TAIL,
    _TEXT,
    ToolCallParser,
    _parse_call,
    _partial_suffix,
    new_call_id,
)

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")
_WHOLE_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_WHOLE_CALL = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?$", re.DOTALL)
_VALUE_END = "\n</parameter>"
_FUNCTION_END = "</function>"
# Keywords that say a schema without a `type` describes a JSON value (not raw text).
_VALUE_KEYWORDS = ("enum", "const", "anyOf", "oneOf", "allOf", "$ref", "properties", "items")
# String keywords the raw-text grammar cannot hold a value to (a strict tool that uses one is refused). `format` is
# not among them: JSON Schema makes it an annotation unless a schema opts into asserting it, and tool schemas carry
# it often (`"format": "uri"`), so a text value is not held to it.
_TEXT_KEYWORDS = ("pattern", "minLength", "maxLength")

# The grammar of a raw-text value with its closing tag: any text that does not hold the closing tag itself
# (one lexeme, so that where the value ends is never ambiguous).
XML_TEXT = "XML_TEXT"
XML_TEXT_RULE = (XML_TEXT + r": /(?s:.*)\n<\/parameter>\n/ & ~/(?s:.*)\n<\/parameter>\n(?s:.+)/")


def is_raw_text(schema: Any) -> bool:
    """Whether a parameter's value is its raw text: its schema's type is "string", or it names no type and no
    JSON value (no schema at all, `{}`, only a description)."""
    if not isinstance(schema, Mapping):
        return True
    kind = schema.get("type")
    if kind is None:
        return not any(key in schema for key in _VALUE_KEYWORDS)
    return kind == "string"


def parameter_value(text: str, schema: Any) -> Any:
    """A parameter's value from its raw text, by its schema (`is_raw_text`; JSON otherwise, falling back to the
    text; `True`/`False`, as the template writes Python booleans back, read as booleans)."""
    if is_raw_text(schema):
        return text
    try:
        return json.loads(text)
    except ValueError:
        if text.strip().lower() in ("true", "false"):
            return text.strip().lower() == "true"
        return text


def _properties(parameters: Any) -> Mapping[str, Any]:
    properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
    return properties if isinstance(properties, Mapping) else {}


class XmlToolCallParser(ToolCallParser):
    """`ToolCallParser` for the XML call syntax: reasoning, text and the call markers as there; a call's body is
    `<function=NAME>` and its `<parameter=…>` blocks (see the module's docstring for the values and how the
    arguments stream).

    A body that does not start as `<function=NAME>` is buffered to the closing marker and parsed whole: as XML, or
    as a Hermes JSON call (a model may write either); otherwise, or when it names a tool that was not declared, it is
    emitted unchanged as text. A generation that stops inside a call's parameters closes the arguments object with
    what came.

    Args:
        family, starts_in_reasoning, parse_tool_calls: as for `ToolCallParser`.
        tools: the declared tools' parameter schemas by name, which type the values; None accepts any name and reads
            every value as text.
    """

    def __init__(self, family: ModelFamily, starts_in_reasoning: bool = False, parse_tool_calls: bool = True,
                 tools: Mapping[str, Any] | None = None) -> None:
        super().__init__(family, starts_in_reasoning, parse_tool_calls, tools)
        self._schemas: Mapping[str, Any] = {}  # the current call's parameters' schemas
        self._parameter: str | None = None  # the parameter whose value is arriving
        self._streaming = False  # its value streams as a JSON string
        self._value = ""  # a value that does not stream, so far
        self._line_start = False  # the value has not begun: a newline right after `<parameter=…>` is the format's
        self._n_parameters = 0

    def finish(self) -> list[Event]:
        if self._state != _CALL_ARGS:
            return super().finish()
        events: list[Event] = []
        rest, self._pending = self._pending, ""
        if self._parameter is not None:
            rest = rest[: len(rest) - _partial_suffix(rest, (_VALUE_END,))]
            if self._line_start:
                rest = rest.removeprefix("\n")
            self._value_piece(events, rest.removesuffix("\n"))
            self._end_parameter(events)
        self._arguments(events, "}")
        self._state = _TEXT
        return events

    # --- the call's body

    def _step_header(self, events: list[Event]) -> bool:
        # Invariant: only text before the first closing marker decides (as in the Hermes parser).
        close = self._pending.find(self._call_close)
        head = self._pending if close < 0 else self._pending[:close]
        found = _FUNCTION.match(head)
        if found is None and close < 0 and _header_prefix(head):
            return False
        if found is None or not self._declared(found.group(1)):
            self._state = _CALL_BUFFERED
            return True
        name = found.group(1)
        events.append(ToolCallStart(self._n_calls, new_call_id(), name))
        self._n_calls += 1
        self._pending = self._pending[found.end():]
        tools = self._tool_names
        self._schemas = _properties(tools.get(name)) if isinstance(tools, Mapping) else {}
        self._parameter, self._n_parameters = None, 0
        self._arguments(events, "{")
        self._state = _CALL_ARGS
        return True

    def _step_args(self, events: list[Event]) -> bool:
        if self._parameter is not None:
            return self._step_value(events)
        text = self._pending.lstrip()
        if text.startswith((_FUNCTION_END, self._call_close)):  # the call's end (its closing marker: a call that
            self._pending = text.removeprefix(_FUNCTION_END)   # left out `</function>`)
            self._arguments(events, "}")
            self._state = _CALL_TAIL
            return True
        found = _PARAMETER.match(self._pending)
        if found is not None:
            self._begin_parameter(events, found.group(1))
            self._pending = self._pending[found.end():]
            return True
        if _tag_prefix(text, ("<parameter=", _FUNCTION_END, self._call_close)):
            self._pending = text
            return False
        # Text out of the format between parameters: skipped up to the next tag.
        at = text.find("<", 1)
        self._pending = text[at:] if at >= 0 else ""
        return at >= 0

    def _step_value(self, events: list[Event]) -> bool:
        if self._line_start:
            if not self._pending:
                return False
            self._pending = self._pending.removeprefix("\n")
            self._line_start = False
        at = self._pending.find(_VALUE_END)
        if at < 0:
            keep = _partial_suffix(self._pending, (_VALUE_END,))
            upto = len(self._pending) - keep
            self._value_piece(events, self._pending[:upto])
            self._pending = self._pending[upto:]
            return False
        self._value_piece(events, self._pending[:at])
        self._pending = self._pending[at + len(_VALUE_END):]
        self._end_parameter(events)
        return True

    def _begin_parameter(self, events: list[Event], name: str) -> None:
        self._parameter, self._value, self._line_start = name, "", True
        self._streaming = is_raw_text(self._schemas.get(name))
        separator = ", " if self._n_parameters else ""
        self._n_parameters += 1
        self._arguments(events, f"{separator}{json.dumps(name, ensure_ascii=False)}: " + ('"' if self._streaming
                                                                                          else ""))

    def _value_piece(self, events: list[Event], text: str) -> None:
        if not text:
            return
        if self._streaming:
            self._arguments(events, json.dumps(text, ensure_ascii=False)[1:-1])
        else:
            self._value += text

    def _end_parameter(self, events: list[Event]) -> None:
        name, self._parameter = self._parameter, None
        if self._streaming:
            self._arguments(events, '"')
        else:
            value = parameter_value(self._value, self._schemas.get(name or ""))
            self._arguments(events, json.dumps(value, ensure_ascii=False))

    def _arguments(self, events: list[Event], text: str) -> None:
        events.append(ToolCallArgumentsDelta(self._n_calls - 1, text))

    def _whole_call(self, body: str, closed: bool) -> list[Event]:
        call = _parse_xml_call(body, self._tool_names) or _parse_call(body)
        if call is None or not self._declared(call[0]):
            return [TextDelta(self._call_open + body + (self._call_close if closed else ""))]
        name, arguments = call
        index, self._n_calls = self._n_calls, self._n_calls + 1
        return [ToolCallStart(index, new_call_id(), name), ToolCallArgumentsDelta(index, arguments)]


def _header_prefix(text: str) -> bool:
    """Whether `text` may still become the start of a call body, `<function=NAME>`."""
    return _tag_prefix(text.lstrip(), ("<function=",))


def _tag_prefix(text: str, tags: tuple[str, ...]) -> bool:
    """Whether `text` is a prefix of one of `tags`, or one of the `<name=` tags with its name not yet closed."""
    return any(tag.startswith(text) or (tag.endswith("=") and text.startswith(tag) and ">" not in text
                                        and "\n" not in text) for tag in tags)


def _parse_xml_call(body: str, tools: Any) -> tuple[str, str] | None:
    """A whole XML call body to (name, arguments JSON text), or None when it is not one."""
    found = _WHOLE_CALL.match(body)
    if found is None:
        return None
    name = found.group(1)
    schemas = _properties(tools.get(name)) if isinstance(tools, Mapping) else {}
    arguments = {key: parameter_value(value, schemas.get(key)) for key, value in
                 _WHOLE_PARAMETER.findall(found.group(2))}
    return name, json.dumps(arguments, ensure_ascii=False)


# --- the grammar of one call


def xml_call_rule(function: Mapping[str, Any], strict: bool) -> tuple[str, str | None]:
    """The grammar piece of one XML call of a declared tool: `<function=NAME>\\n`, its parameters in the order
    its schema declares them (the required ones always, the others optionally), `</function>`. A raw-text
    parameter (`is_raw_text`) is any text without the closing tag (one of its `enum` values, when it has them);
    any other is JSON in its schema (exactly when the tool is strict, else leniently). A tool whose schema declares
    no properties takes any parameters as text. Returns the Lark right-hand side (it uses `XML_TEXT_RULE`) and,
    for a strict tool, the grammar of the call alone (`strata.text.family.CallRule`).

    Raises:
        ValueError: a strict tool's text parameter with a keyword the raw text cannot be held to (`pattern`,
            `minLength`, `maxLength`; `format` is not held either, and not refused), naming its path in the
            parameters' schema.
    """
    parameters = function.get("parameters") or {}
    properties = _properties(parameters)
    required = set(parameters.get("required") or ()) if isinstance(parameters, Mapping) else set()
    pieces = []
    for key, schema in properties.items():
        piece = f'"<parameter={_inside_literal(key)}>\\n" {_value_rule(key, schema, strict)}'
        pieces.append(piece if key in required else f"({piece})?")
    if not properties:
        pieces.append(f'("<parameter=" /[^>\\n]+/ ">\\n" {XML_TEXT})*')
    rule = f'"<function={_inside_literal(function["name"])}>\\n" {" ".join(pieces)} "</function>"'
    if not strict:
        return rule, None
    import llguidance

    return rule, llguidance.LLMatcher.grammar_from_lark(f"start: {rule}\n{XML_TEXT_RULE}\n")


def _value_rule(key: str, schema: Any, strict: bool) -> str:
    if not is_raw_text(schema):
        return f'%json {json_text(schema, lenient=not strict)} "\\n</parameter>\\n"'
    if isinstance(schema, Mapping):
        choices = schema.get("enum") if isinstance(schema.get("enum"), list) else None
        if "const" in schema:
            choices = [schema["const"]]
        if choices is not None and all(isinstance(choice, str) for choice in choices):
            return f'({" | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)}) "\\n</parameter>\\n"'
        unsupported = [word for word in _TEXT_KEYWORDS if word in schema]
        if strict and unsupported:
            raise ValueError(f"properties.{key}.{unsupported[0]}: a text parameter cannot be held to "
                             f"`{unsupported[0]}` in this model's tool-call syntax (its values are raw text); "
                             "drop it or the tool's strict flag")
    return XML_TEXT


def _inside_literal(text: str) -> str:
    """`text` escaped to stand inside a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)[1:-1]
