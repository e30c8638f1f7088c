"""Pictures in requests: where their bytes come from (data: URLs, base64, http(s) downloads) and the checks every
picture passes before it reaches the encoder.

Downloads run in the calling task, so they belong to the request's nursery: a client that hangs up cancels them
at once. Every failure is an `ImageRejected` whose message names what is wrong with the picture or its URL.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import re
import warnings
from urllib.parse import unquote_to_bytes

import httpx
import trio
from PIL import Image

from strata.pictures.downloads import DownloadRefused

MAX_IMAGE_BYTES = 20 * 1024 * 1024  # one picture, downloaded or inline
MAX_PIXELS = 50_000_000  # the encoder's own bound: a larger header is a decompression bomb
DOWNLOAD_TIMEOUT = 30.0  # seconds for one URL, connecting and reading together

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
