"""`BlockReader`: a job's blocks (and a hybrid model's state record after them) read from the store on a thread of
its own, handed to the engine thread as they come (`Load`).

The engine thread imports each block as soon as it is read (a memcpy) and waits for the next only when no other
job has work; a job that goes (a hang-up) cancels its load, and the reader stops at the next block. A block that
cannot be read (an I/O error, a checksum that does not match) ends its load there with one line in the log: the
job computes the rest.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from strata.kv_disk.store import BlockStore


class Load:
    """One job's consecutive blocks (then maybe a state record): `take()` what has been read, in order."""

    def __init__(self, names: list[bytes], arrived: threading.Event):
        self.names = names
        self._ready: collections.deque[tuple[int, memoryview, memoryview]] = collections.deque()
        self._arrived = arrived
        self.cancelled = False
        self.ended = False  # the reader is done with it: every block read, or it stopped early

    def take(self) -> list[tuple[int, memoryview, memoryview]]:
        """The files read since the last call, in order: (first position, payload, state: empty for a block)."""
        taken = []
        while self._ready:
            taken.append(self._ready.popleft())
        return taken

    @property
    def finished(self) -> bool:
        """Nothing more will come and everything read has been taken."""
        return self.ended and not self._ready

    def cancel(self) -> None:
        self.cancelled = True

    def deliver(self, first: int, payload: memoryview, state: memoryview) -> None:
        self._ready.append((first, payload, state))
        self._arrived.set()

    def end(self) -> None:
        self.ended = True
        self._arrived.set()


class BlockReader:
    """Args:
        touched: told the names of each load's blocks once read (their files' times are moved elsewhere: a
            metadata write per file halved the read rate here).
    """

    AHEAD_BYTES = 32 * 2**20  # asked of the disk ahead of the block read: it reads on while a checksum runs

    def __init__(self, store: BlockStore, log: Callable[[str], None] = print,
                 touched: Callable[[list[bytes]], None] = lambda names: None):
        self.store, self._log, self._touched = store, log, touched
        self.arrived = threading.Event()  # a block was read or a load ended: the engine thread may go on
        self._loads: collections.deque[Load | None] = collections.deque()
        self._cond = threading.Condition()
        self.blocks = self.bytes = self.failed = 0
        self.seconds = 0.0  # reading, checksums included
        self._thread = threading.Thread(target=self._run, name="strata kv reader", daemon=True)
        self._thread.start()

    def read(self, names: list[bytes]) -> Load:
        load = Load(names, self.arrived)
        with self._cond:
            self._loads.append(load)
            self._cond.notify()
        return load

    def close(self) -> None:
        with self._cond:
            for load in self._loads:
                if load is not None:
                    load.cancel()
            self._loads.append(None)
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._loads)
                load = self._loads.popleft()
            if load is None:
                return
            self._touched(load.names[:self._load(load)])

    def _load(self, load: Load) -> int:
        """Read the load's blocks until it is cancelled or one fails; returns how many were read."""
        sizes: list[int] = []  # of the blocks asked for so far
        ahead = 0  # their bytes not read yet
        for i, name in enumerate(load.names):
            if load.cancelled:
                load.end()
                return i
            while len(sizes) < len(load.names) and (ahead < self.AHEAD_BYTES or len(sizes) <= i):
                sizes.append(self.store.prefetch(load.names[len(sizes)]))
                ahead += sizes[-1]
            started = time.perf_counter()
            try:
                first, payload, state = self.store.get(name)
            except (OSError, KeyError) as error:  # KeyError: evicted since the lookup, an ordinary miss
                if not isinstance(error, KeyError):
                    self.failed += 1
                    self._log(f"warning: kv_disk: a block could not be read ({error}); its prompt is recomputed")
                load.end()
                return i
            self.seconds += time.perf_counter() - started
            self.blocks += 1
            self.bytes += len(payload) + len(state)
            ahead -= sizes[i]
            load.deliver(first, payload, state)
        load.end()
        return len(load.names)
