"""The server's write path: hypercorn's trio `TCPServer.protocol_send` as `create_app` patches it (a write goes to
the socket at once when it can, the rest hypercorn's way), and the hypercorn and trio internals the patch relies
on, so that a release that changes them fails here rather than in production."""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import socket
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import trio
import trio.testing
from hypercorn.events import RawData
from hypercorn.trio import tcp_server
from hypercorn.trio.tcp_server import TCPServer
from packaging.requirements import Requirement

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


def test_the_installed_hypercorn_is_one_the_patch_was_checked_against() -> None:
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    pinned = next(Requirement(line) for line in pyproject["project"]["dependencies"]
                  if Requirement(line).name == "hypercorn")
    assert pinned.specifier.contains(importlib.metadata.version("hypercorn"))
    assert any(spec.operator == "<" for spec in pinned.specifier), "the patch needs an upper bound on hypercorn"


def _hypercorn_method(name: str) -> str:
    """A `TCPServer` method as hypercorn's source has it (normalised by `ast.unparse`), not as patched."""
    tree = ast.parse(inspect.getsource(tcp_server))
    server = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "TCPServer")
    return ast.unparse(next(node for node in server.body
                            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name))


def test_hypercorn_writes_as_the_patch_expects() -> None:
    # The patch replaces protocol_send(self, event), skips the lock only when it is free, and falls back to the
    # original for the rest of a write: the original must take `self.send_lock` around `self.stream.send_all`
    # and report a closed connection to `self.protocol`.
    assert "self.send_lock = trio.Lock()" in _hypercorn_method("__init__")
    assert "self.stream = stream" in _hypercorn_method("__init__")
    send = _hypercorn_method("protocol_send")
    assert send.startswith("async def protocol_send(self, event: Event) -> None:")
    for line in ("if isinstance(event, RawData):", "async with self.send_lock:",
                 "await self.stream.send_all(event.data)",
                 "except (trio.BrokenResourceError, trio.ClosedResourceError):",
                 "await self.protocol.handle(Closed())"):
        assert line in send
    # The race the patch closes: `_close` shuts the write side without the send lock.
    close = _hypercorn_method("_close")
    assert "await self.stream.send_eof()" in close and "send_lock" not in close


async def test_trio_sockets_have_what_the_fast_write_reads() -> None:
    ours, theirs = trio.socket.socketpair()
    with ours, theirs:
        stream = trio.SocketStream(ours)
        assert isinstance(stream.socket._sock, socket.socket)
        assert stream.socket.did_shutdown_SHUT_WR is False
        await stream.send_eof()
        assert stream.socket.did_shutdown_SHUT_WR is True
