"""`BlockWriter`: blocks (and state records) written to the store on a thread of its own, from a queue bounded by
bytes.

The engine thread offers a block after exporting it; when the queue holds `max_bytes` already, the offer is
refused (the caller exports nothing more) and the block is not saved: a step never waits for the disk. A write
that fails (a full disk) drops its block and logs one line; the next failure logs nothing until a write succeeds
again.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from strata.kv_disk.store import BlockStore


class BlockWriter:
    def __init__(self, store: BlockStore, max_bytes: int, log: Callable[[str], None] = print):
        self.store, self.max_bytes, self._log = store, max_bytes, log
        self._queue: collections.deque[tuple[bytes, int, int, memoryview, bytes]] = collections.deque()
        self._touched: list[bytes] = []  # stored blocks used again, whose files' times to move
        self._cond = threading.Condition()
        self.queued_bytes = 0
        self._queued_names: set[bytes] = set()
        self._closing = False
        self._failing = False  # the last write failed (its line is logged)
        self.written = self.dropped = self.failed = 0
        self._thread = threading.Thread(target=self._run, name="strata kv writer", daemon=True)
        self._thread.start()

    def queued(self, name: bytes) -> bool:
        with self._cond:
            return name in self._queued_names

    def room(self, n_bytes: int, wait: bool = False) -> bool:
        """Whether a block of `n_bytes` would be taken now; with `wait`, wait until it would (a shutdown's
        flush)."""
        with self._cond:
            if wait:
                self._cond.wait_for(lambda: self._fits(n_bytes) or self._closing)
            return self._fits(n_bytes)

    def _fits(self, n_bytes: int) -> bool:
        """An empty queue takes any block: one larger than the queue is written alone."""
        return self.queued_bytes + n_bytes <= self.max_bytes or not self.queued_bytes

    def offer(self, name: bytes, first: int, n: int, payload: memoryview, state: bytes = b"") -> bool:
        """Queue a block (with `state`, a state record) for writing; False (and `dropped` counts it) when the queue
        has no room."""
        with self._cond:
            if self._closing or not self._fits(len(payload) + len(state)):
                self.dropped += 1
                return False
            self._queue.append((name, first, n, payload, state))
            self._queued_names.add(name)
            self.queued_bytes += len(payload) + len(state)
            self._cond.notify_all()
            return True

    def drop(self, n: int) -> None:
        """Count `n` blocks not offered for want of room."""
        with self._cond:
            self.dropped += n

    def touch(self, names: list[bytes]) -> None:
        """Mark stored blocks as just used, in the index now and on their files from this thread."""
        stored = self.store.touch(names)
        if stored:
            with self._cond:
                self._touched += stored
                self._cond.notify_all()

    def close(self) -> None:
        """Write what is queued, then end the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._touched or self._closing)
                touched, self._touched = self._touched, []
                if not self._queue and not touched:
                    return
            self.store.touch_files(touched)
            with self._cond:
                if not self._queue:
                    continue
                name, first, n, payload, state = self._queue[0]
            try:
                self.store.put(name, first, n, payload, state)
            except OSError as error:
                self.failed += 1
                if not self._failing:
                    self._log(f"warning: kv_disk: a block could not be written to {self.store.path} "
                              f"({error.strerror or error}); prompts are recomputed instead of saved until writes "
                              "succeed again")
                self._failing = True
            else:
                self.written += 1
                self._failing = False
            with self._cond:
                self._queue.popleft()
                self._queued_names.discard(name)
                self.queued_bytes -= len(payload) + len(state)
                self._cond.notify_all()
