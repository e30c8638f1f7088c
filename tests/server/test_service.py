"""The service's request lifecycle with a scripted engine: events, the turn, cancellation in each phase, prefix
reuse and history rows."""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import aclosing
from typing import Any

import pytest
import trio
from conftest import server_config, wait_until

from strata.events import (
    ChatRequest,
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallStart,
    Usage,
)
from strata.request_errors import RequestError
from strata.scheduling.engine_loop import EngineLoop
from strata.scheduling.turn import QueueFull
from strata.service import open_service
from strata.text.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def request(text: str = "hi", **fields: Any) -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": text}], sampling=GREEDY, **fields)


async def collect(service: Any, chat_request: ChatRequest) -> list[Any]:
    async with aclosing(service.chat(chat_request)) as events:
        return [event async for event in events]


def joined(events: list[Any], kind: type) -> str:
    return "".join(event.text for event in events if isinstance(event, kind))


async def test_text_answer_events(scripted, tokenizer):
    engine = scripted("Hello there!")
    async with open_service(server_config(), engine=engine, tokenizer=tokenizer) as service:
        events = await collect(service, request())
    assert joined(events, TextDelta) == "Hello there!"
    n_prompt = len(engine.calls[0])
    assert events[-2:] == [Usage(prompt_tokens=n_prompt, cached_tokens=0, completion_tokens=len("Hello there!")),
                           Finish("stop")]


async def test_thinking_and_tool_call_events(scripted, tokenizer):
    arguments = {"city": "Paris", "days": 2}
    call = f'{{"name": "weather", "arguments": {json.dumps(arguments)}}}'
    text = f"<think>\nLook it up.\n</think>\n\n<tool_call>\n{call}\n</tool_call>"
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    async with open_service(server_config(), engine=scripted(text), tokenizer=tokenizer) as service:
        events = await collect(service, request(tools=tools))
    assert joined(events, ReasoningDelta) == "Look it up."
    starts = [event for event in events if isinstance(event, ToolCallStart)]
    assert [(start.index, start.name) for start in starts] == [(0, "weather")]
    assert json.loads(joined(events, ToolCallArgumentsDelta)) == arguments
    assert events[-1] == Finish("tool_calls")
    assert service.history.last.finish == "tool_calls"


async def test_max_tokens_and_stop_strings(scripted, tokenizer):
    async with open_service(server_config(), engine=scripted("one two three"), tokenizer=tokenizer) as service:
        limited = await collect(service, request(max_tokens=5))
        stopped = await collect(service, request(stop=[" tw"]))
    assert joined(limited, TextDelta) == "one t"
    assert limited[-1] == Finish("length")
    assert joined(stopped, TextDelta) == "one"
    assert stopped[-1] == Finish("stop", " tw")
    assert limited[-1].stop_sequence is None


async def test_prompt_longer_than_context_is_refused(scripted, tokenizer):
    engine = scripted(n_ctx=64)
    async with open_service(server_config(), engine=engine, tokenizer=tokenizer) as service:
        with pytest.raises(RequestError, match="context"):
            await collect(service, request("x" * 100))
        assert engine.calls == []
        assert service.history.last.finish == "refused"  # a 400, not a server failure


async def test_prefix_reuse_evaluates_only_new_tokens(scripted, tokenizer):
    engine = scripted("Fine.")
    async with open_service(server_config(), engine=engine, tokenizer=tokenizer) as service:
        first = request("How are you?")
        cold = await collect(service, first)
        follow_up = ChatRequest(messages=[*first.messages, {"role": "assistant", "content": "Fine."},
                                          {"role": "user", "content": "Sure?"}], sampling=GREEDY)
        warm = await collect(service, follow_up)
    prompt_ids = tokenizer.encode(service.render(follow_up), special=True)
    usage = warm[-2]
    # The cache held the first prompt and the answer but its last token; the follow-up shares that prefix.
    first_ids = tokenizer.encode(service.render(first), special=True)
    assert usage.cached_tokens >= len(first_ids)
    assert engine.calls[-len("Fine.") - 1] == prompt_ids[usage.cached_tokens:]
    assert service.history.last.reused_tokens == usage.cached_tokens
    assert joined(warm, TextDelta) == joined(cold, TextDelta)


async def test_turn_is_fifo(scripted, tokenizer):
    engine = scripted("abcdefgh", decode_s=0.01)
    order: list[int] = []
    async with open_service(server_config(), engine=engine, tokenizer=tokenizer) as service:
        async def client(i: int) -> None:
            await collect(service, request(f"request {i}"))
            order.append(i)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(client, 0)
            await wait_until(lambda: service.phase == "decode")  # past the turn's queue
            for i in range(1, 5):
                nursery.start_soon(client, i)
                await wait_until(lambda i=i: service.turn.queued == i)
    assert order == [0, 1, 2, 3, 4]


async def test_cancel_while_queued_never_reaches_the_engine(scripted, tokenizer):
    engine = scripted("x" * 50, decode_s=0.01)
    async with open_service(server_config(), engine=engine, tokenizer=tokenizer) as service:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect, service, request("first"))
            await wait_until(lambda: service.phase == "decode")  # past the turn's queue
            queued = trio.CancelScope()
            nursery.start_soon(_run_in_scope, queued, service, request("second"))
            await wait_until(lambda: service.turn.queued == 1)
            queued.cancel()
            # Invariant 2: the queue length drops at once (within a few scheduler ticks, not after some
            # polling interval), while the first request still holds the turn.
            for _ in range(5):
                await trio.lowlevel.checkpoint()
            assert service.turn.queued == 0
            assert service.turn.busy
            nursery.cancel_scope.cancel()
        assert not any(call for call in engine.calls if _contains(call, tokenizer.encode("second")))
        assert [row.finish for row in service.history.rows] == ["cancel", "cancel"]
        assert not service.turn.busy and service.turn.queued == 0


async def _run_in_scope(scope: trio.CancelScope, service: Any, chat_request: ChatRequest) -> None:
    with scope:
        await collect(service, chat_request)


def _contains(haystack: list[int], needle: list[int]) -> bool:
    return any(haystack[i:i + len(needle)] == needle for i in range(len(haystack) - len(needle) + 1))


@pytest.mark.parametrize("phase", ["prompt", "decode"])
async def test_cancel_on_the_engine_aborts_and_frees_the_turn(scripted, tokenizer, phase):
    # 20 ms per prompt token: the prompt takes ~0.5 s unless aborted; decoding takes 20 ms a token.
    engine = scripted("y" * 200, prompt_s=0.02, decode_s=0.02)
    async with open_service(server_config(), engine=engine, tokenizer=tokenizer) as service:
        with trio.move_on_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(collect, service, request("first"))
                await wait_until(lambda: service.phase == phase and engine.running.is_set(), timeout=5)
                cancelled_at = time.perf_counter()
                nursery.cancel_scope.cancel()
        freed_after = time.perf_counter() - cancelled_at
        # Invariant 3: the engine returned within one step, and only then the turn was free.
        assert engine.aborts == 1
        assert not engine.running.is_set()
        assert not service.turn.busy
        assert freed_after < 0.02 + 0.1  # one step, and room for a loaded machine
        assert service.history.last.finish == "cancel"
        # The context stays usable: the next request runs to the end.
        engine.script = list(tokenizer.encode("ok"))
        events = await collect(service, request("second"))
        assert joined(events, TextDelta) == "ok"


async def test_engine_ahead_of_a_slow_reader_loses_no_token(scripted, tokenizer):
    # The engine thread fills the buffer while the reader sleeps: wake-ups come once per batch, not per token.
    text = "".join(chr(ord("a") + i % 26) for i in range(300))
    fds_before = len(os.listdir("/proc/self/fd"))
    async with open_service(server_config(), engine=scripted(text), tokenizer=tokenizer) as service:
        events = []
        async with aclosing(service.chat(request())) as stream:
            async for event in stream:
                events.append(event)
                if len(events) % 50 == 1:
                    await trio.sleep(0.01)
        assert joined(events, TextDelta) == text
        assert events[-1] == Finish("stop")
        # The engine thread ends once no job came for LINGER_SECONDS, and its relay's eventfd closes.
        await wait_until(lambda: not service.engine_running, timeout=5 * EngineLoop.LINGER_SECONDS)
        assert not [thread for thread in threading.enumerate() if thread.name.startswith("strata engine")]
        assert len(os.listdir("/proc/self/fd")) <= fds_before


async def test_the_next_request_goes_to_the_waiting_engine_thread_which_ends_with_the_service(
        scripted, tokenizer, monkeypatch):
    started = []  # the names of the threads the service starts
    start_thread_soon = trio.lowlevel.start_thread_soon

    def counting(fn: Any, deliver: Any, name: str | None = None) -> None:
        started.append(name)
        start_thread_soon(fn, deliver, name=name)

    monkeypatch.setattr(trio.lowlevel, "start_thread_soon", counting)
    async with open_service(server_config(), engine=scripted("ok"), tokenizer=tokenizer) as service:
        assert joined(await collect(service, request("one")), TextDelta) == "ok"
        assert joined(await collect(service, request("two")), TextDelta) == "ok"
        assert started.count("strata engine") == 1  # the second job went to the thread the first one started
        assert service.engine_running
        closing = time.monotonic()
    # Closing the service ends the waiting thread at once, not after LINGER_SECONDS.
    assert time.monotonic() - closing < EngineLoop.LINGER_SECONDS / 2
    assert not service.engine_running
    await wait_until(lambda: not [thread for thread in threading.enumerate()
                                  if thread.name.startswith("strata engine")])


async def test_stale_abort_flag_does_not_break_the_next_request(scripted, tokenizer):
    engine = scripted("fine")
    async with open_service(server_config(), engine=engine, tokenizer=tokenizer) as service:
        engine.abort()  # as if a cancelled call had finished just before its abort landed
        events = await collect(service, request())
    assert engine.aborts == 1
    assert joined(events, TextDelta) == "fine"
    assert events[-1] == Finish("stop")


async def test_queue_full_is_refused(scripted, tokenizer):
    engine = scripted("z" * 100, decode_s=0.01)
    config = server_config(limits={"queue_length": 1})
    async with open_service(config, engine=engine, tokenizer=tokenizer) as service, trio.open_nursery() as nursery:
        nursery.start_soon(collect, service, request("a"))
        await wait_until(lambda: service.phase == "decode")  # past the turn's queue
        nursery.start_soon(collect, service, request("b"))
        await wait_until(lambda: service.turn.queued == 1)
        with pytest.raises(QueueFull):
            await collect(service, request("c"))
        nursery.cancel_scope.cancel()


async def test_history_rows_and_totals(scripted, tokenizer):
    engine = scripted("abc")
    async with open_service(server_config(limits={"history_size": 2}), engine=engine,
                            tokenizer=tokenizer) as service:
        for _ in range(3):
            await collect(service, request(max_tokens=2))
    rows = list(service.history.rows)
    assert len(rows) == 2
    assert all(row.finish == "length" and row.output_tokens == 2 for row in rows)
    totals = service.history.totals
    assert totals.requests == 3 and totals.output_tokens == 6 and totals.finishes == {"length": 3}
    assert rows[-1].prompt_tokens == len(engine.calls[0])
    assert rows[-1].duration >= rows[-1].prompt_seconds + rows[-1].decode_seconds
