"""Pictures to normalised pixels: decode with Pillow, orient, flatten transparency, resize to a token budget."""

from __future__ import annotations

import dataclasses
import io
import math
import os
import warnings

import numpy as np
from PIL import Image, ImageOps

from strata.vision.mmproj import VisionHParams
from strata.vision.protocol import Sizing

# A bound on decoded pixels, checked from the header before decoding: a small file that decodes to gigabytes (a
# decompression bomb) is refused. 50 MP holds an 8K screenshot or a phone camera's photo.
DEFAULT_MAX_PIXELS = 50_000_000
# Most rows per picture when neither the command line nor the mmproj file gives a budget.
DEFAULT_MAX_TOKENS = 1024
# The budget when neither the command line nor the file gives one: LFM2-VL's processor's (min_image_tokens,
# max_image_tokens); llama.cpp's for Qwen-VL; ours.
DEFAULT_TOKENS = {"lfm2-vl": (64, 256), "qwen3-vl": (8, 4096), "strata": (1, DEFAULT_MAX_TOKENS)}


class ImageError(ValueError):
    """A picture that cannot be used: not an image, truncated, too large, unreadable."""


@dataclasses.dataclass(frozen=True)
class Picture:
    pixels: np.ndarray  # float32 (3, height, width), normalised; height, width multiples of patch_size * merge
    nx: int  # merged-token grid width: width // (patch_size * merge)
    ny: int

    @property
    def n_tokens(self) -> int:
        return self.nx * self.ny


def token_grid(width: int, height: int, unit: int, max_tokens: int, min_tokens: int = 1) -> tuple[int, int]:
    """The merged-token grid (nx, ny) for a width x height picture: the aspect ratio kept, nx * ny <= max_tokens.

    `unit` is the pixels per merged token along a side (patch_size * merge). A picture that already fits is only
    rounded to whole units; a larger one is scaled down; one smaller than `min_tokens` units is scaled up to about
    that many (an encoder trained on pictures of some size sees small ones at that size); every side gets at least
    one unit.
    """
    if max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    area = width * height / (unit * unit)  # in tokens
    scale = math.sqrt(max_tokens / area) if area > max_tokens else 1.0
    if area < min(min_tokens, max_tokens):
        scale = math.sqrt(min(min_tokens, max_tokens) / area)
    nx, ny = max(1, round(width * scale / unit)), max(1, round(height * scale / unit))
    if nx * ny > max_tokens:
        # Invariant: floor(a) * floor(b) <= a * b = width * height * scale**2 / unit**2 <= max_tokens.
        nx, ny = max(1, math.floor(width * scale / unit)), max(1, math.floor(height * scale / unit))
    if nx * ny > max_tokens:  # a thin picture whose short side was raised to one unit
        if nx >= ny:
            nx = max_tokens // ny
        else:
            ny = max_tokens // nx
    return nx, ny


def smart_grid(width: int, height: int, unit: int, max_tokens: int, min_tokens: int = 1) -> tuple[int, int]:
    """The merged-token grid (nx, ny) LFM2-VL's processor (and llama.cpp for `lfm2`) resizes a picture to: each side
    rounded to whole units; if that holds more than `max_tokens`, the picture scaled to that area and each side
    floored; if fewer than `min_tokens`, scaled to that area and each side rounded up (a 128x96 picture with 32-pixel
    units and a minimum of 64 becomes 10x7). A result above `max_tokens` (a minimum near the maximum) falls back to
    `token_grid`, so the bound always holds."""
    if max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    nx, ny = max(1, round(width / unit)), max(1, round(height / unit))
    if nx * ny > max_tokens:
        beta = math.sqrt(width * height / (max_tokens * unit * unit))
        nx, ny = max(1, math.floor(width / beta / unit)), max(1, math.floor(height / beta / unit))
    elif nx * ny < min_tokens:
        beta = math.sqrt(min_tokens * unit * unit / (width * height))
        nx, ny = math.ceil(width * beta / unit), math.ceil(height * beta / unit)
    if nx * ny > max_tokens:
        return token_grid(width, height, unit, max_tokens, min_tokens)
    return nx, ny


def sizing(hp: VisionHParams, max_tokens: int, min_tokens: int = 1) -> Sizing:
    """How an encoder of `hp` sizes pictures: the checkpoint's grid (`smart_grid`) for LFM2-VL and Qwen3-VL files,
    ours (`token_grid`) for our own."""
    return Sizing("token" if hp.variant == "strata" else "smart", hp.patch_size, hp.merge, min_tokens, max_tokens)


def picture_grid(width: int, height: int, rule: Sizing) -> tuple[int, int]:
    """The merged-token grid (nx, ny) an upright width x height picture is resized to under `rule`: the one
    function the encoder sizes pictures with and the server predicts their rows with (from the header alone)."""
    grid = token_grid if rule.grid == "token" else smart_grid
    return grid(width, height, rule.patch_size * rule.merge, rule.max_tokens, rule.min_tokens)


def token_budget(hp: VisionHParams, min_tokens: int | None = None,
                 max_tokens: int | None = None) -> tuple[int, int]:
    """(min_tokens, max_tokens) for an encoder: those given, else the file's trained budget, else DEFAULT_TOKENS
    of its variant: LFM2-VL's (64, 256), Qwen3-VL's (8, 4096), ours (1, 1024).

    A minimum above the maximum is lowered to it.
    """
    area = hp.unit * hp.unit
    default_min, default_max = DEFAULT_TOKENS[hp.variant]
    if max_tokens is None:
        max_tokens = max(1, hp.max_pixels // area) if hp.max_pixels else default_max
    if min_tokens is None:
        min_tokens = -(-hp.min_pixels // area) if hp.min_pixels else default_min
    return min(min_tokens, max_tokens), max_tokens


def load_image(source: bytes | str | os.PathLike[str], max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode a picture (any format Pillow reads; the first frame of an animation) to upright RGB.

    Raises:
        ImageError: unreadable, not an image, truncated, or more than max_pixels pixels.
    """
    what = "image" if isinstance(source, bytes) else f"image '{os.fspath(source)}'"
    try:
        with warnings.catch_warnings():
            # Pillow's own bomb check warns below its hard limit; either way it is a refusal here.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as image:
                width, height = image.size
                if width * height > max_pixels:
                    raise ImageError(f"{what} is {width}x{height}, more than {max_pixels} pixels")
                image.load()
                return _to_rgb(ImageOps.exif_transpose(image))
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"{what} is too large: {exc}") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise ImageError(f"cannot read {what}: {exc}") from None


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white (a transparent screenshot background reads as white)."""
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        background.alpha_composite(rgba)
        return background.convert("RGB")
    return image.convert("RGB")


def preprocess(image: Image.Image, hp: VisionHParams, max_tokens: int, min_tokens: int = 1) -> Picture:
    """Resize an RGB picture to its token grid (`picture_grid` under `sizing`) and normalise it with the file's mean
    and std; LFM2-VL files resample bilinear and the others bicubic, as their processors do."""
    unit = hp.patch_size * hp.merge
    nx, ny = picture_grid(image.width, image.height, sizing(hp, max_tokens, min_tokens))
    size = (nx * unit, ny * unit)
    if image.size != size:
        lfm2_vl = hp.variant == "lfm2-vl"
        image = image.resize(size, Image.Resampling.BILINEAR if lfm2_vl else Image.Resampling.BICUBIC)
    pixels: np.ndarray = np.asarray(image, dtype=np.float32) / 255.0  # (height, width, 3)
    pixels = (pixels - np.asarray(hp.image_mean, np.float32)) / np.asarray(hp.image_std, np.float32)
    return Picture(np.ascontiguousarray(pixels.transpose(2, 0, 1)), nx, ny)
