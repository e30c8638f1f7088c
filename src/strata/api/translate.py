"""Pieces the dialects' request parsers share: typed access to JSON fields that fails with a 400 naming the field,
sampling, stops, answer formats, tools and pictures in the shapes a `ChatRequest` holds. Pure functions, no I/O.
(The answer's side, events to JSON, is `render`.)"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, Literal, overload

from strata.api.errors import ApiError
from strata.pictures.sources import ImageRejected, ImageSource, decode_base64
from strata.text.constraints import AnswerFormat
from strata.text.prompt import RESERVED_TEMPLATE_VARIABLES
from strata.text.sampling import SamplingError, SamplingParams
from strata.vision.embeds import PrecomputedEmbeds

_TYPE_NAMES = {
    str: "a string",
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    list: "an array",
    dict: "an object",
}


def bad_request(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def check_type(value: Any, kinds: type | tuple[type, ...], param: str) -> Any:
    """Return `value` if it is one of `kinds` (JSON types: bool is not a number, an int is a float)."""
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if not any(_is_kind(value, kind) for kind in kinds):
        expected = " or ".join(_TYPE_NAMES[kind] for kind in kinds)
        raise bad_request(param, f"must be {expected}, got {_json_type(value)}")
    return value


def get(obj: dict[str, Any], key: str, kinds: type | tuple[type, ...], param: str, *, required: bool = False) -> Any:
    """`obj[key]` checked against `kinds`; None when absent or null, unless `required`."""
    value = obj.get(key)
    if value is None:
        if required:
            raise bad_request(param, "is required")
        return None
    return check_type(value, kinds, param)


def get_number(obj: dict[str, Any], key: str, param: str, lo: float, hi: float) -> float | None:
    value = get(obj, key, float, param)
    if value is not None and not lo <= value <= hi:
        raise bad_request(param, f"must be between {lo:g} and {hi:g}, got {value!r}")
    return value


@overload
def get_int(obj: dict[str, Any], key: str, param: str, lo: int, *, required: Literal[True]) -> int: ...
@overload
def get_int(obj: dict[str, Any], key: str, param: str, lo: int, *, required: bool = False) -> int | None: ...
def get_int(obj: dict[str, Any], key: str, param: str, lo: int, *, required: bool = False) -> int | None:
    value = get(obj, key, int, param, required=required)
    if value is not None and value < lo:
        raise bad_request(param, f"must be at least {lo}, got {value!r}")
    return value


@overload
def get_choice(obj: dict[str, Any], key: str, options: Iterable[str], param: str, *,
               required: Literal[True]) -> str: ...
@overload
def get_choice(obj: dict[str, Any], key: str, options: Iterable[str], param: str, *,
               required: bool = False) -> str | None: ...
def get_choice(obj: dict[str, Any], key: str, options: Iterable[str], param: str, *,
               required: bool = False) -> str | None:
    value = get(obj, key, str, param, required=required)
    options = tuple(options)
    if value is not None and value not in options:
        raise bad_request(param, f"must be one of {', '.join(map(repr, options))}, got {value!r}")
    return value


# The `required=True` forms never return None: a missing field is a 400.
@overload
def get_object(obj: dict[str, Any], key: str, param: str, *, required: Literal[True]) -> dict[str, Any]: ...
@overload
def get_object(obj: dict[str, Any], key: str, param: str, *, required: bool = False) -> dict[str, Any] | None: ...
def get_object(obj: dict[str, Any], key: str, param: str, *, required: bool = False) -> dict[str, Any] | None:
    return get(obj, key, dict, param, required=required)


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """`chat_template_kwargs`: extra variables for the chat template (`{"enable_thinking": false}`,
    `{"preserve_thinking": true}`), as llama.cpp and vLLM accept them; an object whose keys are not the template's
    own variables (`RESERVED_TEMPLATE_VARIABLES`)."""
    kwargs = get_object(body, "chat_template_kwargs", "chat_template_kwargs") or {}
    for key in kwargs:
        if key in RESERVED_TEMPLATE_VARIABLES:
            raise bad_request(f"chat_template_kwargs.{key}", "the template's own variable cannot be set here (it "
                              "comes from the request)")
    return dict(kwargs)


@overload
def get_list(obj: dict[str, Any], key: str, param: str, *, required: Literal[True]) -> list[Any]: ...
@overload
def get_list(obj: dict[str, Any], key: str, param: str, *, required: bool = False) -> list[Any] | None: ...
def get_list(obj: dict[str, Any], key: str, param: str, *, required: bool = False) -> list[Any] | None:
    return get(obj, key, list, param, required=required)


MAX_STOPS = 16  # stop strings per request: each is matched against every generated token
MAX_STOP_CHARS = 256


def check_stops(stops: list[Any], param: str) -> list[str]:
    """A request's stop strings: strings, at most `MAX_STOPS` of at most `MAX_STOP_CHARS` characters."""
    if len(stops) > MAX_STOPS:
        raise bad_request(param, f"has {len(stops)} stop strings; at most {MAX_STOPS} are allowed")
    for i, stop in enumerate(stops):
        check_type(stop, str, f"{param}[{i}]")
        if len(stop) > MAX_STOP_CHARS:
            raise bad_request(f"{param}[{i}]", f"is {len(stop)} characters long; at most {MAX_STOP_CHARS}")
    return list(stops)


def sampling_params(defaults: Mapping[str, Any] | None, **given: Any) -> SamplingParams:
    """SamplingParams from the fields a client set (None: not set), over the server's `defaults`."""
    chosen = {**(defaults or {}), **{name: value for name, value in given.items() if value is not None}}
    try:
        return SamplingParams(**chosen)
    except SamplingError as error:
        raise ApiError(400, str(error), param=error.field) from None


def logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: `{"token id": bias}` with biases in [-100, 100]."""
    given = get_object(body, "logit_bias", "logit_bias") or {}
    out = []
    for key, value in given.items():
        if not key.isdigit():
            raise bad_request("logit_bias", f"keys must be token ids, got {key!r}")
        check_type(value, float, f"logit_bias.{key}")
        if not -100 <= value <= 100:
            raise bad_request(f"logit_bias.{key}", f"must be between -100 and 100, got {value!r}")
        out.append((int(key), float(value)))
    return tuple(out)


def arguments_object(text: str, param: str) -> dict[str, Any]:
    """A tool call's arguments JSON as the dict the chat template renders."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as error:
        raise bad_request(param, f"is not valid JSON ({error})") from None
    return check_type(value, dict, param)


def function_tool(name: str, description: str | None, parameters: dict[str, Any], strict: bool = False
                  ) -> dict[str, Any]:
    """A tool in the OpenAI chat shape that `ChatRequest.tools` holds (`strict`: its calls must follow
    `parameters` exactly)."""
    function: dict[str, Any] = {"name": name, "parameters": parameters}
    if description is not None:
        function["description"] = description
    if strict:
        function["strict"] = True
    return {"type": "function", "function": function}


# --- log probabilities

def top_logprobs(body: dict[str, Any], enabled: bool, param: str = "top_logprobs") -> int | None:
    """How many alternatives to report per token (0-20), or None when log-probabilities are off."""
    top = get_int(body, "top_logprobs", param, 0)
    if top is not None and top > 20:
        raise bad_request(param, f"must be at most 20, got {top}")
    if not enabled:
        if top:
            raise bad_request(param, "needs logprobs: true")
        return None
    return top or 0


# --- answer formats

_FORMAT_TYPES = ("text", "json_object", "json_schema")


def openai_format(spec: dict[str, Any], param: str, *, nested: bool) -> AnswerFormat | None:
    """OpenAI's answer format: chat's `response_format` (`nested`: the schema under `json_schema`) or the
    Responses API's flat `text.format`. None for plain text."""
    kind = get_choice(spec, "type", _FORMAT_TYPES, f"{param}.type", required=True)
    if kind == "text":
        return None
    if kind == "json_object":
        return AnswerFormat("json_object", param=param)
    where = f"{param}.json_schema" if nested else param
    body = get_object(spec, "json_schema", where, required=True) if nested else spec
    get(body, "name", str, f"{where}.name")
    get(body, "strict", bool, f"{where}.strict")
    # Chat's schema is optional (then any JSON object will do); the Responses API requires it.
    schema = get_object(body, "schema", f"{where}.schema", required=not nested)
    if schema is None:
        return AnswerFormat("json_object", param=where)
    return schema_format(schema, f"{where}.schema")


def schema_format(schema: Any, param: str) -> AnswerFormat:
    """A JSON schema the answer must validate against."""
    check_type(schema, dict, param)
    return AnswerFormat("json_schema", json.dumps(schema), param)


def llama_cpp_format(body: dict[str, Any]) -> AnswerFormat | None:
    """llama.cpp's request fields `json_schema` (an object) and `grammar` (GBNF text), which its clients send."""
    schema = get_object(body, "json_schema", "json_schema")
    grammar = get(body, "grammar", str, "grammar")
    if schema is not None and grammar:
        raise bad_request("grammar", "send json_schema or grammar, not both")
    if schema is not None:
        return schema_format(schema, "json_schema")
    return AnswerFormat("grammar", grammar, "grammar") if grammar else None


def check_unique_tool_names(tools: list[dict[str, Any]], param: str) -> set[str]:
    names = [tool["function"]["name"] for tool in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise bad_request(f"{param}[{i}].name", f"duplicate tool name {name!r}")
    return set(names)


# --- pictures: a message's content becomes a list of parts when it holds one


def image_url_part(url: str, param: str, in_tool_result: bool) -> dict[str, Any]:
    """A picture at an http(s) or data: URL (fetched and checked by the service, in the request's nursery)."""
    return {"type": "image", "image": ImageSource(param, url=url, in_tool_result=in_tool_result)}


def image_base64_part(data: str, param: str, in_tool_result: bool) -> dict[str, Any]:
    try:
        return {"type": "image", "image": ImageSource(param, data=decode_base64(data), in_tool_result=in_tool_result)}
    except ImageRejected as error:
        raise bad_request(param, str(error)) from None


def image_embeds_part(part: dict[str, Any], param: str, in_tool_result: bool) -> dict[str, Any]:
    """`{"type": "image_embeds", "image_embeds": "<base64 SVE1>", "fingerprint": "sha256:..."}`."""
    data = get(part, "image_embeds", str, f"{param}.image_embeds", required=True)
    fingerprint = get(part, "fingerprint", str, f"{param}.fingerprint", required=True)
    try:
        raw = decode_base64(data, "image_embeds")
    except ImageRejected as error:
        raise bad_request(f"{param}.image_embeds", str(error)) from None
    return {"type": "image", "image": PrecomputedEmbeds(param, raw, fingerprint, in_tool_result)}


def join_parts(parts: list[str | dict[str, Any]], separator: str) -> str | list[dict[str, Any]]:
    """Texts joined by `separator`, as a string when there is no picture, else as a list of text and image parts
    (what the chat template renders)."""
    if all(isinstance(part, str) for part in parts):
        return separator.join(parts)  # type: ignore[arg-type]
    out: list[dict[str, Any]] = []
    for i, part in enumerate(parts):
        if i and separator:
            out.append({"type": "text", "text": separator})
        out.append({"type": "text", "text": part} if isinstance(part, str) else part)
    return out


def _is_kind(value: Any, kind: type) -> bool:
    if kind in (int, float) and isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


def _json_type(value: Any) -> str:
    for kind in (bool, str, int, float, list, dict):
        if isinstance(value, kind):
            return _TYPE_NAMES[kind]
    return "null" if value is None else type(value).__name__
