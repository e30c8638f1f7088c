"""The connections to MCP servers, each reading at most `mcp.max_result_bytes` of one answer and parsing large
answers in worker threads; a tool listing over the limits is refused before the session parses it (see
`strata.mcp_tools.answers`). Imported with the SDK, when a server first starts (see servers.py).

- `stdio_transport`: a command's stdin and stdout, one JSON-RPC message a line, for the SDK's `Client`. (The SDK's
  own reads a line whole, however long, and parses it on the event loop.)
- `BoundedHttp`: the HTTP connection under the SDK's streamable-HTTP client: each answer's body, or each event
  of an answer's event stream, read up to the limit; past it the response is closed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import AsyncIterator
from typing import IO, TYPE_CHECKING, Any

import anyio
import httpx2
import mcp_types
import trio
from mcp.client.stdio import get_default_environment
from mcp.shared.message import SessionMessage
from pydantic import ValidationError

from strata.config import McpConfig, McpServerConfig
from strata.mcp_tools.answers import Pending, checked, cut_answer

if TYPE_CHECKING:
    from mcp.client._transport import TransportStreams

_PARSERS = trio.CapacityLimiter(2)  # worker threads parsing MCP answers at once
_INLINE_BYTES = 64 * 1024  # answers up to this size are parsed on the event loop (a thread costs more)
_READ_BYTES = 256 * 1024
_TAIL_BYTES = 256  # of an over-long line, kept to find its id (written last by some SDKs)
_CANCELLED = "notifications/cancelled"
_EXIT_SECONDS = 2.0  # a stdio server gets to exit after its stdin closes, and again after SIGTERM


def parse_answer(data: bytes, pending: Pending, settings: McpConfig) -> SessionMessage | Exception:
    """One message from a server, as the SDK's session takes it (a parse error is handed on as a value, as the
    SDK's transports do). Blocking work for large messages: run in a worker thread."""
    try:
        raw = json.loads(data)
        if isinstance(raw, dict):
            raw = checked(raw, pending.answered(raw), settings)
        return SessionMessage(mcp_types.jsonrpc_message_adapter.validate_python(raw, by_name=False))
    except (ValueError, ValidationError) as error:
        return error


async def _parsed(data: bytes, pending: Pending, settings: McpConfig) -> SessionMessage | Exception:
    if len(data) <= _INLINE_BYTES:
        return parse_answer(data, pending, settings)
    return await trio.to_thread.run_sync(parse_answer, data, pending, settings, limiter=_PARSERS)


# --- stdio


@contextlib.asynccontextmanager
async def stdio_transport(config: McpServerConfig, settings: McpConfig,
                          errlog: IO[str]) -> AsyncIterator[TransportStreams]:
    """Start the server's command and speak to it over its stdin and stdout.

    At the end the server is stopped as the MCP spec says (stdin closed, then SIGTERM, then SIGKILL to its
    process group, each after a grace period), shielded so that a cancelled caller leaks no process.
    """
    assert config.command is not None
    process = await trio.lowlevel.open_process(
        [config.command, *(config.args or [])], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errlog,
        env=get_default_environment() | (config.env or {}), cwd=config.cwd, start_new_session=True)
    assert process.stdin is not None and process.stdout is not None
    read_writer, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, write_reader = anyio.create_memory_object_stream[SessionMessage](0)
    pending = Pending()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_read_lines, process.stdout, read_writer, pending, settings)
        nursery.start_soon(_write_lines, process.stdin, write_reader, read_writer, pending)
        try:
            yield read_stream, write_stream
        finally:
            with trio.CancelScope(shield=True):
                read_stream.close()  # the reader drops what comes now, so that a server stuck writing can exit
                write_stream.close()
                await _stop(process)
            nursery.cancel_scope.cancel()


async def _read_lines(stdout: trio.abc.ReceiveStream, writer: Any, pending: Pending, settings: McpConfig) -> None:
    """Hand the session each line of the server's stdout (`_Lines`: at most `max_result_bytes` of it kept; an
    answer that says so stands for a longer one)."""
    lines = _Lines(settings.max_result_bytes)
    dropping = False  # the session is gone: read on (the server must not block writing), hand nothing on
    async with writer:
        with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError, OSError):
            while chunk := await stdout.receive_some(_READ_BYTES):
                for line, tail in lines.feed(chunk):
                    message = await _message(line, tail, pending, settings)
                    if message is None or dropping:
                        continue
                    try:
                        await writer.send(message)
                    except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                        dropping = True


async def _message(line: bytes, tail: bytes | None, pending: Pending,
                   settings: McpConfig) -> SessionMessage | Exception | None:
    """A line as the session takes it; `tail` (the last bytes) is given when only the line's start was kept."""
    if tail is not None:
        answer = pending.over_long(line, tail, settings.max_result_bytes)
        return None if answer is None else await _parsed(json.dumps(answer).encode(), pending, settings)
    return await _parsed(line, pending, settings) if line.strip() else None


class _Lines:
    """A byte stream split into lines, at most `limit` bytes of each kept: a longer one is read to its end without
    being kept, and comes out as its start and its last `_TAIL_BYTES`."""

    def __init__(self, limit: int):
        self._limit = limit
        self._line = bytearray()
        self._over = False  # the line has gone past the limit
        self._tail = b""

    def feed(self, chunk: bytes | bytearray) -> list[tuple[bytes, bytes | None]]:
        """The lines `chunk` ends: (line, None), or (its kept start, its tail) for an over-long one."""
        done: list[tuple[bytes, bytes | None]] = []
        *ended, rest = chunk.split(b"\n")
        for piece in ended:
            self._add(piece)
            done.append((bytes(self._line), self._tail if self._over else None))
            self._line, self._over, self._tail = bytearray(), False, b""
        self._add(rest)
        return done

    def _add(self, piece: bytes | bytearray) -> None:
        room = self._limit - len(self._line)
        if not self._over and len(piece) > room:
            self._line += piece[:room]
            self._over = True
        if self._over:
            self._tail = bytes(self._tail + piece[-_TAIL_BYTES:])[-_TAIL_BYTES:]
        else:
            self._line += piece


async def _write_lines(stdin: trio.abc.SendStream, reader: Any, read_writer: Any, pending: Pending) -> None:
    try:
        async with reader:
            async for session_message in reader:
                message = session_message.message
                if isinstance(message, mcp_types.JSONRPCRequest):
                    pending.sent(message.id, message.method)
                elif isinstance(message, mcp_types.JSONRPCNotification) and message.method == _CANCELLED:
                    pending.cancelled((message.params or {}).get("requestId"))
                text = message.model_dump_json(by_alias=True, exclude_unset=True)
                await stdin.send_all(text.encode() + b"\n")
    except (anyio.ClosedResourceError, anyio.BrokenResourceError, trio.ClosedResourceError,
            trio.BrokenResourceError, OSError):
        await read_writer.aclose()  # the session sees the connection end instead of a request hanging


async def _stop(process: trio.Process) -> None:
    """Close the server's stdin, then SIGTERM and SIGKILL its process group, each after a grace period."""
    assert process.stdin is not None and process.stdout is not None
    with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError, OSError):
        await process.stdin.aclose()
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, sig)
        with trio.move_on_after(_EXIT_SECONDS):
            await process.wait()
        if process.returncode is not None:
            break
    with contextlib.suppress(trio.ClosedResourceError, OSError):
        await process.stdout.aclose()


# --- streamable HTTP


def bounded_http_client(config: McpServerConfig, settings: McpConfig) -> httpx2.AsyncClient:
    """The HTTP client of a streamable-HTTP server: its configured headers, and answers bounded (`BoundedHttp`)."""
    # Identity encoding: the bound counts the bytes the answer takes, and an answer put in place of one past it
    # must not be decoded as the server's would have been.
    headers = {**(config.headers or {}), "Accept-Encoding": "identity"}
    return httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0, read=300.0),
                              transport=BoundedHttp(httpx2.AsyncHTTPTransport(), settings))


class BoundedHttp(httpx2.AsyncBaseTransport):
    """An HTTP transport whose answers to JSON-RPC requests are bounded (`_Body`)."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, settings: McpConfig):
        self._inner, self._settings = inner, settings

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self._inner.handle_async_request(request)
        asked = _request_of(request)
        if asked is None:
            return response  # the server's own event stream (GET), or a notification: the SDK bounds its events
        kind = response.headers.get("content-type", "").lower()
        body = _Body(response.stream, asked, self._settings, events=kind.startswith("text/event-stream"))
        return httpx2.Response(response.status_code, headers=response.headers, stream=body,
                               extensions=response.extensions)

    async def aclose(self) -> None:
        await self._inner.aclose()


class _Body(httpx2.AsyncByteStream):
    """The answer to one request (`asked`: its id and method), read up to `mcp.max_result_bytes`: a JSON body
    whole, an event stream one event at a time; past the limit the response is closed and an answer that says
    so takes its place. A tool listing over the limits becomes an error."""

    def __init__(self, inner: Any, asked: tuple[Any, str], settings: McpConfig, events: bool):
        self._inner, self._asked, self._settings, self._events = inner, asked, settings, events

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._events:
            async for event in self._read_events():
                yield event
        else:
            yield await self._read_whole()

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def _read_whole(self) -> bytes:
        limit = self._settings.max_result_bytes
        body = bytearray()
        async for chunk in self._inner:
            body += chunk
            if len(body) > limit:
                await self._inner.aclose()
                return json.dumps(cut_answer(*self._asked, bytes(body[:limit]), limit)).encode()
        return await self._checked(bytes(body))

    async def _read_events(self) -> AsyncIterator[bytes]:
        limit = self._settings.max_result_bytes
        held = bytearray()
        searched = 0  # where the search for the held event's end goes on
        async for chunk in self._inner:
            held += chunk
            while (end := _event_end(held, searched)) is not None and end <= limit:
                event, held, searched = bytes(held[:end]), held[end:], 0
                yield await self._checked_event(event)
            searched = max(len(held) - 3, 0)
            if len(held) > limit:  # the held event is longer than the limit, complete or not
                await self._inner.aclose()
                answer = cut_answer(*self._asked, _event_data(bytes(held[:limit])), limit)
                yield b"event: message\ndata: " + json.dumps(answer).encode() + b"\n\n"
                return
        if held:
            yield bytes(held)

    async def _checked(self, body: bytes) -> bytes:
        """A JSON body, or an error in its place when it is a tool listing over the limits."""
        if self._asked[1] != "tools/list":
            return body
        return await trio.to_thread.run_sync(self._check_listing, body, limiter=_PARSERS)

    async def _checked_event(self, event: bytes) -> bytes:
        if self._asked[1] != "tools/list" or b"data:" not in event:
            return event
        data = _event_data(event)
        checked_data = await self._checked(data)
        if checked_data is data:
            return event
        return b"event: message\ndata: " + checked_data + b"\n\n"

    def _check_listing(self, body: bytes) -> bytes:
        try:
            answer = json.loads(body)
        except ValueError:
            return body  # the SDK says what is wrong with it
        if not isinstance(answer, dict) or "result" not in answer:
            return body
        fixed = checked(answer, "tools/list", self._settings)
        return body if fixed is answer else json.dumps(fixed).encode()


def _request_of(request: httpx2.Request) -> tuple[Any, str] | None:
    """(id, method) of the JSON-RPC request a POST carries; None for anything else."""
    if request.method != "POST":
        return None
    try:
        message = json.loads(request.content)
    except ValueError:
        return None
    if not isinstance(message, dict) or message.get("id") is None or not isinstance(message.get("method"), str):
        return None
    return message["id"], message["method"]


def _event_end(held: bytearray, start: int) -> int | None:
    """Where the first complete event of a stream ends (after its blank line; none before `start`), or None."""
    ends = [at + len(mark) for mark in (b"\n\n", b"\r\n\r\n", b"\r\r") if (at := held.find(mark, start)) >= 0]
    return min(ends) if ends else None


def _event_data(event: bytes) -> bytes:
    """An event's data (its `data:` lines joined)."""
    lines = event.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    return b"\n".join(line[5:].removeprefix(b" ") for line in lines if line.startswith(b"data:"))
