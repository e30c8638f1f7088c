"""Pictures in requests: where their bytes come from (data: URLs, base64, http(s) downloads), the checks every
picture passes before it reaches the encoder, and the cache of encoded pictures.

Downloads run in the calling task, so they belong to the request's nursery: a client that hangs up cancels them
at once. Every failure is an `ImageRejected` whose message names what is wrong with the picture or its URL.
"""

from __future__ import annotations

import base64
import binascii
import collections
import dataclasses
import hashlib
import io
import re
import warnings
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote_to_bytes

import httpx
import trio
from PIL import Image

from strata.pictures.downloads import DownloadRefused
from strata.pictures.rows import PictureRows

MAX_IMAGE_BYTES = 20 * 1024 * 1024  # one picture, downloaded or inline
MAX_PIXELS = 50_000_000  # the encoder's own bound: a larger header is a decompression bomb
DOWNLOAD_TIMEOUT = 30.0  # seconds for one URL, connecting and reading together
CACHE_BYTES = 256 * 1024 * 1024  # encoded rows kept by the cache

_ORIENTATION = 0x0112  # the EXIF tag; values 5-8 turn the picture a quarter, swapping its sides
_QUARTER_TURNS = (5, 6, 7, 8)
_DATA_URL_RE = re.compile(r"data:([\w.+-]+/[\w.+-]+)?((?:;[\w.+-]+=[\w.+-]+)*)(;base64)?,", re.ASCII)


class ImageRejected(ValueError):
    """A picture that cannot be used: its source, its bytes, or its size. The message says which."""


@dataclasses.dataclass(frozen=True)
class ImageSource:
    """Where a request's picture comes from: exactly one of `url` (http, https or data) and `data` (bytes).

    Attributes:
        param: the request field it came from (for error messages), e.g. "messages[1].content[0]".
        in_tool_result: the picture is part of a tool's result, not the user's own.
    """

    param: str
    url: str | None = None
    data: bytes | None = None
    in_tool_result: bool = False

    def describe(self) -> str:
        if self.url is None or self.url.startswith("data:"):
            return "the inline picture"
        return self.url if len(self.url) <= 200 else self.url[:197] + "..."


@dataclasses.dataclass(frozen=True)
class ImageInfo:
    format: str
    width: int  # upright: the sides as the encoder sees them, after its EXIF orientation
    height: int


def decode_base64(text: str, what: str = "the picture") -> bytes:
    """Strict base64 (whitespace allowed), or ImageRejected."""
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ImageRejected(f"{what} is not valid base64") from None


def parse_data_url(url: str, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """The bytes of a `data:` URL (base64 or percent-encoded)."""
    match = _DATA_URL_RE.match(url)
    if match is None:
        raise ImageRejected("the data: URL is malformed (expected data:<type>;base64,<data>)")
    media_type = (match.group(1) or "").lower()
    if media_type and not (media_type.startswith("image/") or media_type == "application/octet-stream"):
        raise ImageRejected(f"the data: URL holds {media_type}, not an image")
    payload = url[match.end():]
    if len(payload) > max_bytes * 4 // 3 + 4:
        raise ImageRejected(f"the picture is larger than {max_bytes} bytes")
    if match.group(3):
        data = decode_base64(payload, "the data: URL")
    else:
        data = unquote_to_bytes(payload)
    return data


def check_image(data: bytes, max_bytes: int = MAX_IMAGE_BYTES, max_pixels: int = MAX_PIXELS) -> ImageInfo:
    """Check that `data` is a picture Pillow reads, of a sane size, from its header alone (nothing is decoded).

    Raises:
        ImageRejected: empty, too large, not an image, or more pixels than `max_pixels` (a decompression bomb).
    """
    if not data:
        raise ImageRejected("the picture is empty")
    if len(data) > max_bytes:
        raise ImageRejected(f"the picture is {len(data)} bytes, more than the limit of {max_bytes}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                # Only EXIF read with the header: a PNG's late eXIf chunk would need a decode to find.
                if "exif" in image.info and image.getexif().get(_ORIENTATION) in _QUARTER_TURNS:
                    width, height = height, width
                info = ImageInfo(image.format or "unknown", width, height)
    except Image.DecompressionBombError:
        raise ImageRejected("the picture has too many pixels (a decompression bomb?)") from None
    except Exception:  # noqa: BLE001 - Pillow raises many kinds for data it cannot identify
        raise ImageRejected("the data is not a picture in a format this server reads") from None
    if info.width * info.height > max_pixels:
        raise ImageRejected(f"the picture is {info.width}x{info.height}, more than {max_pixels} pixels "
                            "(a decompression bomb?)")
    return info


async def download(url: str, client: httpx.AsyncClient, max_bytes: int = MAX_IMAGE_BYTES,
                   timeout: float = DOWNLOAD_TIMEOUT) -> bytes:
    """Fetch an http(s) URL in the calling task (cancellable), with a total timeout and a size limit.

    Raises:
        ImageRejected: the URL cannot be fetched, answers with an error or a non-image type, or is too large.
    """
    shown = url if len(url) <= 200 else url[:197] + "..."
    try:
        with trio.fail_after(timeout):
            async with client.stream("GET", url, follow_redirects=True) as response:
                if response.status_code != 200:
                    raise ImageRejected(f"{shown} answered HTTP {response.status_code}")
                _check_content_type(response.headers.get("content-type", ""), shown)
                declared = response.headers.get("content-length")
                if declared and declared.isdigit() and int(declared) > max_bytes:
                    raise ImageRejected(f"{shown} is {declared} bytes, more than the limit of {max_bytes}")
                chunks, size = [], 0
                # Stopped by a cancel scope rather than `break`: the Cancelled raised inside httpx's nested body
                # generators runs each of them to its end, where a break would leave them half-run for the GC.
                with trio.CancelScope() as stop:
                    async for chunk in response.aiter_bytes():
                        size += len(chunk)
                        if size > max_bytes:
                            stop.cancel()
                            continue
                        chunks.append(chunk)
                if size > max_bytes:
                    raise ImageRejected(f"{shown} is more than the limit of {max_bytes} bytes")
    except DownloadRefused as error:
        raise ImageRejected(f"{shown}: {error}") from None
    except trio.TooSlowError:
        raise ImageRejected(f"{shown} did not download within {timeout:g} s") from None
    except httpx.InvalidURL as error:
        raise ImageRejected(f"{shown} is not a valid URL: {error}") from None
    except httpx.HTTPError as error:
        raise ImageRejected(f"{shown} could not be downloaded: {error or type(error).__name__}") from None
    return b"".join(chunks)


def _check_content_type(content_type: str, shown: str) -> None:
    media_type = content_type.split(";", 1)[0].strip().lower()
    # An absent or generic type is allowed: the bytes are checked anyway.
    if media_type and not (media_type.startswith("image/") or media_type in ("application/octet-stream",
                                                                            "binary/octet-stream")):
        raise ImageRejected(f"{shown} is {media_type}, not an image")


async def load_source(source: ImageSource, client: httpx.AsyncClient | None, max_bytes: int = MAX_IMAGE_BYTES,
                      timeout: float = DOWNLOAD_TIMEOUT) -> tuple[bytes, ImageInfo]:
    """The checked bytes of a picture and what its header says, downloading it when it is an http(s) URL."""
    if source.data is not None:
        data = source.data
    elif source.url is not None and source.url.startswith("data:"):
        data = parse_data_url(source.url, max_bytes)
    elif source.url is not None and re.match(r"https?://", source.url, re.IGNORECASE):
        if client is None:
            raise ImageRejected("this server does not download image URLs (the images.downloads config key): send "
                                "the picture inline, as a data: URL or base64")
        data = await download(source.url, client, max_bytes, timeout)
    else:
        scheme = (source.url or "").split(":", 1)[0][:20]
        raise ImageRejected(f"unsupported image URL scheme {scheme!r} (http, https or data)")
    return data, check_image(data, max_bytes)


def content_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class EmbeddingCache:
    """Encoded pictures by content hash, least recently used dropped first, bounded by the bytes of their rows.

    Attributes:
        hits, misses: lookups that found / did not find their picture.
    """

    def __init__(self, max_bytes: int = CACHE_BYTES):
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self._items: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, digest: str) -> Any | None:
        item = self._items.get(digest)
        if item is None:
            self.misses += 1
            return None
        self._items.move_to_end(digest)
        self.hits += 1
        return item

    def put(self, digest: str, item: Any) -> None:
        """Keep `item` (it has `.nbytes`); an item larger than the whole cache is not kept."""
        if digest in self._items:
            self._bytes -= self._items.pop(digest).nbytes
        if item.nbytes > self.max_bytes:
            return
        self._items[digest] = item
        self._bytes += item.nbytes
        while self._bytes > self.max_bytes:
            _, dropped = self._items.popitem(last=False)
            self._bytes -= dropped.nbytes

    def clear(self) -> None:
        self._items.clear()
        self._bytes = 0


# --- pictures in the prompt


@dataclasses.dataclass(frozen=True)
class PromptImages:
    """A prompt with its pictures in place.

    Attributes:
        ids: token ids; each picture's positions hold the pad token (the engine replaces their embeddings).
        keys: one per position, what the KV cache holds there: the token id, or (picture digest, row) for a
            picture's row, so prefix reuse tells two pictures apart although their ids are the same pads.
        spans: (first position, rows) of each picture, in order: `PictureRows`, which know their grid.
    """

    ids: list[int]
    keys: list[Any]
    spans: list[tuple[int, Any]]


def expand_image_pads(ids: list[int], pad_id: int, embeddings: list[Any],
                      marker_ids: Callable[[str], list[int]] | None = None) -> PromptImages:
    """Replace the i-th pad token of `ids` by `embeddings[i].n_tokens` pad positions; a picture split into tiles
    (its `grid`) gets the ids of each part's marker (`marker_ids`, e.g. LFM2-VL's `<|img_row_1_col_1|>`) before
    that part's rows, as its model was trained to read them.

    Raises:
        ImageRejected: the prompt holds a different number of pads than there are pictures (a chat template
            without vision markers, or a pad token typed into the text).
    """
    n_pads = ids.count(pad_id)
    if n_pads != len(embeddings):
        raise ImageRejected(f"the prompt has {n_pads} image placeholders for {len(embeddings)} pictures (the chat "
                            "template must render each picture as <|vision_start|><|image_pad|><|vision_end|>)")
    out_ids: list[int] = []
    keys: list[Any] = []
    spans: list[tuple[int, Any]] = []
    pictures = iter(embeddings)
    for token in ids:
        if token != pad_id:
            out_ids.append(token)
            keys.append(token)
            continue
        embedding = next(pictures)
        first = 0  # the picture's row that the next part starts at
        for marker, nx, ny in embedding.grid.segments():
            if marker and marker_ids is not None:
                marked = marker_ids(marker)
                out_ids.extend(marked)
                keys.extend(marked)
            # each part is a grid of its own (Qwen3-VL's positions read it; a tiled picture is LFM2-VL's)
            rows = embedding.rows if nx * ny == embedding.n_tokens else embedding.rows[first:first + nx * ny]
            spans.append((len(out_ids), PictureRows(rows, nx)))
            out_ids.extend([pad_id] * (nx * ny))
            keys.extend((embedding.digest, row) for row in range(first, first + nx * ny))
            first += nx * ny
    return PromptImages(out_ids, keys, spans)


def marker_tokens(grid: Any, marker_ids: Callable[[str], list[int]]) -> int:
    """The prompt positions a picture's part markers take (see `expand_image_pads`)."""
    return sum(len(marker_ids(marker)) for marker, _, _ in grid.segments() if marker)


def embeds_from(spans: list[tuple[int, Any]], start: int, end: int) -> list[tuple[int, Any]]:
    """The `Engine.eval` embeds for positions [start, end): each span cut to that window, indexed from `start`."""
    out = []
    for first, rows in spans:
        lo, hi = max(first, start), min(first + len(rows), end)
        if lo < hi:
            out.append((lo - start, rows[lo - first: hi - first]))
    return out
