"""Large pictures on an LFM2-VL file are split into tiles as LFM2-VL's image processor splits them: the same tile
grid, thumbnail and markers (`Lfm2VlImageProcessor` / `Lfm2VlProcessor` of the installed transformers are the
reference for the sizing, on many sizes), and the rows the encoder makes of a tiled picture are the checkpoint's
`get_image_features` of the processor's tiles and thumbnail, in the order its prompt places them.

The processor's module imports torchvision (for its resizes) at load; its sizing methods do not use it, so where
torchvision is absent the module is loaded with an empty stand-in for that import and only those methods run. Its
resizes are reproduced with torch's antialiased bilinear `interpolate` on uint8 pictures, the kernel torchvision's
`resize` runs on the CPU for them.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import types

import gguf
import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.lfm2_vl.processing_lfm2_vl import Lfm2VlProcessor

from strata.vision.encoder import Encoder
from strata.vision.mmproj import Mmproj, VisionHParams, read_hparams
from strata.vision.preprocess import LFM2_VL_TILES, picture_grid, preprocess, sizing, token_budget
from strata.vision.protocol import PictureGrid, parse_sve
from strata.vision.worker import encode_picture

from .test_lfm2_vl import N_TEXT, PATCH, lfm2_vl  # noqa: F401 - the fixture

TOLERANCE = 1e-4
TILE_SIZE, MIN_TILES, MAX_TILES = LFM2_VL_TILES


def _processor_module() -> types.ModuleType:
    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2",
             "torchvision.transforms.v2.functional"]
    try:
        import torchvision.transforms.v2.functional  # noqa: F401
    except ImportError:
        stand_ins = {name: types.ModuleType(name) for name in names}
        stand_ins["torchvision.transforms.v2"].functional = stand_ins[names[-1]]  # type: ignore[attr-defined]
        sys.modules.update(stand_ins)
        try:
            return importlib.import_module("transformers.models.lfm2_vl.image_processing_lfm2_vl")
        finally:
            for name in names:
                del sys.modules[name]
    return importlib.import_module("transformers.models.lfm2_vl.image_processing_lfm2_vl")


HF = _processor_module()
# The sizing methods read no instance state but the class's defaults and `_target_ratios`.
PROCESSOR = object.__new__(HF.Lfm2VlImageProcessor)


@dataclasses.dataclass(frozen=True)
class Split:
    """What the processor makes of a picture: its tile grid (1x1: not split) and the resized (thumbnail) size."""

    cols: int
    rows: int
    width: int
    height: int


def processor_split(width: int, height: int, min_tokens: int, max_tokens: int) -> Split:
    """`Lfm2VlImageProcessor.resize_and_split`'s decisions, through its own methods."""
    p = PROCESSOR
    large = p._is_image_too_large(height, width, max_tokens, PATCH, 2, p.max_pixels_tolerance)
    new_width, new_height = p.smart_resize(height, width, 2, min_tokens, max_tokens, PATCH)
    if large:
        cols, rows, *_ = p._get_grid_layout(height, width, MIN_TILES, MAX_TILES, TILE_SIZE)
        return Split(cols, rows, new_width, new_height)
    return Split(1, 1, new_width, new_height)


def processor_placeholder(split: Split) -> str:
    """The text `Lfm2VlProcessor` puts in the prompt for a picture so split."""
    names = {"image_token": "<image>", "image_start_token": "<|image_start|>", "image_end_token": "<|image_end|>",
             "image_thumbnail_token": "<|img_thumbnail|>"}
    per_tile = Lfm2VlProcessor._compute_tokens_per_tile(None, TILE_SIZE, PATCH, 2)  # type: ignore[arg-type]
    whole = Lfm2VlProcessor._compute_tokens_for_image(None, [split.height, split.width], PATCH, 2)  # type: ignore[arg-type]
    return Lfm2VlProcessor._build_image_tokens(types.SimpleNamespace(**names), split.rows, split.cols,  # type: ignore[arg-type]
                                               per_tile, whole, True, True)


def our_placeholder(grid: PictureGrid) -> str:
    parts = "".join(marker + "<image>" * (nx * ny) for marker, nx, ny in grid.segments())
    return "<|image_start|>" + parts + "<|image_end|>"


SIZES = [(512, 512), (724, 724), (725, 725), (1000, 3000), (3000, 1000), (1100, 600), (1920, 1080), (4032, 3024),
         (3024, 4032), (5000, 500), (500, 5000), (10000, 300), (1024, 1024), (2048, 512), (1500, 1499), (760, 700)]


@pytest.mark.parametrize("budget", [(64, 256), (16, 64), (256, 1024)])
def test_the_split_is_the_processors(lfm2_vl: tuple, budget: tuple[int, int]) -> None:  # noqa: F811
    _, path = lfm2_vl
    hp = read_hparams(gguf.GGUFReader(path))
    min_tokens, max_tokens = budget
    rule = sizing(hp, max_tokens, min_tokens)
    rng = np.random.default_rng(max_tokens)
    # sides spread evenly in scale from 16 to 6000 pixels
    sizes = SIZES + [tuple(int(v) for v in np.exp(rng.uniform(np.log(16), np.log(6000), 2))) for _ in range(300)]
    n_tiled = n_over = 0
    unit = 2 * PATCH
    for width, height in sizes:
        grid = picture_grid(width, height, rule)
        split = processor_split(width, height, min_tokens, max_tokens)
        assert ((grid.cols, grid.rows) if grid.tiled else (1, 1)) == (split.cols, split.rows), (width, height)
        if split.width * split.height > max_tokens * unit * unit:
            # A picture so thin that its short side is raised to one token: the processor's grid (or thumbnail)
            # exceeds the budget, by as much as the picture is long; ours keeps it (`smart_grid`'s fallback).
            assert grid.nx * grid.ny <= max_tokens, (width, height)
            n_over += 1
            continue
        assert (grid.nx * unit, grid.ny * unit) == (split.width, split.height), (width, height)
        assert our_placeholder(grid) == processor_placeholder(split), (width, height)
        n_tiled += grid.tiled
    assert 20 < n_tiled < len(sizes) - 20 and n_over < len(sizes) // 10  # both kinds well represented


def test_the_default_budget_splits_as_llama_cpp_does() -> None:
    """The cases of the budget every LFM2-VL file gets (64-256 tokens of 32 pixels)."""
    hp = VisionHParams(image_size=256, patch_size=PATCH, n_embd=32, n_ff=64, n_head=2, n_layer=2, eps=1e-6,
                       n_proj=N_TEXT, merge=2, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))
    min_tokens, max_tokens = token_budget(hp)
    rule = sizing(hp, max_tokens, min_tokens)
    assert picture_grid(700, 700, rule) == PictureGrid(16, 16)  # 22x22 rounded: 484 <= 2 x 256, one piece
    # 23x23 = 529: split; 2x2 and 3x3 tiles are as square as the picture, 2x2's area is under twice the picture's
    assert picture_grid(725, 725, rule) == PictureGrid(16, 16, 2, 2, 16)
    assert picture_grid(1100, 600, rule) == PictureGrid(21, 11, 2, 1, 16)
    assert picture_grid(4032, 3024, rule) == PictureGrid(18, 13, 3, 2, 16)  # 4x3 would be 12 tiles, over 10
    assert picture_grid(4032, 3024, rule).n_tokens == 6 * 256 + 18 * 13


def _resized(picture: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The processor's resize of a uint8 (1, 3, H, W) picture."""
    return torch.nn.functional.interpolate(picture, size=(height, width), mode="bilinear", align_corners=False,
                                           antialias=True)


def processor_pixels(image: Image.Image, split: Split) -> list[torch.Tensor]:
    """The processor's normalised parts of a split picture, float32 (3, H, W) each: tiles in row-major order,
    then the thumbnail."""
    picture = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)[None]
    tiles = _resized(picture, split.rows * TILE_SIZE, split.cols * TILE_SIZE)
    parts = [tiles[0, :, r * TILE_SIZE:(r + 1) * TILE_SIZE, c * TILE_SIZE:(c + 1) * TILE_SIZE]
             for r in range(split.rows) for c in range(split.cols)]
    parts.append(_resized(picture, split.height, split.width)[0])
    return [(part.float() / 255 - 0.5) / 0.5 for part in parts]


def checkpoint_rows(model, parts: list[torch.Tensor]) -> np.ndarray:  # type: ignore[no-untyped-def]
    """`get_image_features` of the parts as the processor batches them (patches padded to the longest, with the
    attention mask and spatial shapes), the rows concatenated as the model places them in the prompt."""
    longest = max(part.shape[1] * part.shape[2] // PATCH**2 for part in parts)
    patches, masks, shapes = [], [], []
    for part in parts:
        flat = HF.convert_image_to_patches(part[None], PATCH)
        padded, mask = HF.pad_along_first_dim(flat, longest)
        patches.append(padded[0])
        masks.append(mask)
        shapes.append([part.shape[1] // PATCH, part.shape[2] // PATCH])
    with torch.no_grad():
        features = model.get_image_features(pixel_values=torch.stack(patches), spatial_shapes=torch.tensor(shapes),
                                            pixel_attention_mask=torch.stack(masks).bool())
    rows = features.pooler_output if hasattr(features, "pooler_output") else features
    return torch.cat(list(rows)).numpy()


def test_a_tiled_pictures_rows_are_the_checkpoints(lfm2_vl: tuple) -> None:  # noqa: F811
    model, path = lfm2_vl
    encoder = Encoder(Mmproj.load(path), threads=2)
    hp = encoder.hp
    min_tokens, max_tokens = token_budget(hp)
    rng = np.random.default_rng(7)
    # smooth content with some detail: resampling differences stay at the scale of real pictures
    base = rng.uniform(0, 255, (12, 22, 3)).astype(np.uint8)
    image = Image.fromarray(base).resize((1100, 600), Image.Resampling.BICUBIC)
    split = processor_split(1100, 600, min_tokens, max_tokens)
    assert (split.cols, split.rows) == (2, 1)
    parts = processor_pixels(image, split)
    expected = checkpoint_rows(model, parts)

    picture = preprocess(image, hp, max_tokens, min_tokens)
    assert picture.grid == PictureGrid(21, 11, 2, 1, 16)
    # our resize (Pillow's) against the processor's (torch's), pixel by pixel, in normalised units (1/255 = 0.0078)
    worst = max(float(np.abs(ours - theirs.numpy()).max()) for ours, theirs in zip(picture.parts, parts, strict=True))
    assert worst <= 2 / 255 + 1e-6, f"pixels differ by {worst:.4f}"  # one level at most (measured: one)

    # the encoder on the processor's own pixels: only the arithmetic differs
    rows = np.concatenate([encoder.encode(part.numpy()) for part in parts])
    assert rows.shape == expected.shape == (2 * 256 + 21 * 11, N_TEXT)
    err = np.linalg.norm(rows - expected) / np.linalg.norm(expected)
    assert err < TOLERANCE, f"relative error {err:.2e}"  # measured 5.4e-7

    # the worker's whole path (resize, tiles, encode, SVE2): within what the resize differences make
    header, sve_rows = parse_sve(encode_picture(encoder, picture))
    assert header.grid == picture.grid
    err = np.linalg.norm(sve_rows - expected) / np.linalg.norm(expected)
    assert err < 1e-3, f"relative error {err:.2e}"  # measured 2.6e-4
