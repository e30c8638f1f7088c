"""A request's pictures staged and encoded without a service: found and counted, checked against the context
before any encode, omitted or refused when unusable, the encoder's absence and a shutdown as `PicturesUnavailable`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest
import trio
from vision.conftest import noise_png

from strata.pictures.sources import ImageSource
from strata.pictures.staging import (
    Downloads,
    PicturesRefused,
    PictureStaging,
    PicturesUnavailable,
    picture_places,
)
from strata.vision.client import Embedding, PictureRefused, VisionUnavailable

pytestmark = pytest.mark.timeout(30)

WIDTH = 8
PICTURE = noise_png(32, 24, seed=3)


class Exclusive:
    def __init__(self) -> None:
        self.holds = 0

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        self.holds += 1
        yield


class Vision:
    """An encoder that makes `rows` rows of `width` per picture, or raises `error`."""

    def __init__(self, rows: int = 4, width: int = WIDTH, error: Exception | None = None):
        self.last_ready: Any = "READY"
        self.n_rows, self.width, self.error = rows, width, error
        self.encoded: list[tuple[bytes, Any, int | None]] = []

    def grid(self, ready: Any, info: Any) -> None:
        return None

    def rows(self, ready: Any, info: Any) -> int:
        return self.n_rows

    async def encode(self, data: bytes, turn: Any = None, rows: int | None = None) -> Embedding:
        self.encoded.append((data, turn, rows))
        if self.error is not None:
            raise self.error
        return Embedding(np.zeros((self.n_rows, self.width), np.float32), self.n_rows, 1, "digest")


def picture(param: str, in_tool_result: bool = False) -> dict[str, Any]:
    return {"type": "image", "image": ImageSource(param, data=PICTURE, in_tool_result=in_tool_result)}


def staging(vision: Vision, n_ctx: int = 100, exclusive: Exclusive | None = None, text: int = 10) -> PictureStaging:
    """Staging for a request whose text takes `text` prompt tokens."""
    async def text_tokens(messages: list[dict[str, Any]]) -> int:
        return text

    return PictureStaging(vision, Downloads(trio.Event()), exclusive or Exclusive(), n_ctx,
                          WIDTH, lambda marker: [], text_tokens)


MESSAGES = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "what is this?"}, picture("messages[1].content[1]")]},
            {"role": "tool", "content": [picture("messages[2].content[0]", in_tool_result=True)]}]


def test_picture_places_in_prompt_order_under_the_limit():
    assert picture_places(MESSAGES, 2, has_encoder=True) == [(1, 1), (2, 0)]
    assert picture_places(MESSAGES[:1], 0, has_encoder=False) == []
    with pytest.raises(PicturesRefused, match=r"messages\[2\].content\[0\]: the request has 2 pictures; at most 1") \
            as caught:
        picture_places(MESSAGES, 1, has_encoder=True)
    assert caught.value.param == "messages[2].content[0]"
    with pytest.raises(PicturesRefused, match="needs an image encoder") as caught:
        picture_places(MESSAGES, 2, has_encoder=False)
    assert caught.value.param == "messages[1].content[1]"


async def test_pictures_are_encoded_in_order_with_the_engine_exclusive():
    vision, exclusive = Vision(), Exclusive()
    messages, pictures = await staging(vision, exclusive=exclusive).encode(MESSAGES, [(1, 1), (2, 0)])
    assert len(pictures) == 2 and messages == MESSAGES
    assert vision.encoded == [(PICTURE, exclusive, 4), (PICTURE, exclusive, 4)]


async def test_pictures_that_cannot_fit_the_context_cost_no_encode():
    vision = Vision(rows=50)
    with pytest.raises(PicturesRefused, match="take 100 prompt tokens; the context holds 100") as caught:
        await staging(vision).encode(MESSAGES, [(1, 1), (2, 0)])
    assert caught.value.code == "context_length_exceeded" and vision.encoded == []


async def test_text_and_pictures_that_cannot_fit_together_cost_no_encode():
    vision = Vision(rows=40)
    with pytest.raises(PicturesRefused, match=r"has 100 tokens \(20 of text, 80 of pictures\); the context holds "
                                              "100") as caught:
        await staging(vision, text=20).encode(MESSAGES, [(1, 1), (2, 0)])
    assert caught.value.code == "context_length_exceeded" and vision.encoded == []
    _, pictures = await staging(vision, text=19).encode(MESSAGES, [(1, 1), (2, 0)])
    assert len(pictures) == 2


async def test_the_text_is_counted_with_the_pictures_omitted_while_staging():
    counted = []

    async def text_tokens(messages: list[dict[str, Any]]) -> int:
        counted.append([part["type"] for part in messages[2]["content"]])
        return 1

    vision = Vision()
    broken = [*MESSAGES[:2], {"role": "tool", "content": [{"type": "image", "image": ImageSource(
        "messages[2].content[0]", data=b"not a picture", in_tool_result=True)}]}]
    staged = PictureStaging(vision, Downloads(trio.Event()), Exclusive(), 100, WIDTH, lambda marker: [], text_tokens)
    _, pictures = await staged.encode(broken, [(1, 1), (2, 0)])
    assert counted == [["text"]] and len(pictures) == 1


async def test_a_tools_picture_is_omitted_and_the_users_refused():
    vision = Vision(error=PictureRefused("image: cannot read it"))
    messages, pictures = await staging(vision).encode(MESSAGES, [(2, 0)])
    assert pictures == [] and messages[2]["content"] == [{"type": "text",
                                                          "text": "[image omitted: image: cannot read it]"}]
    assert MESSAGES[2]["content"][0]["type"] == "image"  # the request's own messages are left as they were
    with pytest.raises(PicturesRefused, match=r"messages\[1\].content\[1\]: image: cannot read it") as caught:
        await staging(vision).encode(MESSAGES, [(1, 1), (2, 0)])
    assert caught.value.param == "messages[1].content[1]"


@pytest.mark.parametrize("vision", [Vision(error=VisionUnavailable("connection refused")), Vision(width=WIDTH + 1)])
async def test_an_encoder_that_is_not_available_names_itself(vision):
    # a tool's picture too: the encoder's state is the server's, not the picture's
    with pytest.raises(PicturesUnavailable, match="the image encoder is not available: "):
        await staging(vision).encode(MESSAGES, [(2, 0)])


async def test_a_shutdown_stops_the_downloads_in_flight():
    async def never_answers(request: httpx.Request) -> httpx.Response:
        await trio.sleep_forever()
        raise AssertionError

    stopping = trio.Event()

    async def shut_down_soon() -> None:
        await trio.sleep(0.05)
        stopping.set()

    async with httpx.AsyncClient(transport=httpx.MockTransport(never_answers)) as client:
        downloads = Downloads(stopping, client)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(downloads.stop_at_shutdown)
            nursery.start_soon(shut_down_soon)
            with trio.fail_after(5), pytest.raises(PicturesUnavailable, match="the server is shutting down"):
                await downloads.load(ImageSource("p", url="http://example.com/a.png"))
        # and a download that starts once shutdown has begun is stopped at once
        with trio.fail_after(1), pytest.raises(PicturesUnavailable, match="shutting down"):
            await downloads.load(ImageSource("p", url="http://example.com/b.png"))
