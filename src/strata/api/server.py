"""Run the HTTP server: the listening sockets bound first, then handed to hypercorn (trio) in-process by
descriptor, with the service beside it; signals and the graceful shutdown."""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import trio

    from strata.config import Config


async def serve(
    config: Config,
    *,
    handle_signals: bool = False,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    log: Callable[[str], None] = print,
    task_status: trio.TaskStatus[list[str]] | None = None,
) -> int:
    """Load `config.model` and serve the HTTP API until shutdown; return the exit status.

    The model file is checked first (`strata.model_file`; an "hf:" model's repository, quant, files and free disk:
    `strata.models.resolve.check_config`), then the listening sockets are bound: a wrong path, a missing
    repository or quant, or an address that cannot be used ends startup with one line, before the model starts
    loading. The server listens while an "hf:" model downloads and while the model loads (`/health` answers 503
    until it is loaded; `/v1/status` and the monitor show the download).
    Shutdown — SIGINT or SIGTERM with `handle_signals`, `shutdown_trigger` returning, or the model failing to load —
    stops accepting connections and gives in-flight requests `limits.graceful_timeout` seconds before they are
    cancelled. A second signal during shutdown cancels them at once ("stop now"); later ones are ignored, so no
    interrupt lands in the middle of closing the engine.

    Args:
        config: the configuration.
        handle_signals: shut down on SIGINT and SIGTERM (only from the main thread).
        shutdown_trigger: an async function whose return shuts the server down.
        log: where startup lines go.
        task_status: for `nursery.start`: started with the bound addresses once listening.
    """
    from strata.model_file import ModelFileError, check_model_file
    from strata.models.hub import HubError
    from strata.models.resolve import check_config

    try:
        # A wrong model path is one line before anything listens; a file that passes and still fails to load
        # (a tensor missing, too little memory) ends serving once loading has failed. An "hf:" model is checked
        # against the hub (or the cache) here, and downloaded while the server listens.
        config = await check_config(config)
        for path in config.model_files():
            check_model_file(path)
        sockets = bind_sockets(listen_addresses(config.host, config.port))
    except (HubError, ModelFileError, ListenError) as error:
        log(f"error: {error}")
        return 1
    try:
        return await _serve(config, sockets, handle_signals, shutdown_trigger, log, task_status)
    finally:
        for sock in sockets:
            sock.close()  # the ones handed to hypercorn are detached: closing them does nothing


async def _serve(config: Config, sockets: list[socket.socket], handle_signals: bool,
                 shutdown_trigger: Callable[[], Awaitable[None]] | None, log: Callable[[str], None],
                 task_status: trio.TaskStatus[list[str]] | None) -> int:
    import hypercorn
    import hypercorn.trio
    import trio

    from strata.api.app import create_app
    from strata.service import open_service

    stop = trio.Event()
    hurry = trio.CancelScope()  # the HTTP server's: a second signal cancels the requests in flight at once
    failed = False

    async def watch_loading(service: Any) -> None:
        """Stop serving when the model fails to load. It runs beside the service, not in hypercorn's nursery:
        a shutdown during the download or the load goes on without waiting for either."""
        nonlocal failed
        await service.loaded.wait()
        if stop.is_set():
            return  # shutting down: a download or load cut short is no failure
        if service.load_error is not None:
            failed = True
            stop.set()
        else:
            log(f"serving {', '.join(service.models.names)} on {', '.join(binds)}")

    async with trio.open_nursery() as nursery:
        if handle_signals:
            nursery.start_soon(_stop_on_signal, stop, hurry)
        if shutdown_trigger is not None:
            nursery.start_soon(_stop_after, shutdown_trigger, stop)
        async with open_service(config, wait=False, log=log) as service:
            nursery.start_soon(_end_streams_on, stop, service)
            hyper = hypercorn.Config()
            # hypercorn takes over the bound sockets by their descriptors.
            hyper.bind = [f"fd://{sock.detach()}" for sock in sockets]
            hyper.graceful_timeout = config.limits.graceful_timeout
            hyper.accesslog = None
            # Invariant: the service closes only after hypercorn has returned, i.e. after every request ended.
            with hurry:
                async with trio.open_nursery() as server_nursery:
                    try:
                        binds = await server_nursery.start(partial(
                            hypercorn.trio.serve, create_app(service=service), hyper, shutdown_trigger=stop.wait))
                    except (OSError, ExceptionGroup) as error:
                        cause = _os_error(error)
                        if cause is None:
                            raise
                        log(f"error: cannot listen on {', '.join(listen_addresses(config.host, config.port))}: {cause}")
                        failed = True
                    else:
                        log(f"listening on {', '.join(binds)}")
                        nursery.start_soon(watch_loading, service)
                        if task_status is not None:
                            task_status.started(binds)
        nursery.cancel_scope.cancel()
    return 1 if failed else 0


def listen_addresses(host: str, port: int) -> list[str]:
    """hypercorn's binds for the `host` key: one address or several separated by commas (IPv6 ones bracketed)."""
    binds = []
    for name in (part.strip() for part in host.split(",")):
        if ":" in name and not name.startswith("["):
            name = f"[{name}]"
        binds.append(f"{name}:{port}")
    return binds


class ListenError(OSError):
    """An address the server cannot listen on, named with its cause."""


def bind_sockets(binds: list[str]) -> list[socket.socket]:
    """Bound sockets for hypercorn's `binds` (made as hypercorn makes them); all or none.

    Raises:
        ListenError: an address in use, a host that does not resolve, ...
    """
    import hypercorn

    sockets: list[socket.socket] = []
    try:
        for bind in binds:
            one = hypercorn.Config()
            one.bind = [bind]
            try:
                sockets += one.create_sockets().insecure_sockets
            except OSError as error:
                raise ListenError(f"cannot listen on {bind}: {error}") from None
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _os_error(error: BaseException) -> OSError | None:
    """The socket error behind a failed listen (hypercorn's task raises it inside exception groups)."""
    if isinstance(error, OSError):
        return error
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            found = _os_error(inner)
            if found is not None:
                return found
    return None


async def _end_streams_on(stop: trio.Event, service: Any) -> None:
    """Let the status streams end when shutdown begins, rather than keep hypercorn's graceful wait going."""
    await stop.wait()
    service.begin_shutdown(service.config.limits.graceful_timeout)


STOP_NOW_TIMEOUT = 3.0  # seconds a forced stop may take before the process exits without finishing it


async def _stop_on_signal(stop: trio.Event, hurry: trio.CancelScope) -> None:
    """The first SIGINT or SIGTERM starts the graceful shutdown; the second cancels the requests in flight, and
    if serving has not ended `STOP_NOW_TIMEOUT` seconds later (hypercorn shields its socket writes: one to a
    client that reads nothing never ends), the process exits; a third exits at once. The receiver stays open
    until serving ends: an interrupt outside it is raised by trio wherever the process is (closing the engine,
    for one), and ends it with a traceback."""
    import trio

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for received in signals:
            name = signal.Signals(received).name
            if not stop.is_set():
                print(f"{name}: shutting down (requests in flight get the graceful_timeout; again to stop now)",
                      flush=True)
                stop.set()
            elif not hurry.cancel_called:
                print(f"{name} again: stopping now (requests in flight are cancelled)", flush=True)
                hurry.cancel()
                with trio.move_on_after(STOP_NOW_TIMEOUT):
                    await signals.__anext__()
                print(f"{name}: exiting without finishing the shutdown", flush=True)
                os._exit(1)


async def _stop_after(trigger: Callable[[], Awaitable[None]], stop: trio.Event) -> None:
    await trigger()
    stop.set()
