"""Several requests generating at once: slots, the queue beyond them, hang-ups that take out only their own
sequence, the prefix cache across slots, and the slots in /status and /metrics."""

from __future__ import annotations

import threading
from contextlib import aclosing
from functools import partial
from typing import Any

import httpx
import trio
from conftest import LiveServer, server_config, wait_until
from fakes import FirstTokenWatch, RecordingEngine

from strata.events import ChatRequest, Finish, TextDelta, Usage
from strata.service import open_service
from strata.text.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def request(text: str, system: str = "You are helpful.", **fields: Any) -> ChatRequest:
    return ChatRequest(messages=[{"role": "system", "content": system}, {"role": "user", "content": text}],
                       sampling=GREEDY, **fields)


async def collect(service: Any, chat_request: ChatRequest) -> list[Any]:
    async with aclosing(service.chat(chat_request)) as events:
        return [event async for event in events]


def text(events: list[Any]) -> str:
    return "".join(event.text for event in events if isinstance(event, TextDelta))


async def test_requests_up_to_the_slots_generate_together_and_the_rest_wait(scripted, tokenizer):
    engine = RecordingEngine(scripted("x" * 40, decode_s=0.004, n_seq=3))
    async with open_service(server_config(), engine=engine, tokenizer=tokenizer) as service:
        results: list[list[Any]] = []

        async def one(i: int) -> None:
            results.append(await collect(service, request(f"question {i}")))

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(one, i)
            await wait_until(lambda: sum(slot["state"] == "decode" for slot in service.slots()) == 3)
            assert service.turn.full and service.turn.queued == 0
            nursery.start_soon(one, 3)
            await wait_until(lambda: service.turn.queued == 1)  # a fourth waits for a slot
        assert [text(events) for events in results] == ["x" * 40] * 4
        assert max(len(batch) for batch in engine.batches) == 3  # one engine call for the three of them
        assert not service.turn.busy and all(slot["state"] == "idle" for slot in service.slots())


async def test_a_cancelled_waiter_leaves_the_queue_and_never_reaches_the_engine(scripted, tokenizer):
    engine = scripted("y" * 200, decode_s=0.005, n_seq=2)
    async with open_service(server_config(), engine=engine, tokenizer=tokenizer) as service:
        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(collect, service, request(f"running {i}"))
            await wait_until(lambda: service.turn.full)
            with trio.CancelScope() as waiter:
                async with trio.open_nursery() as inner:
                    inner.start_soon(collect, service, request("waiting one"))
                    await wait_until(lambda: service.turn.queued == 1)
                    waiter.cancel()
            assert service.turn.queued == 0
            nursery.cancel_scope.cancel()
    needle = tokenizer.encode("waiting one")
    assert not any(call[i:i + len(needle)] == needle for call in engine.calls for i in range(len(call)))


async def test_a_hang_up_takes_out_only_its_own_sequence(tiny_model, tokenizer):
    # Four greedy streams on the real engine: one is cancelled mid-decode, one mid-prompt (a long prompt that
    # comes in chunks beside the decodes). The other two give exactly the answers they give alone, and the
    # cancelled ones' slots are free.
    from strata.engine_cffi import Engine

    prompts = [f"stream {i} " + "abc" * n for i, n in enumerate([5, 12, 19, 250])]
    config = server_config(context=1024, step_tokens=16)

    async def answer(service: Any, i: int) -> str:
        # stream 0 has tokens left when it is cancelled, however slowly the long prompt comes in
        return text(await collect(service, request(prompts[i], max_tokens=900 if i == 0 else 48)))

    with Engine.load(tiny_model, n_ctx=1024, threads=2, n_seq=4) as engine:
        async with open_service(config, engine=engine, tokenizer=tokenizer) as service:
            alone = {i: await answer(service, i) for i in (1, 2)}
    with Engine.load(tiny_model, n_ctx=1024, threads=2, n_seq=4) as engine:
        async with open_service(config, engine=engine, tokenizer=tokenizer) as service:
            got: dict[int, str] = {}
            scopes = [trio.CancelScope() for _ in prompts]

            async def one(i: int) -> None:
                with scopes[i]:
                    got[i] = await answer(service, i)

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
                await wait_until(lambda: sum(slot["state"] == "decode" for slot in service.slots()) == 3, timeout=30)
                nursery.start_soon(one, 3)  # joins the running streams: its prompt comes in chunks between tokens
                await wait_until(lambda: any(stream.job.n_prompt > 700 and stream.job.seq >= 0 and
                                             service.engine.seq_n_past(stream.job.seq) > 100
                                             for _, stream in service._generating), timeout=30)
                long = next(stream.job for _, stream in service._generating if stream.job.n_prompt > 700)
                assert not long.decoding
                scopes[0].cancel()
                scopes[3].cancel()
            assert got == {1: alone[1], 2: alone[2]}
            assert sorted(row.finish for row in service.history.rows) == ["cancel", "cancel", "length", "length"]
            await wait_until(lambda: not service.engine_running)
            assert all(slot["state"] == "idle" for slot in service.slots())
            await wait_until(lambda: not [thread for thread in threading.enumerate()
                                          if thread.name.startswith("strata engine")])


async def test_the_engine_waits_for_a_first_token_to_be_taken_before_its_next_step(scripted, tokenizer):
    # The hand-off: the request's headers and first write run on free cores, not beside the next step.
    engine = FirstTokenWatch(scripted("abcdefgh"))
    async with open_service(server_config(), engine=engine, tokenizer=tokenizer) as service:
        assert service.loop is not None
        service.loop.HANDOFF_SECONDS = 60.0  # only the request taking its token ends the wait here
        with trio.fail_after(30):
            async with aclosing(service.chat(request("hi"))) as events:
                async for event in events:
                    if isinstance(event, TextDelta):
                        engine.given = True
    assert engine.seen[:2] == [False, True]  # the prompt's call, then the next step only after the first token


async def test_a_hang_up_during_the_first_token_hand_off_holds_up_no_one(scripted, tokenizer):
    engine = scripted("x" * 30, decode_s=0.002, n_seq=2)
    async with open_service(server_config(), engine=engine, tokenizer=tokenizer) as service:
        assert service.loop is not None
        service.loop.HANDOFF_SECONDS = 60.0
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                other: list[Any] = []

                async def long() -> None:
                    other.extend(await collect(service, request("the long one")))

                nursery.start_soon(long)
                await wait_until(lambda: any(slot["state"] == "decode" for slot in service.slots()))
                async with aclosing(service.chat(request("a short one"))) as events:
                    async for event in events:
                        if isinstance(event, TextDelta):
                            break  # hangs up holding its first token, before taking another
        assert text(other) == "x" * 30
        assert sorted(row.finish for row in service.history.rows) == ["cancel", "stop"]


async def test_a_side_request_no_longer_evicts_the_main_conversation(scripted, tokenizer):
    engine = scripted("Sure, here it is.", n_seq=2)
    system = "You are a coding agent. " * 40
    async with open_service(server_config(), engine=engine, tokenizer=tokenizer) as service:
        main = [{"role": "system", "content": system}, {"role": "user", "content": "Fix the bug."}]
        first = await collect(service, ChatRequest(messages=main, sampling=GREEDY))
        side = await collect(service, request("Give this conversation a title.", system="You write titles."))
        main += [{"role": "assistant", "content": text(first)}, {"role": "user", "content": "Now add a test."}]
        follow_up = await collect(service, ChatRequest(messages=main, sampling=GREEDY))
    usage = next(event for event in follow_up if isinstance(event, Usage))
    first_usage = next(event for event in first if isinstance(event, Usage))
    assert text(side) == "Sure, here it is."
    # everything the first turn put in its slot is reused, bar the turn's closing tokens
    assert usage.cached_tokens >= first_usage.prompt_tokens
    assert follow_up[-1] == Finish("stop")


async def test_a_system_prompt_held_by_a_busy_slot_is_copied_not_recomputed(scripted, tokenizer):
    engine = scripted("z" * 60, decode_s=0.005, n_seq=2)
    system = "Shared system prompt. " * 30
    async with open_service(server_config(), engine=engine, tokenizer=tokenizer) as service:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect, service, request("first", system=system))
            await wait_until(lambda: service.phase == "decode")
            second = await collect(service, request("second", system=system))
            nursery.cancel_scope.cancel()
    usage = next(event for event in second if isinstance(event, Usage))
    assert usage.cached_tokens > len(tokenizer.encode(system))


def test_status_and_metrics_show_the_slots(scripted, tokenizer):
    engine = scripted("ok", n_seq=3)
    with LiveServer(server_config(), engine=engine, tokenizer=tokenizer) as server:
        reply = httpx.post(server.url + "/v1/chat/completions",
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 200
        status = httpx.get(server.url + "/status").json()
        metrics = httpx.get(server.url + "/metrics").text
    assert [slot["state"] for slot in status["slots"]] == ["idle"] * 3
    assert sorted(slot["cached_tokens"] for slot in status["slots"])[-1] > 0
    assert status["queued"] == 0 and status["busy"] is False
    assert "strata_slots 3.0" in metrics and "strata_slots_busy 0.0" in metrics
    assert "strata_batch_tokens" in metrics


async def test_a_full_queue_answers_503_with_retry_after_in_each_dialect(scripted, tokenizer):
    engine = scripted("w" * 400, decode_s=0.005)
    config = server_config(limits={"queue_length": 1})
    with LiveServer(config, engine=engine, tokenizer=tokenizer) as server:
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300}
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client, trio.open_nursery() as nursery:
            nursery.start_soon(partial(client.post, "/v1/chat/completions", json=chat))
            await wait_until(lambda: server.call(lambda: server.service.turn.busy))
            nursery.start_soon(partial(client.post, "/v1/chat/completions", json=chat))
            await wait_until(lambda: server.call(lambda: server.service.turn.queued) == 1)
            openai_reply = await client.post("/v1/chat/completions", json=chat)
            anthropic_reply = await client.post("/v1/messages", json=chat)
            nursery.cancel_scope.cancel()
    assert openai_reply.status_code == anthropic_reply.status_code == 503
    assert openai_reply.headers["retry-after"] == anthropic_reply.headers["retry-after"] == "1"
    assert openai_reply.json()["error"]["type"] == "server_error"
    assert anthropic_reply.json()["type"] == "error" and "busy" in anthropic_reply.json()["error"]["message"]
