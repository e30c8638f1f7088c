"""Picture sources and checks: data: URLs, base64, http(s) downloads from a local server (limits, timeouts, content
checks, cancellation mid-download), decompression bombs."""

from __future__ import annotations

import base64
import io
import time

import httpx
import pytest
import trio
from PIL import Image
from vision.conftest import noise_png

from strata.pictures.sources import (
    ImageRejected,
    ImageSource,
    check_image,
    download,
    load_source,
    parse_data_url,
)

pytestmark = pytest.mark.timeout(30)

PICTURE = noise_png(40, 24, seed=1)


def test_data_url_base64_and_percent_forms():
    encoded = base64.b64encode(PICTURE).decode()
    assert parse_data_url(f"data:image/png;base64,{encoded}") == PICTURE
    assert parse_data_url("data:image/png;base64," + "\n".join([encoded[:10], encoded[10:]])) == PICTURE
    assert parse_data_url("data:,%89PNG") == b"\x89PNG"


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64,@@@", "not valid base64"),
    ("data:text/plain;base64,aGVsbG8=", "text/plain, not an image"),
    ("data:image/png;base64", "malformed"),
])
def test_bad_data_urls(url, message):
    with pytest.raises(ImageRejected, match=message):
        parse_data_url(url)


def test_check_image_reads_the_header_only():
    info = check_image(PICTURE)
    assert (info.format, info.width, info.height) == ("PNG", 40, 24)


def test_non_images_and_empty_data_are_refused():
    with pytest.raises(ImageRejected, match="not a picture"):
        check_image(b"<html>hello</html>")
    with pytest.raises(ImageRejected, match="empty"):
        check_image(b"")
    with pytest.raises(ImageRejected, match="more than the limit"):
        check_image(PICTURE, max_bytes=len(PICTURE) - 1)


def test_decompression_bomb_is_refused():
    buffer = io.BytesIO()
    Image.new("1", (9000, 6000)).save(buffer, format="PNG")  # 54 million pixels in a few kilobytes
    assert len(buffer.getvalue()) < 100_000
    with pytest.raises(ImageRejected, match="decompression bomb"):
        check_image(buffer.getvalue())


# --- downloads from a local HTTP server


class PictureServer:
    """A minimal HTTP/1.1 server on 127.0.0.1: each path answers in its own way; `open_connections` counts the
    connections still open (a cancelled download must close its own)."""

    def __init__(self):
        self.port = 0
        self.open_connections = 0

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.SocketStream) -> None:
        self.open_connections += 1
        try:
            request = b""
            while b"\r\n\r\n" not in request:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    return
                request += chunk
            path = request.split(b" ")[1].decode()
            await getattr(self, "_" + path.strip("/"), self._missing)(stream)
        except trio.BrokenResourceError:
            pass
        finally:
            self.open_connections -= 1
            await stream.aclose()

    @staticmethod
    async def _reply(stream, body: bytes, content_type: str = "image/png", status: str = "200 OK",
                     length: int | None = None) -> None:
        head = (f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\n"
                f"content-length: {len(body) if length is None else length}\r\nconnection: close\r\n\r\n")
        await stream.send_all(head.encode() + body)

    async def _picture(self, stream):
        await self._reply(stream, PICTURE)

    async def _html(self, stream):
        await self._reply(stream, b"<html></html>", "text/html")

    async def _notapicture(self, stream):
        await self._reply(stream, b"plain bytes", "application/octet-stream")

    async def _missing(self, stream):
        await self._reply(stream, b"no", "text/plain", "404 Not Found")

    async def _declaredbig(self, stream):
        await self._reply(stream, PICTURE[:10], length=10**9)

    async def _slow(self, stream):
        """Headers at once, then one byte every 50 ms, for ever."""
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: image/png\r\nconnection: close\r\n\r\n")
        while True:
            await stream.send_all(b"x")
            await trio.sleep(0.05)


@pytest.fixture
async def pictures(nursery):
    server = PictureServer()
    await nursery.start(server.serve)
    return server


@pytest.fixture
async def http():
    async with httpx.AsyncClient() as client:
        yield client


async def test_download_and_check(pictures, http):
    url = f"http://127.0.0.1:{pictures.port}/picture"
    assert (await load_source(ImageSource("p", url=url), http))[0] == PICTURE


@pytest.mark.parametrize("path, message", [
    ("missing", "answered HTTP 404"),
    ("html", "text/html, not an image"),
    ("notapicture", "not a picture"),
    ("declaredbig", "1000000000 bytes, more than the limit"),
])
async def test_download_failures_name_the_problem(pictures, http, path, message):
    url = f"http://127.0.0.1:{pictures.port}/{path}"
    with pytest.raises(ImageRejected, match=message):
        await load_source(ImageSource("p", url=url), http)


async def test_streamed_size_limit(pictures, http):
    with pytest.raises(ImageRejected, match="more than the limit of 8 bytes"):
        await download(f"http://127.0.0.1:{pictures.port}/slow", http, max_bytes=8, timeout=20)


async def test_download_timeout(pictures, http):
    started = time.perf_counter()
    with pytest.raises(ImageRejected, match="did not download within 0.3 s"):
        await download(f"http://127.0.0.1:{pictures.port}/slow", http, timeout=0.3)
    assert time.perf_counter() - started < 1.0


async def test_unreachable_host_and_bad_scheme(http):
    with pytest.raises(ImageRejected, match="could not be downloaded"):
        await load_source(ImageSource("p", url="http://127.0.0.1:1/x.png"), http)
    with pytest.raises(ImageRejected, match="unsupported image URL scheme 'file'"):
        await load_source(ImageSource("p", url="file:///etc/passwd"), http)


async def test_cancelled_download_stops_at_once(pictures, http):
    url = f"http://127.0.0.1:{pictures.port}/slow"
    with trio.move_on_after(0.3) as scope:
        await download(url, http, timeout=20)
    assert scope.cancelled_caught
    assert trio.current_time() - scope.deadline < 0.05
    with trio.fail_after(2):
        while pictures.open_connections:
            await trio.sleep(0.01)
