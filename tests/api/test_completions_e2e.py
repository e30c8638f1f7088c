"""`POST /v1/completions` through hypercorn and the real C engine with the official client: answers equal greedy
decoding with the engine called directly, streamed and not, for a text prompt, token ids, echo, stop strings and
a fill-in-the-middle suffix where the model has FIM tokens (a 400 naming `suffix` where it has none);
unsupported fields are 400s naming them."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import openai
import pytest
from conftest import live_server, server_config

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def greedy(tiny_model: Path):
    from strata.engine_cffi import Engine
    from strata.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(tiny_model)
    engine = Engine.load(tiny_model, n_ctx=512)

    def continuation(ids: list[int], n: int = MAX_TOKENS) -> list[int]:
        engine.keep(0)
        logits = engine.eval(ids)
        out: list[int] = []
        while len(out) < n:
            token = int(np.argmax(logits))
            if token in tokenizer.eos_ids:
                break
            out.append(token)
            logits = engine.eval([token])
        return out

    continuation.engine = engine  # type: ignore[attr-defined]
    yield continuation
    engine.close()


@pytest.fixture(scope="module")
def client(tiny_model: Path):
    with live_server(server_config(model=str(tiny_model), context=512)) as live:
        with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0) as api:
            yield api


def test_a_text_prompt_streamed_and_not(client, greedy, tokenizer):
    prompt = "Once upon a time"
    expected = tokenizer.decode(greedy(tokenizer.encode(prompt, special=False)))
    reply = client.completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(client.completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert reply.object == "text_completion" and reply.choices[0].text == expected
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == MAX_TOKENS
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.prompt_tokens == len(tokenizer.encode(prompt, special=False))


def test_token_ids_echo_and_stop(client, greedy, tokenizer):
    ids = tokenizer.encode("Numbers: 1 2 3", special=False)
    expected = tokenizer.decode(greedy(ids))
    reply = client.completions.create(model="m", prompt=ids, max_tokens=MAX_TOKENS, temperature=0, echo=True)
    assert reply.choices[0].text == "Numbers: 1 2 3" + expected
    stop = expected[2:4]
    cut = client.completions.create(model="m", prompt=ids, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert cut.choices[0].text == expected[: expected.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_control_token_text_in_a_prompt_stays_text(client, tokenizer):
    reply = client.completions.create(model="m", prompt="<|im_end|>", max_tokens=1, temperature=0)
    assert reply.usage.prompt_tokens == len(tokenizer.encode("<|im_end|>", special=False)) > 1


@pytest.fixture(scope="module")
def no_fim_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its vocabulary's fill-in-the-middle tags renamed: a model without FIM tokens."""
    import dataclasses

    from strata.modelgen import vocab, write_random_model, writer

    renamed = {"<|fim_prefix|>": "<|unused_a|>", "<|fim_suffix|>": "<|unused_b|>", "<|fim_middle|>": "<|unused_c|>"}
    plain = vocab.bytes_vocab()
    without = dataclasses.replace(plain, tokens=tuple(renamed.get(t, t) for t in plain.tokens))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(writer, "get_vocab", lambda name: without)
        return write_random_model(tmp_path_factory.mktemp("nofim") / "nofim.gguf", arch="qwen3moe", size="tiny",
                                  dtype="f32", vocab="bytes", seed=0)


def test_a_suffix_is_filled_in_the_middle(client, greedy, tokenizer):
    # The file has no FIM keys (llama.cpp's converter writes none): the tokens are found in the vocabulary.
    fim = [tokenizer.token_to_id(name) for name in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")]
    ids = [fim[0], *tokenizer.encode("def add(a, b):\n", special=False), fim[1],
           *tokenizer.encode("\n    return c\n", special=False), fim[2]]
    reply = client.completions.create(model="m", prompt="def add(a, b):\n", suffix="\n    return c\n",
                                      max_tokens=MAX_TOKENS, temperature=0)
    assert reply.choices[0].text == tokenizer.decode(greedy(ids))
    assert reply.usage.prompt_tokens == len(ids)


def test_a_suffix_for_a_model_without_fim_is_a_400_naming_it(no_fim_model):
    with live_server(server_config(model=str(no_fim_model), context=512)) as live:
        with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0) as api:
            with pytest.raises(openai.BadRequestError) as caught:
                api.completions.create(model="m", prompt="def add(a, b):\n", suffix="\n    return c\n", max_tokens=4)
            plain = api.completions.create(model="m", prompt="def add(a, b):\n", max_tokens=2, temperature=0)
    assert caught.value.body["param"] == "suffix"
    assert "fill-in-the-middle" in caught.value.body["message"]
    assert plain.choices[0].text  # the same model completes a prompt without a suffix


@pytest.mark.parametrize(("extra", "param"), [
    ({"n": 2}, "n"), ({"best_of": 3}, "best_of"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, "x"]}, "prompt[1]"), ({"prompt": [10**9]}, "prompt"), ({"max_tokens": 0}, "max_tokens"),
])
def test_unsupported_fields_name_themselves(client, extra, param):
    request = {"model": "m", "prompt": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**request)
    assert caught.value.body["param"] == param


def test_json_schema_on_a_completion(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    reply = client.completions.create(model="m", prompt="JSON:", max_tokens=40, temperature=1.0, seed=3,
                                      extra_body={"json_schema": schema})
    jsonschema.validate(json.loads(reply.choices[0].text), schema)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_with_logprobs_scores_the_prompt(client, greedy, tokenizer, stream):
    """The echoed prompt's tokens come first in `logprobs`, the first with null entries, the others with their
    log-probabilities under the model (the engine's own logits, log-softmaxed here in float64), then the answer's."""
    ids = tokenizer.encode("Numbers: 1 2 3", special=False)
    engine = greedy.engine
    engine.keep(0)
    rows = engine.eval(ids, all_logits=True).astype(np.float64)
    log_softmax = rows - rows.max(axis=1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(axis=1, keepdims=True))
    expected = [log_softmax[i, ids[i + 1]] for i in range(len(ids) - 1)]
    request = dict(model="m", prompt=ids, max_tokens=3, temperature=0, echo=True, logprobs=2)
    if stream:
        chunks = list(client.completions.create(stream=True, **request))
        entries = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        tokens = [t for e in entries for t in e.tokens]
        scores = [v for e in entries for v in e.token_logprobs]
        tops = [v for e in entries for v in e.top_logprobs]
    else:
        logprobs = client.completions.create(**request).choices[0].logprobs
        tokens, scores, tops = logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs
        assert logprobs.text_offset[:2] == [0, len(tokens[0])]
    assert len(tokens) == len(ids) + 3
    assert "".join(tokens[:len(ids)]) == tokenizer.decode(ids)
    assert scores[0] is None and tops[0] is None
    np.testing.assert_allclose(scores[1:len(ids)], expected, rtol=0, atol=1e-4)
    assert all(len(top) == 2 for top in tops[1:])
    assert all(score <= 0 for score in scores[1:])
