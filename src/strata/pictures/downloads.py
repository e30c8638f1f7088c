"""Where image downloads may go: the server fetches URLs its clients name, so by default it reaches only public
addresses (no loopback, private, link-local or otherwise non-global ones), checked when each connection is made.

The check lives in the HTTP client's network backend, below redirects and DNS: every hop of a redirect chain
connects through it, and the address checked is the address connected to (a name that resolves to a public
address when checked and a private one later cannot slip through). A refused address raises `DownloadRefused`
before any packet is sent, so the answer is the same whether a port there is open or closed.

Config (`images` section): `downloads: false` switches URL downloads off; `allow_private: true` lifts the address
check; `allow_hosts` lists host names (matched exactly, case-insensitively) or addresses and networks
("10.0.0.0/8") that may be reached although they are not public.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpcore
import httpx
import trio

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class DownloadRefused(Exception):
    """The URL's host is not one this server downloads from (the message says why, the same for every port)."""


@dataclass(frozen=True)
class DownloadPolicy:
    allow_private: bool = False
    hosts: frozenset[str] = frozenset()
    networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def from_config(cls, allow_private: bool, allow_hosts: Iterable[str] | None) -> DownloadPolicy:
        hosts, networks = set(), []
        for entry in allow_hosts or ():
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                hosts.add(entry.lower().rstrip("."))
        return cls(allow_private, frozenset(hosts), tuple(networks))

    def allows_host(self, host: str) -> bool:
        """Whether `host` may be reached whatever it resolves to."""
        return self.allow_private or host.lower().rstrip(".") in self.hosts

    def allows_address(self, address: IPAddress) -> bool:
        if address.version == 6 and address.ipv4_mapped is not None:  # ::ffff:127.0.0.1 is 127.0.0.1
            address = address.ipv4_mapped
        if any(address in network for network in self.networks):
            return True
        return address.is_global and not address.is_multicast


def refusal(host: str) -> str:
    return (f"downloads from {host} are refused: it is not a public address (the images.allow_hosts and "
            "images.allow_private config keys)")


class _CheckedBackend(httpcore.AsyncNetworkBackend):
    """trio's backend, connecting only to addresses the policy allows."""

    def __init__(self, policy: DownloadPolicy):
        self._policy = policy
        self._inner = httpcore.TrioBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        if self._policy.allows_host(host):
            return await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        try:
            with trio.fail_after(timeout) if timeout else trio.CancelScope():
                found = await trio.socket.getaddrinfo(host, port, type=trio.socket.SOCK_STREAM)
        except OSError as failed:
            raise httpcore.ConnectError(f"cannot resolve {host}: {failed.strerror or failed}") from None
        except trio.TooSlowError:
            raise httpcore.ConnectTimeout(f"resolving {host} timed out") from None
        addresses = [str(info[4][0]).split("%", 1)[0] for info in found]
        allowed = [a for a in dict.fromkeys(addresses) if self._policy.allows_address(ipaddress.ip_address(a))]
        if not allowed:
            raise DownloadRefused(refusal(host))
        for address in allowed[:-1]:
            with contextlib.suppress(httpcore.ConnectError, httpcore.ConnectTimeout):
                return await self._inner.connect_tcp(address, port, timeout, local_address, socket_options)
        return await self._inner.connect_tcp(allowed[-1], port, timeout, local_address, socket_options)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        raise DownloadRefused("downloads over unix sockets are refused")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class _CheckedTransport(httpx.AsyncHTTPTransport):
    def __init__(self, policy: DownloadPolicy):
        super().__init__(trust_env=False)
        # httpx takes no network backend: the pool it built is replaced by the same pool over the checked one.
        self._pool = httpcore.AsyncConnectionPool(ssl_context=httpx.create_ssl_context(),
                                                  network_backend=_CheckedBackend(policy))


def download_client(policy: DownloadPolicy, timeout: float) -> httpx.AsyncClient:
    """An HTTP client for image downloads that connects only where `policy` allows (no proxies from the
    environment either: a proxy would make the connection on our behalf, out of sight of the check)."""
    return httpx.AsyncClient(timeout=timeout, transport=_CheckedTransport(policy), trust_env=False)
