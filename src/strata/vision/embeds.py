"""Pre-computed picture embeddings a client sends instead of a picture: a content part
``{"type": "image_embeds", "image_embeds": "<base64 SVE1>", "fingerprint": "sha256:..."}`` made on the client by
``strata-vision encode IMAGE --mmproj F --out X.sve``. Every check names what does not match."""

from __future__ import annotations

import dataclasses

from strata.pictures.cache import content_hash
from strata.pictures.sources import ImageRejected
from strata.vision.client import Embedding
from strata.vision.protocol import (
    SVE_MAX_HEADER_BYTES,
    ProtocolError,
    Ready,
    parse_sve,
    parse_sve_header,
)


@dataclasses.dataclass(frozen=True)
class PrecomputedEmbeds:
    """The SVE1 bytes and encoder fingerprint of an `image_embeds` part; `param` names the request field."""

    param: str
    data: bytes
    fingerprint: str
    in_tool_result: bool = False


def check_embeds(embeds: PrecomputedEmbeds, ready: Ready, max_bytes: int) -> Embedding:
    """The rows of `embeds` once they are known to fit this server's encoder.

    Checks, in order: size, magic and shape (the SVE1 header), width, the exact length, finiteness, the
    token count against the encoder's `max_tokens`, and the fingerprint.

    Raises:
        ImageRejected: the first check that fails, named.
    """
    data = embeds.data
    if len(data) > max_bytes:
        raise ImageRejected(f"image_embeds: {len(data)} bytes, more than the limit of {max_bytes}")
    try:
        header = parse_sve_header(data[:SVE_MAX_HEADER_BYTES])
    except ProtocolError as error:
        raise ImageRejected(f"image_embeds: {error}") from None
    if header.n_embd != ready.n_embd:
        raise ImageRejected(f"image_embeds: rows are {header.n_embd} wide; this server's encoder writes "
                            f"{ready.n_embd}")
    try:
        _, rows = parse_sve(data)
    except ProtocolError as error:
        raise ImageRejected(f"image_embeds: {error}") from None
    caps = ready.capabilities
    if header.n_tokens > caps.max_tokens:
        raise ImageRejected(f"image_embeds: {header.n_tokens} tokens, more than this server's max_tokens "
                            f"{caps.max_tokens}")
    if embeds.fingerprint != caps.fingerprint:
        raise ImageRejected(f"image_embeds: fingerprint {embeds.fingerprint[:80]!r} is not this server's encoder "
                            f"({caps.fingerprint}); encode with the same mmproj file")
    return Embedding(rows, header.nx, header.ny, "embeds:" + content_hash(data),
                     tiles=(header.cols, header.rows, header.tile))
