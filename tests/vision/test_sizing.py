"""A picture's rows predicted from its header (the server's side) equal the rows the encoder's own resize makes of
it (the worker's side), for each variant's sizing rule, EXIF orientations included."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
from PIL import Image

from strata.pictures.sources import check_image
from strata.vision.client import VisionClient
from strata.vision.mmproj import VisionHParams
from strata.vision.preprocess import load_image, preprocess, sizing, token_budget
from strata.vision.protocol import Capabilities, Ready

BASE = VisionHParams(image_size=32, patch_size=8, n_embd=32, n_ff=64, n_head=2, n_layer=2, eps=1e-6, n_proj=48,
                     merge=2, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))
# Each variant with its own patch size and its default budget (token_budget): LFM2-VL 64-256 rows of 32-pixel
# tokens, Qwen3-VL 8-4096 of 32-pixel tokens, ours 1-1024 of 16-pixel tokens.
VARIANTS = {
    "lfm2-vl": dataclasses.replace(BASE, patch_size=16, variant="lfm2-vl"),
    "qwen3-vl": dataclasses.replace(BASE, patch_size=16, variant="qwen3-vl", projector="qwen3vl_merger"),
    "strata": dataclasses.replace(BASE, variant="strata"),
}
SIZES = [(1, 1), (7, 300), (100, 37), (128, 96), (640, 480), (1280, 800), (2000, 1000), (3000, 17), (4032, 3024)]


def picture(width: int, height: int, fmt: str = "PNG", orientation: int | None = None) -> bytes:
    image = Image.new("RGB", (width, height), (90, 140, 200))
    buffer = io.BytesIO()
    if orientation is None:
        image.save(buffer, format=fmt)
    else:
        exif = Image.Exif()
        exif[0x0112] = orientation
        image.save(buffer, format=fmt, exif=exif)
    return buffer.getvalue()


def ready_for(hp: VisionHParams, min_tokens: int, max_tokens: int, with_sizing: bool = True) -> Ready:
    caps = Capabilities(cuda=False, threads=1, max_tokens=max_tokens, fingerprint="f", projector=hp.projector,
                        sizing=sizing(hp, max_tokens, min_tokens) if with_sizing else None)
    return Ready(hp.n_proj, caps)


def encoder_rows(data: bytes, hp: VisionHParams, min_tokens: int, max_tokens: int) -> int:
    """The rows the worker makes of `data` (its own path: load_image, then preprocess), from the pixels it would
    encode: each part's grid, tiles and thumbnail."""
    resized = preprocess(load_image(data), hp, max_tokens, min_tokens)
    unit = hp.patch_size * hp.merge
    return sum(part.shape[1] * part.shape[2] // (unit * unit) for part in resized.parts)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rows_from_the_header_equal_the_encoders(variant: str):
    hp = VARIANTS[variant]
    for min_tokens, max_tokens in [token_budget(hp), (1, 64), (64, 64)]:
        ready = ready_for(hp, min_tokens, max_tokens)
        rng = np.random.default_rng(len(variant) + max_tokens)
        sizes = SIZES + [(int(w), int(h)) for w, h in rng.integers(1, 2500, size=(25, 2))]
        for width, height in sizes:
            data = picture(width, height)
            rows = encoder_rows(data, hp, min_tokens, max_tokens)
            assert VisionClient.rows(ready, check_image(data)) == rows, (variant, width, height, max_tokens)


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_exif_orientation_is_counted_as_the_encoder_turns_the_picture(variant: str, orientation: int):
    hp = VARIANTS[variant]
    min_tokens, max_tokens = token_budget(hp)
    data = picture(1200, 300, "JPEG", orientation)  # a quarter turn makes it 300x1200
    info = check_image(data)
    assert (info.width, info.height) == ((300, 1200) if orientation in (6, 8) else (1200, 300))
    rows = encoder_rows(data, hp, min_tokens, max_tokens)
    assert VisionClient.rows(ready_for(hp, min_tokens, max_tokens), info) == rows


def test_an_encoder_without_a_sizing_rule_counts_every_picture_as_its_most():
    hp = VARIANTS["strata"]
    ready = ready_for(hp, 1, 64, with_sizing=False)
    assert VisionClient.rows(ready, check_image(picture(16, 16))) == 64
