"""The benchmarks' in-process server: a service's app on hypercorn (trio worker) on a free loopback port."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import hypercorn
import hypercorn.trio
import trio

from strata.api import create_app
from strata.service import Service


@asynccontextmanager
async def served(service: Service) -> AsyncIterator[tuple[str, int]]:
    """Serve `service` over HTTP for the length of the block; yields the (host, port) it listens on."""
    config = hypercorn.Config()
    config.bind, config.accesslog, config.errorlog = ["127.0.0.1:0"], None, None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(hypercorn.trio.serve, create_app(service=service), config))
        host, port = binds[0].removeprefix("http://").split(":")
        yield host, int(port)
        nursery.cancel_scope.cancel()
