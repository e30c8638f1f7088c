"""Pictures to pixels: token budgets, orientation, transparency, formats, normalisation and refusals."""

from __future__ import annotations

import dataclasses
import io
import math

import numpy as np
import pytest
from PIL import Image

from strata.vision.mmproj import VisionHParams
from strata.vision.preprocess import DEFAULT_MAX_TOKENS, ImageError, load_image, preprocess, token_budget, token_grid

HP = VisionHParams(image_size=32, patch_size=8, n_embd=32, n_ff=64, n_head=2, n_layer=2, eps=1e-6, n_proj=48,
                   merge=2, image_mean=(0.4, 0.5, 0.6), image_std=(0.2, 0.25, 0.3), variant="strata")


def encoded(image: Image.Image, fmt: str = "PNG", **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def test_a_screenshot_fills_the_budget():
    assert token_grid(1280, 800, unit=32, max_tokens=1024) == (40, 25)  # 1000 tokens, 16:10 kept exactly
    nx, ny = token_grid(1280, 800, unit=28, max_tokens=1024)  # a 14-pixel patch: scaled down to fit
    assert 950 <= nx * ny <= 1024 and abs(nx / ny - 1.6) < 0.05


@pytest.mark.parametrize("max_tokens", [1, 16, 256, 1024])
def test_token_grid_keeps_the_budget_and_the_aspect_ratio(max_tokens: int):
    rng = np.random.default_rng(max_tokens)
    for width, height in rng.integers(1, 6000, size=(300, 2)):
        nx, ny = token_grid(int(width), int(height), 32, max_tokens)
        assert nx >= 1 and ny >= 1 and nx * ny <= max_tokens, (width, height)
        if min(nx, ny) >= 8:  # far from the rounding floor, the shape follows the picture
            assert abs(math.log((nx / ny) / (width / height))) < 0.15, (width, height, nx, ny)
        if width * height <= max_tokens * 32 * 32 and min(width, height) >= 32 * 4:
            assert (nx, ny) == (round(width / 32), round(height / 32))  # fits already: only rounded


def test_large_pictures_use_most_of_the_budget():
    for width, height in [(4032, 3024), (3000, 4000), (1920, 1080), (8000, 8000)]:
        nx, ny = token_grid(width, height, 32, 1024)
        assert 0.9 * 1024 <= nx * ny <= 1024


def test_thin_and_tiny_pictures_get_at_least_one_unit():
    assert token_grid(10000, 10, 32, 64) == (64, 1)
    assert token_grid(10, 10000, 32, 64) == (1, 64)
    assert token_grid(3, 3, 32, 64) == (1, 1)
    with pytest.raises(ValueError):
        token_grid(100, 100, 32, 0)


def test_preprocess_resizes_to_the_grid_and_normalises_with_the_files_mean_and_std():
    image = Image.new("RGB", (100, 37), (255, 0, 128))
    picture = preprocess(image, HP, max_tokens=64)
    assert (picture.nx, picture.ny) == token_grid(100, 37, 16, 64)
    assert picture.pixels.shape == (3, picture.ny * 16, picture.nx * 16)
    assert picture.pixels.dtype == np.float32
    expected = [(255 / 255 - 0.4) / 0.2, (0 - 0.5) / 0.25, (128 / 255 - 0.6) / 0.3]
    for channel, value in enumerate(expected):
        np.testing.assert_allclose(picture.pixels[channel], value, atol=1.01 / 255 / 0.2)


def test_preprocess_keeps_pixel_layout():
    # A picture already on the grid is not resampled: every pixel lands where it was, channel first.
    pixels = np.random.default_rng(0).integers(0, 256, (32, 48, 3), dtype=np.uint8)
    picture = preprocess(Image.fromarray(pixels), HP, max_tokens=64)
    expected = (pixels / 255 - np.array(HP.image_mean)) / np.array(HP.image_std)
    np.testing.assert_allclose(picture.pixels, expected.transpose(2, 0, 1), atol=1e-5)


def test_exif_orientation_is_applied():
    image = Image.new("RGB", (64, 32), (255, 0, 0))
    image.paste((0, 0, 255), (32, 0, 64, 32))  # left half red, right half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    upright = load_image(encoded(image, "JPEG", exif=exif, quality=95))
    assert upright.size == (32, 64)
    top, bottom = np.asarray(upright)[8, 16], np.asarray(upright)[56, 16]
    assert top[0] > 200 and top[2] < 60  # the left edge went to the top
    assert bottom[2] > 200 and bottom[0] < 60


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        (Image.new("RGBA", (8, 8), (255, 0, 0, 0)), (255, 255, 255)),
        (Image.new("RGBA", (8, 8), (0, 0, 0, 128)), (127, 127, 127)),
        (Image.new("RGBA", (8, 8), (10, 20, 30, 255)), (10, 20, 30)),
        (Image.new("LA", (8, 8), (0, 0)), (255, 255, 255)),
        (Image.new("L", (8, 8), 77), (77, 77, 77)),
    ],
)
def test_transparency_goes_onto_white(image: Image.Image, expected: tuple[int, int, int]):
    rgb = load_image(encoded(image))
    assert rgb.mode == "RGB"
    np.testing.assert_allclose(np.asarray(rgb)[4, 4], expected, atol=1)


def test_palette_transparency_goes_onto_white():
    image = Image.new("P", (8, 8), 1)
    image.putpalette([0, 0, 0, 200, 10, 10] + [0] * 762)
    image.putpixel((0, 0), 0)
    rgb = np.asarray(load_image(encoded(image, transparency=0)))
    assert tuple(rgb[0, 0]) == (255, 255, 255)
    assert tuple(rgb[4, 4]) == (200, 10, 10)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "BMP", "GIF", "TIFF"])
def test_common_formats_are_read(fmt: str):
    rgb = load_image(encoded(Image.new("RGB", (40, 24), (0, 200, 0)), fmt))
    assert rgb.size == (40, 24)
    assert np.asarray(rgb)[12, 20][1] > 180


def test_an_animation_gives_its_first_frame():
    frames = [Image.new("RGB", (16, 16), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    data = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert np.asarray(load_image(data))[8, 8][0] > 200


def test_paths_are_read(tmp_path):
    path = tmp_path / "p.png"
    Image.new("RGB", (20, 10)).save(path)
    assert load_image(str(path)).size == (20, 10)
    with pytest.raises(ImageError, match=f"cannot read image '{tmp_path / 'missing.png'}'"):
        load_image(str(tmp_path / "missing.png"))


def test_decompression_bombs_are_refused_before_decoding(monkeypatch):
    big = encoded(Image.new("1", (3000, 2000)))  # 6 MP in a few kB
    assert len(big) < 20_000
    with pytest.raises(ImageError, match="3000x2000, more than 5000000 pixels"):
        load_image(big, max_pixels=5_000_000)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 4_000_000)  # Pillow's own guard: a warning, then an error
    for data in (big, encoded(Image.new("1", (3000, 3000)))):
        with pytest.raises(ImageError, match="too large"):
            load_image(data)


def test_non_images_and_truncated_images_are_refused():
    with pytest.raises(ImageError, match="cannot read image"):
        load_image(b"GIF89a? no, just text")
    with pytest.raises(ImageError, match="cannot read image"):
        load_image(b"")
    png = encoded(Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)))
    with pytest.raises(ImageError, match="cannot read image"):
        load_image(png[: len(png) // 2])


def test_small_pictures_are_scaled_up_to_the_minimum():
    assert token_grid(48, 48, 16, max_tokens=64, min_tokens=64) == (8, 8)
    assert token_grid(48, 48, 16, max_tokens=64) == (3, 3)  # no minimum: only rounded
    nx, ny = token_grid(100, 50, 16, max_tokens=64, min_tokens=64)
    assert 48 <= nx * ny <= 64 and abs(nx / ny - 2) < 0.3
    assert token_grid(48, 48, 16, max_tokens=16, min_tokens=64) == (4, 4)  # the maximum wins
    assert token_grid(320, 320, 16, max_tokens=1024, min_tokens=64) == (20, 20)  # above the minimum: unchanged


def test_the_budget_comes_from_the_arguments_then_the_file_then_the_defaults():
    assert token_budget(HP) == (1, DEFAULT_MAX_TOKENS)
    trained = dataclasses.replace(HP, min_pixels=48 * 16 * 16 + 1, max_pixels=64 * 16 * 16 + 255)
    assert token_budget(trained) == (49, 64)  # whole tokens: the minimum rounds up, the maximum down
    assert token_budget(trained, max_tokens=100) == (49, 100)
    assert token_budget(trained, min_tokens=10) == (10, 64)
    assert token_budget(trained, max_tokens=32) == (32, 32)  # a minimum above the maximum is lowered to it
