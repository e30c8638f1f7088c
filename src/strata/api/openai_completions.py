"""OpenAI text completions (`POST /v1/completions`): a raw prompt (text or token ids) continued without the chat
template, through the same service, turn and cancellation as chat. Pure translation, no I/O."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, final

from strata.api.errors import ApiError
from strata.api.openai_chat import sampling_from, stops_from, stream_error, usage_json
from strata.api.render import Renderer, SseEvent, unfinished
from strata.api.translate import bad_request, check_type, get, get_int, llama_cpp_format
from strata.events import (
    ChatRequest,
    CompletionPrompt,
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

_FINISH_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop"}


def parse_request(body: Any) -> ChatRequest:
    """Validate a completions body into a `ChatRequest` whose `completion` holds the prompt.

    Raises:
        ApiError: 400 naming the field at fault (`n` or `best_of` above 1, a list of several prompts, ...).
    """
    body = check_type(body, dict, "body")
    for key in ("n", "best_of"):
        if get_int(body, key, key, 1) not in (None, 1):
            raise bad_request(key, f"only {key}=1 is supported")
    logprobs = get_int(body, "logprobs", "logprobs", 0)
    if logprobs is not None and logprobs > 20:
        raise bad_request("logprobs", f"must be at most 20, got {logprobs}")
    return ChatRequest(
        logprobs=logprobs,
        messages=[],
        completion=CompletionPrompt(**_prompt(body), suffix=get(body, "suffix", str, "suffix"),
                                    echo=bool(get(body, "echo", bool, "echo"))),
        sampling=sampling_from(body),
        max_tokens=get_int(body, "max_tokens", "max_tokens", 1) or 16,  # OpenAI's default for this route
        stop=stops_from(body),
        answer_format=llama_cpp_format(body),
        route="completions",
    )


def _prompt(body: dict[str, Any]) -> dict[str, Any]:
    """`prompt`: a string, a list of token ids, or a list holding one of those."""
    prompt = get(body, "prompt", (str, list), "prompt", required=True)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return {"text": prompt}
    if prompt and all(isinstance(item, (str, list)) for item in prompt):
        raise bad_request("prompt", "only one prompt per request is supported")
    for i, token in enumerate(prompt):
        check_type(token, int, f"prompt[{i}]")
    return {"ids": tuple(prompt)}


def _logprobs_json(entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """The legacy completions `logprobs` object for `entries` whose text starts at `offset`. An echoed prompt's
    first token has null `token_logprobs` and `top_logprobs` entries."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return {"tokens": [entry.token for entry in entries],
            "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [None if entry.logprob is None else {token: logprob for token, _, logprob in entry.top}
                             for entry in entries],
            "text_offset": offsets}


@final
class CompletionRenderer(Renderer):
    """The streamed `text_completion` chunks, and the `text_completion` they add up to: one chunk per text
    delta, the last with `finish_reason`, with `include_usage` one more with the usage and no choices; `[DONE]`
    follows (sent by the caller). A failed generation ends with an error event instead.

    Args:
        model: the model name to report.
        request_id: the server's id of this request; the completion id is `cmpl-` + it.
        include_usage: end the stream with the usage chunk (the client's `stream_options.include_usage`).
    """

    def __init__(self, *, model: str, request_id: str, include_usage: bool = False):
        super().__init__()
        self._head = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()),
                      "model": model}
        self._include_usage = include_usage
        self._usage: Usage | None = None
        self._logprobs: list[TokenLogprob] = []  # waiting for the chunk of their text
        self._offset = 0  # where the next chunk's text starts

    def on_start(self, first: Event | None) -> list[SseEvent]:
        return []

    def on_text(self, event: TextDelta) -> list[SseEvent]:
        return [self._chunk(event.text)] if event.text else []

    def on_reasoning(self, event: ReasoningDelta) -> list[SseEvent]:
        return []  # a raw completion has no chat template, so no thinking

    def on_tool_call(self, event: ToolCallStart) -> list[SseEvent]:
        return []  # nor tools

    def on_tool_arguments(self, event: ToolCallArgumentsDelta) -> list[SseEvent]:
        return []

    def on_logprob(self, event: TokenLogprob) -> list[SseEvent]:
        self._logprobs.append(event)
        return []

    def on_prompt_logprobs(self, event: PromptLogprobs) -> list[SseEvent]:
        self._logprobs.extend(event.entries)  # they go out with the echoed prompt's chunk
        return []

    def on_prompt(self, event: PromptProcessed) -> list[SseEvent]:
        return []

    def on_tool_list(self, event: McpToolList) -> list[SseEvent]:
        return []

    def on_tool_result(self, event: ToolResult) -> list[SseEvent]:
        return []

    def on_usage(self, event: Usage) -> list[SseEvent]:
        self._usage = event
        return []

    def on_finish(self, event: Finish) -> list[SseEvent]:
        error = unfinished(event)
        if error is not None:
            return self.error(error)
        out = [self._chunk("", _FINISH_REASONS[event.reason])]
        if self._include_usage or self.folding:
            out.append(("", {**self._head, "choices": [], "usage": usage_json(self._usage)}))
        return out

    def on_error(self, error: ApiError) -> list[SseEvent]:
        return stream_error(error)

    def fold(self, stream: Iterable[SseEvent]) -> dict[str, Any]:
        """The chunks' texts joined, their logprobs joined, the last finish reason, the usage chunk's usage."""
        text: list[str] = []
        logprobs: list[dict[str, Any]] = []
        finish_reason, usage = None, None
        for _, chunk in stream:
            if not chunk["choices"]:
                usage = chunk["usage"]
                continue
            choice = chunk["choices"][0]
            text.append(choice["text"])
            if choice["logprobs"] is not None:
                logprobs.append(choice["logprobs"])
            finish_reason = choice["finish_reason"] or finish_reason
        return {**self._head, "choices": [{"index": 0, "text": "".join(text), "logprobs": _joined_logprobs(logprobs),
                                           "finish_reason": finish_reason}], "usage": usage}

    def _chunk(self, text: str, finish_reason: str | None = None) -> SseEvent:
        logprobs = None
        if self._logprobs:
            logprobs, self._logprobs = _logprobs_json(self._logprobs, self._offset), []
        self._offset += len(text)
        return ("", {**self._head, "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                                                "finish_reason": finish_reason}]})


def _joined_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The chunks' `logprobs` as one: their lists joined, `text_offset` counting the tokens' own text on from
    where the first token starts (the chunks' offsets count the text sent, which a stop string may have cut)."""
    if not parts:
        return None
    joined: dict[str, Any] = {key: [value for part in parts for value in part[key]]
                              for key in ("tokens", "token_logprobs", "top_logprobs")}
    offsets, offset = [], parts[0]["text_offset"][0]
    for token in joined["tokens"]:
        offsets.append(offset)
        offset += len(token)
    joined["text_offset"] = offsets
    return joined
