"""A graceful shutdown whose time runs out ends each stream with its dialect's error event and end marker (the
client can tell a shutdown from a network fault), through hypercorn's own graceful shutdown."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest
from conftest import LiveServer, live_server, server_config
from fakes import ScriptedEngine

REQUESTS = {
    "/v1/chat/completions": {"model": "m", "stream": True, "max_tokens": 2000,
                             "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages": {"model": "m", "stream": True, "max_tokens": 2000, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": "m", "stream": True, "max_output_tokens": 2000, "input": "hi"},
}


def read_stream(server: LiveServer, path: str, body: dict[str, Any], into: dict[str, Any],
                started: threading.Event) -> None:
    chunks: list[bytes] = []
    try:
        with httpx.stream("POST", server.url + path, json=body, timeout=30) as reply:
            for chunk in reply.iter_bytes():
                chunks.append(chunk)
                started.set()
        into[path] = b"".join(chunks).decode()
    except httpx.HTTPError as error:  # a cut connection: what a shutdown must not look like
        into[path] = error


def events(text: str) -> list[tuple[str, str]]:
    """(event name, data) of each SSE frame."""
    found = []
    for frame in text.strip().split("\n\n"):
        name, data = "", ""
        for line in frame.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        found.append((name, data))
    return found


@pytest.fixture
def slow_writer(tokenizer):
    """A model that writes a word every 20 ms, for much longer than the shutdown's grace."""
    return ScriptedEngine(tokenizer, tokenizer.encode(" word" * 1000), decode_s=0.02, n_seq=4)


def test_streams_still_running_when_the_grace_ends_get_an_error_event(slow_writer, tokenizer):
    results: dict[str, Any] = {}
    config = server_config(slots=4, limits={"graceful_timeout": 1.5})
    with live_server(config, slow_writer, tokenizer) as server:
        threads = []
        for path, body in REQUESTS.items():
            started = threading.Event()
            thread = threading.Thread(target=read_stream, args=(server, path, body, results, started))
            thread.start()
            assert started.wait(10), path
            threads.append(thread)
        began = time.monotonic()
        server.call(server.service.begin_shutdown, 1.5)  # as `serve()` does when SIGTERM comes
    for thread in threads:
        thread.join(10)
    assert time.monotonic() - began < 1.5 + 1.0
    chat = events(results["/v1/chat/completions"])
    assert chat[-1] == ("", "[DONE]")
    error = json.loads(chat[-2][1])["error"]
    assert error["code"] == "server_shutting_down" and error["message"] == "the server is shutting down"
    messages = events(results["/v1/messages"])
    assert messages[-1][0] == "error"
    assert json.loads(messages[-1][1])["error"]["message"] == "the server is shutting down"
    responses = events(results["/v1/responses"])
    assert responses[-1][0] in ("error", "response.failed")
    assert "server_shutting_down" in responses[-1][1]
    assert all(len(events(reply)) > 20 for reply in results.values())  # they were cut mid-answer


def test_a_whole_answer_cut_by_the_shutdown_is_a_503_saying_so(slow_writer, tokenizer):
    results: dict[str, Any] = {}
    with live_server(server_config(limits={"graceful_timeout": 1.0}), slow_writer, tokenizer) as server:

        def ask() -> None:
            results["reply"] = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
                "model": "m", "max_tokens": 2000, "messages": [{"role": "user", "content": "hi"}]})

        thread = threading.Thread(target=ask)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.call(lambda: server.service.phase == "decode"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        server.call(server.service.begin_shutdown, 1.0)
    thread.join(10)
    reply = results["reply"]
    assert reply.status_code == 503
    assert reply.json()["error"]["code"] == "server_shutting_down"
