"""A request's pictures on their way to the prompt: found in its messages, downloaded and checked, sized from
their headers, then encoded in prompt order, all in the request's task (cancelling it stops every step).

Invariants:
- Every picture is checked and sized (from its header, or its pre-computed rows) before any is encoded, and the
  request's text is counted with them: a request whose text and pictures cannot fit the context together costs no
  encoder time.
- A request cancelled while its picture is queued for the encoder drops the job; one cancelled while its picture
  is encoded sends `CANCEL` (both kept by `VisionClient.encode`, which runs in the calling task).
- A picture that cannot be used is refused with its field named, unless a tool returned it: then it becomes the
  text `[image omitted: <why>]`. An encoder that is not available fails the request with `PicturesUnavailable`,
  naming the encoder and its reason, never with an internal error.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import trio

from strata.activity import RequestProgress
from strata.pictures.expand import marker_tokens
from strata.pictures.sources import (
    DOWNLOAD_TIMEOUT,
    MAX_IMAGE_BYTES,
    ImageInfo,
    ImageRejected,
    ImageSource,
    load_source,
)
from strata.vision.client import Embedding, PictureRefused, VisionClient, VisionUnavailable
from strata.vision.embeds import PrecomputedEmbeds, check_embeds
from strata.vision.pool import VisionPool
from strata.vision.protocol import Ready

_UNUSABLE = (ImageRejected, PictureRefused, VisionUnavailable)  # what one picture's staging or encoding may raise


class PicturesRefused(ValueError):
    """The request's pictures cannot be served: `param` names the field at fault when there is one, `code` the
    error's code (`context_length_exceeded`)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class PicturesUnavailable(Exception):
    """Something the pictures need is not there now: the image encoder (down, crashed or hung), or the server
    (shutting down while a picture downloads). Trying again later may work."""


class ExclusiveEngine(Protocol):
    """The engine taken whole: `hold()` keeps the engine thread between two steps for the block, so that an
    encoder sharing its GPU runs alone."""

    def hold(self) -> AbstractAsyncContextManager[None]: ...


class Downloads:
    """The service's image downloads: its HTTP client (None: image URLs are refused) and the downloads in flight,
    which a shutdown stops (`stop_at_shutdown`).

    Args:
        stopping: set when the server starts shutting down.
    """

    def __init__(self, stopping: trio.Event, client: httpx.AsyncClient | None = None):
        self.client = client
        self._stopping = stopping
        self._in_flight: set[trio.CancelScope] = set()

    async def load(self, image: ImageSource) -> tuple[bytes, ImageInfo]:
        """The picture's checked bytes; a shutdown that begins meanwhile stops the download with
        `PicturesUnavailable` (the request has not answered yet: it gets a status rather than a dropped
        connection).

        Raises:
            ImageRejected: the picture or its URL cannot be used.
            PicturesUnavailable: the server is shutting down.
        """
        with trio.CancelScope() as scope:
            self._in_flight.add(scope)
            try:
                if self._stopping.is_set():
                    scope.cancel()
                return await load_source(image, self.client, MAX_IMAGE_BYTES, DOWNLOAD_TIMEOUT)
            finally:
                self._in_flight.discard(scope)
        raise PicturesUnavailable("the server is shutting down")

    async def stop_at_shutdown(self) -> None:
        """In the service's nursery: when shutdown begins, stop the downloads in flight (see `load`)."""
        await self._stopping.wait()
        for scope in list(self._in_flight):
            scope.cancel()


def picture_places(messages: list[dict[str, Any]], max_pictures: int, has_encoder: bool) -> list[tuple[int, int]]:
    """Where the request's pictures are: (message, part) indices in prompt order, checked against the limit
    before any picture is downloaded or encoded.

    Raises:
        PicturesRefused: more than `max_pictures` pictures, or pictures and no image encoder.
    """
    places = [(i, j) for i, message in enumerate(messages) if isinstance(message.get("content"), list)
              for j, part in enumerate(message["content"]) if part.get("type") == "image"]
    if len(places) > max_pictures:
        i, j = places[max_pictures]
        param = messages[i]["content"][j]["image"].param
        raise PicturesRefused(f"{param}: the request has {len(places)} pictures; at most {max_pictures} are allowed "
                              "(the limits.max_pictures config key)", param)
    if places and not has_encoder:
        param = messages[places[0][0]]["content"][places[0][1]]["image"].param
        raise PicturesRefused(f"{param}: image input needs an image encoder, and this server has none (the "
                              "vision.mmproj key)", param)
    return places


@dataclass(frozen=True)
class _Staged:
    """A request's picture checked and sized, not encoded yet: its bytes and the rows they will take (predicted
    from the header), or its pre-computed rows."""

    rows: int
    data: bytes = b""
    embedding: Embedding | None = None
    markers: int = 0  # prompt positions of its parts' markers (a picture split into tiles)


def _omit_or_refuse(content: list[dict[str, Any]], j: int, error: Exception) -> None:
    """A picture that cannot be used: one a tool returned becomes the text `[image omitted: <why>]`; the user's
    own refuses the request, and an encoder that is not available fails it (`PicturesUnavailable`)."""
    image = content[j]["image"]
    if isinstance(error, VisionUnavailable):
        raise PicturesUnavailable(str(error)) from None
    if not image.in_tool_result:
        raise PicturesRefused(f"{image.param}: {error}", image.param) from None
    content[j] = {"type": "text", "text": f"[image omitted: {error}]"}


@dataclass(frozen=True)
class PictureStaging:
    """What encoding a request's pictures takes.

    Attributes:
        vision: the image encoder.
        downloads: the service's image downloads.
        exclusive: the engine taken whole, held around an encode when the encoder shares the engine's GPU.
        n_ctx: the engine's context (the pictures' rows must leave room in it).
        picture_width: the width of the rows the engine takes.
        marker_ids: the ids of a tiled picture's part marker.
        text_tokens: the prompt tokens the request's text takes with these messages (rendered and tokenised: the
            service's prepare step), each picture's placeholder not counted.
    """

    vision: VisionClient | VisionPool
    downloads: Downloads
    exclusive: ExclusiveEngine
    n_ctx: int
    picture_width: int
    marker_ids: Callable[[str], list[int]]
    text_tokens: Callable[[list[dict[str, Any]]], Awaitable[int]]

    async def encode(self, messages: list[dict[str, Any]], places: list[tuple[int, int]],
                     live: RequestProgress | None = None) -> tuple[list[dict[str, Any]], list[Embedding]]:
        """Encode the pictures at `places` (from `picture_places`), in prompt order, in the calling task.

        Returns:
            The messages with every picture that was omitted replaced by its text, and the pictures encoded.

        Raises:
            PicturesRefused: a user's picture cannot be used, or the text and pictures cannot fit the context.
            PicturesUnavailable: the encoder is not available, or the server is shutting down.
        """
        messages = [dict(message, content=list(message["content"])) if isinstance(message.get("content"), list)
                    else message for message in messages]
        staged = await self._stage_all(messages, places, live)
        n_rows = sum(picture.rows + picture.markers for _, _, picture in staged)
        if n_rows >= self.n_ctx:
            raise PicturesRefused(f"the request's pictures take {n_rows} prompt tokens; the context holds "
                                  f"{self.n_ctx} (prompt and answer)", code="context_length_exceeded")
        n_text = await self.text_tokens(messages)
        if n_text + n_rows >= self.n_ctx:
            raise PicturesRefused(f"the prompt has {n_text + n_rows} tokens ({n_text} of text, {n_rows} of "
                                  f"pictures); the context holds {self.n_ctx} (prompt and answer)",
                                  code="context_length_exceeded")
        pictures = []
        for i, j, picture in staged:
            try:
                pictures.append(await self._encode(picture, live))
            except _UNUSABLE as error:
                _omit_or_refuse(messages[i]["content"], j, error)
        return messages, pictures

    async def _stage_all(self, messages: list[dict[str, Any]], places: list[tuple[int, int]],
                         live: RequestProgress | None) -> list[tuple[int, int, _Staged]]:
        staged: list[tuple[int, int, _Staged]] = []
        for i, j in places:
            try:
                staged.append((i, j, await self._stage(messages[i]["content"][j]["image"], live)))
            except _UNUSABLE as error:
                _omit_or_refuse(messages[i]["content"], j, error)
        return staged

    async def _stage(self, image: ImageSource | PrecomputedEmbeds, live: RequestProgress | None) -> _Staged:
        """A picture's checked bytes and the rows the encoder will make of them, or its pre-computed rows."""
        if isinstance(image, PrecomputedEmbeds):
            embedding = check_embeds(image, await self._ready(), MAX_IMAGE_BYTES)
            return _Staged(embedding.n_tokens, embedding=embedding,
                           markers=marker_tokens(embedding.grid, self.marker_ids))
        if live is not None:
            live.phase = "download"
        data, info = await self.downloads.load(image)  # first: a bad picture is refused whatever the encoder's state
        ready = await self._ready()
        grid = self.vision.grid(ready, info)
        markers = 0 if grid is None else marker_tokens(grid, self.marker_ids)
        return _Staged(self.vision.rows(ready, info), data=data, markers=markers)

    async def _ready(self) -> Ready:
        """The encoder's READY (its last one, else it is started for it)."""
        return self.vision.last_ready or (await self.vision.session()).ready_reply()

    async def _encode(self, picture: _Staged, live: RequestProgress | None) -> Embedding:
        embedding = picture.embedding
        if embedding is None:
            if live is not None:
                live.phase = "encoding"
            # The deadline is this picture's own: its predicted rows times vision.encode_timeout_per_row.
            embedding = await self.vision.encode(picture.data, self.exclusive, picture.rows)
        if embedding.rows.shape[1] != self.picture_width:
            raise VisionUnavailable(f"its rows are {embedding.rows.shape[1]} wide and the model's embeddings "
                                    f"{self.picture_width} (an mmproj made for another model?)")
        return embedding
