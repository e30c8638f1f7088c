"""The line protocol between the server and a `strata-vision` encoder: pure code, no I/O.

Each message is one UTF-8 line ending in ``\\n``; two messages carry raw bytes after their line (an in-band job's
image, an in-band result's SVE1 data) whose length the line states. Words are separated by spaces; a word that
holds a space, a quote or a control character (a path, usually) is written as a JSON string literal.
docs/VISION.md has the grammar.

Client to encoder:  ``ENC <image> <out>``, ``JOB <id> <n_bytes>`` + bytes, ``CANCEL <id>``, ``QUIT``.
Encoder to client:  ``READY <n_embd> <json>``, ``OK <n_tokens> <nx> <ny> <ms>``,
                    ``RES <id> <n_tokens> <nx> <ny> <ms> <n_bytes>`` + bytes, ``CANCELLED <id>``,
                    ``ERR [<id>] <kind>: <detail>``.

Invariant: an ``ERR`` that answers an in-band job names the job's id; every other ``ERR`` starts with a word that
ends in ``:`` (its kind). Ids cannot contain ``:``, so the two never read alike.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
from typing import Any

import numpy as np

PROTOCOL_VERSION = 1
MAX_LINE_BYTES = 8192  # a line longer than this (newline included) is refused
MAX_IMAGE_BYTES = 64 * 1024 * 1024  # an in-band job's image
MAX_SVE_BYTES = 1 << 30  # an in-band result (the client's bound when it reads one)
MAX_MESSAGE_CHARS = 500
MAX_DIMENSION = 1 << 20  # bound on token counts, grid sides and widths read from a line or a header

SVE_MAGIC = 0x31455653  # b"SVE1" read as a little-endian int32
SVE_TILED_MAGIC = 0x32455653  # b"SVE2": SVE1's header plus the tiles of a tiled picture
_SVE_HEADER = struct.Struct("<5i")
_SVE_TILED_HEADER = struct.Struct("<8i")
SVE_HEADER_BYTES = _SVE_HEADER.size
SVE_MAX_HEADER_BYTES = _SVE_TILED_HEADER.size

_ID_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_UINT_RE = re.compile(r"[0-9]{1,12}")
_BARE_WORD_RE = re.compile(r'[^\s"\x00-\x1f\x7f]+')
_JSON = json.JSONDecoder()


class ProtocolError(ValueError):
    """A line, payload or file that does not follow the protocol.

    Attributes:
        job_id: the in-band job the bad line belonged to, when its id could be read, else None.
    """

    def __init__(self, message: str, job_id: str | None = None):
        super().__init__(message)
        self.job_id = job_id


# --- client to encoder


@dataclasses.dataclass(frozen=True)
class EncodePath:
    """``ENC <image> <out>``: encode the picture at `image`, write SVE1 to `out` (paths on the encoder's host)."""

    image: str
    out: str


@dataclasses.dataclass(frozen=True)
class EncodeBytes:
    """``JOB <id> <n_bytes>``, followed by the picture's `n_bytes` bytes."""

    job_id: str
    n_bytes: int


@dataclasses.dataclass(frozen=True)
class Cancel:
    """``CANCEL <id>``: drop the job if queued; if running, stop it at its next check (within one layer)."""

    job_id: str


@dataclasses.dataclass(frozen=True)
class Quit:
    """``QUIT``: answer the jobs already received, then exit."""


Request = EncodePath | EncodeBytes | Cancel | Quit


# --- encoder to client


@dataclasses.dataclass(frozen=True)
class Sizing:
    """How the encoder sizes a picture to rows (READY's optional `sizing`): `grid` names the rule ("token" or
    "smart", see `strata.vision.preprocess.picture_grid`), applied with merged tokens of `patch_size * merge`
    pixels a side and a budget of `min_tokens` to `max_tokens` rows. With `tile_size`, a picture too large for
    that budget is split into `min_tiles` to `max_tiles` square tiles of `tile_size` pixels, plus a thumbnail
    (LFM2-VL's image splitting); 0: never split."""

    grid: str
    patch_size: int
    merge: int
    min_tokens: int
    max_tokens: int
    tile_size: int = 0
    min_tiles: int = 0
    max_tiles: int = 0


SIZING_GRIDS = ("token", "smart")
_OPTIONAL_SIZING = ("tile_size", "min_tiles", "max_tiles")  # absent from an older encoder: 0


@dataclasses.dataclass(frozen=True)
class PictureGrid:
    """What a picture becomes: a grid of `nx` x `ny` merged tokens (rows in row-major order), preceded, for a
    picture split into tiles, by `cols` x `rows` tiles (in row-major order) of `tile` x `tile` tokens each; the
    grid is then the whole picture's thumbnail. This is the layout of LFM2-VL's image processor."""

    nx: int
    ny: int
    cols: int = 0
    rows: int = 0
    tile: int = 0

    @property
    def tiled(self) -> bool:
        return self.cols * self.rows > 0

    @property
    def n_tokens(self) -> int:
        """Embedding rows, tiles and thumbnail together."""
        return self.cols * self.rows * self.tile * self.tile + self.nx * self.ny

    def segments(self) -> list[tuple[str, int, int]]:
        """(marker, nx, ny) of each part in prompt order: the text the model reads before the part's rows ("" for
        none) and its grid. A tiled picture's tiles follow LFM2-VL's `<|img_row_R_col_C|>` (from 1), its thumbnail
        `<|img_thumbnail|>`."""
        if not self.tiled:
            return [("", self.nx, self.ny)]
        tiles = [(f"<|img_row_{r + 1}_col_{c + 1}|>", self.tile, self.tile)
                 for r in range(self.rows) for c in range(self.cols)]
        return [*tiles, ("<|img_thumbnail|>", self.nx, self.ny)]


# How a `strata-vision --gpu` that cannot run on the GPU ends its `ERR gpu:` startup line.
GPU_ADVICE = "leave out --gpu to encode on the CPU"


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """The JSON object on the READY line."""

    cuda: bool  # whether this process holds a CUDA context (an encode then competes for the GPU)
    threads: int
    max_tokens: int
    fingerprint: str  # equal fingerprints give equal embeddings for the same picture and max_tokens
    projector: str
    max_image_bytes: int = MAX_IMAGE_BYTES
    protocol: int = PROTOCOL_VERSION
    sizing: Sizing | None = None  # absent: the server counts every picture as max_tokens rows
    device_bytes: int | None = None  # a GPU encoder's device memory (weights and workspace); absent otherwise


@dataclasses.dataclass(frozen=True)
class Ready:
    """``READY <n_embd> <json>``: the encoder is loaded; its embeddings are `n_embd` wide."""

    n_embd: int
    capabilities: Capabilities


@dataclasses.dataclass(frozen=True)
class Encoded:
    """``OK <n_tokens> <nx> <ny> <ms>``: a path-form job is done and its SVE1 file written."""

    n_tokens: int
    nx: int
    ny: int
    ms: float


@dataclasses.dataclass(frozen=True)
class Result:
    """``RES <id> <n_tokens> <nx> <ny> <ms> <n_bytes>``, followed by `n_bytes` of SVE1 data."""

    job_id: str
    n_tokens: int
    nx: int
    ny: int
    ms: float
    n_bytes: int


@dataclasses.dataclass(frozen=True)
class Cancelled:
    """``CANCELLED <id>``: the job was dropped from the queue or stopped; it gets no other reply."""

    job_id: str


@dataclasses.dataclass(frozen=True)
class Failed:
    """``ERR [<id>] <kind>: <detail>``: a job failed (`job_id` set for in-band jobs) or a line was refused."""

    kind: str
    detail: str
    job_id: str | None = None

    @property
    def message(self) -> str:
        return f"{self.kind}: {self.detail}"


Reply = Ready | Encoded | Result | Cancelled | Failed


# --- words


def quote_word(text: str) -> str:
    """`text` as one protocol word: bare when it can be, else a JSON string literal."""
    if _BARE_WORD_RE.fullmatch(text):
        return text
    return json.dumps(text, ensure_ascii=False)


def split_words(text: str) -> list[str]:
    """Split a line's text into words; JSON string literals become the strings they denote.

    Raises:
        ProtocolError: a quoted word that is not a valid JSON string, or two words without a space between.
    """
    words: list[str] = []
    pos = 0
    while True:
        while pos < len(text) and text[pos] in " \t":
            pos += 1
        if pos == len(text):
            return words
        if text[pos] == '"':
            try:
                word, end = _JSON.raw_decode(text, pos)
            except json.JSONDecodeError as exc:
                raise ProtocolError(f"bad quoted word at column {pos + 1}: {exc.msg}") from None
        else:
            match = _BARE_WORD_RE.match(text, pos)
            if match is None:
                raise ProtocolError(f"control character at column {pos + 1}")
            word, end = match.group(), match.end()
        if end < len(text) and text[end] not in " \t":
            if text[end] < " " or text[end] == "\x7f":
                raise ProtocolError(f"control character at column {end + 1}")
            raise ProtocolError(f"no space after the word ending at column {end}")
        words.append(word)
        pos = end


def _line_text(line: bytes) -> str:
    if len(line) > MAX_LINE_BYTES:
        raise ProtocolError(f"line longer than {MAX_LINE_BYTES} bytes")
    if line.endswith(b"\n"):
        line = line[:-1]
    if line.endswith(b"\r"):
        line = line[:-1]
    if b"\n" in line:
        raise ProtocolError("more than one line")
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("line is not valid UTF-8") from None


def _line(*words: str) -> bytes:
    data = (" ".join(words) + "\n").encode("utf-8")
    if len(data) > MAX_LINE_BYTES:
        raise ProtocolError(f"line longer than {MAX_LINE_BYTES} bytes")
    return data


def _job_id(word: str) -> str:
    if not _ID_RE.fullmatch(word):
        raise ProtocolError(f"bad job id {word[:80]!r} (1-64 of A-Z a-z 0-9 _ . -)")
    return word


def _uint(word: str, what: str, limit: int) -> int:
    if not _UINT_RE.fullmatch(word) or int(word) > limit:
        raise ProtocolError(f"bad {what} {word[:80]!r} (an integer from 0 to {limit})")
    return int(word)


def _ms(word: str) -> float:
    try:
        value = float(word)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ProtocolError(f"bad milliseconds {word[:80]!r}")
    return value


def _arity(words: list[str], n: int, usage: str, job_id: str | None = None) -> None:
    if len(words) != n:
        raise ProtocolError(f"expected {usage!r}, got {len(words) - 1} argument(s)", job_id)


# --- requests


def encode_request(request: Request) -> bytes:
    """The line for `request` (an EncodeBytes line is followed by the image bytes, sent by the caller)."""
    match request:
        case EncodePath(image, out):
            return _line("ENC", quote_word(image), quote_word(out))
        case EncodeBytes(job_id, n_bytes):
            return _line("JOB", _job_id(job_id), str(n_bytes))
        case Cancel(job_id):
            return _line("CANCEL", _job_id(job_id))
        case Quit():
            return _line("QUIT")
    raise TypeError(f"not a request: {request!r}")


def parse_request(line: bytes, max_image_bytes: int = MAX_IMAGE_BYTES) -> Request:
    """Parse one client line.

    Raises:
        ProtocolError: the line is malformed; its `job_id` is set when the line named a readable job id (a JOB
            line whose byte count is out of range: the caller must still skip that many bytes to stay in step).
    """
    words = split_words(_line_text(line))
    if not words:
        raise ProtocolError("empty line")
    verb = words[0]
    if verb == "ENC":
        _arity(words, 3, "ENC <image> <out>")
        if not words[1] or not words[2]:
            raise ProtocolError("empty path")
        return EncodePath(words[1], words[2])
    if verb == "JOB":
        job_id = _job_id(words[1]) if len(words) > 1 else None
        _arity(words, 3, "JOB <id> <n_bytes>", job_id)
        assert job_id is not None  # three words: _arity passed
        return EncodeBytes(job_id, _uint_for_job(words[2], max_image_bytes, job_id))
    if verb == "CANCEL":
        _arity(words, 2, "CANCEL <id>")
        return Cancel(_job_id(words[1]))
    if verb == "QUIT":
        _arity(words, 1, "QUIT")
        return Quit()
    raise ProtocolError(f"unknown verb {verb[:40]!r} (ENC, JOB, CANCEL, QUIT)")


def _uint_for_job(word: str, limit: int, job_id: str) -> int:
    try:
        return _uint(word, "byte count", limit)
    except ProtocolError as exc:
        raise ProtocolError(str(exc), job_id) from None


def job_bytes_to_skip(line: bytes) -> int:
    """After a refused JOB line: how many payload bytes follow it (0 when its count cannot be read)."""
    try:
        words = split_words(_line_text(line))
    except ProtocolError:
        return 0
    if len(words) == 3 and words[0] == "JOB" and _UINT_RE.fullmatch(words[2]):
        return int(words[2])
    return 0


# --- replies


def encode_reply(reply: Reply) -> bytes:
    """The line for `reply` (a Result line is followed by the SVE1 bytes, sent by the caller)."""
    match reply:
        case Ready(n_embd, caps):
            fields = dataclasses.asdict(caps)
            for optional in ("sizing", "device_bytes"):
                if fields[optional] is None:
                    del fields[optional]
            text = json.dumps(fields, separators=(",", ":"), sort_keys=True)
            return _line("READY", str(n_embd), text)
        case Encoded(n_tokens, nx, ny, ms):
            return _line("OK", str(n_tokens), str(nx), str(ny), f"{ms:.1f}")
        case Result(job_id, n_tokens, nx, ny, ms, n_bytes):
            return _line("RES", _job_id(job_id), str(n_tokens), str(nx), str(ny), f"{ms:.1f}", str(n_bytes))
        case Cancelled(job_id):
            return _line("CANCELLED", _job_id(job_id))
        case Failed(kind, detail, job_id):
            head = ["ERR", _job_id(job_id)] if job_id is not None else ["ERR"]
            return _line(*head, f"{_kind(kind)}:", _one_line(detail))
    raise TypeError(f"not a reply: {reply!r}")


def _kind(kind: str) -> str:
    if not re.fullmatch(r"[a-z]{1,20}", kind):
        raise ValueError(f"bad error kind {kind!r}")
    return kind


def _one_line(text: str) -> str:
    """Collapse whitespace (newlines included) and bound the length, so a message is always one short line."""
    text = " ".join(text.split()) or "(no detail)"
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[: MAX_MESSAGE_CHARS - 3] + "..."
    return text


def parse_reply(line: bytes) -> Reply:
    """Parse one encoder line.

    Raises:
        ProtocolError: the line is malformed.
    """
    text = _line_text(line)
    verb, _, rest = text.partition(" ")
    if verb == "ERR":
        return _parse_failed(rest)
    if verb == "READY":
        return _parse_ready(rest)
    words = split_words(rest)
    if verb == "OK":
        _arity(["OK", *words], 5, "OK <n_tokens> <nx> <ny> <ms>")
        n_tokens, nx, ny = (_uint(w, "count", MAX_DIMENSION) for w in words[:3])
        return Encoded(n_tokens, nx, ny, _ms(words[3]))
    if verb == "RES":
        _arity(["RES", *words], 7, "RES <id> <n_tokens> <nx> <ny> <ms> <n_bytes>")
        n_tokens, nx, ny = (_uint(w, "count", MAX_DIMENSION) for w in words[1:4])
        return Result(_job_id(words[0]), n_tokens, nx, ny, _ms(words[4]), _uint(words[5], "byte count", MAX_SVE_BYTES))
    if verb == "CANCELLED":
        _arity(["CANCELLED", *words], 2, "CANCELLED <id>")
        return Cancelled(_job_id(words[0]))
    raise ProtocolError(f"unknown reply {verb[:40]!r}")


def _parse_failed(rest: str) -> Failed:
    first, _, tail = rest.partition(" ")
    job_id = None
    if not first.endswith(":"):
        job_id = _job_id(first)
        first, _, tail = tail.partition(" ")
    if not (first.endswith(":") and len(first) > 1):
        raise ProtocolError("ERR without a '<kind>:' word")
    return Failed(first[:-1], tail.strip(), job_id)


def _parse_ready(rest: str) -> Ready:
    n_embd_word, _, text = rest.partition(" ")
    n_embd = _uint(n_embd_word, "width", MAX_DIMENSION)
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProtocolError(f"READY capabilities are not JSON: {exc.msg}") from None
    if not isinstance(fields, dict):
        raise ProtocolError("READY capabilities are not a JSON object")
    return Ready(n_embd, _capabilities(fields))


_CAPABILITY_TYPES = {
    "cuda": bool,
    "threads": int,
    "max_tokens": int,
    "fingerprint": str,
    "projector": str,
    "max_image_bytes": int,
    "protocol": int,
}


def _capabilities(fields: dict) -> Capabilities:
    """Known fields are checked; unknown ones are ignored, so a newer encoder can add some."""
    values: dict[str, Any] = {}
    for name, kind in _CAPABILITY_TYPES.items():
        if name not in fields:
            raise ProtocolError(f"READY capabilities lack {name!r}")
        value = fields[name]
        if type(value) is not kind:
            raise ProtocolError(f"READY capability {name!r} is not a {kind.__name__}")
        values[name] = value
    device_bytes = fields.get("device_bytes")
    if device_bytes is not None and (type(device_bytes) is not int or device_bytes < 0):
        raise ProtocolError("READY capability 'device_bytes' is not a non-negative integer")
    return Capabilities(**values, sizing=_sizing(fields.get("sizing")), device_bytes=device_bytes)


def _sizing(fields: Any) -> Sizing | None:
    """READY's optional `sizing`: absent from an older encoder (None then); malformed is a protocol error."""
    if fields is None:
        return None
    if not isinstance(fields, dict):
        raise ProtocolError("READY capability 'sizing' is not a JSON object")
    values: dict[str, Any] = {}
    for field in dataclasses.fields(Sizing):
        optional = field.name in _OPTIONAL_SIZING
        value = fields.get(field.name, 0 if optional else None)
        if field.name == "grid":
            if value not in SIZING_GRIDS:
                raise ProtocolError(f"READY sizing 'grid' is not one of {', '.join(SIZING_GRIDS)}")
        elif type(value) is not int or not int(not optional) <= value <= MAX_DIMENSION:
            raise ProtocolError(f"READY sizing {field.name!r} is not an integer from {int(not optional)} to "
                                f"{MAX_DIMENSION}")
        values[field.name] = value
    return Sizing(**values)


# --- SVE1: the embeddings of one picture


@dataclasses.dataclass(frozen=True)
class SveHeader:
    n_tokens: int
    nx: int  # merged-token grid width; n_tokens = nx * ny, rows in row-major grid order
    ny: int
    n_embd: int
    # A tiled picture (SVE2): cols x rows tiles of tile x tile tokens come first, then the nx x ny thumbnail.
    cols: int = 0
    rows: int = 0
    tile: int = 0

    @property
    def grid(self) -> PictureGrid:
        return PictureGrid(self.nx, self.ny, self.cols, self.rows, self.tile)

    @property
    def size(self) -> int:
        """Bytes of the header: SVE1's, or SVE2's for a tiled picture."""
        return _SVE_TILED_HEADER.size if self.grid.tiled else _SVE_HEADER.size


def encode_sve(embeddings: np.ndarray, nx: int, ny: int, tiles: tuple[int, int, int] = (0, 0, 0)) -> bytes:
    """SVE1 bytes for `embeddings` (n_tokens, n_embd), n_tokens = nx * ny; for a tiled picture (`tiles` = cols,
    rows, tile side), SVE2 bytes, n_tokens = cols * rows * tile**2 + nx * ny."""
    n_tokens, n_embd = embeddings.shape
    grid = PictureGrid(nx, ny, *tiles)
    if n_tokens != grid.n_tokens:
        raise ValueError(f"{n_tokens} rows for a {nx}x{ny} grid" + (f" after {tiles} tiles" if grid.tiled else ""))
    if grid.tiled:
        header = _SVE_TILED_HEADER.pack(SVE_TILED_MAGIC, n_tokens, nx, ny, n_embd, *tiles)
    else:
        header = _SVE_HEADER.pack(SVE_MAGIC, n_tokens, nx, ny, n_embd)
    return header + np.ascontiguousarray(embeddings, dtype="<f4").tobytes()


def parse_sve_header(data: bytes) -> SveHeader:
    """The header of SVE1/SVE2 `data` (at least its first SVE_MAX_HEADER_BYTES bytes, or all of it if shorter).

    Raises:
        ProtocolError: wrong magic, or counts that are negative, too large or inconsistent.
    """
    magic = struct.unpack_from("<i", data)[0] if len(data) >= 4 else None
    layout = _SVE_TILED_HEADER if magic == SVE_TILED_MAGIC else _SVE_HEADER
    if len(data) < layout.size:
        raise ProtocolError(f"SVE1 data shorter than its {layout.size}-byte header")
    magic, n_tokens, nx, ny, n_embd, *tiles = layout.unpack_from(data)
    if magic not in (SVE_MAGIC, SVE_TILED_MAGIC):
        raise ProtocolError(f"not SVE1 data (magic {magic & 0xFFFFFFFF:#010x})")
    if not all(0 < v <= MAX_DIMENSION for v in (n_tokens, nx, ny, n_embd, *tiles)):
        raise ProtocolError(f"SVE1 header out of range: {n_tokens} tokens, {nx}x{ny} grid, width {n_embd}"
                            + (f", tiles {tiles}" if tiles else ""))
    header = SveHeader(n_tokens, nx, ny, n_embd, *tiles)
    if n_tokens != header.grid.n_tokens:
        raise ProtocolError(f"SVE1 header says {n_tokens} tokens for a {nx}x{ny} grid"
                            + (f" after {tiles[0]}x{tiles[1]} tiles of {tiles[2]}x{tiles[2]}" if tiles else ""))
    return header


def parse_sve(data: bytes) -> tuple[SveHeader, np.ndarray]:
    """Header and float32 rows (n_tokens, n_embd) of SVE1/SVE2 `data`, which must be exactly that long.

    Raises:
        ProtocolError: a bad header, a size that does not match it, or a value that is not finite.
    """
    header = parse_sve_header(data)
    expected = header.size + 4 * header.n_tokens * header.n_embd
    if len(data) != expected:
        raise ProtocolError(f"SVE1 data is {len(data)} bytes, its header needs {expected}")
    rows = np.frombuffer(data, dtype="<f4", offset=header.size).reshape(header.n_tokens, header.n_embd)
    if not np.isfinite(rows).all():
        raise ProtocolError("SVE1 data holds values that are not finite")
    return header, rows
