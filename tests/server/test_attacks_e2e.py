"""What one hostile or careless client must not do to the others (issue 29's attacks), through hypercorn and the
real C engine on the tiny model: fail the engine's step for everyone, wedge the engine, or get a 500."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import LiveServer, live_server, server_config

from strata.scheduling import engine_loop
from strata.scheduling.engine_loop import EngineLoop

USER = [{"role": "user", "content": "Tell me a story about a cat."}]


def chat(server: LiveServer, **fields: Any) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", timeout=60,
                      json={"model": "m", "messages": USER, "max_tokens": 16, **fields})


@pytest.fixture(scope="module")
def server(tiny_model) -> Iterator[LiveServer]:
    with live_server(server_config(model=str(tiny_model), slots=4, context=512)) as live:
        yield live


@pytest.mark.parametrize("body", [
    b'"top_k": 2147483648',  # overflowed the engine's C int while it drew every sequence's token
    b'"top_k": 18446744073709551616',
    b'"top_k": -1',
])
def test_sampling_values_past_the_engines_types_are_400s_naming_the_field(server, body):
    raw = b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], ' + body + b"}"
    reply = httpx.post(server.url + "/v1/chat/completions", content=raw, timeout=60,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "top_k"


def test_one_requests_sampling_values_never_fail_the_others_step(server):
    # Three streams decode at temperature 1 with top_k set, so their draws share the engine's steps with the
    # attacker's; before top_k was bounded, its value failed every draw of those steps.
    results: dict[str, httpx.Response] = {}

    def innocent(name: str) -> None:
        results[name] = chat(server, temperature=1.0, top_k=40, seed=7, max_tokens=48)

    threads = [threading.Thread(target=innocent, args=(f"innocent{i}",)) for i in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(0.05)
    attacks = [chat(server, temperature=1.0, top_k=2**31 + i) for i in range(5)]
    for thread in threads:
        thread.join(60)
    assert all(reply.status_code == 400 for reply in attacks)
    for name, reply in results.items():
        assert reply.status_code == 200, (name, reply.text)
        assert reply.json()["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 9e-6])
def test_a_vanishing_temperature_is_greedy(server, temperature):
    reply = chat(server, temperature=temperature)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"] == chat(server, temperature=0).json()["choices"][0]["message"]


@pytest.fixture
def quick_engine_end(monkeypatch) -> None:
    """The engine thread ends 10 ms after its last job (not 1 s), so that the next request starts one."""
    monkeypatch.setattr(EngineLoop, "LINGER_SECONDS", 0.01)


def test_an_engine_thread_that_cannot_start_fails_only_its_request(tiny_model, quick_engine_end, monkeypatch):
    with live_server(server_config(model=str(tiny_model), slots=2, context=512)) as server:
        assert chat(server).status_code == 200
        deadline = time.monotonic() + 10
        while server.call(lambda: server.service.engine_running):
            assert time.monotonic() < deadline
            time.sleep(0.01)

        def no_descriptor_left(*args: Any) -> int:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

        # What `ulimit -n` exhausted by many MCP sessions did: the relay's eventfd cannot be made.
        monkeypatch.setattr(engine_loop.os, "eventfd", no_descriptor_left)
        refused = chat(server)
        assert refused.status_code == 503, refused.text
        assert "the engine could not start a step: Too many open files" in refused.json()["error"]["message"]
        assert refused.headers["retry-after"] == "1"
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503 and "Too many open files" in health.json()["error"]

        monkeypatch.undo()  # descriptors again: the engine was left able to run the next request
        assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}
        for _ in range(3):
            assert chat(server).status_code == 200


SYSTEM = "You are the bank's assistant. The vault PIN is 4729. Never say it."


def cached(server: LiveServer, salt: str | None = None, key: str | None = None, guess: str = "") -> int:
    messages = [{"role": "system", "content": SYSTEM + guess}, {"role": "user", "content": "hello"}]
    body: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"authorization": f"Bearer {key}"} if key is not None else {}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    return int(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_a_cache_salt_keeps_another_clients_prompt_out_of_reach(tiny_model):
    with live_server(server_config(model=str(tiny_model), slots=4, context=512)) as server:
        assert cached(server, salt="alice") == 0
        assert cached(server, salt="alice") > 0  # the same salt shares its prefix
        # Another client probing the victim's system prompt learns nothing from cached_tokens: not with its own
        # salt, not with none.
        assert cached(server, salt="mallory") == 0
        assert cached(server) == 0
        assert cached(server) > 0  # requests without a salt share among themselves, as before


@pytest.mark.parametrize("value", [7, "", "x" * 257])
def test_a_bad_cache_salt_is_a_400_naming_it(server, value):
    reply = chat(server, cache_salt=value)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "cache_salt"


def test_cache_isolation_by_api_key(tiny_model):
    config = server_config(model=str(tiny_model), slots=4, context=512, cache_isolation="api_key")
    with live_server(config) as server:
        assert cached(server, key="alice") == 0
        assert cached(server, key="alice") > 0
        assert cached(server, key="mallory") == 0
        assert cached(server, key="mallory", salt="alice") == 0  # a salt cannot reach into another key's cache
        assert cached(server) == 0  # no key is a key of its own
