"""The MCP tools one request offers the model: resolved from the request's MCP servers (configured ones by name,
others by URL when the config allows), named as the model calls them, and called on the model's behalf."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import trio

from strata.config import MCP_SERVER_NAME, McpServerConfig
from strata.events import McpToolList, McpUse
from strata.mcp_tools.servers import McpServer, McpServers, McpUnavailable
from strata.mcp_tools.tools import McpTool, ToolOutput
from strata.pictures.downloads import DownloadPolicy

_CLOSE_TIMEOUT = 5.0  # seconds to close the MCP servers a request opened


class McpRequestError(ValueError):
    """A request's MCP servers cannot be used as asked (a 400); `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class _Offered:
    label: str  # the server as the request named it
    server: McpServer
    tool: McpTool


@dataclass
class Toolset:
    """The request's MCP tools by the name the model calls them.

    Attributes:
        listings: one `McpToolList` per server the client has no listing of yet (the dialects show them).
    """

    servers: McpServers
    tools: dict[str, _Offered] = field(default_factory=dict)
    listings: list[McpToolList] = field(default_factory=list)
    _own: list[McpServer] = field(default_factory=list)  # servers opened for this request alone

    def functions(self) -> list[dict]:
        """The tools in the OpenAI chat shape, for the prompt."""
        return [offered.tool.function() for offered in self.tools.values()]

    def server_of(self, name: str) -> str | None:
        """The label of the MCP server that runs tool `name`; None for the client's own tools."""
        offered = self.tools.get(name)
        return offered.label if offered is not None else None

    async def call(self, name: str, arguments: str, *, pictures: bool) -> ToolOutput:
        """Run a call the model made, in the calling task (the request's)."""
        offered = self.tools[name]
        timeout = offered.server.config.timeout or self.servers.settings.call_timeout
        return await offered.server.call(offered.tool.name, arguments, timeout=timeout, pictures=pictures)

    async def aclose(self) -> None:
        """Close the servers this request opened (cleanup that must finish: shielded, and bounded, so that a
        remote that does not answer the session's closing request holds no one for long)."""
        with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_TIMEOUT):
            for server in self._own:
                await server.aclose()


async def open_toolset(uses: Iterable[McpUse], servers: McpServers, client_tools: set[str],
                       nursery: trio.Nursery) -> Toolset:
    """Resolve a request's MCP servers to the tools it offers.

    A configured server that is down offers no tools (its listing says why); the request goes on. Servers
    named by URL are opened in `nursery` (the service's) for this request and closed by `Toolset.aclose`.

    Raises:
        McpRequestError: more servers than `mcp.max_servers`, a label that is not a server name, an unknown
            server, a URL the config does not allow, or two tools with one name.
    """
    uses = _checked(list(uses), servers.settings.max_servers)
    toolset = Toolset(servers)
    try:
        for use in uses:
            server = await _server_for(use, servers, toolset, nursery)
            try:
                await server.client()
            except McpUnavailable as error:
                servers.log(f"mcp: {use.label}: offered no tools: {error}")
                toolset.listings.append(McpToolList(use.label, (), str(error)))
                continue
            offered = [tool for tool in server.tools if use.allows(tool.name)]
            for tool in offered:
                clash = ("a tool of the MCP server " + repr(toolset.tools[tool.name].label)
                         if tool.name in toolset.tools else "one of the request's own tools"
                         if tool.name in client_tools else None)
                if clash is not None:
                    raise McpRequestError(f"the MCP server's tool {tool.name!r} has the same name as {clash}; "
                                          "leave one out with allowed_tools", use.param)
                toolset.tools[tool.name] = _Offered(use.label, server, tool)
            if not use.listed:
                toolset.listings.append(McpToolList(use.label, tuple(tool.listing() for tool in offered)))
    except BaseException:
        await toolset.aclose()
        raise
    return toolset


def _checked(uses: list[McpUse], max_servers: int) -> list[McpUse]:
    """The request's servers, refused before any is opened when there are more than `max_servers` (each is a
    session, a process or a connection) or when a label is not a server name (labels go to the log)."""
    if len(uses) > max_servers:
        raise McpRequestError(f"a request may name at most {max_servers} MCP servers (the config's "
                              "mcp.max_servers)", uses[max_servers].param)
    for use in uses:
        if not MCP_SERVER_NAME.fullmatch(use.label):
            raise McpRequestError("an MCP server's name must be 1 to 64 letters, digits, '_' or '-'",
                                  _label_field(use))
    return uses


def _label_field(use: McpUse) -> str:
    """The field that holds a server's label: Anthropic's `mcp_servers[i].name`, Responses' `tools[i].server_label`."""
    return f"{use.param}.{'name' if use.param.startswith('mcp_servers') else 'server_label'}"


async def _server_for(use: McpUse, servers: McpServers, toolset: Toolset, nursery: trio.Nursery) -> McpServer:
    configured = servers.servers.get(use.label)
    if configured is not None and use.url in (None, configured.config.url):
        return configured
    if use.url is None:
        known = ", ".join(sorted(servers.servers)) or "none"
        raise McpRequestError(f"no MCP server named {use.label!r} is configured (configured: {known})", use.param)
    if configured is not None:
        raise McpRequestError(f"{use.label!r} names a configured MCP server, at another URL", use.param)
    settings = servers.settings
    if not settings.request_urls:
        raise McpRequestError("this server connects only to its configured MCP servers (the config's "
                              "mcp.request_urls is off)", use.param)
    await check_request_url(use.url, servers.policy, use.param)
    server = McpServer(use.label, McpServerConfig(url=use.url, headers=dict(use.headers) or None), settings,
                       servers.log)
    toolset._own.append(server)
    await nursery.start(server.run)
    return server


async def check_request_url(url: str, policy: DownloadPolicy, param: str) -> None:
    """Refuse a URL from a request unless it is http(s) and every address its host resolves to is one picture
    downloads may reach (`images.allow_private`, `images.allow_hosts`). The refusal is the same whatever is
    listening there. (Checked before connecting; the SDK follows redirects only within the URL's origin.)

    Raises:
        McpRequestError: naming `param`.
    """
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise McpRequestError("must be an http:// or https:// URL", param)
    host = parts.hostname
    if policy.allows_host(host):
        return
    try:
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
        infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        raise McpRequestError(f"the host {host!r} cannot be resolved", param) from None
    for info in infos:
        if not policy.allows_address(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])):
            raise McpRequestError(f"the host {host!r} is not a public address (the images.allow_hosts and "
                                  "images.allow_private config keys)", param)
