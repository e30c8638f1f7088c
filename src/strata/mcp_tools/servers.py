"""MCP servers the service talks to, each one a client session of the official `mcp` SDK supervised by a task in
the service's long-lived nursery.

A supervisor connects (starting the command for stdio servers), lists the tools, and then watches the session:
a tools-changed event lists them again; a lost connection (a crashed process, a closed HTTP session, a call that
saw the connection close) marks the server `failed`, drops its tools and logs why. A failed server starts again
when a request next needs it. Tool calls run in the calling task — the request's — so a client that hangs up
cancels its call, and the SDK sends the server `notifications/cancelled`.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import sys
import tempfile
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

import trio

import strata
from strata.config import McpConfig, McpServerConfig
from strata.mcp_tools.tools import McpTool, ToolOutput, tool_output, usable_tools
from strata.pictures.downloads import DownloadPolicy

if TYPE_CHECKING:
    import mcp_types
    from mcp import Client

# The SDK is imported when a server first starts, not with the service: it takes seconds to import on a busy
# machine, which every `strata serve` start and stop would pay without MCP servers too.

_MAX_PAGES = 50  # of one tool listing: a server whose cursor never ends cannot hang a listing
_STDERR_TAIL = 400  # characters of a failed stdio server's stderr kept in its error
_CHECKS = trio.CapacityLimiter(1)  # worker threads checking tool listings at once


class McpUnavailable(Exception):
    """The server cannot be used now; the message says why."""


class ListingRefused(Exception):
    """The server's tool listing is over the limits (`mcp.max_tools`); the message says which."""


class McpServer:
    """One MCP server and its supervisor (`run`, in the service's nursery).

    Attributes:
        name: the configured name (requests name the server by it).
        state: "starting", "ready", "failed" or "stopped".
        error: why the server failed, when it did.
        tools: the usable tools of the last listing (none unless ready).
        skipped: (name, reason) for each listed tool that cannot be offered to a model.
        starts: how many times the supervisor connected or tried to.
    """

    def __init__(self, name: str, config: McpServerConfig, settings: McpConfig,
                 log: Callable[[str], None] = print):
        self.name, self.config, self.settings = name, config, settings
        self.transport = "stdio" if config.command is not None else "http"
        self.state = "starting"
        self.error: str | None = None
        self.tools: list[McpTool] = []
        self.skipped: list[tuple[str, str]] = []
        self.starts = 0
        self._log = log
        self._client: Client | None = None
        self._settled = trio.Event()  # the current start attempt has ended (ready or failed)
        self._wanted = trio.Event()  # a request needs the failed server again
        self._relist = trio.Event()  # a tools-changed notification arrived (older protocol versions)
        self._watch: trio.CancelScope | None = None  # cancelled when a call sees the connection close
        self._scope: trio.CancelScope | None = None
        self._ended = trio.Event()
        self._closing = False

    # --- the supervisor

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect, list, watch; after a failure wait until a request needs the server, then start again."""
        try:
            with trio.CancelScope() as self._scope:
                task_status.started()
                while not self._closing:
                    await self._serve_once()
                    await self._wanted.wait()
                    self._wanted = trio.Event()
        finally:
            self.state, self.tools, self._client = "stopped", [], None
            self._settled.set()
            self._ended.set()

    async def aclose(self) -> None:
        """Stop the supervisor and wait for it (callers shield this; the SDK's own shutdown is bounded)."""
        self._closing = True
        if self._scope is not None:
            self._scope.cancel()
            await self._ended.wait()

    async def _serve_once(self) -> None:
        await _import_sdk()
        from mcp.client.subscriptions import SubscriptionLost

        self.starts += 1
        errlog = tempfile.TemporaryFile("w+") if self.transport == "stdio" else None  # noqa: SIM115 - closed below
        reason = "the server closed the session"
        was_ready = False
        try:
            # A deadline for connecting and listing only: cleared once ready. (A `fail_after` block could not
            # be left while the session's task group, opened inside it, lives on.)
            with trio.CancelScope(deadline=trio.current_time() + self.settings.connect_timeout) as connecting:
                async with contextlib.AsyncExitStack() as stack:
                    client = await stack.enter_async_context(self._new_client(stack, errlog))
                    await self._list(client)
                    connecting.deadline = math.inf
                    self._client, self.state, self.error = client, "ready", None
                    was_ready = True
                    self._settled.set()
                    self._log(f"mcp: {self.name}: ready, {len(self.tools)} tools"
                              + (f" ({len(self.skipped)} skipped)" if self.skipped else ""))
                    await self._watch_session(client)
            if connecting.cancelled_caught:
                reason = f"did not start within {self.settings.connect_timeout:g} s"
        except SubscriptionLost:
            reason = "the connection was lost" + (" (the process ended)" if self.transport == "stdio" else "")
        except Exception as error:  # noqa: BLE001 - whatever a server does, it fails alone
            reason = _describe(error)
        finally:
            self._client = None
            if errlog is not None:
                if not was_ready:  # why it could not start, in its own words
                    reason += _stderr_tail(errlog)
                errlog.close()
        if self._closing:
            return
        self.state, self.error, self.tools = "failed", reason, []
        self._settled.set()
        self._log(f"mcp: {self.name}: failed: {reason}")

    def _new_client(self, stack: contextlib.AsyncExitStack, errlog: IO[str] | None) -> Client:
        import mcp_types
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client

        from strata.mcp_tools.transports import bounded_http_client, stdio_transport

        config, settings = self.config, self.settings
        options: dict[str, Any] = {"cache": None, "message_handler": self._on_message,
                                   "client_info": mcp_types.Implementation(name="strata", version=strata.__version__)}
        if config.command is not None:
            assert errlog is not None
            return Client(stdio_transport(config, settings, errlog), **options)
        assert config.url is not None
        http = bounded_http_client(config, settings)
        stack.push_async_callback(http.aclose)
        # Our transport holds an event to the limit (or puts a short answer in its place); the SDK's own bound
        # must not come first.
        return Client(streamable_http_client(config.url, http_client=http,
                                             max_sse_event_size=2 * settings.max_result_bytes + 4096), **options)

    async def _watch_session(self, client: Client) -> None:
        """Until the session ends: list the tools again whenever the server says they changed."""
        from mcp.client.subscriptions import ListenNotSupportedError
        from mcp.shared.exceptions import MCPError

        with trio.CancelScope() as self._watch:
            try:
                async with client.listen(tools_list_changed=True) as subscription:
                    async for _ in subscription:
                        await self._list(client)
            except (ListenNotSupportedError, MCPError):
                # Older protocol versions notify without a subscription (`_on_message`); a lost connection then
                # shows at the next call.
                while True:
                    await self._relist.wait()
                    self._relist = trio.Event()
                    await self._list(client)

    async def _list(self, client: Client) -> None:
        """List the tools (each page bounded by the transport, see `strata.mcp_tools.answers`) and check them in
        a worker thread: a tool's schema check takes about a millisecond.

        Raises:
            ListingRefused: the pages have more than `mcp.max_tools` tools in all.
        """
        listing: list[mcp_types.Tool] = []
        cursor: str | None = None
        for _ in range(_MAX_PAGES):
            page = await client.list_tools(cursor=cursor)
            listing += page.tools
            if len(listing) > self.settings.max_tools:
                raise ListingRefused(f"the tool listing has more than {self.settings.max_tools} tools "
                                     "(mcp.max_tools)")
            cursor = page.next_cursor
            if not cursor:
                break
        self.tools, self.skipped = await trio.to_thread.run_sync(usable_tools, listing, limiter=_CHECKS)
        for name, why in self.skipped:
            self._log(f"mcp: {self.name}: tool {name[:80]!r} skipped: {why}")

    async def _on_message(self, message: Any) -> None:
        import mcp_types

        if isinstance(message, mcp_types.ToolListChangedNotification):
            self._relist.set()
        await trio.lowlevel.checkpoint()

    # --- for requests

    async def client(self) -> Client:
        """The connected session, starting a failed server again and waiting for it (bounded).

        Raises:
            McpUnavailable: the server is not ready within the connect timeout, or failed.
        """
        if self.state == "failed":
            self.state, self._settled = "starting", trio.Event()
            self._wanted.set()
        with trio.move_on_after(self.settings.connect_timeout + 1.0):
            await self._settled.wait()
        if self.state == "ready" and self._client is not None:
            return self._client
        why = self.error or ("it is stopped" if self.state == "stopped" else "it is still starting")
        raise McpUnavailable(f"the MCP server {self.name!r} is not available: {why}")

    async def call(self, tool: str, arguments: str, *, timeout: float, pictures: bool) -> ToolOutput:
        """Call `tool` with the model's arguments (JSON text) in the calling task; every failure is an error
        result the model can read.

        Args:
            timeout: seconds the call may take; then it is cancelled (the server is told) and reported.
            pictures: whether the result's pictures can reach the model (see `tool_output`).
        """
        import mcp_types
        from mcp.shared.exceptions import MCPError

        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except ValueError as error:
            return ToolOutput.error(f"the arguments are not valid JSON: {error}")
        if not isinstance(parsed, dict):
            return ToolOutput.error("the arguments must be a JSON object")
        try:
            client = await self.client()
        except McpUnavailable as error:
            return ToolOutput.error(str(error))
        with trio.move_on_after(timeout):
            try:
                result = await client.call_tool(tool, parsed)
            except MCPError as error:
                if error.code == mcp_types.CONNECTION_CLOSED:
                    self._connection_lost()
                    return ToolOutput.error(f"the MCP server {self.name!r} closed the connection during the call")
                return ToolOutput.error(f"the MCP server {self.name!r} refused the call: {error.message}")
            except Exception as error:  # noqa: BLE001 - a tool server's failure is a result the model reads
                return ToolOutput.error(f"the call to the MCP server {self.name!r} failed: {_describe(error)}")
            return tool_output(result, f"the result of {self.name}.{tool}", pictures)
        return ToolOutput.error(f"the tool {tool!r} did not answer within {timeout:g} s")

    def _connection_lost(self) -> None:
        if self._watch is not None:
            self._watch.cancel()

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "transport": self.transport,
            "state": self.state,
            "error": self.error,
            "starts": self.starts,
            "tools": [tool.listing() for tool in self.tools],
            "skipped": [{"name": name, "reason": why} for name, why in self.skipped],
        }


class McpServers:
    """The configured MCP servers (config `mcp_servers`), supervised in the service's nursery."""

    def __init__(self, servers: dict[str, McpServerConfig], settings: McpConfig,
                 log: Callable[[str], None] = print, policy: DownloadPolicy | None = None):
        self.settings = settings
        self.log = log
        self.policy = policy or DownloadPolicy()  # where servers named by URL in requests may be
        self.servers = {name: McpServer(name, config, settings, log) for name, config in servers.items()}

    async def start(self, nursery: trio.Nursery) -> None:
        """Start every supervisor; they connect in the background, so a slow server delays no one."""
        for server in self.servers.values():
            await nursery.start(server.run)

    def status(self) -> list[dict[str, Any]]:
        return [server.status() for server in self.servers.values()]


async def _import_sdk() -> None:
    """Import the SDK in a worker thread (imports are serialised by Python's import lock): seconds of module
    loading would otherwise stall the event loop."""
    if "mcp.client.streamable_http" not in sys.modules:
        await trio.to_thread.run_sync(_import_modules)


def _import_modules() -> None:
    for name in ("mcp_types", "mcp", "mcp.client.stdio", "mcp.client.streamable_http", "mcp.client.subscriptions",
                 "jsonschema.validators", "httpx2", "strata.mcp_tools.transports"):
        importlib.import_module(name)


def _describe(error: BaseException) -> str:
    """A failure in words: the first leaf of an exception group, the message of an MCP error."""
    from mcp.shared.exceptions import MCPError

    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    if isinstance(error, MCPError):
        return error.message
    if isinstance(error, ListingRefused):
        return str(error)
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _stderr_tail(errlog: IO[str]) -> str:
    try:
        errlog.seek(0)
        tail = " ".join(errlog.read()[-_STDERR_TAIL:].split())
    except (OSError, ValueError):
        return ""
    return f" (stderr: {tail})" if tail else ""
