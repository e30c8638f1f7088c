"""Several models behind one server, end to end through hypercorn and the real C engine: two tiny models made from
different seeds (so their greedy answers differ), each request answered by the model it names; loading on first
use and unloading the least recently used under `models_memory`; a hang-up while waiting for a swap; concurrent
requests to both; the unknown model's 404 in both dialects; `/v1/models`, `/v1/status` and `/metrics`."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import pytest
import trio
from conftest import live_server, server_config, wait_until

from strata.model_set import footprint
from strata.text.prompt import render_chat

MAX_TOKENS = 8
SLOTS = 2
CONTEXT = 256


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny random models of the same shape, from different seeds."""
    from strata.modelgen import write_random_model

    folder = tmp_path_factory.mktemp("two-models")
    return {name: write_random_model(folder / f"{name}.gguf", arch="qwen3moe", size="tiny", dtype="f32",
                                     vocab="bytes", seed=seed) for name, seed in (("alpha", 0), ("beta", 1))}


@pytest.fixture(scope="module")
def reference(model_files: dict[str, Path]):
    """Greedy answers with each model's engine called directly (no server code): text for (model, messages)."""
    from strata.engine_cffi import Engine
    from strata.text.tokenizer import Tokenizer

    engines = {name: (Engine.load(path, n_ctx=CONTEXT), Tokenizer.from_gguf(path))
               for name, path in model_files.items()}

    def answer(name: str, messages: list[dict[str, str]]) -> str:
        engine, tokenizer = engines[name]
        engine.keep(0)
        logits = engine.eval(tokenizer.encode(render_chat(tokenizer.chat_template, messages), special=True))
        out: list[int] = []
        while len(out) < MAX_TOKENS:
            token = int(np.argmax(logits))
            if token in tokenizer.eos_ids:
                break
            out.append(token)
            logits = engine.eval([token])
        return str(tokenizer.decode(out))

    yield answer
    for engine, _ in engines.values():
        engine.close()


def two_models(files: dict[str, Path], **keys: Any) -> Any:
    return server_config(models=[
        {"name": "alpha", "model": str(files["alpha"]), "aliases": ["a"], "context": CONTEXT, "slots": SLOTS},
        {"name": "beta", "model": str(files["beta"]), "context": CONTEXT, "slots": SLOTS},
    ], **keys)


def budget_for_one(files: dict[str, Path]) -> int:
    """A `models_memory` that holds either model but not both."""
    config = two_models(files)
    sizes = [footprint(config.for_model(entry)) for entry in config.models]
    assert max(sizes) < 2 * min(sizes)
    return max(sizes) + min(sizes) // 2


def chat(client: openai.OpenAI, model: str, text: str) -> Any:
    return client.chat.completions.create(model=model, messages=ask(text), max_tokens=MAX_TOKENS, temperature=0)


def states(url: str) -> dict[str, str]:
    return {entry["id"]: entry["state"] for entry in httpx.get(url + "/v1/models").json()["data"]}


def test_each_request_is_answered_by_the_model_it_names(model_files, reference):
    assert reference("alpha", ask("Tell me a story.")) != reference("beta", ask("Tell me a story."))
    with live_server(two_models(model_files)) as server, \
            openai.OpenAI(base_url=server.url + "/v1", api_key="unused") as client:
        assert states(server.url) == {"alpha": "not loaded", "beta": "not loaded"}  # nothing loads at startup
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}
        first = chat(client, "alpha", "Tell me a story.")
        assert states(server.url) == {"alpha": "loaded", "beta": "not loaded"}
        second = chat(client, "beta", "Tell me a story.")
        by_alias = chat(client, "a", "Tell me a story.")
        assert states(server.url) == {"alpha": "loaded", "beta": "loaded"}  # no budget: both stay
        listed = httpx.get(server.url + "/v1/models").json()["data"]
    assert first.choices[0].message.content == reference("alpha", ask("Tell me a story."))
    assert second.choices[0].message.content == reference("beta", ask("Tell me a story."))
    assert by_alias.choices[0].message.content == first.choices[0].message.content
    assert (first.model, second.model, by_alias.model) == ("alpha", "beta", "alpha")  # the name, not the alias
    assert [(entry["id"], entry["aliases"], entry["context_length"]) for entry in listed] == \
        [("alpha", ["a"], CONTEXT), ("beta", [], CONTEXT)]


def test_an_unknown_model_is_a_404_in_each_dialect(model_files):
    with live_server(two_models(model_files)) as server:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client, \
                pytest.raises(openai.NotFoundError) as openai_error:
            chat(client, "gamma", "Hello")
        with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as client, \
                pytest.raises(anthropic.NotFoundError) as anthropic_error:
            client.messages.create(model="gamma", max_tokens=4, messages=ask("Hello"))
        assert server.service.models.taken() == 0  # nothing was loaded for them
    body = openai_error.value.body
    assert isinstance(body, dict) and body["code"] == "model_not_found" and body["param"] == "model"
    assert "'gamma'" in body["message"] and "alpha, beta" in body["message"]
    assert anthropic_error.value.body["error"]["type"] == "not_found_error"
    assert "alpha, beta" in anthropic_error.value.body["error"]["message"]


def test_the_least_recently_used_model_is_unloaded_to_make_room(model_files, reference):
    config = two_models(model_files, models_memory=budget_for_one(model_files))
    with live_server(config) as server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused") as client:
        answers = [chat(client, "alpha", "Hello there")]
        alpha = server.service.models.find("alpha")
        tokenizer = alpha.tokenizer
        answers += [chat(client, name, "Hello there") for name in ("beta", "alpha")]
        assert states(server.url) == {"alpha": "loaded", "beta": "not loaded"}
        assert alpha.tokenizer is tokenizer  # the text side kept through the unload
        models = server.service.models
        assert models.taken() <= models.budget
        metrics = httpx.get(server.url + "/metrics").text
        status = httpx.get(server.url + "/v1/status").json()["models"]
        history = httpx.get(server.url + "/v1/history").json()["data"]
    for answer in answers:
        assert answer.choices[0].message.content == reference(answer.model, ask("Hello there"))
    assert [row["model"] for row in history] == ["alpha", "beta", "alpha"][::-1]
    assert 'strata_model_loaded{model="alpha"} 1.0' in metrics and 'strata_model_loaded{model="beta"} 0.0' in metrics
    assert 'strata_requests_total{finish="length",model="alpha"}' in metrics
    assert status["memory"]["budget"] == config.models_memory
    assert [(model["name"], model["state"], model["totals"]["requests"]) for model in status["data"]] == \
        [("alpha", "loaded", 2), ("beta", "not loaded", 1)]


async def test_a_hang_up_while_waiting_for_a_swap_leaves_nothing_behind(model_files, reference):
    config = two_models(model_files, models_memory=budget_for_one(model_files))
    with live_server(config) as server:
        service = server.service
        alpha, beta = service.models.find("alpha"), service.models.find("beta")
        async with httpx.AsyncClient(base_url=server.url + "/v1", timeout=30) as client:
            await client.post("/chat/completions", json={"model": "alpha", "messages": ask("warm up"),
                                                          "max_tokens": 1})
            release = threading.Event()

            async def hold_alpha_between_steps() -> None:  # in the server's trio run
                assert alpha.loop is not None
                async with alpha.loop.paused():
                    await trio.to_thread.run_sync(release.wait)

            # The alpha request stays on its engine (the engine thread held between two steps) while beta's
            # request waits for alpha's memory.
            server.call(lambda: service.nursery.start_soon(hold_alpha_between_steps))
            async with trio.open_nursery() as nursery:
                answers: list[Any] = []

                async def alpha_request() -> None:
                    answers.append(await client.post("/chat/completions", json={
                        "model": "alpha", "messages": ask("Tell me a story."), "max_tokens": MAX_TOKENS,
                        "temperature": 0}))

                nursery.start_soon(alpha_request)
                await wait_until(lambda: alpha.users == 1 and any(
                    progress.phase in ("prompt", "decode") for progress in service.activity))
                waiting = trio.CancelScope()

                async def beta_request() -> None:
                    with waiting:  # leaving the client closes its connection: a hang-up
                        async with httpx.AsyncClient(base_url=server.url + "/v1") as own:
                            await own.post("/chat/completions", json={"model": "beta", "messages": ask("Hi")})

                nursery.start_soon(beta_request)
                await wait_until(lambda: any(progress.phase == "loading" for progress in service.activity))
                assert (alpha.state, beta.state, beta.users) == ("loaded", "not loaded", 1)
                # A new alpha request does not start while beta's waits for alpha's memory: it waits behind it.
                nursery.start_soon(alpha_request)
                await wait_until(lambda: [progress.phase for progress in service.activity].count("loading") == 2)
                shown = {entry["name"]: entry for entry in (await client.get("/status")).json()["models"]["data"]}
                assert [(shown[name]["draining"], shown[name]["waiting"], shown[name]["users"])
                        for name in ("alpha", "beta")] == [(True, 1, 2), (False, 1, 1)]
                waiting.cancel()  # the beta client hangs up while it waits: the drain it began ends
                await wait_until(lambda: beta.users == 0 and not service.models.waits(alpha))
                assert (alpha.state, beta.state) == ("loaded", "not loaded")  # no swap for a client that left
                shown = {entry["name"]: entry for entry in (await client.get("/status")).json()["models"]["data"]}
                assert (shown["alpha"]["draining"], shown["alpha"]["waiting"]) == (False, 0)
                release.set()
            assert [answer.json()["choices"][0]["message"]["content"] for answer in answers] == \
                [reference("alpha", ask("Tell me a story."))] * 2
            await wait_until(lambda: alpha.users == 0 and len(service.activity) == 0)
            finishes = [(row.model, row.finish) for row in service.history.rows]
            assert ("beta", "cancel") in finishes
            # Now the swap happens for the next beta request.
            again = await client.post("/chat/completions", json={"model": "beta", "messages": ask("Hi"),
                                                                  "max_tokens": MAX_TOKENS, "temperature": 0})
            assert again.json()["choices"][0]["message"]["content"] == reference("beta", ask("Hi"))
            assert (alpha.state, beta.state) == ("not loaded", "loaded")


async def test_concurrent_requests_to_both_models_do_not_mix(model_files, reference):
    prompts = [f"Question number {i}" for i in range(6)]
    with live_server(two_models(model_files)) as server:
        async with httpx.AsyncClient(base_url=server.url + "/v1", timeout=60) as client:
            answers: dict[tuple[str, str], str] = {}

            async def one(name: str, text: str) -> None:
                reply = await client.post("/chat/completions", json={
                    "model": name, "messages": ask(text), "max_tokens": MAX_TOKENS, "temperature": 0})
                answers[name, text] = reply.json()["choices"][0]["message"]["content"]

            async with trio.open_nursery() as nursery:
                for text in prompts:
                    for name in ("alpha", "beta"):
                        nursery.start_soon(one, name, text)
        assert all(model.users == 0 for model in server.service.models.models)
    assert answers == {(name, text): reference(name, ask(text)) for name in ("alpha", "beta") for text in prompts}


def test_a_model_that_fails_to_load_is_a_503_and_a_state(model_files, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(model_files["alpha"].read_bytes()[:4096])  # a truncated file
    config = server_config(models=[{"name": "alpha", "model": str(model_files["alpha"]), "context": CONTEXT},
                                   {"name": "broken", "model": str(broken), "context": CONTEXT}])
    with live_server(config) as server, \
            openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.InternalServerError) as error:
            chat(client, "broken", "Hello")
        listed = {entry["id"]: entry for entry in httpx.get(server.url + "/v1/models").json()["data"]}
        healthy = chat(client, "alpha", "Hello")  # the server goes on
    assert error.value.status_code == 503 and "the model broken failed to load" in str(error.value)
    assert listed["broken"]["state"] == "failed" and listed["broken"]["error"]
    assert healthy.choices[0].message.content


def test_token_routes_take_the_named_model_or_the_first(model_files):
    with live_server(two_models(model_files)) as server:
        named = httpx.post(server.url + "/tokenize", json={"model": "beta", "content": "hi"})
        assert states(server.url) == {"alpha": "not loaded", "beta": "loaded"}
        unnamed = httpx.post(server.url + "/tokenize", json={"content": "hi"})  # llama.cpp's shape: no model
        assert states(server.url) == {"alpha": "loaded", "beta": "loaded"}
        unknown = httpx.post(server.url + "/detokenize", json={"model": "gamma", "tokens": [1]})
        missing = httpx.post(server.url + "/v1/chat/completions", json={"messages": ask("Hi")})
    assert named.json() == unnamed.json() and named.json()["tokens"]
    assert unknown.status_code == 404 and "'gamma' does not exist" in unknown.json()["error"]["message"]
    assert missing.status_code == 404 and missing.json()["error"]["message"] == \
        "the request names no model: this server serves alpha, beta"


async def test_a_hang_up_while_its_model_loads_leaves_the_load_to_finish(model_files, reference, monkeypatch):
    from strata.served_model import ServedModel

    loading, release = threading.Event(), threading.Event()
    load_blocking = ServedModel._load_blocking

    def held_load(self: ServedModel, *args: Any) -> Any:  # in the load's worker thread
        loading.set()
        release.wait(30)
        return load_blocking(self, *args)

    monkeypatch.setattr(ServedModel, "_load_blocking", held_load)
    with live_server(two_models(model_files)) as server:
        service = server.service
        beta = service.models.find("beta")
        async with httpx.AsyncClient(base_url=server.url + "/v1", timeout=30) as client:
            waiting = trio.CancelScope()

            async def beta_request() -> None:
                with waiting:  # leaving the client closes its connection: a hang-up
                    async with httpx.AsyncClient(base_url=server.url + "/v1") as own:
                        await own.post("/chat/completions", json={"model": "beta", "messages": ask("Hi")})

            async with trio.open_nursery() as nursery:
                nursery.start_soon(beta_request)
                await wait_until(loading.is_set)
                assert [progress.phase for progress in service.activity] == ["loading"]
                waiting.cancel()
                await wait_until(lambda: beta.users == 0 and len(service.activity) == 0)
            assert beta.state == "loading"  # the load goes on for the next request
            release.set()
            await wait_until(lambda: beta.state == "loaded")
            assert [(row.model, row.finish) for row in service.history.rows] == [("beta", "cancel")]
            again = await client.post("/chat/completions", json={"model": "beta", "messages": ask("Hi"),
                                                                  "max_tokens": MAX_TOKENS, "temperature": 0})
    assert again.json()["choices"][0]["message"]["content"] == reference("beta", ask("Hi"))
    assert beta.loads == 1  # loaded once, for both requests


def test_a_model_larger_than_the_budget_is_a_503_that_says_so(model_files):
    with live_server(two_models(model_files, models_memory="1MiB")) as server:
        reply = httpx.post(server.url + "/v1/chat/completions", json={"model": "alpha", "messages": ask("Hi")})
        still = states(server.url)
    assert reply.status_code == 503
    assert re.fullmatch(r"the model alpha needs 0\.\d\d GiB, more than models_memory \(0\.00 GiB\)",
                        reply.json()["error"]["message"])
    assert still == {"alpha": "not loaded", "beta": "not loaded"}  # nothing loaded, nothing unloaded
