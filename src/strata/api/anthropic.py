"""The Anthropic Messages dialect (`POST /v1/messages`, `/v1/messages/count_tokens`): request JSON to a
`ChatRequest`, generation events to Anthropic's stream of events and the message it adds up to. Pure
translation, no I/O.

Tool calls keep the ids the generation gives them; thinking blocks carry an empty signature (nothing signs them).
The MCP connector works with the servers this server is configured with (`mcp_servers` entries name them; others
by URL only where the config allows): the server calls their tools itself, shown as `mcp_tool_use` and
`mcp_tool_result` blocks after an `mcp_tool_listing` block per server.
Follows Anthropic's semantics where the model family allows: without a `thinking` field the model does not think,
and `usage.input_tokens` counts only the prompt tokens that were not read from the KV cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, final

from strata.api.errors import ApiError, anthropic_error_body
from strata.api.render import Renderer, SseEvent, unfinished
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
    image_base64_part,
    image_embeds_part,
    image_url_part,
    join_parts,
    sampling_params,
    schema_format,
    template_kwargs,
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
from strata.text.prompt import strip_billing_header

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
_ROUTE = "messages"
_EMPTY_BLOCKS = {
    "text": {"type": "text", "text": ""},
    "thinking": {"type": "thinking", "thinking": "", "signature": ""},
}


# --- requests

def parse_request(body: Any, *, sampling_defaults: Mapping[str, Any] | None = None) -> ChatRequest:
    """Translate a `POST /v1/messages` body.

    Args:
        body: the decoded JSON body.
        sampling_defaults: the server's `SamplingParams` field values for what the client leaves out.

    Raises:
        ApiError: 400 naming the field at fault (`param`); pictures are refused with a 400 once their block is
            found well-formed.
    """
    body = check_type(body, dict, "body")
    max_tokens = get_int(body, "max_tokens", "max_tokens", 1, required=True)
    get(body, "stream", bool, "stream")
    stops = check_stops(get_list(body, "stop_sequences", "stop_sequences") or [], "stop_sequences")
    request = _parse_prompt(body)
    request.max_tokens = max_tokens
    request.stop = list(stops)
    request.sampling = sampling_params(
        sampling_defaults,
        temperature=get_number(body, "temperature", "temperature", 0.0, 1.0),
        top_p=get_number(body, "top_p", "top_p", 0.0, 1.0),
        top_k=get_int(body, "top_k", "top_k", 0),
    )
    return request


def parse_count_tokens_request(body: Any) -> ChatRequest:
    """Translate a `POST /v1/messages/count_tokens` body: a message request without `max_tokens`."""
    return _parse_prompt(check_type(body, dict, "body"))


def render_count(n_tokens: int) -> dict[str, Any]:
    """The count_tokens answer for a prompt of n_tokens."""
    return {"input_tokens": n_tokens}


def _parse_prompt(body: dict[str, Any]) -> ChatRequest:
    """What every message request shares: model, system, messages, tools, tool choice, thinking."""
    get(body, "model", str, "model", required=True)
    messages = _system(body)
    turns = get_list(body, "messages", "messages", required=True)
    if not turns:
        raise bad_request("messages", "must hold at least one message")
    listed: set[str] = set()
    for i, turn in enumerate(turns):
        messages.extend(_message(turn, f"messages[{i}]", listed))
    tools, toolsets = _tools(body)
    choice = get_object(body, "tool_choice", "tool_choice") or {}
    return ChatRequest(
        messages=messages,
        tools=tools,
        tool_fields={tool["name"]: f"tools[{i}].input_schema" for i, tool in enumerate(body.get("tools") or [])
                     if tool.get("type") in (None, "custom")},
        mcp=_mcp_servers(body, toolsets, listed),
        tool_choice=_tool_choice(body, check_unique_tool_names(tools, "tools")),
        parallel_tool_calls=not get(choice, "disable_parallel_tool_use", bool,
                                    "tool_choice.disable_parallel_tool_use"),
        answer_format=_output_format(body),
        # A last assistant message is a prefill: the answer continues it (Anthropic's documented behaviour).
        prefill=turns[-1].get("role") == "assistant",
        enable_thinking=_thinking(body),
        template_kwargs=template_kwargs(body),
        route=_ROUTE,
    )


def _output_format(body: dict[str, Any]) -> AnswerFormat | None:
    """`output_config.format`: `{"type": "json_schema", "schema": {...}}` (structured outputs)."""
    config = get_object(body, "output_config", "output_config")
    spec = get_object(config, "format", "output_config.format") if config else None
    if spec is None:
        return None
    get_choice(spec, "type", ("json_schema",), "output_config.format.type", required=True)
    return schema_format(get_object(spec, "schema", "output_config.format.schema", required=True),
                         "output_config.format.schema")


def _system(body: dict[str, Any]) -> list[dict[str, Any]]:
    system = get(body, "system", (str, list), "system")
    if isinstance(system, list):
        # a block that is only the billing header leaves no empty paragraph
        texts = (strip_billing_header(_text_block(block, f"system[{i}]")) for i, block in enumerate(system))
        system = "\n\n".join(text for text in texts if text)
    else:
        system = strip_billing_header(system) if system else system
    return [{"role": "system", "content": system}] if system else []


def _message(turn: Any, param: str, listed: set[str]) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results become `tool` messages in their place; the MCP
    servers whose `mcp_tool_listing` an assistant message holds go to `listed`."""
    turn = check_type(turn, dict, param)
    role = get_choice(turn, "role", ("user", "assistant"), f"{param}.role", required=True)
    content = get(turn, "content", (str, list), f"{param}.content", required=True)
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    blocks = [check_type(block, dict, f"{param}.content[{i}]") for i, block in enumerate(content)]
    if role == "assistant":
        return _assistant(blocks, f"{param}.content", listed)
    return _user(blocks, f"{param}.content")


def _user(blocks: list[dict[str, Any]], param: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    parts: list[str | dict[str, Any]] = []
    kinds = ("text", "image", "image_embeds", "tool_result")
    for i, block in enumerate(blocks):
        where = f"{param}[{i}]"
        kind = get_choice(block, "type", kinds, f"{where}.type", required=True)
        if kind == "text":
            parts.append(_text_block(block, where))
        elif kind in ("image", "image_embeds"):
            parts.append(_image(block, where, in_tool_result=False))
        else:
            if parts:
                messages.append({"role": "user", "content": join_parts(parts, "\n\n")})
                parts = []
            messages.append(_tool_result(block, where))
    if parts or not messages:
        messages.append({"role": "user", "content": join_parts(parts, "\n\n")})
    return messages


def _assistant(blocks: list[dict[str, Any]], param: str, listed: set[str]) -> list[dict[str, Any]]:
    """An assistant message; the results of MCP calls the server made in it split it where they stand."""
    messages: list[dict[str, Any]] = []
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []

    def flush() -> None:
        message: dict[str, Any] = {"role": "assistant", "content": "\n\n".join(texts)}
        if thoughts:
            message["reasoning_content"] = "\n\n".join(thoughts)
        if calls:
            message["tool_calls"] = list(calls)
        messages.append(message)
        texts.clear()
        thoughts.clear()
        calls.clear()

    kinds = ("text", "thinking", "redacted_thinking", "tool_use", "mcp_tool_use", "mcp_tool_result",
             "mcp_tool_listing")
    for i, block in enumerate(blocks):
        where = f"{param}[{i}]"
        kind = get_choice(block, "type", kinds, f"{where}.type", required=True)
        if kind == "text":
            texts.append(_text_block(block, where))
        elif kind == "thinking":
            # Clients hand earlier thinking back (with its signature) when tools are in use; the template decides
            # whether the model sees it.
            thoughts.append(get(block, "thinking", str, f"{where}.thinking", required=True))
        elif kind in ("tool_use", "mcp_tool_use"):
            calls.append(_tool_use(block, where))
        elif kind == "mcp_tool_result":
            if texts or thoughts or calls:
                flush()
            messages.append(_tool_result(block, where))
        elif kind == "mcp_tool_listing":
            listed.add(get(block, "mcp_server_name", str, f"{where}.mcp_server_name", required=True))
        # redacted_thinking: encrypted by another server, nothing here can read it.
    if texts or thoughts or calls or not messages:
        flush()
    return messages


def _text_block(block: Any, param: str) -> str:
    block = check_type(block, dict, param)
    get_choice(block, "type", ("text",), f"{param}.type", required=True)
    return get(block, "text", str, f"{param}.text", required=True)


def _tool_use(block: dict[str, Any], param: str) -> dict[str, Any]:
    return {
        "id": get(block, "id", str, f"{param}.id", required=True),
        "type": "function",
        "function": {
            "name": get(block, "name", str, f"{param}.name", required=True),
            "arguments": get_object(block, "input", f"{param}.input", required=True),
        },
    }


def _tool_result(block: dict[str, Any], param: str) -> dict[str, Any]:
    call_id = get(block, "tool_use_id", str, f"{param}.tool_use_id", required=True)
    get(block, "is_error", bool, f"{param}.is_error")
    content = get(block, "content", (str, list), f"{param}.content")
    if isinstance(content, list):
        content = join_parts([_result_part(part, f"{param}.content[{i}]") for i, part in enumerate(content)],
                             "\n\n")
    return {"role": "tool", "tool_call_id": call_id, "content": content or ""}


def _result_part(part: Any, param: str) -> str | dict[str, Any]:
    part = check_type(part, dict, param)
    kind = get_choice(part, "type", ("text", "image", "image_embeds"), f"{param}.type", required=True)
    if kind in ("image", "image_embeds"):
        return _image(part, param, in_tool_result=True)
    return _text_block(part, param)


def _image(block: dict[str, Any], param: str, in_tool_result: bool) -> dict[str, Any]:
    """An `image` block (base64 or url source) or an `image_embeds` block as a picture part."""
    if block.get("type") == "image_embeds":
        return image_embeds_part(block, param, in_tool_result)
    source = get_object(block, "source", f"{param}.source", required=True)
    kind = get_choice(source, "type", ("base64", "url"), f"{param}.source.type", required=True)
    if kind == "url":
        return image_url_part(get(source, "url", str, f"{param}.source.url", required=True), param, in_tool_result)
    get_choice(source, "media_type", _IMAGE_MEDIA_TYPES, f"{param}.source.media_type", required=True)
    return image_base64_part(get(source, "data", str, f"{param}.source.data", required=True), f"{param}.source.data",
                             in_tool_result)


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, tuple[str, dict[str, Any]]]]:
    """The custom tools, and the `mcp_toolset` entries by server name (with their field names)."""
    tools = []
    toolsets: dict[str, tuple[str, dict[str, Any]]] = {}
    for i, tool in enumerate(get_list(body, "tools", "tools") or []):
        param = f"tools[{i}]"
        tool = check_type(tool, dict, param)
        kind = get(tool, "type", str, f"{param}.type")
        if kind == "mcp_toolset":
            name = get(tool, "mcp_server_name", str, f"{param}.mcp_server_name", required=True)
            if name in toolsets:
                raise bad_request(f"{param}.mcp_server_name", f"a second toolset for the MCP server {name!r}")
            toolsets[name] = (param, tool)
            continue
        if kind not in (None, "custom"):
            raise bad_request(f"{param}.type", f"server tool {kind!r} is not supported; define a custom tool or "
                                               "an mcp_toolset")
        tools.append(function_tool(
            get(tool, "name", str, f"{param}.name", required=True),
            get(tool, "description", str, f"{param}.description"),
            get_object(tool, "input_schema", f"{param}.input_schema", required=True),
            strict=bool(get(tool, "strict", bool, f"{param}.strict")),
        ))
    return tools, toolsets


def _mcp_servers(body: dict[str, Any], toolsets: dict[str, tuple[str, dict[str, Any]]],
                 listed: set[str]) -> list[McpUse]:
    """`mcp_servers` entries with their toolsets (`mcp_toolset` tools, or the older `tool_configuration`)."""
    servers: list[McpUse] = []
    names: set[str] = set()
    for i, entry in enumerate(get_list(body, "mcp_servers", "mcp_servers") or []):
        param = f"mcp_servers[{i}]"
        entry = check_type(entry, dict, param)
        get_choice(entry, "type", ("url",), f"{param}.type", required=True)
        name = get(entry, "name", str, f"{param}.name", required=True)
        if name in names:
            raise bad_request(f"{param}.name", f"duplicate MCP server name {name!r}")
        names.add(name)
        token = get(entry, "authorization_token", str, f"{param}.authorization_token")
        allowed, denied = _tool_configuration(entry, param)
        if name in toolsets:
            allowed, denied = _toolset(*toolsets[name])
        if allowed == ():
            continue  # every tool disabled
        servers.append(McpUse(name, url=get(entry, "url", str, f"{param}.url"),
                              headers=(("Authorization", f"Bearer {token}"),) if token else (),
                              allowed_tools=allowed, denied_tools=denied, listed=name in listed, param=param))
    for name, (param, _) in toolsets.items():
        if name not in names:
            raise bad_request(f"{param}.mcp_server_name", f"no entry of mcp_servers is named {name!r}")
    return servers


def _tool_configuration(entry: dict[str, Any], param: str) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    config = get_object(entry, "tool_configuration", f"{param}.tool_configuration")
    if config is None:
        return None, ()
    if get(config, "enabled", bool, f"{param}.tool_configuration.enabled") is False:
        return (), ()
    names = get_list(config, "allowed_tools", f"{param}.tool_configuration.allowed_tools")
    for j, name in enumerate(names or []):
        check_type(name, str, f"{param}.tool_configuration.allowed_tools[{j}]")
    return (None if names is None else tuple(names)), ()


def _toolset(param: str, toolset: dict[str, Any]) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    """(allowed, denied) tool names of an `mcp_toolset`: `default_config.enabled` with per-tool `configs`, cut to
    the pinned `tools` listing when there is one."""
    default = get_object(toolset, "default_config", f"{param}.default_config") or {}
    enabled = get(default, "enabled", bool, f"{param}.default_config.enabled") is not False
    configs = get_object(toolset, "configs", f"{param}.configs") or {}
    switched: dict[str, bool] = {}
    for name, config in configs.items():
        config = check_type(config, dict, f"{param}.configs.{name}")
        value = get(config, "enabled", bool, f"{param}.configs.{name}.enabled")
        if value is not None:
            switched[name] = value
    allowed = None if enabled else tuple(name for name, on in switched.items() if on)
    denied = tuple(name for name, on in switched.items() if not on)
    pinned = get_list(toolset, "tools", f"{param}.tools")
    if pinned is not None:
        names = tuple(get(check_type(tool, dict, f"{param}.tools[{j}]"), "name", str, f"{param}.tools[{j}].name",
                          required=True) for j, tool in enumerate(pinned))
        allowed = names if allowed is None else tuple(name for name in allowed if name in names)
    return allowed, denied


def _tool_choice(body: dict[str, Any], names: set[str]) -> str | dict[str, Any] | None:
    choice = get_object(body, "tool_choice", "tool_choice")
    if choice is None:
        return None
    kind = get_choice(choice, "type", ("auto", "any", "tool", "none"), "tool_choice.type", required=True)
    get(choice, "disable_parallel_tool_use", bool, "tool_choice.disable_parallel_tool_use")
    if kind != "tool":
        return {"auto": "auto", "any": "required", "none": "none"}[kind]
    name = get(choice, "name", str, "tool_choice.name", required=True)
    if name not in names:
        raise bad_request("tool_choice.name", f"no tool named {name!r} in tools")
    return {"type": "function", "function": {"name": name}}


def _thinking(body: dict[str, Any]) -> bool:
    thinking = get_object(body, "thinking", "thinking")
    if thinking is None:
        return False
    kind = get_choice(thinking, "type", ("enabled", "adaptive", "disabled"), "thinking.type", required=True)
    if kind == "enabled":
        # The budget is validated for the client's sake; the model's template has no way to bound its thinking.
        get_int(thinking, "budget_tokens", "thinking.budget_tokens", 1, required=True)
    return kind != "disabled"


# --- responses

def _stop_reason(finish: Finish) -> str:
    if finish.reason == "stop" and finish.stop_sequence is not None:
        return "stop_sequence"
    return _STOP_REASONS[finish.reason]


def _usage(usage: Usage | None) -> dict[str, int]:
    usage = usage or Usage(0, 0, 0)
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


@final
class MessageRenderer(Renderer):
    """Anthropic's event stream for one message, and the message it adds up to.

    The sequence: `message_start`, `ping`, then per content block `content_block_start`, its
    `content_block_delta`s and `content_block_stop`, and at the end `message_delta` (stop reason, usage) and
    `message_stop`. A failed or cancelled generation ends with an `error` event instead.

    Args:
        model: the model name to report.
        request_id: the server's id of this request; the message id is `msg_` + it.
    """

    def __init__(self, *, model: str, request_id: str):
        super().__init__()
        self._model = model
        self._id = f"msg_{request_id}"
        self._blocks = 0  # content blocks started so far
        self._open: str | None = None  # the kind of the block still open
        self._tool_blocks: dict[int, int] = {}  # tool call index -> its block index
        self._usage: Usage | None = None

    def on_start(self, first: Event | None) -> list[SseEvent]:
        """`message_start` carries the prompt's token counts when the stream opens with them."""
        prompt = first if isinstance(first, PromptProcessed) else None
        usage = _usage(Usage(prompt.prompt_tokens, prompt.cached_tokens, 0) if prompt else None)
        message: dict[str, Any] = {
            "id": self._id, "type": "message", "role": "assistant", "model": self._model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage,
        }
        return [("message_start", {"type": "message_start", "message": message}), ("ping", {"type": "ping"})]

    def on_text(self, event: TextDelta) -> list[SseEvent]:
        return self._delta("text", {"type": "text_delta", "text": event.text}) if event.text else []

    def on_reasoning(self, event: ReasoningDelta) -> list[SseEvent]:
        return self._delta("thinking", {"type": "thinking_delta", "thinking": event.text}) if event.text else []

    def on_tool_call(self, event: ToolCallStart) -> list[SseEvent]:
        self._tool_blocks[event.index] = self._blocks
        if event.server is not None:
            return self._open_block("mcp_tool_use", {"type": "mcp_tool_use", "id": event.id, "name": event.name,
                                                     "server_name": event.server, "input": {}})
        return self._open_block("tool_use", {"type": "tool_use", "id": event.id, "name": event.name, "input": {}})

    def on_tool_arguments(self, event: ToolCallArgumentsDelta) -> list[SseEvent]:
        if not event.text:
            return []
        return [_block_delta(self._tool_blocks[event.index], {"type": "input_json_delta", "partial_json": event.text})]

    def on_logprob(self, event: TokenLogprob) -> list[SseEvent]:
        return []  # the Messages API has no log-probabilities

    def on_prompt_logprobs(self, event: PromptLogprobs) -> list[SseEvent]:
        return []

    def on_prompt(self, event: PromptProcessed) -> list[SseEvent]:
        return []  # its counts open the stream (`on_start`)

    def on_tool_list(self, event: McpToolList) -> list[SseEvent]:
        if event.error is not None:
            return []  # a server that is down lists nothing
        block = {"type": "mcp_tool_listing", "mcp_server_name": event.server, "tools": list(event.tools)}
        return self._open_block("mcp_tool_listing", block) + self._close_block()

    def on_tool_result(self, event: ToolResult) -> list[SseEvent]:
        block = {"type": "mcp_tool_result", "tool_use_id": event.call_id, "is_error": event.is_error,
                 "content": [{"type": "text", "text": event.text}]}
        return self._open_block("mcp_tool_result", block) + self._close_block()

    def on_usage(self, event: Usage) -> list[SseEvent]:
        self._usage = event
        return []

    def on_finish(self, event: Finish) -> list[SseEvent]:
        out = self._close_block()
        error = unfinished(event)
        if error is not None:
            return out + self.error(error)
        delta = {"stop_reason": _stop_reason(event), "stop_sequence": event.stop_sequence}
        out.append(("message_delta", {"type": "message_delta", "delta": delta, "usage": _usage(self._usage)}))
        out.append(("message_stop", {"type": "message_stop"}))
        return out

    def on_error(self, error: ApiError) -> list[SseEvent]:
        return [("error", anthropic_error_body(error))]

    def fold(self, stream: Iterable[SseEvent]) -> dict[str, Any]:
        """The message as the Anthropic SDK accumulates it: `message_start`'s message, each block from its start
        with its deltas joined (a tool call's `input` parsed from its JSON pieces), `message_delta`'s stop reason
        and usage.

        Raises:
            ApiError: 400 when the arguments of a call to one of the client's tools are not a JSON object.
        """
        message: dict[str, Any] = {}
        pieces: dict[int, list[str]] = {}  # an open block's index -> its deltas' pieces
        for name, data in stream:
            if name == "message_start":
                message = {**data["message"], "content": []}
            elif name == "content_block_start":
                message["content"].append(dict(data["content_block"]))
            elif name == "content_block_delta":
                delta = data["delta"]
                pieces.setdefault(data["index"], []).append(delta[_DELTA_PIECES[delta["type"]]])
            elif name == "content_block_stop":
                _finish_block(message["content"][data["index"]], "".join(pieces.pop(data["index"], [])))
            elif name == "message_delta":
                message.update(data["delta"], usage=data["usage"])
        return message

    def _delta(self, kind: str, delta: dict[str, Any]) -> list[SseEvent]:
        out = [] if self._open == kind else self._open_block(kind, dict(_EMPTY_BLOCKS[kind]))
        out.append(_block_delta(self._blocks - 1, delta))
        return out

    def _open_block(self, kind: str, block: dict[str, Any]) -> list[SseEvent]:
        out = self._close_block()
        out.append(("content_block_start", {"type": "content_block_start", "index": self._blocks,
                                            "content_block": block}))
        self._blocks += 1
        self._open = kind
        return out

    def _close_block(self) -> list[SseEvent]:
        if self._open is None:
            return []
        self._open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self._blocks - 1})]


def _block_delta(index: int, delta: dict[str, Any]) -> SseEvent:
    return ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})


# A content block delta's type -> its field that holds the piece.
_DELTA_PIECES = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}


def _finish_block(block: dict[str, Any], joined: str) -> None:
    """A block with its deltas' pieces `joined`: a call to the client's tool must carry an object as its
    `input`; a call the server ran shows arguments that are not an object (the model's mistake, which its result
    reported) as {}."""
    kind = block["type"]
    if kind in ("text", "thinking"):
        block[kind] = joined
    elif kind == "tool_use":
        block["input"] = arguments_object(joined, "tool_use.input")
    elif kind == "mcp_tool_use":
        try:
            block["input"] = arguments_object(joined, "mcp_tool_use.input")
        except ApiError:
            block["input"] = {}
