"""The OpenAI Responses dialect (`POST /v1/responses`): request JSON to a `ChatRequest`, generation events to the
Responses stream of events and the response it adds up to. Pure translation, no I/O.

Strata keeps no responses: everything that needs a stored one (`previous_response_id`, `store: true`,
`conversation`, `background`, item references) is refused with a 400, and so are the built-in tools but `mcp`;
function tools work. `mcp` tools name MCP servers the server calls itself (`mcp_list_tools` and `mcp_call` items);
approvals are not supported, so `require_approval` must be "never" when given. Reasoning comes out as `reasoning`
items whose `content` holds the model's own reasoning text (`reasoning_text` parts, streamed as
`response.reasoning_text.delta`), as open-weight servers do.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, final

from strata.api.errors import ApiError
from strata.api.render import Renderer, SseEvent, openai_logprob
from strata.api.translate import (
    arguments_object,
    bad_request,
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
    join_parts,
    openai_format,
    sampling_params,
    template_kwargs,
    top_logprobs,
)
from strata.events import (
    ChatRequest,
    Event,
    Finish,
    McpToolList,
    McpUse,
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

_ROUTE = "responses"
# Assistant turns hold the server's own output parts; some clients send that text back as input_text.
_ASSISTANT_PARTS = ("output_text", "input_text", "refusal")
_INPUT_PARTS = ("input_text", "input_image", "input_file", "image_embeds")
_NO_THINKING_EFFORTS = ("none", "minimal")
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# Fields that only make sense with responses stored on the server: (field, why it is refused).
_STATEFUL = (
    ("previous_response_id", "this server keeps no responses; send the whole conversation in input"),
    ("conversation", "this server keeps no conversations; send the whole conversation in input"),
    ("prompt", "stored prompts are not supported"),
)
# Finish reason -> (response status, closing stream event).
_ENDINGS = {
    "stop": ("completed", "response.completed"),
    "tool_calls": ("completed", "response.completed"),
    "length": ("incomplete", "response.incomplete"),
    "error": ("failed", "response.failed"),
    "cancel": ("cancelled", "response.failed"),
}


# --- requests

def parse_request(body: Any, *, sampling_defaults: Mapping[str, Any] | None = None) -> ChatRequest:
    """Translate a `POST /v1/responses` body.

    Args:
        body: the decoded JSON body.
        sampling_defaults: the server's `SamplingParams` field values for what the client leaves out.

    Raises:
        ApiError: 400 naming the field at fault (`param`), also for the stateful features and built-in tools;
            pictures are refused with a 400 once their part is found well-formed.
    """
    body = check_type(body, dict, "body")
    get(body, "model", str, "model", required=True)
    get(body, "stream", bool, "stream")
    _refuse_stateful(body)
    answer_format = _text_format(body)
    messages = []
    instructions = get(body, "instructions", str, "instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    listed: set[str] = set()
    messages += _input(get(body, "input", (str, list), "input", required=True), listed)
    tools, servers = _tools(body, listed)
    return ChatRequest(
        messages=messages,
        tools=tools,
        tool_fields=_tool_fields(body),
        mcp=servers,
        tool_choice=_tool_choice(body, check_unique_tool_names(tools, "tools")),
        parallel_tool_calls=get(body, "parallel_tool_calls", bool, "parallel_tool_calls") is not False,
        answer_format=answer_format,
        logprobs=top_logprobs(body, _LOGPROBS in _include(body)),
        sampling=sampling_params(
            sampling_defaults,
            temperature=get_number(body, "temperature", "temperature", 0.0, 2.0),
            top_p=get_number(body, "top_p", "top_p", 0.0, 1.0),
        ),
        max_tokens=get_int(body, "max_output_tokens", "max_output_tokens", 1),
        enable_thinking=_thinking(body),
        template_kwargs=template_kwargs(body),
        route=_ROUTE,
    )


def parse_count_request(body: Any) -> ChatRequest:
    """Translate a `POST /v1/responses/input_tokens` body: a response request whose model may be left out."""
    body = check_type(body, dict, "body")
    return parse_request({"model": "", **body} if body.get("model") is None else body)


def _refuse_stateful(body: dict[str, Any]) -> None:
    for key, why in _STATEFUL:
        if body.get(key) is not None:
            raise bad_request(key, why)
    if get(body, "store", bool, "store"):
        raise bad_request("store", "this server keeps no responses; send store: false")
    if get(body, "background", bool, "background"):
        raise bad_request("background", "background responses are not supported")


_LOGPROBS = "message.output_text.logprobs"
_INCLUDABLE = (_LOGPROBS, "reasoning.encrypted_content")  # nothing is encrypted here: that one adds nothing


def _include(body: dict[str, Any]) -> list[str]:
    items = get_list(body, "include", "include") or []
    for i, item in enumerate(items):
        if check_type(item, str, f"include[{i}]") not in _INCLUDABLE:
            raise bad_request(f"include[{i}]", f"{item!r} is not supported (supported: {', '.join(_INCLUDABLE)})")
    return items


def _text_format(body: dict[str, Any]) -> AnswerFormat | None:
    text = get_object(body, "text", "text")
    text_format = get_object(text, "format", "text.format") if text else None
    return openai_format(text_format, "text.format", nested=False) if text_format is not None else None


def _input(items: str | list[Any], listed: set[str]) -> list[dict[str, Any]]:
    """Input items as chat messages: function calls join the assistant message before them, function outputs
    become `tool` messages, reasoning goes with the assistant message that follows it; an `mcp_call` is a call
    and its output; the labels of `mcp_list_tools` items go to `listed`."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise bad_request("input", "must hold at least one item")
    builder = _Conversation()
    for i, item in enumerate(items):
        param = f"input[{i}]"
        item = check_type(item, dict, param)
        kind = get(item, "type", str, f"{param}.type") or "message"
        if kind == "message":
            builder.message(item, param)
        elif kind == "function_call":
            builder.function_call(item, param)
        elif kind == "function_call_output":
            builder.function_call_output(item, param)
        elif kind == "reasoning":
            builder.reasoning(item, param)
        elif kind == "mcp_call":
            builder.mcp_call(item, param)
        elif kind == "mcp_list_tools":
            listed.add(get(item, "server_label", str, f"{param}.server_label", required=True))
        elif kind in ("mcp_approval_request", "mcp_approval_response"):
            raise bad_request(f"{param}.type", "MCP approvals are not supported (this server runs MCP tools with "
                                               'require_approval "never")')
        elif kind == "item_reference":
            raise bad_request(param, "this server keeps no items; send the item itself")
        else:
            raise bad_request(f"{param}.type", f"input item type {kind!r} is not supported")
    return builder.messages


@dataclass
class _Conversation:
    messages: list[dict[str, Any]] = field(default_factory=list)
    pending_reasoning: list[str] = field(default_factory=list)  # reasoning for the next assistant message

    def message(self, item: dict[str, Any], param: str) -> None:
        role = get_choice(item, "role", ("user", "assistant", "system", "developer"), f"{param}.role",
                          required=True)
        content = get(item, "content", (str, list), f"{param}.content", required=True)
        if isinstance(content, list):
            content = join_parts([_content_part(part, role, f"{param}.content[{i}]")
                                  for i, part in enumerate(content)], "")
        if role == "assistant":
            self._assistant()["content"] += content
        else:
            self.messages.append({"role": "system" if role == "developer" else role, "content": content})

    def function_call(self, item: dict[str, Any], param: str) -> None:
        call = {
            "id": get(item, "call_id", str, f"{param}.call_id", required=True),
            "type": "function",
            "function": {
                "name": get(item, "name", str, f"{param}.name", required=True),
                "arguments": arguments_object(get(item, "arguments", str, f"{param}.arguments", required=True),
                                              f"{param}.arguments"),
            },
        }
        self._assistant().setdefault("tool_calls", []).append(call)

    def function_call_output(self, item: dict[str, Any], param: str) -> None:
        call_id = get(item, "call_id", str, f"{param}.call_id", required=True)
        output = get(item, "output", (str, list), f"{param}.output", required=True)
        if isinstance(output, list):
            output = join_parts([_content_part(part, "user", f"{param}.output[{i}]", in_tool_result=True)
                                 for i, part in enumerate(output)], "")
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": output})

    def mcp_call(self, item: dict[str, Any], param: str) -> None:
        call_id = get(item, "id", str, f"{param}.id", required=True)
        self.function_call({"call_id": call_id, "name": item.get("name"), "arguments": item.get("arguments")}, param)
        get(item, "server_label", str, f"{param}.server_label", required=True)
        output = get(item, "output", str, f"{param}.output")
        error = get(item, "error", (str, dict), f"{param}.error")
        if output is None and error is not None:
            output = "error: " + (error if isinstance(error, str) else _error_text(error))
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": output or ""})

    def reasoning(self, item: dict[str, Any], param: str) -> None:
        # Reasoning from other servers may come only encrypted (`encrypted_content`): nothing to read then.
        for key in ("content", "summary"):
            for i, part in enumerate(get_list(item, key, f"{param}.{key}") or []):
                part = check_type(part, dict, f"{param}.{key}[{i}]")
                self.pending_reasoning.append(get(part, "text", str, f"{param}.{key}[{i}].text", required=True))
            if self.pending_reasoning:
                break

    def _assistant(self) -> dict[str, Any]:
        """The assistant message being built: the last message, unless reasoning or another role came since."""
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant" or self.pending_reasoning:
            last = {"role": "assistant", "content": ""}
            if self.pending_reasoning:
                last["reasoning_content"] = "\n\n".join(self.pending_reasoning)
                self.pending_reasoning = []
            self.messages.append(last)
        return last


def _content_part(part: Any, role: str, param: str, in_tool_result: bool = False) -> str | dict[str, Any]:
    part = check_type(part, dict, param)
    kinds = _ASSISTANT_PARTS if role == "assistant" else _INPUT_PARTS
    kind = get_choice(part, "type", kinds, f"{param}.type", required=True)
    if kind == "input_image":
        get_choice(part, "detail", ("auto", "low", "high", "original"), f"{param}.detail")
        url = get(part, "image_url", str, f"{param}.image_url")
        if url is None:
            get(part, "file_id", str, f"{param}.file_id", required=True)
            raise bad_request(f"{param}.file_id", "this server keeps no files; send the picture as image_url")
        return image_url_part(url, param, in_tool_result)
    if kind == "image_embeds":
        return image_embeds_part(part, param, in_tool_result)
    if kind == "input_file":
        raise bad_request(param, "file input is not supported")
    key = "refusal" if kind == "refusal" else "text"
    return get(part, key, str, f"{param}.{key}", required=True)


def _error_text(error: dict[str, Any]) -> str:
    """An `mcp_call` error object as text (`message`, or the texts of `content`)."""
    if isinstance(error.get("message"), str):
        return error["message"]
    content = error.get("content")
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
    return str(content)


def _tools(body: dict[str, Any], listed: set[str]) -> tuple[list[dict[str, Any]], list[McpUse]]:
    tools = []
    servers: list[McpUse] = []
    for i, tool in enumerate(get_list(body, "tools", "tools") or []):
        param = f"tools[{i}]"
        tool = check_type(tool, dict, param)
        kind = get(tool, "type", str, f"{param}.type", required=True)
        if kind == "mcp":
            use = _mcp_use(tool, param, listed)
            if any(other.label == use.label for other in servers):
                raise bad_request(f"{param}.server_label", f"duplicate server_label {use.label!r}")
            servers.append(use)
            continue
        if kind != "function":
            raise bad_request(f"{param}.type", f"built-in tool {kind!r} is not supported; use function or mcp tools")
        # The Responses API's functions are strict unless the request says otherwise (its documented default).
        strict = get(tool, "strict", bool, f"{param}.strict")
        tools.append(function_tool(
            get(tool, "name", str, f"{param}.name", required=True),
            get(tool, "description", str, f"{param}.description"),
            get_object(tool, "parameters", f"{param}.parameters") or {"type": "object", "properties": {}},
            strict=strict is None or strict,
        ))
    return tools, servers


def _tool_fields(body: dict[str, Any]) -> dict[str, str]:
    """Each function tool's parameters field, by name (after `_tools` checked them)."""
    return {tool["name"]: f"tools[{i}].parameters" for i, tool in enumerate(body.get("tools") or [])
            if tool.get("type") == "function"}


def _mcp_use(tool: dict[str, Any], param: str, listed: set[str]) -> McpUse:
    """An `mcp` tool: a configured server by `server_label`, or one at `server_url`."""
    label = get(tool, "server_label", str, f"{param}.server_label", required=True)
    for key in ("connector_id", "tunnel_id"):
        if tool.get(key) is not None:
            raise bad_request(f"{param}.{key}", "connectors and tunnels are not supported; name a configured MCP "
                                                "server by server_label, or give server_url")
    approval = get(tool, "require_approval", (str, dict), f"{param}.require_approval")
    if approval is not None and approval != "never":
        raise bad_request(f"{param}.require_approval", 'only "never" is supported: this server calls MCP tools '
                                                       "without asking (approvals are not supported yet)")
    allowed = get(tool, "allowed_tools", (list, dict), f"{param}.allowed_tools")
    names: list[Any] | None = None
    if isinstance(allowed, dict):
        if get(allowed, "read_only", bool, f"{param}.allowed_tools.read_only"):
            raise bad_request(f"{param}.allowed_tools.read_only", "is not supported; list the tools by name")
        names = get_list(allowed, "tool_names", f"{param}.allowed_tools.tool_names")
    elif allowed is not None:
        names = allowed
    for j, name in enumerate(names or []):
        check_type(name, str, f"{param}.allowed_tools[{j}]")
    headers = dict(get_object(tool, "headers", f"{param}.headers") or {})
    for key, value in headers.items():
        check_type(value, str, f"{param}.headers.{key}")
    token = get(tool, "authorization", str, f"{param}.authorization")
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return McpUse(label, url=get(tool, "server_url", str, f"{param}.server_url"), headers=tuple(headers.items()),
                  allowed_tools=None if names is None else tuple(names), listed=label in listed, param=param)


def _tool_choice(body: dict[str, Any], names: set[str]) -> str | dict[str, Any] | None:
    choice = get(body, "tool_choice", (str, dict), "tool_choice")
    if isinstance(choice, str):
        return get_choice(body, "tool_choice", ("auto", "none", "required"), "tool_choice")
    if choice is None:
        return None
    get_choice(choice, "type", ("function",), "tool_choice.type", required=True)
    name = get(choice, "name", str, "tool_choice.name", required=True)
    if name not in names:
        raise bad_request("tool_choice.name", f"no function named {name!r} in tools")
    return {"type": "function", "function": {"name": name}}


def _thinking(body: dict[str, Any]) -> bool:
    reasoning = get_object(body, "reasoning", "reasoning")
    effort = get_choice(reasoning, "effort", _EFFORTS, "reasoning.effort") if reasoning else None
    return effort not in _NO_THINKING_EFFORTS


# --- responses

@dataclass(frozen=True)
class _Header:
    """What every rendering of one response shares: ids, time, and the request settings a response echoes."""

    request_id: str
    model: str
    created_at: int
    request: ChatRequest | None

    def response(self, status: str, output: list[dict[str, Any]], usage: Usage | None = None,
                 finish: Finish | None = None) -> dict[str, Any]:
        request = self.request or ChatRequest(messages=[])
        return {
            "id": f"resp_{self.request_id}",
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "usage": _usage(usage) if usage else None,
            "error": _error(finish),
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": None,
            "max_output_tokens": request.max_tokens,
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": request.sampling.temperature,
            "top_p": request.sampling.top_p,
            "text": {"format": {"type": "text"}},
            "tool_choice": _echo_tool_choice(request.tool_choice),
            "tools": [_echo_tool(tool) for tool in request.tools] + [_echo_mcp(use) for use in request.mcp],
            "truncation": "disabled",
            "metadata": {},
        }

    def item_id(self, prefix: str, output_index: int) -> str:
        return f"{prefix}_{self.request_id}_{output_index}"


@dataclass
class _Block:
    """What one output item holds so far: a run of reasoning or of text (with its tokens' logprobs, OpenAI
    entries), one call of the client's tool (`text` = its arguments JSON), one call the server makes on an MCP
    server (`server`, then its `output` once run) or one MCP server's tool listing (`tools`, `error`)."""

    kind: Literal["reasoning", "text", "tool_call", "mcp_call", "mcp_list"]
    text: str = ""
    call_id: str = ""
    name: str = ""
    server: str = ""
    output: str | None = None
    is_error: bool = False
    tools: tuple[dict[str, Any], ...] = ()
    error: str | None = None
    logprobs: list[dict[str, Any]] = field(default_factory=list)


def _output_item(header: _Header, block: _Block, output_index: int, status: str) -> dict[str, Any]:
    if block.kind == "reasoning":
        return {"id": header.item_id("rs", output_index), "type": "reasoning", "status": status, "summary": [],
                "content": [_part("reasoning_text", block.text)]}
    if block.kind == "text":
        part = {**_part("output_text", block.text), "logprobs": list(block.logprobs)}
        return {"id": header.item_id("msg", output_index), "type": "message", "status": status,
                "role": "assistant", "content": [part]}
    if block.kind == "mcp_list":
        return {"id": header.item_id("mcpl", output_index), "type": "mcp_list_tools", "server_label": block.server,
                "tools": list(block.tools), "error": block.error}
    if block.kind == "mcp_call":
        if block.output is not None:
            status = "failed" if block.is_error else "completed"
        error = {"type": "mcp_tool_execution_error", "content": [_part("text", block.output or "")]}
        return {"id": block.call_id, "type": "mcp_call", "status": status, "server_label": block.server,
                "name": block.name, "arguments": block.text,
                "output": None if block.is_error else block.output, "error": error if block.is_error else None}
    return {"id": header.item_id("fc", output_index), "type": "function_call", "status": status,
            "call_id": block.call_id, "name": block.name, "arguments": block.text}


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "output_text":
        return {"type": kind, "text": text, "annotations": [], "logprobs": []}
    return {"type": kind, "text": text}


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def _error(finish: Finish | None) -> dict[str, Any] | None:
    if finish is None or finish.reason not in ("error", "cancel"):
        return None
    message = "generation failed" if finish.reason == "error" else "the request was cancelled"
    return {"code": "server_error", "message": message}


def _echo_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool["function"]
    return {"type": "function", "name": function["name"], "description": function.get("description"),
            "parameters": function["parameters"], "strict": bool(function.get("strict"))}


def _echo_mcp(use: McpUse) -> dict[str, Any]:
    allowed = None if use.allowed_tools is None else list(use.allowed_tools)
    return {"type": "mcp", "server_label": use.label, "server_url": use.url, "allowed_tools": allowed,
            "require_approval": "never"}


def _echo_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any]:
    if isinstance(choice, dict):
        return {"type": "function", "name": choice["function"]["name"]}
    return choice or "auto"


@final
class ResponseRenderer(Renderer):
    """The Responses stream for one response, and the response it adds up to (its last event carries it).

    The sequence: `response.created`, `response.in_progress`; per output item `response.output_item.added`, its
    content (`response.content_part.added`, `response.output_text.delta`s or `response.reasoning_text.delta`s,
    `.done`, `response.content_part.done`; or `response.function_call_arguments.delta`s and `.done`) and
    `response.output_item.done`; at the end `response.completed` (`response.incomplete` when the token limit cut
    the answer, `response.failed` when the generation failed). Every event carries its `sequence_number`.

    Args:
        model: the model name to report.
        request_id: the server's id of this request; the response id is `resp_` + it.
        request: the parsed request, whose settings the response echoes.
    """

    def __init__(self, *, model: str, request_id: str, request: ChatRequest | None = None):
        super().__init__()
        self._header = _Header(request_id, model, int(time.time()), request)
        self._sequence = 0
        self._items: list[dict[str, Any]] = []  # output items so far; the last may still be open
        self._open: _Block | None = None  # what the open item holds so far
        self._calls: dict[int, tuple[int, _Block]] = {}  # tool call index -> (its output index, its block)
        self._usage: Usage | None = None
        self._logprobs: list[dict[str, Any]] = []  # waiting for the delta of their text

    def on_start(self, first: Event | None) -> list[SseEvent]:
        response = self._header.response("in_progress", [])
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def on_text(self, event: TextDelta) -> list[SseEvent]:
        return self._text("text", event.text) if event.text else []

    def on_reasoning(self, event: ReasoningDelta) -> list[SseEvent]:
        return self._text("reasoning", event.text) if event.text else []

    def on_tool_call(self, event: ToolCallStart) -> list[SseEvent]:
        if event.server is None:
            block = _Block("tool_call", call_id=event.id, name=event.name)
        else:
            block = _Block("mcp_call", call_id=event.id, name=event.name, server=event.server)
        self._calls[event.index] = (len(self._items), block)
        out = self._open_item(block)
        if block.kind == "mcp_call":
            out.append(self._event("response.mcp_call.in_progress", **self._where()))
        return out

    def on_tool_arguments(self, event: ToolCallArgumentsDelta) -> list[SseEvent]:
        if not event.text:
            return []
        output_index, block = self._calls[event.index]
        block.text += event.text
        name = "response.mcp_call_arguments.delta" if block.kind == "mcp_call" else \
            "response.function_call_arguments.delta"
        return [self._event(name, item_id=self._items[output_index]["id"], output_index=output_index,
                            delta=event.text)]

    def on_logprob(self, event: TokenLogprob) -> list[SseEvent]:
        if not event.reasoning:  # the Responses API has logprobs for output text only
            self._logprobs.append(openai_logprob(event))
        return []

    def on_prompt_logprobs(self, event: PromptLogprobs) -> list[SseEvent]:
        return []  # the prompt is never echoed

    def on_prompt(self, event: PromptProcessed) -> list[SseEvent]:
        return []

    def on_tool_result(self, event: ToolResult) -> list[SseEvent]:
        """An MCP call's result: the call's item is done (its arguments were done when the next item began)."""
        output_index, block = self._calls[event.index]
        out = self._close_item("completed") if self._open is block else []
        block.output, block.is_error = event.text, event.is_error
        item = self._items[output_index] = _output_item(self._header, block, output_index, "completed")
        where = {"item_id": item["id"], "output_index": output_index}
        out.append(self._event("response.mcp_call.failed" if event.is_error else "response.mcp_call.completed",
                               **where))
        out.append(self._event("response.output_item.done", output_index=output_index, item=item))
        return out

    def on_tool_list(self, event: McpToolList) -> list[SseEvent]:
        out = self._close_item("completed")
        output_index = len(self._items)
        block = _Block("mcp_list", server=event.server, tools=event.tools, error=event.error)
        item = _output_item(self._header, block, output_index, "completed")
        self._items.append(item)
        where = {"item_id": item["id"], "output_index": output_index}
        out.append(self._event("response.output_item.added", output_index=output_index, item={**item, "tools": []}))
        out.append(self._event("response.mcp_list_tools.in_progress", **where))
        out.append(self._event("response.mcp_list_tools.failed" if event.error else
                               "response.mcp_list_tools.completed", **where))
        out.append(self._event("response.output_item.done", output_index=output_index, item=item))
        return out

    def on_usage(self, event: Usage) -> list[SseEvent]:
        self._usage = event
        return []

    def on_finish(self, event: Finish) -> list[SseEvent]:
        """The closing event carries the whole response; only the item still open can have been cut short."""
        status, name = _ENDINGS[event.reason]
        out = self._close_item("completed" if status == "completed" else "incomplete")
        response = self._header.response(status, self._items, self._usage, event)
        out.append(self._event(name, response=response))
        return out

    def on_error(self, error: ApiError) -> list[SseEvent]:
        return [self._event("error", code=error.code or error.kind, message=error.message, param=error.param)]

    def fold(self, stream: Iterable[SseEvent]) -> dict[str, Any]:
        """The response the stream's last `response` carries (a failed generation's too: its status says so)."""
        response: dict[str, Any] = {}
        for _, data in stream:
            response = data.get("response", response)
        return response

    def _text(self, kind: Literal["text", "reasoning"], text: str) -> list[SseEvent]:
        if self._open is not None and self._open.kind == kind:
            out, block = [], self._open
        else:
            block = _Block(kind)
            out = self._open_item(block)
        block.text += text
        name = "response.output_text.delta" if kind == "text" else "response.reasoning_text.delta"
        extra: dict[str, Any] = {}
        if kind == "text":
            extra["logprobs"], self._logprobs = self._logprobs, []
            block.logprobs += extra["logprobs"]
        out.append(self._event(name, **self._where(), content_index=0, delta=text, **extra))
        return out

    def _open_item(self, block: _Block) -> list[SseEvent]:
        out = self._close_item("completed")
        self._open = block
        item = _output_item(self._header, block, len(self._items), "in_progress")
        calls = ("tool_call", "mcp_call")
        if block.kind not in calls:
            item["content"] = []
        self._items.append(item)
        out.append(self._event("response.output_item.added", output_index=len(self._items) - 1, item=item))
        if block.kind not in calls:
            part = _part("output_text" if block.kind == "text" else "reasoning_text", "")
            out.append(self._event("response.content_part.added", **self._where(), content_index=0, part=part))
        return out

    def _close_item(self, status: str) -> list[SseEvent]:
        block, self._open = self._open, None
        if block is None:
            return []
        output_index = len(self._items) - 1
        item = self._items[output_index] = _output_item(self._header, block, output_index, status)
        where = {"item_id": item["id"], "output_index": output_index}
        out = []
        if block.kind == "mcp_call":
            # The item is done when its result comes (`_result`).
            return [self._event("response.mcp_call_arguments.done", **where, arguments=block.text)]
        if block.kind == "tool_call":
            out.append(self._event("response.function_call_arguments.done", **where, arguments=block.text))
        else:
            part = item["content"][0]
            done = "response.output_text.done" if block.kind == "text" else "response.reasoning_text.done"
            extra: dict[str, Any] = {"logprobs": list(block.logprobs)} if block.kind == "text" else {}
            out.append(self._event(done, **where, content_index=0, text=block.text, **extra))
            out.append(self._event("response.content_part.done", **where, content_index=0, part=part))
        out.append(self._event("response.output_item.done", output_index=output_index, item=item))
        return out

    def _finish(self, finish: Finish) -> list[SseEvent]:
        status, name = _ENDINGS[finish.reason]
        out = self._close_item("completed" if status == "completed" else "incomplete")
        response = self._header.response(status, self._items, self._usage, finish)
        out.append(self._event(name, response=response))
        return out

    def _where(self) -> dict[str, Any]:
        """The open item's id and output index, as content events name them."""
        return {"item_id": self._items[-1]["id"], "output_index": len(self._items) - 1}

    def _event(self, name: str, **data: Any) -> SseEvent:
        event = (name, {"type": name, "sequence_number": self._sequence, **data})
        self._sequence += 1
        return event
