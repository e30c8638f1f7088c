"""What a chat request is, and the events its generation produces. Dialects (OpenAI chat, Responses, Anthropic)
translate their JSON into a `ChatRequest` and render these events back; nothing here knows HTTP."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from strata.constraints import AnswerFormat
from strata.sampling import SamplingParams

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
    parallel_tool_calls: bool = True
    answer_format: AnswerFormat | None = None
    prefill: bool = False  # the last message is the assistant's: the model continues it instead of a new turn
    completion: CompletionPrompt | None = None  # a raw completion: this prompt instead of the messages
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    enable_thinking: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    route: str = "chat"


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call begins: its id and name come first, its arguments follow as `ToolCallArgumentsDelta`s."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    index: int
    text: str


@dataclass(frozen=True)
class PromptProcessed:
    """The prompt is in the KV cache (it comes before the first generated token): its size is known."""

    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Usage:
    """Token counts of a finished generation; `reasoning_tokens` are the completion tokens inside `<think>`
    (tags included)."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0


@dataclass(frozen=True)
class Finish:
    """The generation ended. `stop_sequence` is the request's stop string that ended it, if one did."""

    reason: FinishReason
    stop_sequence: str | None = None


Event = TextDelta | ReasoningDelta | ToolCallStart | ToolCallArgumentsDelta | PromptProcessed | Usage | Finish
