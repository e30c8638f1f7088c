"""Startup steps that take a while, on the terminal: a line while they run, every few seconds, saying for how long
and what they are doing now, so that a slow load is never silence."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import outcome
import trio

T = TypeVar("T")


class Stage:
    """What a step is doing now; `now` may be set from a worker thread."""

    def __init__(self) -> None:
        self.now = ""


async def with_progress(log: Callable[[str], None], what: str, work: Callable[[Stage], Awaitable[T]],
                        every: float = 2.0) -> T:
    """Run `work(stage)`; while it runs, log `what ... N s (stage)` every `every` seconds. Returns its result and
    raises its exception (never an exception group)."""
    stage = Stage()
    started = trio.current_time()
    result: outcome.Outcome[T] | None = None

    async def tick() -> None:
        while True:
            await trio.sleep(every)
            doing = f" ({stage.now})" if stage.now else ""
            log(f"{what} ... {trio.current_time() - started:.0f} s{doing}")

    async def run(cancel_scope: trio.CancelScope) -> None:
        nonlocal result
        try:
            result = outcome.Value(await work(stage))
        except Exception as error:  # noqa: BLE001 - handed to the caller below
            result = outcome.Error(error)
        finally:
            cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(tick)
        nursery.start_soon(run, nursery.cancel_scope)
    assert result is not None
    return result.unwrap()
