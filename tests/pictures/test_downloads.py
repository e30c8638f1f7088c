"""The download policy: image URLs reach public addresses only, checked at connect time for every redirect hop;
the tests' own picture servers on 127.0.0.1 are let in through the config, as users would let in theirs."""

from __future__ import annotations

import ipaddress

import pytest
import trio

from strata.pictures.downloads import DownloadPolicy, download_client
from strata.pictures.sources import ImageRejected, ImageSource, load_source

from .test_sources import PICTURE, PictureServer


class RedirectingServer(PictureServer):
    """Answers /to/<port>/<path> with a redirect to that path on http://127.0.0.1:<port>."""

    def __init__(self, target: str):
        super().__init__()
        self.target = target

    async def _redirect(self, stream):
        head = f"HTTP/1.1 302 Found\r\nlocation: {self.target}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
        await stream.send_all(head.encode())


@pytest.fixture
async def pictures(nursery):
    server = PictureServer()
    await nursery.start(server.serve)
    return server


async def fetch(url: str, policy: DownloadPolicy) -> bytes:
    async with download_client(policy, timeout=10) as client:
        data, _ = await load_source(ImageSource("p", url=url), client)
        return data


def closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed again when the socket is


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "2130706433", "0.0.0.0", "[::ffff:127.0.0.1]"])
async def test_loopback_is_refused_by_default(pictures, host):
    with pytest.raises(ImageRejected, match="not a public address") as caught:
        await fetch(f"http://{host}:{pictures.port}/picture", DownloadPolicy())
    assert "images.allow_hosts" in str(caught.value)


async def test_the_same_answer_for_an_open_and_a_closed_port(pictures):
    """No port scanner: the address is refused before anything is sent to it."""
    answers = []
    for port in (pictures.port, closed_port()):
        with pytest.raises(ImageRejected) as caught:
            await fetch(f"http://127.0.0.1:{port}/picture", DownloadPolicy())
        answers.append(str(caught.value).replace(str(port), "PORT"))
    assert answers[0] == answers[1]
    assert pictures.open_connections == 0


async def test_redirects_to_internal_addresses_are_refused(nursery, pictures):
    redirector = RedirectingServer(f"http://127.0.0.1:{pictures.port}/picture")
    await nursery.start(redirector.serve)
    # The first hop (by name) is allowed; the redirect's target, an address, is not.
    policy = DownloadPolicy.from_config(False, ["localhost"])
    with pytest.raises(ImageRejected, match="downloads from 127.0.0.1 are refused"):
        await fetch(f"http://localhost:{redirector.port}/redirect", policy)
    allowed = DownloadPolicy.from_config(False, ["localhost", "127.0.0.0/8"])
    assert await fetch(f"http://localhost:{redirector.port}/redirect", allowed) == PICTURE


async def test_allow_hosts_and_allow_private(pictures):
    url = f"http://127.0.0.1:{pictures.port}/picture"
    assert await fetch(url, DownloadPolicy.from_config(False, ["127.0.0.1"])) == PICTURE
    assert await fetch(url, DownloadPolicy.from_config(True, None)) == PICTURE
    with pytest.raises(ImageRejected, match="not a public address"):
        await fetch(url, DownloadPolicy.from_config(False, ["10.0.0.0/8", "example.com"]))


@pytest.mark.parametrize(("address", "allowed"), [
    ("8.8.8.8", True), ("2606:4700::1111", True), ("10.1.2.3", False), ("172.16.0.1", False),
    ("192.168.1.1", False), ("169.254.169.254", False), ("100.64.0.1", False), ("fe80::1", False),
    ("fc00::1", False), ("::1", False), ("::ffff:10.0.0.1", False), ("224.0.0.1", False), ("0.0.0.0", False),
])
def test_which_addresses_are_public(address, allowed):
    assert DownloadPolicy().allows_address(ipaddress.ip_address(address)) is allowed


async def test_service_refuses_internal_urls_and_switches_downloads_off(pictures, scripted, tokenizer):
    from conftest import server_config

    from strata.request_errors import RequestError
    from strata.service import open_service

    url = f"http://127.0.0.1:{pictures.port}/picture"
    for images, message in (({}, "not a public address"), ({"downloads": False}, "images.downloads")):
        config = server_config(vision={"exe": ["false"], "remote": True, "lazy_load": True}, images=images)
        async with open_service(config, engine=scripted(), tokenizer=tokenizer, log=lambda line: None) as service:
            part = {"type": "image", "image": ImageSource("messages[0].content[0]", url=url)}
            with pytest.raises(RequestError, match=message):
                await service.count_tokens(_request(part))
    assert pictures.open_connections == 0
    await trio.lowlevel.checkpoint()


def _request(part):
    from strata.events import ChatRequest

    return ChatRequest(messages=[{"role": "user", "content": [part]}])
