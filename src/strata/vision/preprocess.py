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
from strata.vision.protocol import PictureGrid, Sizing

# A bound on decoded pixels, checked from the header before decoding: a small file that decodes to gigabytes (a
# decompression bomb) is refused. 50 MP holds an 8K screenshot or a phone camera's photo.
DEFAULT_MAX_PIXELS = 50_000_000
# Most rows per picture when neither the command line nor the mmproj file gives a budget.
DEFAULT_MAX_TOKENS = 1024
# The budget when neither the command line nor the file gives one: LFM2-VL's processor's (min_image_tokens,
# max_image_tokens); llama.cpp's for Qwen-VL; ours.
DEFAULT_TOKENS = {"lfm2-vl": (64, 256), "qwen3-vl": (8, 4096), "strata": (1, DEFAULT_MAX_TOKENS)}
# LFM2-VL's image splitting, as its processor's configuration and llama.cpp have it: a picture whose rounded area
# exceeds TILE_TOLERANCE times the token budget is split into 2 to 10 tiles of 512 pixels a side, plus a thumbnail.
LFM2_VL_TILES = (512, 2, 10)  # (tile_size, min_tiles, max_tiles)
TILE_TOLERANCE = 2.0


class ImageError(ValueError):
    """A picture that cannot be used: not an image, truncated, too large, unreadable."""


@dataclasses.dataclass(frozen=True)
class Picture:
    pixels: np.ndarray  # float32 (3, height, width), normalised; height, width multiples of patch_size * merge
    grid: PictureGrid  # pixels is its nx x ny grid (a tiled picture's thumbnail)
    tiles: tuple[np.ndarray, ...] = ()  # a tiled picture's tiles in row-major order, each like pixels

    @property
    def nx(self) -> int:
        return self.grid.nx

    @property
    def ny(self) -> int:
        return self.grid.ny

    @property
    def n_tokens(self) -> int:
        return self.grid.n_tokens

    @property
    def parts(self) -> list[np.ndarray]:
        """The pixels to encode, in the order of their rows: the tiles, then the whole picture."""
        return [*self.tiles, self.pixels]


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
    LFM2-VL's also split into tiles when large (`tile_layout`); ours (`token_grid`) for our own."""
    tiles = LFM2_VL_TILES if hp.variant == "lfm2-vl" else (0, 0, 0)
    return Sizing("token" if hp.variant == "strata" else "smart", hp.patch_size, hp.merge, min_tokens, max_tokens,
                  *tiles)


def tile_layout(width: int, height: int, rule: Sizing) -> tuple[int, int] | None:
    """The (cols, rows) of tiles LFM2-VL's processor splits a width x height picture into, None when it is not
    split: each side rounded to whole units (the short side at least one patch), the picture is split when that
    area exceeds TILE_TOLERANCE times the token budget's; the grid is the one of min_tiles to max_tiles tiles whose
    aspect ratio is nearest the picture's, among equally near ones (in increasing tile count) the last whose
    tiles' area is under twice the picture's."""
    unit = rule.patch_size * rule.merge
    if not rule.tile_size or rule.tile_size % unit or rule.max_tiles < max(2, rule.min_tiles):
        return None
    h_bar = max(rule.patch_size, round(height / unit) * unit)
    w_bar = max(rule.patch_size, round(width / unit) * unit)
    if h_bar * w_bar <= rule.max_tokens * unit * unit * TILE_TOLERANCE:
        return None
    # Candidates in increasing tile count; within one count the order is Python's set order, as the processor's.
    counts = range(max(1, rule.min_tiles), rule.max_tiles + 1)
    candidates = sorted({(c, r) for n in counts for c in range(1, n + 1) for r in range(1, n + 1)
                         if rule.min_tiles <= c * r <= rule.max_tiles}, key=lambda cr: cr[0] * cr[1])
    aspect = width / height
    best, best_diff = (1, 1), math.inf
    for cols, rows in candidates:
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and width * height > 0.5 * rule.tile_size * rule.tile_size * cols * rows:
            best = (cols, rows)
    return best if best[0] * best[1] > 1 else None


def picture_grid(width: int, height: int, rule: Sizing) -> PictureGrid:
    """What an upright width x height picture becomes under `rule`: its merged-token grid, and its tiles when it is
    split (`tile_layout`; the grid is then the thumbnail's). The one function the encoder sizes pictures with and
    the server predicts their rows with (from the header alone)."""
    grid = token_grid if rule.grid == "token" else smart_grid
    nx, ny = grid(width, height, rule.patch_size * rule.merge, rule.max_tokens, rule.min_tokens)
    tiles = tile_layout(width, height, rule)
    if tiles is None:
        return PictureGrid(nx, ny)
    return PictureGrid(nx, ny, *tiles, rule.tile_size // (rule.patch_size * rule.merge))


def most_rows(rule: Sizing) -> int:
    """The most embedding rows one picture can take under `rule`: max_tokens, plus every tile when split."""
    side = rule.tile_size // (rule.patch_size * rule.merge) if rule.tile_size else 0
    tiles = rule.max_tiles * side * side if rule.max_tiles >= max(2, rule.min_tiles) else 0
    return rule.max_tokens + tiles


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
    and std; LFM2-VL files resample bilinear and the others bicubic, as their processors do. A picture split into
    tiles is resized to cols x rows tiles and cut, and resized once more whole to its grid as the thumbnail."""
    unit = hp.patch_size * hp.merge
    rule = sizing(hp, max_tokens, min_tokens)
    grid = picture_grid(image.width, image.height, rule)
    tiles: tuple[np.ndarray, ...] = ()
    if grid.tiled:
        side = rule.tile_size
        whole = _normalise(_resize(image, (grid.cols * side, grid.rows * side), hp), hp)
        tiles = tuple(np.ascontiguousarray(whole[:, r * side:(r + 1) * side, c * side:(c + 1) * side])
                      for r in range(grid.rows) for c in range(grid.cols))
    pixels = _normalise(_resize(image, (grid.nx * unit, grid.ny * unit), hp), hp)
    return Picture(pixels, grid, tiles)


def _resize(image: Image.Image, size: tuple[int, int], hp: VisionHParams) -> Image.Image:
    if image.size == size:
        return image
    return image.resize(size, Image.Resampling.BILINEAR if hp.variant == "lfm2-vl" else Image.Resampling.BICUBIC)


def _normalise(image: Image.Image, hp: VisionHParams) -> np.ndarray:
    """float32 (3, height, width): the picture scaled to [0, 1], less the file's mean, over its std."""
    pixels: np.ndarray = np.asarray(image, dtype=np.float32) / 255.0  # (height, width, 3)
    pixels = (pixels - np.asarray(hp.image_mean, np.float32)) / np.asarray(hp.image_std, np.float32)
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))
