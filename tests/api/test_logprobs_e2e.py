"""Log-probabilities through hypercorn, the real C engine and the official client: chat `logprobs` /
`top_logprobs`, completions `logprobs`, Responses `include: ["message.output_text.logprobs"]`, streamed and not,
checked against log-softmax of the engine's own logits computed directly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openai
import pytest
from conftest import live_server, server_config

from strata.text.prompt import render_chat

N = 6
USER = [{"role": "user", "content": "Count with me."}]


@pytest.fixture(scope="module")
def reference(tiny_model: Path):
    """(token ids, log-probabilities of each, top-3 ids at each step) of greedy decoding, computed directly."""
    from strata.engine_cffi import Engine
    from strata.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(tiny_model)
    engine = Engine.load(tiny_model, n_ctx=512)

    def decode(ids: list[int]) -> tuple[list[int], list[float], list[list[int]]]:
        engine.keep(0)
        logits = engine.eval(ids).astype(np.float64)
        out, logprobs, tops = [], [], []
        for _ in range(N):
            log_softmax = logits - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max()
            token = int(np.argmax(logits))
            if token in tokenizer.eos_ids:
                break
            out.append(token)
            logprobs.append(float(log_softmax[token]))
            tops.append([int(i) for i in np.argsort(-logits)[:3]])
            logits = engine.eval([token]).astype(np.float64)
        return out, logprobs, tops

    def chat() -> tuple[list[int], list[float], list[list[int]]]:
        prompt = render_chat(tokenizer.chat_template, USER, enable_thinking=False)
        return decode(tokenizer.encode(prompt, special=True))

    yield chat, decode
    engine.close()


@pytest.fixture(scope="module")
def client(tiny_model: Path):
    with live_server(server_config(model=str(tiny_model), context=512)) as live:
        with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0) as api:
            yield api


def test_chat_logprobs_streamed_and_not(client, reference, tokenizer):
    ids, logprobs, tops = reference[0]()
    request = dict(model="m", messages=USER, max_tokens=N, temperature=0, reasoning_effort="none", logprobs=True,
                   top_logprobs=3)
    whole = client.chat.completions.create(**request).choices[0].logprobs.content
    streamed = [entry for chunk in client.chat.completions.create(stream=True, **request)
                for choice in chunk.choices if choice.logprobs for entry in choice.logprobs.content]
    for entries in (whole, streamed):
        assert [bytes(entry.bytes) for entry in entries] == [tokenizer.id_bytes[i] for i in ids]
        assert np.allclose([entry.logprob for entry in entries], logprobs, atol=2e-3)
        assert [[bytes(top.bytes) for top in entry.top_logprobs] for entry in entries] == [
            [tokenizer.id_bytes[i] for i in top] for top in tops]
        assert all(entry.top_logprobs[0].logprob == entry.logprob for entry in entries)  # greedy: the best


def test_chat_without_logprobs_has_none_and_top_needs_logprobs(client):
    reply = client.chat.completions.create(model="m", messages=USER, max_tokens=2)
    assert reply.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=USER, max_tokens=2, top_logprobs=2)
    assert caught.value.body["param"] == "top_logprobs"


def test_completions_logprobs(client, reference, tokenizer):
    prompt = tokenizer.encode("Once upon", special=False)
    ids, logprobs, _ = reference[1](prompt)
    reply = client.completions.create(model="m", prompt=prompt, max_tokens=N, temperature=0, logprobs=2)
    chunks = list(client.completions.create(model="m", prompt=prompt, max_tokens=N, temperature=0, logprobs=2,
                                            stream=True))
    result = reply.choices[0].logprobs
    assert np.allclose(result.token_logprobs, logprobs, atol=2e-3)
    assert [len(top) for top in result.top_logprobs] == [2] * len(ids)
    assert result.text_offset[0] == 0 and len(result.tokens) == len(ids)
    streamed = [value for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for value in chunk.choices[0].logprobs.token_logprobs]
    assert np.allclose(streamed, logprobs, atol=2e-3)


def test_responses_include_logprobs(client, reference):
    _, logprobs, _ = reference[0]()
    request = dict(model="m", input=USER, max_output_tokens=N, temperature=0, reasoning={"effort": "none"},
                   include=["message.output_text.logprobs"], top_logprobs=2)
    whole = client.responses.create(**request)
    # Cut short by max_output_tokens, the stream ends with response.incomplete: read its events as they come.
    events = list(client.responses.create(stream=True, **request))
    deltas = [entry for event in events if event.type == "response.output_text.delta" for entry in event.logprobs]
    done = next(event for event in events if event.type == "response.output_text.done")
    part = whole.output[-1].content[0]
    for entries in (part.logprobs, deltas, done.logprobs):
        assert np.allclose([entry.logprob for entry in entries], logprobs, atol=2e-3)
        assert all(len(entry.top_logprobs) == 2 for entry in entries)


@pytest.fixture(scope="module")
def demo():
    import strata

    demo_model = Path(strata.__file__).parent / "models" / "demo.gguf"
    with live_server(server_config(model=str(demo_model), context=1024)) as live:
        with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0) as api:
            yield api


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_reasoning_tokens_have_their_own_logprobs(demo, stream):
    """The demo model thinks first: its reasoning tokens' entries come under `logprobs.reasoning_content` (they
    spell the message's `reasoning_content`), the answer's under `content` (they spell `content`), the tags in
    neither. Responses reports output text only: the same answer, no reasoning entries."""
    request = dict(model="m", messages=[{"role": "user", "content": "What is the capital of Japan?"}], max_tokens=200,
                   temperature=0, logprobs=True, top_logprobs=1)
    if stream:
        content = reasoning = ""
        content_entries, reasoning_entries = [], []
        for chunk in demo.chat.completions.create(stream=True, **request):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
                if choice.logprobs is not None:
                    content_entries += [entry.token for entry in choice.logprobs.content or []]
                    reasoning_entries += [entry["token"] for entry in
                                          (choice.logprobs.model_extra or {}).get("reasoning_content") or []]
    else:
        choice = demo.chat.completions.create(**request).choices[0]
        content, reasoning = choice.message.content, choice.message.model_extra["reasoning_content"]
        content_entries = [entry.token for entry in choice.logprobs.content]
        reasoning_entries = [entry["token"] for entry in choice.logprobs.model_extra["reasoning_content"]]
    assert reasoning.strip() and content.strip()
    assert "".join(reasoning_entries).strip() == reasoning.strip()
    assert "".join(content_entries).strip() == content.strip()
    assert not any("think>" in token for token in content_entries + reasoning_entries)
    response = demo.responses.create(model="m", input="What is the capital of Japan?", max_output_tokens=200,
                                     temperature=0, include=["message.output_text.logprobs"])
    message = next(item for item in response.output if item.type == "message")
    assert "".join(entry.token for entry in message.content[0].logprobs).strip() == response.output_text.strip()
