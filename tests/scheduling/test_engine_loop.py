"""The engine thread's relay of wake-ups to trio, on its own (the engine loop through the service is in
tests/server/test_service.py and test_slots.py)."""

from __future__ import annotations

import os

import trio
from conftest import wait_until

from strata.scheduling.engine_loop import Relay


def closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


async def test_the_relay_runs_the_engine_threads_calls_in_order_and_closes_its_eventfd():
    relay, ran = Relay(), []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay.deliver)
        for i in range(3):
            relay.put(lambda i=i: ran.append(i))
        await trio.sleep(0.01)
        assert ran == []  # queued: they go when an engine call (or the thread itself) writes the eventfd
        relay.flush()
        await wait_until(lambda: ran == [0, 1, 2], timeout=5)
        relay.put(lambda: ran.append(3))
        await trio.to_thread.run_sync(relay.end, lambda: ran.append("end"))  # as the engine thread ends
    assert ran == [0, 1, 2, 3, "end"]
    assert closed(relay.fd)


async def test_a_relay_whose_task_was_cancelled_closes_its_eventfd_with_the_engine_thread():
    relay = Relay()
    with trio.move_on_after(0.01):
        await relay.deliver()  # cancelled: trio is done with the eventfd, the engine thread is not
    assert not closed(relay.fd)
    relay.put(lambda: None)
    relay.notify()  # the engine thread may still write to it
    relay.end(lambda: None)
    assert closed(relay.fd)
