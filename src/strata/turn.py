"""The engine's turn: one generation at a time, granted in arrival order."""

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
    """

    def __init__(self, max_queued: int | None = None):
        # A trio semaphore parks waiters in a FIFO and hands a release straight to the first of them, so the turn
        # is fair; unlike trio.Lock it may be released from another task (an async generator finalised elsewhere).
        self._slot = trio.Semaphore(1)
        self._max_queued = max_queued
        self.queued = 0

    @property
    def busy(self) -> bool:
        return self._slot.value == 0

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """Wait for the turn (a checkpoint, cancellable), hold it for the block, release it on exit."""
        if self._max_queued is not None and self.queued >= self._max_queued and self.busy:
            raise QueueFull(f"{self.queued} requests are already waiting for the engine")
        self.queued += 1
        try:
            await self._slot.acquire()
        finally:
            self.queued -= 1
        try:
            yield
        finally:
            self._slot.release()
