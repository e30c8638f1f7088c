"""What else clients send, through hypercorn with the official clients: logit_bias, assistant prefill (Anthropic's
last assistant message, OpenAI's continue_final_message), /tokenize and /detokenize in llama.cpp's shapes, CORS,
and the served model's aliases with its context length."""

from __future__ import annotations

from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from conftest import live_server, server_config

USER = [{"role": "user", "content": "What is the answer?"}]


@pytest.fixture(scope="module")
def real(tiny_model: Path):
    with live_server(server_config(model=str(tiny_model), context=512)) as live:
        yield live


def test_logit_bias_bans_and_forces_tokens(real, tokenizer):
    with openai.OpenAI(base_url=real.url + "/v1", api_key="unused", max_retries=0) as client:
        def answer(**extra) -> str:
            return client.chat.completions.create(model="m", messages=USER, max_tokens=6, temperature=0,
                                                  reasoning_effort="none", **extra).choices[0].message.content

        def first_token(n_prompt: int) -> int:  # what the last used slot's cache holds after the prompt
            slots = real.service.loop.batcher.slots
            return real.call(lambda: max(slots, key=lambda slot: slot.used).keys[n_prompt])

        n_prompt = client.chat.completions.create(model="m", messages=USER, max_tokens=6, temperature=0,
                                                  reasoning_effort="none").usage.prompt_tokens
        first = first_token(n_prompt)
        answer(logit_bias={str(first): -100})
        banned = first_token(n_prompt)
        forced_id = tokenizer.encode("z", special=True)[0]
        forced = answer(logit_bias={str(forced_id): 100})
        with pytest.raises(openai.BadRequestError) as too_big:
            answer(logit_bias={str(tokenizer.n_vocab + 5): 1})
        with pytest.raises(openai.BadRequestError) as out_of_range:
            answer(logit_bias={"1": 101})
    assert banned != first
    assert forced == "z" * 6
    assert too_big.value.body["param"] == "logit_bias"
    assert out_of_range.value.body["param"] == "logit_bias.1"


def test_anthropic_prefill_continues_the_assistant_text(serve_script, tokenizer):
    with serve_script("The answer is 42.") as server:
        with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as client:
            message = client.messages.create(model="m", max_tokens=50, messages=[
                *USER, {"role": "assistant", "content": "The answer is"}])
        prompt = tokenizer.decode(server.service.engine.calls[0])
    assert message.content[0].text == " 42."
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nThe answer is")


def test_openai_continue_final_message(serve_script, tokenizer):
    with serve_script("The answer is 42.") as server:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            messages = [*USER, {"role": "assistant", "content": "The answer is"}]
            continued = client.chat.completions.create(model="m", messages=messages,
                                                       extra_body={"continue_final_message": True})
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model="m", messages=USER, extra_body={"continue_final_message": True})
    assert continued.choices[0].message.content == " 42."
    assert refused.value.body["param"] == "continue_final_message"


def test_tokenize_and_detokenize(serve_script, tokenizer):
    text = "Hi <|im_end|> é"
    with serve_script("x") as server, httpx.Client(base_url=server.url) as client:
        ids = client.post("/tokenize", json={"content": text}).json()["tokens"]
        plain = client.post("/tokenize", json={"content": text, "parse_special": False}).json()["tokens"]
        pieces = client.post("/tokenize", json={"content": "é", "with_pieces": True}).json()["tokens"]
        back = client.post("/detokenize", json={"tokens": ids}).json()
        bad = client.post("/detokenize", json={"tokens": [tokenizer.n_vocab]})
    assert ids == tokenizer.encode(text, special=True) and tokenizer.token_to_id("<|im_end|>") in ids
    assert plain == tokenizer.encode(text, special=False) and tokenizer.token_to_id("<|im_end|>") not in plain
    # The byte vocabulary spells é in two tokens, neither valid UTF-8 alone: their pieces are bytes.
    assert pieces == [{"id": i, "piece": list(tokenizer.id_bytes[i])} for i in tokenizer.encode("é")]
    assert back == {"content": text}
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[0]"


def test_cors_preflight_without_the_key_and_requests_with_it(tokenizer, scripted):
    config = server_config(api_key="secret", cors_origins=["http://app.example"])
    with live_server(config, scripted("x"), tokenizer) as server, httpx.Client(base_url=server.url) as client:
        preflight = client.options("/v1/chat/completions", headers={
            "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        stranger = client.options("/v1/chat/completions", headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        no_key = client.get("/v1/models", headers={"Origin": "http://app.example"})
        with_key = client.get("/v1/models", headers={"Origin": "http://app.example",
                                                     "Authorization": "Bearer secret"})
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == "http://app.example"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization, content-type"
    assert stranger.status_code == 403 and "access-control-allow-origin" not in stranger.headers
    assert no_key.status_code == 401 and no_key.headers["access-control-allow-origin"] == "http://app.example"
    assert with_key.status_code == 200


def test_no_cors_headers_by_default(serve_script):
    with serve_script("x") as server, httpx.Client(base_url=server.url) as client:
        reply = client.get("/v1/models", headers={"Origin": "http://app.example"})
    assert reply.status_code == 200 and "access-control-allow-origin" not in reply.headers


def test_model_aliases_and_context_length(tiny_model: Path):
    config = server_config(model=str(tiny_model), context=256, model_alias="qwen-local, gpt-4o-mini")
    with live_server(config) as server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused") as client:
        models = client.models.list().data
        reply = client.chat.completions.create(model="gpt-4o-mini", messages=USER, max_tokens=2)
    assert [model.id for model in models] == ["qwen-local", "gpt-4o-mini"]
    assert {model.model_extra["context_length"] for model in models} == {256}
    assert reply.model == "qwen-local"


def test_responses_input_token_count(serve_script, tokenizer):
    with serve_script("x") as server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused") as client:
        count = client.responses.input_tokens.count(model="m", input="Hello there", instructions="Be brief.")
        client.responses.create(model="m", input="Hello there", instructions="Be brief.", max_output_tokens=5)
        n_prompt = len(server.service.engine.calls[0])
    assert (count.object, count.input_tokens) == ("response.input_tokens", n_prompt)


@pytest.mark.parametrize(("extra", "param"), [
    ({"n": 2}, "n"), ({"modalities": ["text", "audio"]}, "modalities[1]"), ({"audio": {"voice": "x"}}, "audio"),
    ({"prediction": {"type": "text", "content": "x"}}, "prediction.type"),
    ({"prediction": {"type": "content", "content": [{"type": "image"}]}}, "prediction.content[0].type"),
    ({"response_format": {"type": "sound"}}, "response_format.type"),
])
def test_unsupported_chat_fields_are_400s(serve_script, extra, param):
    with serve_script("x") as server, httpx.Client(base_url=server.url) as client:
        reply = client.post("/v1/chat/completions", json={"messages": USER, **extra})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param
