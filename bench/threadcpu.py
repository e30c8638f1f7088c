"""CPU time of this process's threads, by role, from `/proc/self/task/*/schedstat` (nanoseconds on a CPU, exact;
`stat`'s ticks are 10 ms, too coarse for one request).

Roles by thread name: "loop" the main thread (trio: HTTP, rendering, the hand-off of tokens), "engine" the
engine's threads (the batcher's thread, which also computes, and the pool's workers), "other" the rest (trio's
worker threads, the tokenizer's).
"""

from __future__ import annotations

import os
import threading

ROLES = ("loop", "engine", "other")


def _role(tid: str, name: str) -> str:
    if tid == str(threading.main_thread().native_id):
        return "loop"
    if name.startswith("strata-engine") or name == "strata engine":
        return "engine"
    return "other"


class Names:
    """Learns each thread's role while it runs: trio's cached worker threads carry a job's name only while they
    run it, so a snapshot taken between requests sees them unnamed. A thread of its own reads the names every
    `interval` seconds (about 50 us of CPU a time) inside the block."""

    def __init__(self, interval: float = 0.05):
        self.roles: dict[str, str] = {}
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Names:
        self.roles = {}  # a cached thread may take another role in the next request
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="threadcpu", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self._interval):
            for tid, (role, _) in snapshot().items():
                if role != "other":
                    self.roles.setdefault(tid, role)


def snapshot() -> dict[str, tuple[str, int]]:
    """thread id -> (role, nanoseconds on a CPU so far)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm, open(f"/proc/self/task/{tid}/schedstat") as stat:
                out[tid] = (_role(tid, comm.read().strip()), int(stat.read().split()[0]))
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
    return out


def spent(before: dict[str, tuple[str, int]], after: dict[str, tuple[str, int]], names: Names | None = None
          ) -> dict[str, float]:
    """Seconds on a CPU per role between two snapshots, a thread's role as `names` saw it if it did (threads
    that ended between the snapshots are not counted)."""
    seconds = dict.fromkeys(ROLES, 0.0)
    for tid, (role, ns) in after.items():
        if names is not None:
            role = names.roles.get(tid, role)
        seconds[role] += (ns - before.get(tid, (role, 0))[1]) / 1e9
    return seconds
