"""Every route end to end through hypercorn and the real C engine on a generated tiny model, with the official
clients. Answers are checked against greedy decoding with the engine called directly (no server code)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import pytest
from conftest import live_server, server_config

from strata.text.prompt import render_chat

MAX_TOKENS = 12
FIRST = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def reference(tiny_model: Path):
    """Greedy answers computed with the engine and tokenizer directly: (text, n_tokens) for given messages."""
    from strata.engine_cffi import Engine
    from strata.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(tiny_model)
    engine = Engine.load(tiny_model, n_ctx=512)

    def answer(messages: list[dict[str, Any]], enable_thinking: bool = True) -> tuple[str, int]:
        prompt = render_chat(tokenizer.chat_template, messages, enable_thinking=enable_thinking)
        engine.keep(0)
        logits = engine.eval(tokenizer.encode(prompt, special=True))
        out: list[int] = []
        while len(out) < MAX_TOKENS:
            token = int(np.argmax(logits))
            if token in tokenizer.eos_ids:
                break
            out.append(token)
            logits = engine.eval([token])
        return tokenizer.decode(out), len(out)

    yield answer
    engine.close()


@pytest.fixture(scope="module")
def server(tiny_model: Path):
    with live_server(server_config(model=str(tiny_model), context=512)) as live:
        yield live


def test_openai_chat_matches_direct_greedy_decoding(server, reference):
    text, n_tokens = reference(FIRST)
    assert "<" not in text, "the reference answer must be plain text for this comparison"
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused") as client:
        reply = client.chat.completions.create(model="m", messages=FIRST, max_tokens=MAX_TOKENS, temperature=0)
        stream = client.chat.completions.create(model="m", messages=FIRST, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
    assert reply.choices[0].message.content == text
    assert reply.usage.completion_tokens == n_tokens
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == text
    # The same prompt again: everything but its last token came from the KV cache.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == chunks[-1].usage.prompt_tokens - 1


def test_follow_up_reuses_the_cache_and_matches_a_cold_run(tiny_model, server, reference):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused") as client:
        first = client.chat.completions.create(model="m", messages=FIRST, max_tokens=MAX_TOKENS, temperature=0)
        follow_up = [*FIRST, {"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And then?"}]
        warm = client.chat.completions.create(model="m", messages=follow_up, max_tokens=MAX_TOKENS, temperature=0)
    cold_text, _ = reference(follow_up)
    # Invariant 5: only the new tokens were processed, and the answer is the cold run's.
    assert warm.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens // 2
    assert server.service.history.last.reused_tokens == warm.usage.prompt_tokens_details.cached_tokens
    assert warm.choices[0].message.content == cold_text


async def test_openai_chat_async_client(server, reference):
    text, _ = reference(FIRST)
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused") as client:
        reply = await client.chat.completions.create(model="m", messages=FIRST, max_tokens=MAX_TOKENS,
                                                     temperature=0)
    assert reply.choices[0].message.content == text


def test_anthropic_messages_route(server, reference):
    text, n_tokens = reference(FIRST, enable_thinking=False)
    with anthropic.Anthropic(base_url=server.url, api_key="unused") as client:
        greedy = {"extra_body": {"temperature": 0}}
        message = client.messages.create(model="m", max_tokens=MAX_TOKENS, messages=FIRST, **greedy)
        with client.messages.stream(model="m", max_tokens=MAX_TOKENS, messages=FIRST, **greedy) as stream:
            streamed = stream.get_final_message()
        counted = client.messages.count_tokens(model="m", messages=FIRST)
    assert "".join(block.text for block in message.content if block.type == "text") == text
    assert message.usage.output_tokens == n_tokens
    assert [block.model_dump() for block in streamed.content] == [block.model_dump() for block in message.content]
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_openai_responses_route(server, reference):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused") as client:
        response = client.responses.create(model="m", input="Tell me a story.", max_output_tokens=MAX_TOKENS,
                                           temperature=0, reasoning={"effort": "none"})
        events = list(client.responses.create(model="m", input="Tell me a story.", max_output_tokens=MAX_TOKENS,
                                              temperature=0, reasoning={"effort": "none"}, stream=True))
    text, n_tokens = reference(FIRST, enable_thinking=False)
    assert response.output_text == text
    # The answer is cut at max_output_tokens (the random model rarely stops sooner): the stream ends "incomplete".
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.output_text == text
    assert response.usage.output_tokens == n_tokens


def test_status_routes_report_the_engine(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused") as client:
        client.chat.completions.create(model="m", messages=FIRST, max_tokens=2, temperature=0)
    status = httpx.get(server.url + "/v1/status").json()
    assert status["engine"]["backend"] == "cpu" and status["context"] == 512
    assert status["last"]["output_tokens"] <= 2 and status["last"]["prompt_tokens"] > 0
    assert httpx.get(server.url + "/v1/history").json()["data"][0] == status["last"]
    assert "strata_tokens_total{kind=\"prompt\"}" in httpx.get(server.url + "/metrics").text
    assert httpx.get(server.url + "/status").json()["busy"] is False
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "tiny"
