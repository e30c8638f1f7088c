"""OpenAI text completions (`POST /v1/completions`): a raw prompt (text or token ids) continued without the chat
template, through the same service, turn and cancellation as chat. Pure translation, no I/O."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from strata.api.errors import ApiError
from strata.api.openai_chat import include_usage, sampling_from, stops_from, usage_json
from strata.api.translate import SseEvent, bad_request, check_type, collect, get, get_int, llama_cpp_format
from strata.events import ChatRequest, CompletionPrompt, Event, Finish, TextDelta, Usage

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
    if get(body, "logprobs", int, "logprobs") is not None:
        raise bad_request("logprobs", "log probabilities are not supported on this route yet")
    return ChatRequest(
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


def render_response(events: Iterable[Event], *, model: str, request_id: str) -> dict[str, Any]:
    """The `text_completion` object of a finished generation."""
    outcome = collect(events)
    finish_reason = _finish_reason(outcome.finish or Finish("error"))
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": "".join(block.text for block in outcome.blocks if block.kind == "text"),
                     "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage_json(outcome.usage),
    }


class CompletionStream:
    """The streamed `text_completion` chunks: one per text delta, the last with `finish_reason`, with
    `include_usage` one more with the usage and no choices; `[DONE]` follows (sent by the caller)."""

    def __init__(self, *, model: str, request_id: str, body: Any):
        self._head = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()),
                      "model": model}
        self._include_usage = include_usage(body) if isinstance(body, dict) else False
        self._usage: Usage | None = None

    def feed(self, event: Event) -> list[SseEvent]:
        if isinstance(event, TextDelta) and event.text:
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
        return ("", {**self._head, "choices": [{"index": 0, "text": text, "logprobs": None,
                                                "finish_reason": finish_reason}]})
