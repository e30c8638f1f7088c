"""The server's write path: hypercorn's trio `TCPServer.protocol_send` as `create_app` patches it (a write goes to
the socket at once when it can, the rest hypercorn's way)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import trio
import trio.testing
from hypercorn.events import RawData
from hypercorn.trio.tcp_server import TCPServer

from strata.api.app import _patch_tcp_server_send


@contextmanager
def connection() -> Iterator[tuple[SimpleNamespace, trio.socket.SocketType]]:
    """What `protocol_send` uses of a `TCPServer` over one end of a socket pair, and the other end."""
    _patch_tcp_server_send()
    ours, theirs = trio.socket.socketpair()
    with ours, theirs:
        yield SimpleNamespace(stream=trio.SocketStream(ours), send_lock=trio.Lock(), protocol=None), theirs


async def receive(sock: trio.socket.SocketType, n: int) -> bytes:
    data = bytearray()
    with trio.fail_after(10):  # a write that lost its rest would leave the reader waiting
        while len(data) < n:
            data += await sock.recv(1 << 16)
    return bytes(data)


async def test_a_write_the_socket_does_not_take_whole_is_finished_when_the_reader_reads() -> None:
    data = bytes(range(256)) * (1 << 13)  # 2 MiB: more than a socket buffer holds
    with connection() as (server, theirs):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(TCPServer.protocol_send, server, RawData(data=data))
            await trio.testing.wait_all_tasks_blocked()  # the write waits for the reader
            assert await receive(theirs, len(data)) == data


async def test_a_write_waits_for_the_one_in_flight() -> None:
    with connection() as (server, theirs):
        await server.send_lock.acquire()  # another task's write is under way
        async with trio.open_nursery() as nursery:
            nursery.start_soon(TCPServer.protocol_send, server, RawData(data=b"second"))
            await trio.testing.wait_all_tasks_blocked()
            await server.stream.send_all(b"first")
            server.send_lock.release()
        assert await receive(theirs, 11) == b"firstsecond"


async def test_a_small_write_goes_out_without_a_pass_of_the_scheduler() -> None:
    with connection() as (server, theirs):
        coroutine = TCPServer.protocol_send(server, RawData(data=b"token"))
        try:
            coroutine.send(None)  # a checkpoint would suspend it here
        except StopIteration:
            pass
        else:
            coroutine.close()
            raise AssertionError("the write yielded to the scheduler")
        assert await receive(theirs, 5) == b"token"


async def test_a_cancelled_task_writes_nothing() -> None:
    # as through hypercorn's lock: a request cancelled before its response (a graceful shutdown's deadline)
    # leaves a connection closed without one, not a 500 written by its cancelled task
    with connection() as (server, theirs):
        with trio.CancelScope() as scope:
            scope.cancel()
            await TCPServer.protocol_send(server, RawData(data=b"late"))
        assert scope.cancelled_caught
        server.stream.socket.close()
        assert await theirs.recv(16) == b""
