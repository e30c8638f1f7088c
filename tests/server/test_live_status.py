"""The live status stream (`/v1/status/stream`): every slot, every request's phase, its prompt's progress chunk by
chunk, the queue, and finished rows, through a live server with a scripted engine; the key that guards the
status routes, and the bound on streams open at once."""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import live_server, server_config
from fakes import ScriptedEngine

from strata.api import sse
from strata.cli.serve import add_arguments, config_from_args
from strata.config import Config, ConfigError, config_from_dict

LONG_PROMPT = [{"role": "user", "content": "count " * 60}]


def snapshots(url: str, interval: float = 0.1) -> Iterator[dict[str, Any]]:
    with httpx.stream("GET", url + f"/v1/status/stream?interval={interval}", timeout=30) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        buffer = b""
        for data in reply.iter_bytes():
            buffer += data
            while b"\n\n" in buffer:
                block, buffer = buffer.split(b"\n\n", 1)
                ((name, body),) = sse.decode(block + b"\n\n")
                assert name == "status"
                yield json.loads(body)


def post_in_thread(url: str, body: dict[str, Any]) -> threading.Thread:
    thread = threading.Thread(target=httpx.post, args=(url + "/v1/chat/completions",), kwargs={
        "json": body, "timeout": 30}, daemon=True)
    thread.start()
    return thread


def test_phases_prompt_progress_and_queue(tokenizer):
    # Prompts of ~300 byte tokens in chunks of 16 at 2 ms a token: the prompt phase reports every chunk.
    engine = ScriptedEngine(tokenizer, tokenizer.encode("a" * 40), prompt_s=0.002, decode_s=0.01)
    with live_server(server_config(batch=16), engine, tokenizer) as server:
        first = post_in_thread(server.url, {"messages": LONG_PROMPT})
        second = post_in_thread(server.url, {"messages": LONG_PROMPT + [{"role": "user", "content": "more"}]})
        seen: dict[str, list[tuple[str, int, int]]] = {}
        queued_at_most = 0
        for snapshot in snapshots(server.url, 0.1):
            queued_at_most = max(queued_at_most, snapshot["queued"])
            for request in snapshot["requests"]:
                seen.setdefault(request["id"], []).append(
                    (request["phase"], request["prompt_done"], request["prompt_tokens"]))
            if snapshot["totals"]["requests"] == 2:
                rows = snapshot["recent"]
                break
        first.join(5)
        second.join(5)
    assert queued_at_most >= 1
    assert [row["finish"] for row in rows] == ["stop", "stop"] and len(seen) == 2
    phases = {phase for trail in seen.values() for phase, _, _ in trail}
    assert {"queued", "prompt", "decode"} <= phases
    # Mid-prompt progress: some snapshot shows a prompt partly done, and progress never goes back.
    partial = [done for trail in seen.values() for phase, done, total in trail if phase == "prompt" and
               0 < done < total]
    assert partial, seen
    for trail in seen.values():
        dones = [done for _, done, _ in trail]
        assert dones == sorted(dones)


def test_a_cancelled_request_shows_in_the_stream(tokenizer):
    engine = ScriptedEngine(tokenizer, tokenizer.encode("b" * 400), decode_s=0.01)
    with live_server(server_config(), engine, tokenizer) as server:
        stream = snapshots(server.url, 0.1)
        with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30,
                          json={"messages": [{"role": "user", "content": "hi"}], "stream": True}) as reply:
            for snapshot in stream:
                if any(request["phase"] == "decode" and request["output_tokens"] > 5
                       for request in snapshot["requests"]):
                    assert snapshot["decode_tokens_per_second"] >= 0
                    break
            reply.close()  # hang up mid-answer
        for snapshot in stream:
            if snapshot["recent"]:
                break
        stream.close()
    assert snapshot["recent"][0]["finish"] == "cancel" and snapshot["requests"] == []
    assert snapshot["busy"] is False and snapshot["totals"]["finishes"] == {"cancel": 1}


@pytest.mark.parametrize("interval", ["0", "fast", "11", "nan"])
def test_the_interval_is_checked(tokenizer, interval):
    with live_server(server_config(), ScriptedEngine(tokenizer), tokenizer) as server:
        reply = httpx.get(server.url + f"/v1/status/stream?interval={interval}")
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "interval"


def test_every_slot_and_several_requests_at_once(tokenizer):
    engine = ScriptedEngine(tokenizer, tokenizer.encode("c" * 300), decode_s=0.01, n_seq=3)
    with live_server(server_config(slots=3), engine, tokenizer) as server:
        threads = [post_in_thread(server.url, {"messages": [{"role": "user", "content": f"story {n}"}]})
                   for n in range(2)]
        stream = snapshots(server.url, 0.1)
        for snapshot in stream:
            decoding = [request for request in snapshot["requests"] if request["phase"] == "decode"]
            if len(decoding) == 2:
                break
        stream.close()
        for thread in threads:
            thread.join(10)
    slots = snapshot["slots"]
    assert [slot["slot"] for slot in slots] == [0, 1, 2]
    busy = [slot for slot in slots if slot["state"] != "idle"]
    assert len(busy) == 2 and all(slot["state"] == "decode" for slot in busy)
    assert sorted(slot["request"] for slot in busy) == sorted(request["id"] for request in decoding)
    assert all(slot["cached_tokens"] > 0 for slot in busy)
    assert {request["slot"] for request in decoding} == {slot["slot"] for slot in busy}


def test_status_key_guards_the_status_routes(tokenizer):
    """/status, /v1/status and its stream show other clients' requests (the last one, the recent rows, the totals,
    the request on each slot), as /v1/history does: status_key guards them all, while the API stays open."""
    with live_server(server_config(status_key="s3cret"), ScriptedEngine(tokenizer, tokenizer.encode("ok")),
                     tokenizer) as server:
        reply = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                           json={"messages": [{"role": "user", "content": "my secret question"}]})
        assert reply.status_code == 200
        request_id = reply.json()["id"].removeprefix("chatcmpl-")
        key = {"authorization": "Bearer s3cret"}
        for path in ("/status", "/v1/status", "/v1/status/stream"):
            refused = httpx.get(server.url + path, timeout=30)
            assert refused.status_code == 401, path
            assert refused.json()["error"]["type"] == "authentication_error"
            assert request_id not in refused.text
        assert httpx.get(server.url + "/v1/status", headers=key, timeout=30).json()["last"]["id"] == request_id
        with httpx.stream("GET", server.url + "/v1/status/stream", headers=key, timeout=30) as stream:
            assert stream.status_code == 200
            first = json.loads(sse.decode(next(stream.iter_bytes()))[0][1])
        assert first["recent"][0]["id"] == request_id and first["totals"]["requests"] == 1
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 200
    both = server_config(status_key="s3cret", api_key="k")
    with live_server(both, ScriptedEngine(tokenizer), tokenizer) as server:
        for path in ("/status", "/v1/status"):
            assert httpx.get(server.url + path, timeout=30).status_code == 401
            assert httpx.get(server.url + path, headers={"x-api-key": "k"}, timeout=30).status_code == 200
            assert httpx.get(server.url + path, headers={"x-api-key": "s3cret"}, timeout=30).status_code == 200


def stream_when_free(client: httpx.Client, wait: float = 5.0) -> httpx.Response:
    """A status stream's response, asked for again while the server answers 503 (a seat is freed when the server
    has seen a client hang up)."""
    deadline = time.monotonic() + wait
    while True:
        reply = client.send(client.build_request("GET", "/v1/status/stream"), stream=True)
        if reply.status_code != 503 or time.monotonic() > deadline:
            return reply
        reply.close()
        time.sleep(0.05)


def test_status_streams_are_bounded(tokenizer):
    config = server_config(limits={"status_streams": 2})
    with live_server(config, ScriptedEngine(tokenizer), tokenizer) as server, httpx.Client(
            base_url=server.url, timeout=30) as client:
        first, second = snapshots(server.url), snapshots(server.url)
        next(first), next(second)
        refused = client.get("/v1/status/stream")
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert refused.json()["error"] == {"message": "2 status streams are open, the most this server allows",
                                           "type": "server_error", "param": None, "code": None}
        assert client.get("/health").status_code == 200
        # A client that hangs up gives its seat back, one that reads nothing of the body too.
        first.close()
        for _ in range(3):
            reply = stream_when_free(client)
            assert reply.status_code == 200
            reply.close()
        second.close()


def test_the_bound_on_status_streams_is_a_flag():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(["--limits.status-streams", "3"])).limits.status_streams == 3
    assert Config().limits.status_streams == 16
    with pytest.raises(ConfigError, match='"limits.status_streams" must be at least 1'):
        config_from_dict({"limits": {"status_streams": 0}})
