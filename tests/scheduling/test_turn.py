"""The engine's turn on its own: a free slot is taken at once, a cancelled request never holds one."""

import pytest
import trio
import trio.testing

from strata.scheduling.turn import Turn


class _Yields(trio.abc.Instrument):
    """Counts the times a task gave the scheduler its turn."""

    def __init__(self, task: trio.lowlevel.Task):
        self.task, self.count = task, 0

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self.count += task is self.task


async def test_a_free_turn_is_taken_without_a_pass_of_the_scheduler():
    turn = Turn(slots=2)
    yields = _Yields(trio.lowlevel.current_task())
    trio.lowlevel.add_instrument(yields)
    try:
        async with turn.hold():
            assert yields.count == 0
            assert turn.holders == 1 and turn.queued == 0
    finally:
        trio.lowlevel.remove_instrument(yields)
    assert turn.holders == 0


async def test_a_cancelled_request_does_not_take_a_free_turn():
    turn = Turn(slots=1)
    with trio.CancelScope() as scope:
        scope.cancel()
        with pytest.raises(trio.Cancelled):
            async with turn.hold():
                pytest.fail("a cancelled request held the turn")
    assert turn.holders == 0 and turn.queued == 0


async def test_a_full_turn_queues_in_order():
    turn = Turn(slots=1)
    order: list[int] = []

    async def waiter(i: int) -> None:
        async with turn.hold():
            order.append(i)

    async with trio.open_nursery() as nursery:
        async with turn.hold():
            for i in range(3):
                nursery.start_soon(waiter, i)
                await trio.testing.wait_all_tasks_blocked()
            assert turn.queued == 3
    assert order == [0, 1, 2]
    assert turn.holders == 0
