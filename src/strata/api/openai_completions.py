"""OpenAI text completions (`POST /v1/completions`): a raw prompt (text or token ids) continued without the chat
template, through the same service, turn and cancellation as chat. Pure translation, no I/O."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from strata.api.errors import ApiError
from strata.api.openai_chat import include_usage, sampling_from, stops_from, usage_json
from strata.api.translate import SseEvent, bad_request, check_type, collect, get, get_int, llama_cpp_format
from strata.events import (
    ChatRequest,
    CompletionPrompt,
    Event,
    Finish,
    PromptLogprobs,
    TextDelta,
    TokenLogprob,
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


def _finish_reason(finish: Finish) -> str:
    if finish.reason == "error":
        raise ApiError(500, "generation failed", kind="server_error")
    if finish.reason == "cancel":
        raise ApiError(503, "the request was cancelled", kind="server_error")
    return _FINISH_REASONS[finish.reason]


def _logprobs_json(entries: list[TokenLogprob], offset: int) -> tuple[dict[str, Any] | None, int]:
    """The legacy completions `logprobs` object for `entries` whose text starts at `offset`; and the offset
    after them. An echoed prompt's first token has null `token_logprobs` and `top_logprobs` entries."""
    if not entries:
        return None, offset
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return {"tokens": [entry.token for entry in entries],
            "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [None if entry.logprob is None else {token: logprob for token, _, logprob in entry.top}
                             for entry in entries],
            "text_offset": offsets}, offset


def render_response(events: Iterable[Event], *, model: str, request_id: str) -> dict[str, Any]:
    """The `text_completion` object of a finished generation."""
    events = list(events)
    outcome = collect(events)
    finish_reason = _finish_reason(outcome.finish or Finish("error"))
    echoed = next((len(e.text) for e in events if isinstance(e, TextDelta)), 0) if _echoes(events) else 0
    entries = [e for e in events if isinstance(e, TokenLogprob)]
    prompt = next((e for e in events if isinstance(e, PromptLogprobs)), None)
    if prompt is not None:  # the echoed prompt's tokens come first, from offset 0
        entries, echoed = [*prompt.entries, *entries], 0
    logprobs, _ = _logprobs_json(entries, echoed)
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": "".join(block.text for block in outcome.blocks if block.kind == "text"),
                     "logprobs": logprobs, "finish_reason": finish_reason}],
        "usage": usage_json(outcome.usage),
    }


def _echoes(events: list[Event]) -> bool:
    """Whether the first text came before any token (the echoed prompt)."""
    for event in events:
        if isinstance(event, TokenLogprob):
            return False
        if isinstance(event, TextDelta):
            return True
    return False


class CompletionStream:
    """The streamed `text_completion` chunks: one per text delta, the last with `finish_reason`, with
    `include_usage` one more with the usage and no choices; `[DONE]` follows (sent by the caller)."""

    def __init__(self, *, model: str, request_id: str, body: Any):
        self._head = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()),
                      "model": model}
        self._include_usage = include_usage(body) if isinstance(body, dict) else False
        self._usage: Usage | None = None
        self._logprobs: list[TokenLogprob] = []  # waiting for the chunk of their text
        self._offset = 0  # where the next chunk's text starts

    def feed(self, event: Event) -> list[SseEvent]:
        if isinstance(event, TokenLogprob):
            self._logprobs.append(event)
        elif isinstance(event, PromptLogprobs):  # they go out with the echoed prompt's chunk
            self._logprobs.extend(event.entries)
        elif isinstance(event, TextDelta) and event.text:
            return [self._chunk(event.text)]
        if isinstance(event, Usage):
            self._usage = event
        elif isinstance(event, Finish):
            try:
                reason = _finish_reason(event)
            except ApiError as error:
                return self.error(error)
            out = [self._chunk("", reason)]
            if self._include_usage:
                out.append(("", {**self._head, "choices": [], "usage": usage_json(self._usage)}))
            return out
        return []

    def error(self, error: ApiError) -> list[SseEvent]:
        return [("", {"error": {"message": error.message, "type": error.kind, "param": error.param,
                                "code": error.code}})]

    def _chunk(self, text: str, finish_reason: str | None = None) -> SseEvent:
        logprobs, _ = _logprobs_json(self._logprobs, self._offset)
        self._logprobs = []
        self._offset += len(text)
        return ("", {**self._head, "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                                                "finish_reason": finish_reason}]})
