"""`BlockReader`: a job's blocks read from the store on a thread of its own, handed to the engine thread as they
come (`Load`).

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
    """One job's consecutive blocks: `take()` what has been read, in order."""

    def __init__(self, names: list[bytes], arrived: threading.Event):
        self.names = names
        self._ready: collections.deque[tuple[int, memoryview]] = collections.deque()
        self._arrived = arrived
        self.cancelled = False
        self.ended = False  # the reader is done with it: every block read, or it stopped early

    def take(self) -> list[tuple[int, memoryview]]:
        """The blocks read since the last call, in order: (first position, payload)."""
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

    def deliver(self, first: int, payload: memoryview) -> None:
        self._ready.append((first, payload))
        self._arrived.set()

    def end(self) -> None:
        self.ended = True
        self._arrived.set()


class BlockReader:
    def __init__(self, store: BlockStore, log: Callable[[str], None] = print):
        self.store, self._log = store, log
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
            self._load(load)

    PREFETCH = 2  # blocks asked of the disk ahead of the one read

    def _load(self, load: Load) -> None:
        for name in load.names[:self.PREFETCH]:
            self.store.prefetch(name)
        for i, name in enumerate(load.names):
            if load.cancelled:
                break
            if i + self.PREFETCH < len(load.names):
                self.store.prefetch(load.names[i + self.PREFETCH])
            started = time.perf_counter()
            try:
                first, payload = self.store.get(name)
            except (OSError, KeyError) as error:  # KeyError: evicted since the lookup, an ordinary miss
                if not isinstance(error, KeyError):
                    self.failed += 1
                    self._log(f"warning: kv_disk: a block could not be read ({error}); its prompt is recomputed")
                load.end()
                return
            self.seconds += time.perf_counter() - started
            self.blocks += 1
            self.bytes += len(payload)
            load.deliver(first, payload)
        load.end()
