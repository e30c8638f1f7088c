"""The end of a graceful shutdown, as requests see it.

When shutdown begins, requests in flight get `limits.graceful_timeout` seconds to finish; after that the HTTP
server cancels them and closes their connections, and a streaming client cannot tell that from a network fault.
So a little before that time (`MARGIN`) the service cuts what is still running: a generation waiting for or
reading tokens, a request that would start generating, an MCP tool call. Each ends with `ShuttingDown`, which the
routes render as their dialect's error event (`server_shutting_down`) before they close the stream.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import trio


class ShuttingDown(Exception):
    """The request was cut: the server is shutting down and the request's time to finish ran out."""

    code = "server_shutting_down"

    def __init__(self) -> None:
        super().__init__("the server is shutting down")


class ShutdownCut:
    """When the requests in flight are cut, and what cuts them.

    The per-token path pays one attribute read (`Stream.interrupted`); the cut's own work happens once, in the
    task `run` starts.
    """

    MARGIN = 0.5  # seconds before the HTTP server's own cut: time to write the error events

    def __init__(self) -> None:
        self.at = math.inf  # trio time of the cut; inf until shutdown begins
        self.done = False  # the cut has happened: nothing new starts
        self._scopes: set[trio.CancelScope] = set()

    def begin(self, grace: float) -> None:
        """Shutdown begins now; requests get `grace` seconds (less the margin, at least half of them)."""
        self.at = min(self.at, trio.current_time() + max(grace - self.MARGIN, grace / 2))
        for scope in self._scopes:
            scope.deadline = self.at

    async def run(self, interrupt: Callable[[], None], started: trio.Event) -> None:
        """Wait for the cut's time (after `started`: shutdown began), then cut: `interrupt()` the generations and
        cancel the scopes of `cutting()` blocks."""
        await started.wait()
        await trio.sleep_until(self.at)
        self.done = True
        interrupt()

    def check(self) -> None:
        """Raise `ShuttingDown` once the cut has happened (a request about to start generating)."""
        if self.done:
            raise ShuttingDown()

    @contextmanager
    def cutting(self) -> Iterator[None]:
        """A block that the cut cancels (an MCP tool call): it then raises `ShuttingDown`. No yield inside."""
        scope = trio.CancelScope(deadline=self.at)
        self._scopes.add(scope)
        try:
            with scope:
                yield
        finally:
            self._scopes.discard(scope)
        if scope.cancelled_caught:
            raise ShuttingDown()
