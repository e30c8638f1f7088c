"""The engine's turn: up to `slots` generations at a time, granted in arrival order."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio


class QueueFull(Exception):
    """More requests wait for the turn than the configured queue length allows."""


class Turn:
    """A fair FIFO lock with the statistics `/status` shows.

    Invariant: a waiter that is cancelled leaves the queue at once (`queued` drops before its cancellation
    propagates) and never holds the turn, so it never reaches the engine.

    Args:
        max_queued: waiters beyond this raise `QueueFull` instead of queueing.
        slots: holders at once.
    """

    def __init__(self, max_queued: int | None = None, slots: int = 1):
        # A trio semaphore parks waiters in a FIFO and hands a release straight to the first of them, so the turn
        # is fair; unlike trio.Lock it may be released from another task (an async generator finalised elsewhere).
        self._slot = trio.Semaphore(slots)
        self._max_queued = max_queued
        self.slots = slots
        self.queued = 0
        self.exclusive = 0  # holders of the whole engine (an image encoder that shares its GPU)

    @property
    def holders(self) -> int:
        return self.slots - self._slot.value

    @property
    def busy(self) -> bool:
        """Some request holds a slot, or something holds the whole engine."""
        return self.holders > 0 or self.exclusive > 0

    @property
    def full(self) -> bool:
        """Every slot is taken, or something holds the whole engine: a new request waits."""
        return self._slot.value == 0 or self.exclusive > 0

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """Wait for the turn (a checkpoint, cancellable), hold it for the block, release it on exit."""
        if self._max_queued is not None and self.queued >= self._max_queued and self.full:
            raise QueueFull(f"{self.queued} requests are already waiting for the engine")
        if self._slot.value > 0:  # free, so nobody waits: taken without a pass of trio's scheduler
            await trio.lowlevel.checkpoint_if_cancelled()
            self._slot.acquire_nowait()
        else:
            self.queued += 1
            try:
                await self._slot.acquire()
            finally:
                self.queued -= 1
        try:
            yield
        finally:
            self._slot.release()
