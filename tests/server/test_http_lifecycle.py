"""The request lifecycle over real HTTP: clients that hang up while queued, during prompt processing, during
generation and while streaming; a soak of random hang-ups; nothing left behind afterwards."""

from __future__ import annotations

import json
import os
import random
import threading
import time
from functools import partial
from typing import Any

import httpx
import pytest
import trio
from conftest import live_server, server_config, wait_until
from fakes import ScriptedEngine


def body(text: str, **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "temperature": 0, **fields}


def task_count() -> int:
    """Tasks alive in the calling trio run."""

    def walk(task: Any) -> int:
        return 1 + sum(walk(child) for nursery in task.child_nurseries for child in nursery.child_tasks)

    return walk(trio.lowlevel.current_root_task())


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def post(client: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> httpx.Response:
    return await client.post(url + "/v1/chat/completions", json=payload)


async def raw_request(url: str, payload: dict[str, Any], *, hang_up_after: float = 30.0,
                      hang_up_at_bytes: int | None = None) -> bytes:
    """POST `payload` over a plain socket and read the answer; close the socket (a hang-up) after
    `hang_up_after` seconds or once `hang_up_at_bytes` have arrived, whichever comes first."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(payload).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
    received = b""
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(head + data)
        with trio.move_on_after(hang_up_after):
            while (hang_up_at_bytes is None or len(received) < hang_up_at_bytes) and not _complete(received):
                chunk = await stream.receive_some()
                if not chunk:
                    break
                received += chunk
    return received


def _complete(response: bytes) -> bool:
    """Whether `response` holds a whole HTTP/1.1 response (sized by content-length, or chunked)."""
    head, found, rest = response.partition(b"\r\n\r\n")
    if not found:
        return False
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(rest) >= int(line.split(b":")[1])
    return rest.endswith(b"0\r\n\r\n")


def prompt_seen(engine: ScriptedEngine, tokenizer: Any, text: str) -> bool:
    needle = tokenizer.encode(text)
    return any(call[i:i + len(needle)] == needle for call in engine.calls for i in range(len(call)))


async def test_hang_up_while_queued_leaves_the_queue_at_once(tokenizer):
    engine = ScriptedEngine(tokenizer, tokenizer.encode("z" * 200), decode_s=0.01)
    with live_server(server_config(), engine, tokenizer) as server:
        service = server.service
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(raw_request, server.url, body("first", stream=True), hang_up_after=1.0))
            await wait_until(lambda: service.phase == "decode")  # past the turn's queue
            waiting = trio.CancelScope()

            async def queued() -> None:
                with waiting:
                    await raw_request(server.url, body("second in line"))

            nursery.start_soon(queued)
            await wait_until(lambda: service.turn.queued == 1)
            waiting.cancel()
            hung_up = time.perf_counter()
            await wait_until(lambda: service.turn.queued == 0, timeout=1)
            left_after = time.perf_counter() - hung_up
            assert service.turn.busy  # the first request still holds the engine
        assert left_after < 0.25  # generous for a loaded machine; the first request still has ~1.5 s to go
        assert not prompt_seen(engine, tokenizer, "second in line")
        await wait_until(lambda: len(service.history.rows) == 2)
        assert {row.finish for row in service.history.rows} == {"cancel"}


@pytest.mark.parametrize("phase", ["prompt", "decode"])
async def test_hang_up_on_the_engine_aborts_it_and_the_next_request_starts(tokenizer, phase):
    # A 10 ms prompt token: the long prompt would take seconds; a decode step takes 10 ms.
    engine = ScriptedEngine(tokenizer, tokenizer.encode("w" * 400), prompt_s=0.01, decode_s=0.01)
    with live_server(server_config(), engine, tokenizer) as server:
        service = server.service
        async with trio.open_nursery() as nursery:
            first = trio.CancelScope()

            async def first_client() -> None:
                with first:
                    await raw_request(server.url, body("long " * (100 if phase == "prompt" else 1), stream=True))

            nursery.start_soon(first_client)
            await wait_until(lambda: service.phase == phase and engine.running.is_set(), timeout=10)
            nursery.start_soon(raw_request, server.url, body("next", max_tokens=1))
            await wait_until(lambda: service.turn.queued == 1)
            n_calls = len(engine.calls)
            hung_up = time.perf_counter()
            first.cancel()
            await wait_until(lambda: prompt_seen(engine, tokenizer, "next"), timeout=2)
        next_started = engine.call_times[n_calls] - hung_up
        # The second-long prompt is aborted mid-call; a hang-up between two decode steps needs no abort (the job
        # just never enters the next step), one during a step aborts it.
        assert engine.aborts == 1 if phase == "prompt" else engine.aborts <= 1
        # Invariant 3: within one step (10 ms here, a quarter of it per abort check) plus the HTTP hang-up; the
        # bound is generous for a loaded machine, and far below the seconds the prompt would still take.
        assert next_started < 0.25
        rows = list(service.history.rows)
        assert [row.finish for row in rows] == ["cancel", "length"]


async def test_hang_up_mid_stream_frees_everything(tokenizer):
    engine = ScriptedEngine(tokenizer, tokenizer.encode("v" * 300), decode_s=0.005)
    with live_server(server_config(), engine, tokenizer) as server:
        service = server.service
        received = await raw_request(server.url, body("stream", stream=True), hang_up_at_bytes=2000)
        assert received.startswith(b"HTTP/1.1 200") and received.count(b"data: ") >= 5
        await wait_until(lambda: not service.turn.busy, timeout=1)
        assert service.history.last.finish == "cancel"
        assert 5 <= service.history.last.output_tokens < 300
        assert not engine.running.is_set()


@pytest.mark.parametrize("slots", [1, 8])
async def test_random_hang_ups_leave_nothing_behind(tokenizer, slots):
    rng = random.Random(1234)
    engine = ScriptedEngine(tokenizer, tokenizer.encode("u" * 40), prompt_s=0.002, decode_s=0.002, n_seq=slots)
    with live_server(server_config(), engine, tokenizer) as server:
        service = server.service
        tasks_before, fds_before = server.call(task_count), open_fds()
        n_requests = 40

        async def one(i: int) -> None:
            payload = body(f"request {i} " + "p" * rng.randrange(1, 60), stream=rng.random() < 0.7)
            # Hang-ups land in every phase: queued, prompt, decode, streaming, and after the end.
            await raw_request(server.url, payload, hang_up_after=rng.uniform(0.0, 0.4))

        async with trio.open_nursery() as nursery:
            for i in range(n_requests):
                nursery.start_soon(one, i)
                await trio.sleep(rng.uniform(0, 0.02))
        # Invariant 4: every request is accounted for and nothing it started is left.
        await wait_until(lambda: len(service.history.rows) == n_requests, timeout=10)
        finishes = {row.finish for row in service.history.rows}
        assert "cancel" in finishes and finishes <= {"cancel", "stop"}
        assert not service.turn.busy and service.turn.queued == 0
        assert service.phase == "idle" and service.current is None
        assert all(slot["state"] == "idle" for slot in server.call(service.slots))
        await wait_until(lambda: not server.call(lambda: service.engine_running), timeout=5)
        await wait_until(lambda: not [thread for thread in threading.enumerate()
                                      if thread.name.startswith("strata engine")], timeout=5)
        assert not engine.running.is_set() and not engine._abort  # no abort flag left raised for a slot
        await wait_until(lambda: server.call(task_count) == tasks_before, timeout=5)
        await wait_until(lambda: open_fds() <= fds_before, timeout=5)
        # The engine still serves.
        async with httpx.AsyncClient(timeout=30) as client:
            reply = await post(client, server.url, body("after the storm", max_tokens=3))
        assert reply.json()["choices"][0]["message"]["content"] == "uuu"
