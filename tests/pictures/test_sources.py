"""Picture sources and checks: data: URLs, base64, http(s) downloads from a local server (limits, timeouts, content
checks, cancellation mid-download), decompression bombs, and the LRU cache of encoded pictures."""

from __future__ import annotations

import base64
import io
import time

import httpx
import numpy as np
import pytest
import trio
from PIL import Image
from vision.conftest import noise_png

from strata.pictures.rows import PictureRows
from strata.pictures.sources import (
    EmbeddingCache,
    ImageRejected,
    ImageSource,
    check_image,
    download,
    embeds_from,
    expand_image_pads,
    load_source,
    marker_tokens,
    parse_data_url,
)
from strata.vision.protocol import PictureGrid

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


# --- the cache


class Rows:
    def __init__(self, nbytes: int):
        self.nbytes = nbytes


def test_cache_is_lru_bounded_by_bytes():
    cache = EmbeddingCache(max_bytes=100)
    a, b, c = Rows(40), Rows(40), Rows(40)
    cache.put("a", a)
    cache.put("b", b)
    assert cache.get("a") is a  # a is now the most recently used
    cache.put("c", c)  # 120 bytes: the least recently used (b) goes
    assert cache.get("b") is None and cache.get("a") is a and cache.get("c") is c
    assert (cache.hits, cache.misses) == (3, 1)
    cache.put("huge", Rows(101))
    assert cache.get("huge") is None and len(cache) == 2


def test_cache_keeps_real_rows():
    cache = EmbeddingCache(max_bytes=1 << 20)
    rows = np.zeros((10, 8), np.float32)
    cache.put("x", rows)
    assert cache.get("x") is rows


# --- pictures in the prompt


class Picture:
    def __init__(self, digest: str, n_tokens: int, grid: PictureGrid | None = None):
        self.digest, self.n_tokens = digest, n_tokens
        self.grid = grid or PictureGrid(n_tokens, 1)
        self.nx = self.grid.nx
        self.rows = np.arange(n_tokens * 2, dtype=np.float32).reshape(n_tokens, 2) + hash(digest) % 7


def test_expand_image_pads_places_each_picture():
    pad = 9
    a, b = Picture("a", 3), Picture("b", 2)
    prompt = expand_image_pads([1, 8, pad, 7, 2, 8, pad, 7, 3], pad, [a, b])
    assert prompt.ids == [1, 8, pad, pad, pad, 7, 2, 8, pad, pad, 7, 3]
    assert prompt.keys[2:5] == [("a", 0), ("a", 1), ("a", 2)] and prompt.keys[8:10] == [("b", 0), ("b", 1)]
    assert [first for first, _ in prompt.spans] == [2, 8]
    assert prompt.spans[0][1].rows is a.rows and prompt.spans[0][1].nx == a.nx  # the grid goes with the rows


def test_a_tiled_picture_gets_its_parts_markers():
    pad, markers = 9, {"<|img_row_1_col_1|>": [51], "<|img_row_1_col_2|>": [52], "<|img_thumbnail|>": [60, 61]}
    grid = PictureGrid(2, 1, cols=2, rows=1, tile=1)  # two one-token tiles, then a 2x1 thumbnail
    tiled = Picture("t", 4, grid)
    prompt = expand_image_pads([1, pad, 2], pad, [tiled], markers.__getitem__)
    assert prompt.ids == [1, 51, pad, 52, pad, 60, 61, pad, pad, 2]
    assert prompt.keys == [1, 51, ("t", 0), 52, ("t", 1), 60, 61, ("t", 2), ("t", 3), 2]
    assert [first for first, _ in prompt.spans] == [2, 4, 7]
    assert [rows.nx for _, rows in prompt.spans] == [1, 1, 2]  # each part its own grid
    assert np.array_equal(np.concatenate([rows.rows for _, rows in prompt.spans]), tiled.rows)
    assert marker_tokens(grid, markers.__getitem__) == 4
    # a picture in one piece has no markers
    assert expand_image_pads([1, pad, 2], pad, [Picture("a", 2)], markers.__getitem__).ids == [1, pad, pad, 2]


def test_two_pictures_with_the_same_pads_have_different_keys():
    pad = 9
    one = expand_image_pads([1, pad, 2], pad, [Picture("a", 2)])
    other = expand_image_pads([1, pad, 2], pad, [Picture("b", 2)])
    assert one.ids == other.ids and one.keys != other.keys


def test_pad_count_must_match_the_pictures():
    with pytest.raises(ImageRejected, match="1 image placeholders for 2 pictures"):
        expand_image_pads([1, 9, 2], 9, [Picture("a", 1), Picture("b", 1)])


def test_embeds_window():
    rows = np.arange(10, dtype=np.float32).reshape(5, 2)
    spans = [(3, rows)]
    (index, part), = embeds_from(spans, 5, 20)  # the first two rows are already in the cache
    assert index == 0 and np.array_equal(part, rows[2:])
    (index, part), = embeds_from(spans, 0, 20)
    assert index == 3 and part is not None and np.array_equal(part, rows)
    assert embeds_from(spans, 8, 20) == []


def test_a_picture_cut_between_calls_keeps_its_grid():
    rows = PictureRows(np.arange(12, dtype=np.float32).reshape(6, 2), nx=3)  # a 3 x 2 grid
    (index, part), = embeds_from([(3, rows)], 5, 20)  # the first two rows are already in the cache
    assert index == 0 and np.array_equal(part, rows.rows[2:])
    assert part.grid().tolist() == [[0, 2], [1, 0], [1, 1], [1, 2]]
    with pytest.raises(ValueError, match="grid of width 0"):
        PictureRows(rows.rows, nx=0)
