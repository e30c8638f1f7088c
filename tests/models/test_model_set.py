"""`ModelSet`'s line for memory, with models whose loads and unloads are instant fakes (no engine): swaps happen in
arrival order, and a request waiting to swap a busy model out is not starved by new requests for that model
(end to end through hypercorn and the engine: `test_model_set_e2e.py`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing
from conftest import server_config

from strata.model_set import ModelSet
from strata.request_errors import ServiceUnavailable
from strata.served_model import ServedModel

SIZE = 100  # each model's footprint


def fake_model(name: str, events: list[str]) -> ServedModel:
    """A model whose load and unload take one checkpoint each and are recorded in `events`."""
    model = ServedModel(server_config(model=f"{name}.gguf"), [name])
    model.footprint = SIZE

    async def load(nursery: trio.Nursery, log: Callable[[str], None]) -> None:
        model.state = "loading"
        await trio.lowlevel.checkpoint()
        model.state = "loaded"
        events.append(f"load {name}")

    async def unload() -> None:
        model.state = "unloading"
        await trio.lowlevel.checkpoint()
        model.state = "not loaded"
        events.append(f"unload {name}")

    model.load = load  # type: ignore[method-assign]
    model.unload = unload  # type: ignore[method-assign]
    return model


@asynccontextmanager
async def model_set(names: str, budget: int | None) -> AsyncIterator[tuple[ModelSet, list[str]]]:
    events: list[str] = []
    models = ModelSet([fake_model(name, events) for name in names], named=True, budget=budget)
    async with trio.open_nursery() as nursery:
        models.nursery, models.log = nursery, lambda line: None
        yield models, events
        nursery.cancel_scope.cancel()


class Requests:
    """Requests as tasks: each holds its model (`ModelSet.use`) until released; `events` records when each one
    starts using it."""

    def __init__(self, models: ModelSet, events: list[str], nursery: trio.Nursery):
        self.models, self.events, self.nursery = models, events, nursery
        self.done: dict[str, trio.Event] = {}
        self.scopes: dict[str, trio.CancelScope] = {}
        self.errors: dict[str, BaseException] = {}

    def start(self, tag: str, name: str) -> None:
        self.done[tag], self.scopes[tag] = trio.Event(), trio.CancelScope()
        self.nursery.start_soon(self._run, tag, name)

    async def _run(self, tag: str, name: str) -> None:
        with self.scopes[tag]:
            try:
                async with self.models.use(self.models.find(name)):
                    self.events.append(f"start {tag}")
                    await self.done[tag].wait()
            except ServiceUnavailable as error:
                self.errors[tag] = error

    async def release(self, *tags: str) -> None:
        for tag in tags:
            self.done[tag].set()
        await trio.testing.wait_all_tasks_blocked()

    async def settle(self) -> None:
        await trio.testing.wait_all_tasks_blocked()


@asynccontextmanager
async def requests(models: ModelSet, events: list[str]) -> AsyncIterator[Requests]:
    async with trio.open_nursery() as nursery:
        yield Requests(models, events, nursery)
        nursery.cancel_scope.cancel()


async def test_new_requests_for_a_busy_model_queue_behind_a_request_waiting_to_swap_it_out():
    async with model_set("ab", budget=SIZE) as (models, events), requests(models, events) as asked:
        a, b = models.find("a"), models.find("b")
        asked.start("a1", "a")
        await asked.settle()
        asked.start("b1", "b")  # b must wait for a's memory; a is busy
        await asked.settle()
        for tag in ("a2", "a3"):  # a stream of requests for a, each arriving while a is still busy
            asked.start(tag, "a")
            await asked.settle()
        assert events == ["load a", "start a1"]  # a2 and a3 did not start: they wait behind b1
        assert (a.state, models.waiting(a), models.waiting(b), models.waits(a)) == ("loaded", 2, 1, True)
        await asked.release("a1")
        assert events[2:] == ["unload a", "load b", "start b1"]
        await asked.release("b1")
        # Both start once a is loaded again (which of the two first is the scheduler's: they then take the
        # model's slots in the order they reach them).
        assert events[5:7] == ["unload b", "load a"] and sorted(events[7:]) == ["start a2", "start a3"]
        assert (a.users, b.users, a.state, b.state) == (2, 0, "loaded", "not loaded")
        await asked.release("a2", "a3")
    assert a.users == 0 and models.waiting(a) == 0


async def test_swaps_are_served_in_arrival_order():
    async with model_set("abc", budget=SIZE) as (models, events), requests(models, events) as asked:
        asked.start("a1", "a")
        await asked.settle()
        asked.start("b1", "b")
        await asked.settle()
        asked.start("c1", "c")
        await asked.settle()
        asked.start("a2", "a")
        await asked.settle()
        await asked.release("a1")
        await asked.release("b1")
        await asked.release("c1")
        await asked.release("a2")
    starts = [event for event in events if event.startswith("start")]
    assert starts == ["start a1", "start b1", "start c1", "start a2"]
    assert events.count("load a") == 2


async def test_a_model_no_waiter_needs_unloaded_serves_new_requests_at_once():
    async with model_set("abc", budget=2 * SIZE) as (models, events), requests(models, events) as asked:
        asked.start("a1", "a")
        await asked.settle()
        asked.start("b1", "b")
        await asked.settle()
        models.find("b").last_used += 1  # b used last: a is the one c's request will unload
        asked.start("c1", "c")
        await asked.settle()
        asked.start("b2", "b")  # b is not a victim: it starts
        asked.start("a2", "a")  # a is: it waits
        await asked.settle()
        assert [event for event in events if event.startswith("start")] == ["start a1", "start b1", "start b2"]
        await asked.release("a1")
        assert events[-3:] == ["unload a", "load c", "start c1"]
        await asked.release("b1", "b2", "c1", "a2")


async def test_a_waiter_that_hangs_up_ends_the_drain_it_began():
    async with model_set("ab", budget=SIZE) as (models, events), requests(models, events) as asked:
        a = models.find("a")
        asked.start("a1", "a")
        await asked.settle()
        asked.start("b1", "b")
        await asked.settle()
        asked.start("a2", "a")
        await asked.settle()
        assert "start a2" not in events
        asked.scopes["b1"].cancel()  # b1's client hangs up: nothing needs a unloaded any more
        await asked.settle()
        assert events[-1] == "start a2" and "unload a" not in events
        assert (a.users, models.waiting(a), models.waits(a)) == (2, 0, False)
        await asked.release("a1", "a2")


async def test_a_model_over_the_budget_is_refused_and_leaves_the_line():
    async with model_set("ab", budget=SIZE) as (models, events), requests(models, events) as asked:
        models.find("b").footprint = 2 * SIZE
        asked.start("b1", "b")
        await asked.settle()
        asked.start("a1", "a")
        await asked.settle()
        assert "needs" in str(asked.errors["b1"]) and events == ["load a", "start a1"]
        await asked.release("a1")


@pytest.fixture(autouse=True)
def _no_stray_tasks(monkeypatch: Any) -> None:
    """The fakes never touch an engine: loading one would be a bug in the test."""
    monkeypatch.setattr(ServedModel, "_load_blocking", lambda *args: pytest.fail("a real load"))
