"""What a chat request is, and the events its generation produces. Dialects (OpenAI chat, Responses, Anthropic)
translate their JSON into a `ChatRequest` and render these events back; nothing here knows HTTP."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from strata.text.constraints import AnswerFormat
from strata.text.sampling import SamplingParams

FinishReason = Literal["stop", "length", "tool_calls", "cancel", "error"]


@dataclass(frozen=True)
class CompletionPrompt:
    """A raw text completion's prompt (`POST /v1/completions`): no chat template.

    Attributes:
        text: the prompt as text (tokenised as plain text: control-token text stays text), or None.
        ids: the prompt as token ids, or None (exactly one of `text` and `ids` is set).
        suffix: text after the insertion point: the prompt becomes the model's fill-in-the-middle form.
        echo: the answer repeats the prompt before the completion.
    """

    text: str | None = None
    ids: tuple[int, ...] | None = None
    suffix: str | None = None
    echo: bool = False


@dataclass(frozen=True)
class McpUse:
    """An MCP server a request offers the model: a configured one by name, or one at a URL the request gives.

    Attributes:
        label: the server's name (Responses `server_label`, Anthropic `name`); the configured server's name.
        url: the server's URL when the request gives one.
        headers: HTTP headers for a server at a URL (authorization).
        allowed_tools: offer only these tools (None: all of them but `denied_tools`).
        denied_tools: tools not to offer.
        listed: the client already holds this server's tool listing (from an earlier response): not shown again.
        param: the request field that named the server, for errors.
    """

    label: str
    url: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    allowed_tools: tuple[str, ...] | None = None
    denied_tools: tuple[str, ...] = ()
    listed: bool = False
    param: str = "tools"

    def allows(self, name: str) -> bool:
        return (self.allowed_tools is None or name in self.allowed_tools) and name not in self.denied_tools


@dataclass
class ChatRequest:
    """A dialect-neutral chat request.

    `messages` and `tools` use the OpenAI chat shapes (roles system/user/assistant/tool; assistant `tool_calls`
    with `function.arguments` as a dict; content as a string or a list of `{"type": "text", ...}` parts), since
    that is what the chat template renders. `answer_format` constrains the answer's text (JSON schema, JSON
    object, grammar); `tool_choice` "required" or a named function forces tool calls; `parallel_tool_calls` False
    allows one call at most.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str | dict[str, Any] | None = None
    # Each tool's parameters schema as the request's dialect names it (errors name it so), by tool name.
    tool_fields: dict[str, str] = field(default_factory=dict)
    parallel_tool_calls: bool = True
    answer_format: AnswerFormat | None = None
    prefill: bool = False  # the last message is the assistant's: the model continues it instead of a new turn
    completion: CompletionPrompt | None = None  # a raw completion: this prompt instead of the messages
    logprobs: int | None = None  # report each answer token's log-probability and this many alternatives
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    enable_thinking: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    route: str = "chat"
    mcp: list[McpUse] = field(default_factory=list)  # MCP servers whose tools the server itself calls
    # Only requests with the same salt share cached prefixes (vLLM's `cache_salt`; with `cache_isolation` "api_key"
    # the client's key joins it). None: the prefix cache is shared with every request without one.
    cache_salt: str | None = None
    # The client's guess of the answer (OpenAI's Predicted Outputs): drafts for speculative decoding.
    prediction: str | None = None


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call begins: its id and name come first, its arguments follow as `ToolCallArgumentsDelta`s.

    `server` is the label of the MCP server the service calls the tool on (a `ToolResult` follows); None for the
    client's own tools, which end the response. Indexes count the calls of the whole response.
    """

    index: int
    id: str
    name: str
    server: str | None = None


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    index: int
    text: str


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the most likely alternatives (requests with `logprobs`); it
    comes before the text events of its token. Tokens are (text, UTF-8 bytes) as OpenAI reports them.
    `reasoning`: a token of the reasoning's text (the `<think>` tags themselves get no entry)."""

    token: str
    bytes: tuple[int, ...]
    logprob: float | None  # None only for the first token of an echoed prompt
    top: tuple[tuple[str, tuple[int, ...], float], ...] = ()
    reasoning: bool = False


@dataclass(frozen=True)
class PromptLogprobs:
    """The echoed prompt's tokens with their log-probabilities (a completion with `echo` and `logprobs`), before
    the echoed text; the first token's `logprob` is None (nothing predicts it)."""

    entries: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class PromptProcessed:
    """The prompt is in the KV cache (it comes before the first generated token): its size is known."""

    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class McpToolList:
    """The tools an MCP server offers this request (shown before the answer); `error` when it is down."""

    server: str
    tools: tuple[dict[str, Any], ...]
    error: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """The service called an MCP tool (the call `index` announced by `ToolCallStart`): its result as text, and
    whether it is an error (the tool failed, timed out, or its server was not available)."""

    index: int
    call_id: str
    text: str
    is_error: bool = False


@dataclass(frozen=True)
class Usage:
    """Token counts of a finished generation; `reasoning_tokens` are the completion tokens inside `<think>`
    (tags included). With a `prediction`: its tokens drafted and accepted, and drafted and rejected (None
    without one)."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None


@dataclass(frozen=True)
class Finish:
    """The generation ended. `stop_sequence` is the request's stop string that ended it, if one did."""

    reason: FinishReason
    stop_sequence: str | None = None


Event = (TextDelta | ReasoningDelta | ToolCallStart | ToolCallArgumentsDelta | TokenLogprob | PromptProcessed
         | PromptLogprobs | McpToolList | ToolResult | Usage | Finish)
