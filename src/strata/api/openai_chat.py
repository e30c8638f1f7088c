"""OpenAI chat completions (`POST /v1/chat/completions`): request JSON to a `ChatRequest`, events to SSE chunks
and the completion they add up to. Pure translation, no I/O."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, final

from strata.api.errors import ApiError
from strata.api.render import Renderer, SseEvent, openai_logprob, unfinished
from strata.api.translate import (
    arguments_object,
    bad_request,
    check_stops,
    check_type,
    check_unique_tool_names,
    function_tool,
    get,
    get_choice,
    get_int,
    get_list,
    get_number,
    get_object,
    image_embeds_part,
    image_url_part,
    llama_cpp_format,
    logit_bias,
    openai_format,
    template_kwargs,
    top_logprobs,
)
from strata.events import (
    ChatRequest,
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
from strata.text.constraints import AnswerFormat
from strata.text.sampling import SamplingError, SamplingParams

_ROLES = ("system", "developer", "user", "assistant", "tool")
_EFFORTS = ("none", "minimal", "low", "medium", "high")
_NO_THINKING_EFFORTS = ("none", "minimal")
# body key -> (SamplingParams field, lowest, highest)
_SAMPLING_RANGES = {
    "temperature": ("temperature", 0.0, 2.0),
    "top_p": ("top_p", 0.0, 1.0),
    "min_p": ("min_p", 0.0, 1.0),
    "frequency_penalty": ("frequency_penalty", -2.0, 2.0),
    "presence_penalty": ("presence_penalty", -2.0, 2.0),
    "repetition_penalty": ("repetition_penalty", 0.0, 10.0),
}


# --- requests


def parse_request(body: Any) -> ChatRequest:
    """Validate a chat completions body into a `ChatRequest`.

    Raises:
        ApiError: 400 naming the field at fault.
    """
    body = check_type(body, dict, "body")
    messages = get_list(body, "messages", "messages", required=True)
    if not messages:
        raise bad_request("messages", "must not be empty")
    if get_int(body, "n", "n", 1) not in (None, 1):
        raise bad_request("n", "only n=1 is supported")
    _refuse_unsupported(body)
    tools = _tools(body)
    tool_choice = _tool_choice(body, {tool["function"]["name"] for tool in tools})
    effort = get_choice(body, "reasoning_effort", _EFFORTS, "reasoning_effort")
    return ChatRequest(
        messages=[_message(message, f"messages[{i}]") for i, message in enumerate(messages)],
        tools=[] if tool_choice == "none" else tools,
        tool_choice=tool_choice,
        parallel_tool_calls=get(body, "parallel_tool_calls", bool, "parallel_tool_calls") is not False,
        answer_format=_answer_format(body),
        prefill=_continue_final_message(body, messages),
        logprobs=top_logprobs(body, bool(get(body, "logprobs", bool, "logprobs"))),
        sampling=sampling_from(body),
        max_tokens=_max_tokens(body),
        stop=stops_from(body),
        enable_thinking=effort not in _NO_THINKING_EFFORTS,
        template_kwargs=template_kwargs(body),
        route="chat",
        prediction=_prediction(body),
    )


# Fields that would change the answer in ways this server cannot: refused, never silently ignored.
_UNSUPPORTED = (
    ("audio", "audio output is not supported"),
    ("web_search_options", "web search is not supported"),
)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for key, why in _UNSUPPORTED:
        if body.get(key) is not None:
            raise bad_request(key, why)
    modalities = get_list(body, "modalities", "modalities") or []
    for i, modality in enumerate(modalities):
        if modality != "text":
            raise bad_request(f"modalities[{i}]", f"only text output is supported, got {modality!r}")


def _prediction(body: dict[str, Any]) -> str | None:
    """OpenAI's Predicted Outputs: `{"type": "content", "content": text or [text parts]}`, the answer's text as
    the client expects it (drafts for speculative decoding: the answer itself is the model's)."""
    prediction = get_object(body, "prediction", "prediction")
    if prediction is None:
        return None
    if get(prediction, "type", str, "prediction.type", required=True) != "content":
        raise bad_request("prediction.type", 'must be "content"')
    content = prediction.get("content")
    if isinstance(content, str):
        return content
    parts = get_list(prediction, "content", "prediction.content", required=True) or []
    texts = []
    for i, part in enumerate(parts):
        if get(part, "type", str, f"prediction.content[{i}].type", required=True) != "text":
            raise bad_request(f"prediction.content[{i}].type", 'must be "text"')
        texts.append(get(part, "text", str, f"prediction.content[{i}].text", required=True))
    return "".join(texts)


def _continue_final_message(body: dict[str, Any], messages: list[Any]) -> bool:
    """vLLM's `continue_final_message`: the answer continues the last (assistant) message."""
    if not get(body, "continue_final_message", bool, "continue_final_message"):
        return False
    if not isinstance(messages[-1], dict) or messages[-1].get("role") != "assistant":
        raise bad_request("continue_final_message", "needs an assistant message last")
    return True


def _answer_format(body: dict[str, Any]) -> AnswerFormat | None:
    response_format = get_object(body, "response_format", "response_format")
    chosen = openai_format(response_format, "response_format", nested=True) if response_format else None
    extension = llama_cpp_format(body)
    if chosen is not None and extension is not None:
        raise bad_request(extension.param, "send response_format or this field, not both")
    return chosen or extension


def wants_stream(body: dict[str, Any]) -> bool:
    return bool(get(body, "stream", bool, "stream"))


def include_usage(body: dict[str, Any]) -> bool:
    options = get_object(body, "stream_options", "stream_options") or {}
    return bool(get(options, "include_usage", bool, "stream_options.include_usage"))


def _message(message: Any, param: str) -> dict[str, Any]:
    message = check_type(message, dict, param)
    role = get(message, "role", str, f"{param}.role", required=True)
    if role not in _ROLES:
        raise bad_request(f"{param}.role", f"unknown role {role!r} (expected one of {', '.join(_ROLES)})")
    out: dict[str, Any] = {"role": role,
                           "content": _content(message.get("content"), f"{param}.content", role == "tool")}
    if role == "assistant":
        calls = get_list(message, "tool_calls", f"{param}.tool_calls") or []
        if calls:
            out["tool_calls"] = [_tool_call(call, f"{param}.tool_calls[{i}]") for i, call in enumerate(calls)]
        reasoning = get(message, "reasoning_content", str, f"{param}.reasoning_content")
        if reasoning:
            out["reasoning_content"] = reasoning
    elif role == "tool":
        out["tool_call_id"] = get(message, "tool_call_id", str, f"{param}.tool_call_id") or ""
    elif out["content"] is None:
        raise bad_request(f"{param}.content", "is required")
    return out


def _content(content: Any, param: str, in_tool_result: bool) -> str | list[dict[str, Any]] | None:
    if content is None or isinstance(content, str):
        return content
    parts = check_type(content, list, param)
    out = []
    for i, part in enumerate(parts):
        where = f"{param}[{i}]"
        part = check_type(part, dict, where)
        kind = get(part, "type", str, f"{where}.type", required=True)
        if kind == "text":
            out.append({"type": "text", "text": get(part, "text", str, f"{where}.text", required=True)})
        elif kind == "image_url":
            out.append(image_url_part(_image_url(part, where), where, in_tool_result))
        elif kind == "image_embeds":
            out.append(image_embeds_part(part, where, in_tool_result))
        else:
            raise bad_request(f"{where}.type", f"unknown content part type {kind!r}")
    return out


def _image_url(part: dict[str, Any], param: str) -> str:
    """`image_url` is `{"url": ..., "detail": ...}` (or, from some clients, the URL itself)."""
    value = get(part, "image_url", (dict, str), f"{param}.image_url", required=True)
    if isinstance(value, str):
        return value
    return get(value, "url", str, f"{param}.image_url.url", required=True)


def _tool_call(call: Any, param: str) -> dict[str, Any]:
    call = check_type(call, dict, param)
    function = get_object(call, "function", f"{param}.function", required=True)
    name = get(function, "name", str, f"{param}.function.name", required=True)
    arguments = function.get("arguments")
    if not isinstance(arguments, dict):
        text = get(function, "arguments", str, f"{param}.function.arguments") or ""
        arguments = arguments_object(text, f"{param}.function.arguments")
    return {"id": get(call, "id", str, f"{param}.id") or "", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    tools = []
    for i, tool in enumerate(get_list(body, "tools", "tools") or []):
        param = f"tools[{i}]"
        tool = check_type(tool, dict, param)
        if get(tool, "type", str, f"{param}.type") not in (None, "function"):
            raise bad_request(f"{param}.type", "only function tools are supported")
        function = get_object(tool, "function", f"{param}.function", required=True)
        name = get(function, "name", str, f"{param}.function.name", required=True)
        description = get(function, "description", str, f"{param}.function.description")
        parameters = get_object(function, "parameters", f"{param}.function.parameters") or {
            "type": "object", "properties": {}}
        strict = get(function, "strict", bool, f"{param}.function.strict")
        tools.append(function_tool(name, description, parameters, bool(strict)))
    check_unique_tool_names(tools, "tools")
    return tools


def _tool_choice(body: dict[str, Any], names: set[str]) -> str | dict[str, Any] | None:
    choice = body.get("tool_choice")
    if choice is None:
        return None
    if isinstance(choice, str):
        return get_choice(body, "tool_choice", ("none", "auto", "required"), "tool_choice")
    choice = check_type(choice, dict, "tool_choice")
    function = get_object(choice, "function", "tool_choice.function", required=True)
    name = get(function, "name", str, "tool_choice.function.name", required=True)
    if name not in names:
        raise bad_request("tool_choice.function.name", f"no tool named {name!r}")
    return {"type": "function", "function": {"name": name}}


def sampling_from(body: dict[str, Any]) -> SamplingParams:
    given: dict[str, Any] = {}
    for key, (name, lo, hi) in _SAMPLING_RANGES.items():
        value = get_number(body, key, key, lo, hi)
        if value is not None:
            given[name] = value
    bias = logit_bias(body)
    if bias:
        given["logit_bias"] = bias
    for key in ("top_k", "seed"):
        value = get_int(body, key, key, 0 if key == "top_k" else -(2**63))
        if value is not None:
            given[key] = value
    try:
        return SamplingParams(**given)
    except SamplingError as error:
        raise ApiError(400, str(error), param=error.field) from None


def _max_tokens(body: dict[str, Any]) -> int | None:
    value = get_int(body, "max_completion_tokens", "max_completion_tokens", 1)
    return value if value is not None else get_int(body, "max_tokens", "max_tokens", 1)


def stops_from(body: dict[str, Any]) -> list[str]:
    stop = get(body, "stop", (str, list), "stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return check_stops([stop], "stop")
    return check_stops(stop, "stop")


# --- responses

_FINISH_REASONS = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}


def usage_json(usage: Usage | None) -> dict[str, Any]:
    usage = usage or Usage(0, 0, 0)
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens} | ({
            "accepted_prediction_tokens": usage.accepted_prediction_tokens or 0,
            "rejected_prediction_tokens": usage.rejected_prediction_tokens or 0,
        } if usage.accepted_prediction_tokens is not None else {}),
    }


def stream_error(error: ApiError) -> list[SseEvent]:
    """The event that ends an OpenAI stream (chat or completions) the server cannot finish."""
    return [("", {"error": {"message": error.message, "type": error.kind, "param": error.param,
                            "code": error.code}})]


def _logprobs_json(entries: list[TokenLogprob]) -> dict[str, Any] | None:
    """OpenAI's `logprobs`: `content` for the answer's tokens; the reasoning's under `reasoning_content` (named
    after the message field their text is in; OpenAI itself reports none)."""
    if not entries:
        return None
    out: dict[str, Any] = {"content": [openai_logprob(entry) for entry in entries if not entry.reasoning],
                           "refusal": None}
    reasoning = [openai_logprob(entry) for entry in entries if entry.reasoning]
    if reasoning:
        out["reasoning_content"] = reasoning
    return out


@final
class ChatRenderer(Renderer):
    """The `chat.completion.chunk` stream of one generation, and the `chat.completion` it adds up to.

    The sequence: a first chunk with the role, then one chunk per delta (`content`, `reasoning_content`, or
    `tool_calls` entries — a call's id, type and name first, then pieces of its arguments), a last chunk with
    `finish_reason`, with `include_usage` one more chunk with no choices and the usage, then `[DONE]` (sent by
    the caller). Chunk events have no SSE event name. A failed generation ends with an error event instead.

    Args:
        model: the model name to report.
        request_id: the server's id of this request; the completion id is `chatcmpl-` + it.
        include_usage: end the stream with the usage chunk (the client's `stream_options.include_usage`).
    """

    def __init__(self, *, model: str, request_id: str, include_usage: bool = False):
        super().__init__()
        self._head = {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk",
                      "created": int(time.time()), "model": model}
        self._include_usage = include_usage
        self._usage: Usage | None = None
        self._logprobs: list[TokenLogprob] = []  # waiting for the chunk of their text

    def on_start(self, first: Event | None) -> list[SseEvent]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def on_text(self, event: TextDelta) -> list[SseEvent]:
        return [self._chunk({"content": event.text})] if event.text else []

    def on_reasoning(self, event: ReasoningDelta) -> list[SseEvent]:
        return [self._chunk({"reasoning_content": event.text})] if event.text else []

    def on_tool_call(self, event: ToolCallStart) -> list[SseEvent]:
        call = {"index": event.index, "id": event.id, "type": "function",
                "function": {"name": event.name, "arguments": ""}}
        return [self._chunk({"tool_calls": [call]})]

    def on_tool_arguments(self, event: ToolCallArgumentsDelta) -> list[SseEvent]:
        if not event.text:
            return []
        return [self._chunk({"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})]

    def on_logprob(self, event: TokenLogprob) -> list[SseEvent]:
        self._logprobs.append(event)
        return []

    def on_prompt_logprobs(self, event: PromptLogprobs) -> list[SseEvent]:
        return []  # a chat prompt is never echoed

    def on_prompt(self, event: PromptProcessed) -> list[SseEvent]:
        return []

    def on_tool_list(self, event: McpToolList) -> list[SseEvent]:
        return []  # chat requests name no MCP servers

    def on_tool_result(self, event: ToolResult) -> list[SseEvent]:
        return []

    def on_usage(self, event: Usage) -> list[SseEvent]:
        self._usage = event
        return []

    def on_finish(self, event: Finish) -> list[SseEvent]:
        error = unfinished(event)
        if error is not None:
            return self.error(error)
        out = [self._chunk({}, finish_reason=_FINISH_REASONS[event.reason])]
        if self._include_usage or self.folding:
            out.append(("", {**self._head, "choices": [], "usage": usage_json(self._usage)}))
        return out

    def on_error(self, error: ApiError) -> list[SseEvent]:
        return stream_error(error)

    def fold(self, stream: Iterable[SseEvent]) -> dict[str, Any]:
        message = _Message()
        for _, chunk in stream:
            message.add(chunk)
        return message.completion(self._head)

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> SseEvent:
        logprobs = None
        if self._logprobs:
            logprobs, self._logprobs = _logprobs_json(self._logprobs), []
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
        chunk: dict[str, Any] = {**self._head, "choices": [choice]}
        if self._include_usage:
            chunk["usage"] = None
        return ("", chunk)


class _Message:
    """A `chat.completion` accumulated from its chunks, as the OpenAI SDK accumulates a stream: the deltas'
    texts joined, each tool call's pieces joined by its index, the logprobs' lists joined."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.logprobs: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def add(self, chunk: dict[str, Any]) -> None:
        if not chunk["choices"]:
            self.usage = chunk["usage"]
            return
        choice = chunk["choices"][0]
        delta = choice["delta"]
        self.content.append(delta.get("content") or "")
        self.reasoning.append(delta.get("reasoning_content") or "")
        for piece in delta.get("tool_calls", ()):
            self._add_call(piece)
        if choice["logprobs"] is not None:
            self._add_logprobs(choice["logprobs"])
        self.finish_reason = choice["finish_reason"] or self.finish_reason

    def completion(self, head: dict[str, Any]) -> dict[str, Any]:
        text, reasoning = "".join(self.content), "".join(self.reasoning)
        calls = [{"id": call["id"], "type": "function", "function": {"name": call["name"],
                                                                     "arguments": "".join(call["arguments"])}}
                 for call in self.calls.values()]
        message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return {
            **head,
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "finish_reason": self.finish_reason,
                         "logprobs": self.logprobs}],
            "usage": self.usage,
        }

    def _add_call(self, piece: dict[str, Any]) -> None:
        function = piece["function"]
        if piece["index"] not in self.calls:
            self.calls[piece["index"]] = {"id": piece["id"], "name": function["name"], "arguments": []}
        self.calls[piece["index"]]["arguments"].append(function["arguments"])

    def _add_logprobs(self, logprobs: dict[str, Any]) -> None:
        if self.logprobs is None:
            self.logprobs = {"content": [], "refusal": None}
        self.logprobs["content"] += logprobs["content"]
        if "reasoning_content" in logprobs:
            self.logprobs.setdefault("reasoning_content", []).extend(logprobs["reasoning_content"])
