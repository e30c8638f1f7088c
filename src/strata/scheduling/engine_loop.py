"""The engine thread: the loop that runs `Batcher.step()` after step in a thread of its own, the relay that wakes
the requests' tasks with their tokens, each request's `Stream` of its job, and `Exclusive`, the engine taken whole
between two steps.

A hang-up walks this room alone: `Stream.stop` -> `EngineLoop.cancel` -> `Batcher.cancel` (the engine's abort
flag, when the job's call is in flight) -> the next step takes the job out -> `Relay` wakes the request's task.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from functools import partial

import outcome
import trio

from strata.scheduling.batcher import Batcher, Job
from strata.scheduling.turn import Turn
from strata.shutdown import ShuttingDown


class EngineLoop:
    """The engine thread: while any job has work it runs `Batcher.step()` after step, adding the jobs that arrived
    between steps; with nothing left to do it waits `LINGER_SECONDS` for the next job, then ends (the next job
    starts it again), so an idle server holds no thread. Agents send their requests in bursts (a turn, a side
    request, a sub-agent's call): a job handed to the waiting thread starts 0.1-0.2 ms sooner than one that
    starts a thread through trio's thread cache, on the first token's path.

    Invariant: a job reaches the engine only through the batcher, in this thread; a cancelled job leaves at the
    next step boundary (an engine call in flight drops its sequence within one layer), and the others go on.

    The requests' tasks learn of their tokens through the thread's `Relay`: a step's wake-ups go to trio as the
    next engine call starts, one wake-up for every stream of the step. A step that gave some job its first token
    (or ended one) wakes trio from the engine thread at once: the first token is what a client waits for. After
    a first token the engine thread also waits, at most `HANDOFF_SECONDS`, until those requests have taken it
    (the response's headers and first write, the most Python a request runs at once): run beside the next step,
    that work shared the cores with the engine's threads and took 2-3 times as long. The other streams lose that
    wait once per request that joins.
    """

    HANDOFF_SECONDS = 0.003
    LINGER_SECONDS = 1.0

    def __init__(self, batcher: Batcher):
        self.batcher = batcher
        self._cond = threading.Condition()
        self._inbox: list[Stream] = []  # submitted, not yet added to the batcher (guarded by _cond)
        self._streams: dict[Job, Stream] = {}  # the batcher's jobs (guarded by _cond)
        self.running = False  # the engine thread runs (guarded by _cond)
        self.periods = 0  # engine threads started whose end trio has not seen yet (trio only)
        self._pauses = 0  # paused() holders (guarded by _cond)
        self._pause_ack: trio.Event | None = None
        self._handoffs: set[Stream] = set()  # woken with a first token, not taken yet (guarded by _cond)
        self._closing = False  # no job comes any more: a waiting engine thread ends (guarded by _cond)
        self._ended: trio.Event | None = None  # set when trio has seen the last engine thread end

    def submit(self, stream: Stream) -> None:
        """Hand a stream's job to the engine thread, starting one if none runs. A thread that cannot be started
        (no file descriptor left for its relay, no thread) fails this job alone, with `EngineStartError`, and
        leaves the loop as it was: the next job tries again."""
        with self._cond:
            if not self.running:
                try:
                    relay = Relay()  # this engine thread's
                except OSError as error:
                    self._refuse(stream, error)
                    return
                # Invariant: `running` is set only once the thread's relay exists, so a failed start never leaves
                # the loop marked running with no thread to run it.
                self.running = True
                self.periods += 1
                trio.lowlevel.spawn_system_task(relay.deliver, name="strata engine relay")
                trio.lowlevel.start_thread_soon(partial(self._work, relay), partial(self._ended_with, relay),
                                                name="strata engine")
            self._inbox.append(stream)
            self._cond.notify()

    def start_problem(self) -> OSError | None:
        """Why a job could not start an engine thread now, if it could not: None while one runs, else what
        making a thread's relay meets (`/health` asks)."""
        if self.running:
            return None
        try:
            os.close(os.eventfd(0, os.EFD_CLOEXEC))
        except OSError as error:
            return error
        return None

    def _refuse(self, stream: Stream, error: OSError) -> None:
        stream.job.error = EngineStartError(f"the engine could not start a step: {error.strerror or error}")
        stream.job.finish = "error"
        stream.wake()

    def cancel(self, stream: Stream) -> None:
        """Take a stream's job out: from the inbox at once, else at the batcher's next step."""
        with self._cond:
            if stream in self._inbox:
                self._inbox.remove(stream)
                stream.job.finish = "cancel"
                stream.wake()
            elif stream.job.finish is None:
                self.batcher.cancel(stream.job)
            self._handoffs.discard(stream)
            self._cond.notify()

    @asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """Keep the engine thread between two steps for the block."""
        with self._cond:
            self._pauses += 1
            ack = None
            if self.running:
                self._pause_ack = ack = trio.Event()
            self._cond.notify()
        try:
            if ack is not None:
                await ack.wait()
            yield
        finally:
            with self._cond:
                self._pauses -= 1
                self._cond.notify()

    async def close(self) -> None:
        """End the engine thread once it has no job (at once if it waits for one), and wait until trio has seen
        it end, at most `LINGER_SECONDS` longer than its jobs: the service is closing, no job comes."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self.periods:
            self._ended = trio.Event()
            with trio.CancelScope(shield=True), trio.move_on_after(self.LINGER_SECONDS):
                await self._ended.wait()

    def taken(self, stream: Stream) -> None:
        """A stream woken with its first token has taken it (see `HANDOFF_SECONDS`)."""
        with self._cond:
            self._handoffs.discard(stream)
            if not self._handoffs:
                self._cond.notify()

    # in the engine thread

    def _work(self, relay: Relay) -> None:
        try:
            self._steps(relay)
        finally:
            self.batcher.notify_fd = -1

    def _steps(self, relay: Relay) -> None:
        idle_until = None  # the time this thread ends unless a job comes
        while True:
            with self._cond:
                if self._pauses:
                    self._hold_paused(relay)
                arrived, self._inbox = self._inbox, []
                if not arrived and not self.batcher.jobs:
                    idle_until = self._linger(relay, idle_until)
                    if idle_until is None:
                        return
                    continue
                idle_until = None
                for stream in arrived:  # under the lock: cancel() finds a job either in the inbox or here
                    try:
                        self.batcher.add(stream.job)
                    except Exception as error:  # noqa: BLE001 - a job that cannot start fails alone (a bug)
                        stream.job.error, stream.job.finish = error, "error"
                        relay.put(partial(_wake_all, [stream]))
                        continue
                    self._streams[stream.job] = stream
            # The next call carries the wake-ups queued, if any: a call that wakes trio for nothing (a prompt's)
            # shares the cores with the loop's turn for nothing.
            self.batcher.notify_fd = relay.fd if relay.queued else -1
            changed = self.batcher.step()
            if not changed:
                continue
            with self._cond:
                streams = [self._streams[job] if job.finish is None else self._streams.pop(job) for job in changed]
            wake = partial(_wake_all, streams)
            if any(len(stream.job.tokens) <= 1 for stream in streams):
                self._wake_now(relay, streams, wake)
            else:
                relay.put(wake)  # one wake-up of trio for every stream of the step, as the next call starts

    def _linger(self, relay: Relay, idle_until: float | None) -> float | None:
        """Nothing to do (under `_cond`): wait for a job until `idle_until` (from now, on the first pass that finds
        nothing); None: the thread ends, as no job came or the service is closing."""
        relay.flush()  # no engine call comes to carry the wake-ups queued
        now = time.monotonic()
        idle_until = idle_until or now + self.LINGER_SECONDS
        if now >= idle_until or self._closing:
            self.running = False
            return None
        self._cond.wait(idle_until - now)
        return idle_until

    def _hold_paused(self, relay: Relay) -> None:
        """Tell trio the thread is between two steps, and stay there while `paused()` is held (under `_cond`)."""
        relay.put(self._acknowledge_pause)
        relay.notify()
        while self._pauses:
            self._cond.wait()

    def _wake_now(self, relay: Relay, streams: list[Stream], wake: Callable[[], object]) -> None:
        """A first token (or an end): trio is woken now, not as the next call starts, at the price of this thread
        waiting for the GIL once before that call; after a first token, the thread waits for the hand-off."""
        firsts = {stream for stream in streams if stream.job.finish is None and len(stream.job.tokens) == 1}
        for stream in firsts:
            stream.handing_off = True
        with self._cond:
            self._handoffs = firsts
        relay.put(wake)
        relay.notify()
        if firsts:
            self._await_handoffs()

    def _await_handoffs(self) -> None:
        deadline = time.monotonic() + self.HANDOFF_SECONDS
        with self._cond:
            while self._handoffs and not self._pauses and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            self._handoffs = set()

    def _ended_with(self, relay: Relay, result: outcome.Outcome) -> None:
        """The engine thread's last act: trio learns its outcome after every wake-up it queued."""
        relay.end(partial(self._finish, result))

    # back in trio

    def _acknowledge_pause(self) -> None:
        if self._pause_ack is not None:
            self._pause_ack.set()

    def _finish(self, result: outcome.Outcome) -> None:
        """The engine thread ended. An exception there (a bug: engine errors end jobs, not the thread) fails every
        job it had."""
        self.periods -= 1
        self._acknowledge_pause()
        if self._ended is not None and not self.periods:
            self._ended.set()
        if isinstance(result, outcome.Error):
            with self._cond:
                self.running = False
                streams = list(self._streams.values()) + self._inbox
                self._streams.clear()
                self._inbox = []
            for stream in streams:
                stream.job.error, stream.job.finish = result.error, "error"
                stream.wake()


class EngineStartError(OSError):
    """The engine thread could not be started for a job (the process is out of file descriptors or threads)."""


class Relay:
    """One engine thread's wake-ups of trio: the thread queues calls, and an eventfd wakes a trio task (a system
    task: it lives as long as the thread) that runs them in order, the thread's outcome last.

    The engine call after a step carries the notification: it adds 1 to the eventfd as it starts, without the GIL
    (`strata_batch.notify_fd`), so the loop wakes while the engine computes, and finds the GIL free. The engine
    thread writes the eventfd itself only where no call follows (it waits, pauses or ends): the write releases the
    GIL, and a loop already awake takes it there and holds the thread for as long as it renders (0.1-0.25 ms a
    token, measured when the thread woke trio after every step). A thread of its own for the wake-ups, as before,
    cost a second wake-up per step on the cores the engine keeps busy, and 0.07 ms of CPU a token at one stream.
    The eventfd closes when both the engine thread and the task are done with it."""

    _END = None  # queued after the engine thread's outcome: the task ends there

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._calls: collections.deque[Callable[[], object] | None] = collections.deque()
        self._holders = 2  # the engine thread and the trio task
        self._lock = threading.Lock()

    # in the engine thread

    def put(self, call: Callable[[], object]) -> None:
        self._calls.append(call)

    def notify(self) -> None:
        os.eventfd_write(self.fd, 1)

    @property
    def queued(self) -> bool:
        return bool(self._calls)

    def flush(self) -> None:
        if self._calls:
            self.notify()

    def end(self, call: Callable[[], object]) -> None:
        self._calls.extend((call, self._END))
        self.notify()
        self._release()

    # in trio

    async def deliver(self) -> None:
        try:
            while True:
                await trio.lowlevel.wait_readable(self.fd)
                with suppress(BlockingIOError):  # a notification the last pass took already
                    os.eventfd_read(self.fd)
                while self._calls:
                    call = self._calls.popleft()
                    if call is self._END:
                        return
                    call()
        finally:
            trio.lowlevel.notify_closing(self.fd)
            self._release()

    def _release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders:
                return
        os.close(self.fd)


def _wake_all(streams: list[Stream]) -> None:
    for stream in streams:
        stream.wake()


class Stream:
    """A request's view of its job: the tokens as they come, and `stop()`, awaited on every exit of the request
    (cancellation included), which takes the job out and waits, shielded, until it has left its slot."""

    def __init__(self, loop: EngineLoop, job: Job):
        self.job, self._loop = job, loop
        self._taken = 0
        self.handing_off = False  # the engine thread waits for this stream to take its first token
        self.interrupted = False  # cut by a shutdown whose time ran out (`interrupt`)
        self._waiter: trio.Event | None = None
        self._ended = trio.Event()
        loop.submit(self)

    def seconds(self) -> tuple[float, float]:
        """(prompt seconds, decode seconds) so far."""
        job = self.job
        if not job.prompt_done:
            return time.perf_counter() - job.started, 0.0
        return job.prompt_done - job.started, max(job.last_token - job.prompt_done, 0.0)

    async def next_tokens(self) -> list[int]:
        """Wait for sampled tokens; [] once the job has left its slot and every token was taken.

        Raises: what the engine raised (EngineError, ...); ShuttingDown once `interrupt`ed.
        """
        if self.interrupted:
            raise ShuttingDown()
        if self.handing_off:  # called again: the first token went out (or more tokens are needed for it)
            self.handing_off = False
            self._loop.taken(self)
        waited = False
        while True:
            ended = self.job.finish is not None  # read first: every token is appended before finish is set
            tokens = self.job.tokens[self._taken:]
            if tokens and not waited:
                # Tokens that came while the last ones were sent: give the loop a turn (the sends themselves need
                # not: see the API's `_patch_tcp_server_send`), then take them and any that came meanwhile.
                waited = True
                await trio.lowlevel.checkpoint()
                continue
            if tokens:
                self._taken += len(tokens)
                return tokens
            if ended:
                if self.job.error is not None:
                    raise self.job.error
                return []
            # `wake` runs in trio, so no wake-up falls between the reads above and this wait.
            self._waiter = waiter = trio.Event()
            await waiter.wait()
            if self.interrupted:
                raise ShuttingDown()
            waited = True

    def interrupt(self) -> None:
        """End the request's wait for tokens with `ShuttingDown`, now or at its next call (its `stop()` then takes
        the job out)."""
        self.interrupted = True
        if self._waiter is not None:
            self._waiter.set()

    def wake(self) -> None:
        if self._waiter is not None:
            self._waiter.set()
        if self.job.finish is not None:
            self._ended.set()

    async def stop(self) -> None:
        if not self._ended.is_set():
            self._loop.cancel(self)
            with trio.CancelScope(shield=True):
                await self._ended.wait()


class Exclusive:
    """The engine taken whole, for an image encoder that shares its GPU: `hold()` waits until the engine thread
    is between two steps and keeps it there (the whole batch waits) for the block."""

    def __init__(self, loop: EngineLoop, turn: Turn):
        self._loop, self._turn = loop, turn

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        async with self._loop.paused():
            self._turn.exclusive += 1
            try:
                yield
            finally:
                self._turn.exclusive -= 1
