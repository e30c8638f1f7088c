"""vLLM's render routes, which KV-aware routers call to learn a request's prompt token ids:
`POST /v1/chat/completions/render` and `/v1/responses/render` (a chat or Responses body in, one vLLM
`GenerateRequest` out) and `/v1/completions/render` (a completions body in, a list of them: one per prompt). A
router hashes the ids in blocks and asks its index which replica holds the longest prefix (`strata.kv_events`).
No engine: the chat template and the tokenizer only, in a worker thread unless the request is short, as the chat
routes render.

The ids are those the chat route would evaluate, but for two things a router cannot match anyway: a picture is
its one placeholder token (its rows come from the encoder), and the tools of MCP servers the request names are not
listed (the server lists them when it answers).
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import trio

from strata.api import openai_chat, openai_completions, openai_responses
from strata.api.translate import bad_request, check_type
from strata.events import ChatRequest
from strata.prompts import short


async def render_chat(model: Any, body: Any, limiter: trio.CapacityLimiter) -> dict[str, Any]:
    """A chat completions body to `{"request_id", "token_ids", "model", "sampling_params", "stream"}`.

    Args:
        model: the loaded `strata.served_model.ServedModel` the body names (or the first).
        limiter: the worker threads of the app's token routes.

    Raises:
        ApiError: 400 for a body the chat route would refuse.
        RequestError: a prompt the chat route would refuse (too long for the context, a bad template argument).
    """
    request = openai_chat.parse_request(body)
    return await _generate_request(model, request, body, f"chatcmpl-{uuid.uuid4().hex}", limiter)


async def render_responses(model: Any, body: Any, limiter: trio.CapacityLimiter) -> dict[str, Any]:
    """A Responses body to a `GenerateRequest`, as `render_chat`.

    Raises:
        ApiError: 400 for a body the Responses route would refuse (`previous_response_id`: no response is kept).
        RequestError: a prompt the Responses route would refuse.
    """
    request = openai_responses.parse_request(body)
    return await _generate_request(model, request, body, f"resp_{uuid.uuid4().hex}", limiter)


async def render_completions(model: Any, body: Any, limiter: trio.CapacityLimiter) -> list[dict[str, Any]]:
    """A completions body to one `GenerateRequest` per prompt (`prompt` may list several, as vLLM's allows).

    Raises:
        ApiError: 400 for a body the completions route would refuse (but for several prompts).
        RequestError: a prompt the completions route would refuse.
    """
    body = check_type(body, dict, "body")
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt)
    if isinstance(prompt, list) and not prompt:
        raise bad_request("prompt", "must not be empty")
    bodies = [{**body, "prompt": one} for one in prompt] if several else [body]
    return [await _generate_request(model, openai_completions.parse_request(one), one,
                                    f"cmpl-{uuid.uuid4().hex}", limiter) for one in bodies]


async def _generate_request(model: Any, request: ChatRequest, body: Any, request_id: str,
                            limiter: trio.CapacityLimiter) -> dict[str, Any]:
    prompts = model.prompts
    if short(request):
        _, ids = prompts.text_and_ids(request)
    else:
        _, ids = await trio.to_thread.run_sync(prompts.text_and_ids, request, limiter=limiter)
    sampling = dataclasses.asdict(request.sampling)
    sampling["logit_bias"] = dict(request.sampling.logit_bias)
    return {"request_id": request_id, "token_ids": ids, "model": model.name,
            "sampling_params": {**sampling, "max_tokens": request.max_tokens, "stop": request.stop},
            "stream": isinstance(body, dict) and body.get("stream") is True}
