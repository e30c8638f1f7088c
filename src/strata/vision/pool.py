"""Several remote image encoders as one (`vision.pool`), so that the replicas of a fleet share a few encoder hosts
instead of each needing its own: a picture goes to an idle encoder, else to the one with the fewest pictures
waiting; an encoder that cannot be reached passes the picture to the next. Each encoder is a `VisionClient` of its
own (the remote-encoder protocol, one command line each, e.g. an `ssh` to its host); they share one cache of
encoded pictures. They must run the same mmproj with the same settings: a picture's rows are counted from the
READY of whichever answered first.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from typing import Any

import trio

from strata.pictures.cache import EmbeddingCache
from strata.vision.client import Embedding, VisionClient, VisionUnavailable
from strata.vision.protocol import Ready


class VisionPool:
    """The encoders of `config.pool` (the `vision` section), with `VisionClient`'s interface.

    Args:
        config: the `vision` section; each `pool` entry is one encoder's command line (split as a shell would).
        engine_threads: the engine's threads (shown in the status).
        log: where each encoder's startup line and state changes go.
    """

    remote = True

    def __init__(self, config: Any, *, engine_threads: int | None = None, log: Any = print,
                 start_timeout: float | None = None):
        self.cache = EmbeddingCache()
        self.engine_threads = engine_threads
        self.clients = [VisionClient(dataclasses.replace(config, exe=shlex.split(command), remote=True, pool=None),
                                     engine_threads=engine_threads, log=log, start_timeout=start_timeout,
                                     cache=self.cache)
                        for command in config.pool]
        self._handed = [0] * len(self.clients)  # pictures handed to each encoder and not answered yet
        self.grid, self.rows = VisionClient.grid, VisionClient.rows

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own every encoder until cancelled (each starts now unless `lazy_load`; one not reachable is asked
        again on the pictures that come)."""
        async with trio.open_nursery() as nursery:
            for client in self.clients:
                await nursery.start(client.run)
            task_status.started()

    @property
    def last_ready(self) -> Ready | None:
        return next((client.last_ready for client in self.clients if client.last_ready is not None), None)

    @property
    def available(self) -> bool:
        return any(client.available for client in self.clients)

    def mode(self) -> str:
        return "remote"

    def state(self) -> str:
        states = {client.state() for client in self.clients}
        return next(state for state in ("ready", "starting", "lazy", "absent") if state in states)

    def startup_line(self) -> str:
        ready = sum(client.available for client in self.clients)
        return f"vision: a pool of {len(self.clients)} remote encoders, {ready} ready"

    def status(self) -> dict[str, Any]:
        """`VisionClient.status` summed over the encoders, and each one's under `pool`."""
        each = [client.status() for client in self.clients]
        last_ready = self.last_ready
        return {
            "mode": "remote",
            "state": self.state(),
            "job": next((status["job"] for status in each if status["job"] is not None), None),
            "available": self.available,
            "cuda": any(status["cuda"] for status in each),
            "threads": last_ready.capabilities.threads if last_ready else None,
            "engine_threads": self.engine_threads,
            "cores": len(os.sched_getaffinity(0)),
            "takes_turn": any(status["takes_turn"] for status in each),
            "fingerprint": last_ready.capabilities.fingerprint if last_ready else None,
            "last_error": next((status["last_error"] for status in each if status["last_error"]), None),
            **{key: sum(status[key] for status in each) for key in ("encodes", "queued", "timeouts", "restarts")},
            "cache_hits": self.cache.hits,
            "cached": len(self.cache),
            "pool": each,
        }

    async def session(self) -> Any:
        """A running encoder's session (the first available one, else the first that starts).

        Raises:
            VisionUnavailable: none could be reached (the last one's reason).
        """
        failure = VisionUnavailable("the pool has no encoder")
        for i in self._by_preference():
            try:
                return await self.clients[i].session()
            except VisionUnavailable as error:
                failure = error
        raise failure

    async def encode(self, data: bytes, turn: Any = None, rows: int | None = None) -> Embedding:
        """`VisionClient.encode` on the encoder the picture goes to: an idle available one first, then the
        available ones by pictures waiting, then the others (which are asked to start again).

        Raises:
            VisionUnavailable: no encoder could encode it (the last one's reason).
            PictureRefused: the encoder could not read the picture.
        """
        failure = VisionUnavailable("the pool has no encoder")
        for i in self._by_preference():
            self._handed[i] += 1
            try:
                return await self.clients[i].encode(data, turn, rows)
            except VisionUnavailable as error:
                failure = error
            finally:
                self._handed[i] -= 1
        raise failure

    def _by_preference(self) -> list[int]:
        """The encoders' indexes, the one a picture should go to first: available before not, then by the
        pictures handed to it and not answered yet, then in the configured order."""
        return sorted(range(len(self.clients)), key=lambda i: (not self.clients[i].available, self._handed[i], i))
