"""The Host header check: a server on loopback answers only to loopback names.

A web page can make a browser send requests to 127.0.0.1 under a name it controls (DNS rebinding): the browser
then treats the answers as the page's own. Such requests carry the attacker's name in `Host`, so a server
listening on loopback refuses any other name; `allowed_hosts` in the config sets the list explicitly.
"""

from __future__ import annotations

import ipaddress

from quart import Quart, request

from strata.api.errors import ApiError
from strata.config import Config

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def allowed_hosts(config: Config) -> frozenset[str] | None:
    """The host names to accept (lower case, no port), or None for any."""
    if config.allowed_hosts is not None:
        return frozenset(name.lower().strip("[]") for name in config.allowed_hosts)
    binds = [part.strip().strip("[]").lower() for part in config.host.split(",")]  # "127.0.0.1,::1" binds both
    if all(_is_loopback(bind) for bind in binds):
        return frozenset((*LOOPBACK_NAMES, *binds))
    return None


def host_name(header: str) -> str:
    """`Host` without its port: "127.0.0.1:8080" -> "127.0.0.1", "[::1]:8080" -> "::1"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def add_host_check(app: Quart, config: Config) -> None:
    names = allowed_hosts(config)
    if names is None:
        return

    @app.before_request
    async def check_host() -> None:
        if request.path == "/health":
            return
        given = host_name(request.headers.get("host", ""))
        if given not in names:
            raise ApiError(403, f"this server does not answer to the host name {given[:100]!r} (the "
                           "allowed_hosts config key)", kind="permission_error")


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
