"""Defects found by running another server's API test suite against Strata, each pinned by a test through
hypercorn with the official clients: prompt usage at the start of an Anthropic stream, reasoning tokens in the
Responses usage, and the OpenAI error code of a prompt that does not fit the context."""

from __future__ import annotations

import anthropic
import openai
from conftest import live_server, server_config

USER = [{"role": "user", "content": "hi"}]


def test_anthropic_message_start_carries_the_prompt_tokens(serve_script, tokenizer):
    with serve_script("Hello") as server:
        with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as client:
            first = client.messages.create(model="m", max_tokens=20, messages=USER, stream=True)
            start = next(iter(first))
            for _ in first:
                pass
            again = client.messages.create(model="m", max_tokens=20, messages=USER, stream=True)
            start_again = next(iter(again))
            for _ in again:
                pass
    n_prompt = len(server.service.engine.calls[0])
    assert start.type == "message_start"
    assert (start.message.usage.input_tokens, start.message.usage.cache_read_input_tokens) == (n_prompt, 0)
    # The second time all but the last prompt token come from the KV cache; Anthropic counts those apart.
    assert (start_again.message.usage.input_tokens, start_again.message.usage.cache_read_input_tokens) == (
        1, n_prompt - 1)


def test_responses_usage_counts_reasoning_tokens(serve_script, tokenizer):
    script = "<think>\nabc\n</think>\n\nHi"
    with serve_script(script) as server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused") as client:
        response = client.responses.create(model="m", input="hi", max_output_tokens=50)
        with client.responses.stream(model="m", input="hi", max_output_tokens=50) as events:
            streamed = events.get_final_response()
        chat = client.chat.completions.create(model="m", messages=USER, max_tokens=50)
    reasoning = len(tokenizer.encode("<think>\nabc\n</think>", special=True))
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.usage.output_tokens_details.reasoning_tokens == reasoning
    assert streamed.usage.output_tokens_details.reasoning_tokens == reasoning
    assert chat.usage.completion_tokens_details.reasoning_tokens == reasoning
    assert response.usage.output_tokens == len(tokenizer.encode(script, special=True))


def test_a_prompt_over_the_context_is_context_length_exceeded(scripted, tokenizer):
    engine = scripted("x", n_ctx=64)
    with live_server(server_config(), engine, tokenizer) as server:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            try:
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": "word " * 100}])
            except openai.BadRequestError as error:
                caught = error
            else:
                raise AssertionError("a prompt over the context was accepted")
    assert caught.code == "context_length_exceeded"
    assert "context" in caught.body["message"]
