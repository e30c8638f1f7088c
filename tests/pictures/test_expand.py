"""Pictures in the prompt: pads expanded to rows (and tiled pictures' markers), and the rows of a window."""

from __future__ import annotations

import numpy as np
import pytest

from strata.pictures.expand import embeds_from, expand_image_pads, marker_tokens
from strata.pictures.rows import PictureRows
from strata.pictures.sources import ImageRejected
from strata.vision.protocol import PictureGrid


class Picture:
    def __init__(self, digest: str, n_tokens: int, grid: PictureGrid | None = None):
        self.digest, self.n_tokens = digest, n_tokens
        self.grid = grid or PictureGrid(n_tokens, 1)
        self.nx = self.grid.nx
        self.rows = np.arange(n_tokens * 2, dtype=np.float32).reshape(n_tokens, 2) + hash(digest) % 7


def test_expand_image_pads_places_each_picture():
    pad = 9
    a, b = Picture("a", 3), Picture("b", 2)
    prompt = expand_image_pads([1, 8, pad, 7, 2, 8, pad, 7, 3], pad, [a, b])
    assert prompt.ids == [1, 8, pad, pad, pad, 7, 2, 8, pad, pad, 7, 3]
    assert prompt.keys[2:5] == [("a", 0), ("a", 1), ("a", 2)] and prompt.keys[8:10] == [("b", 0), ("b", 1)]
    assert [first for first, _ in prompt.spans] == [2, 8]
    assert prompt.spans[0][1].rows is a.rows and prompt.spans[0][1].nx == a.nx  # the grid goes with the rows


def test_a_tiled_picture_gets_its_parts_markers():
    pad, markers = 9, {"<|img_row_1_col_1|>": [51], "<|img_row_1_col_2|>": [52], "<|img_thumbnail|>": [60, 61]}
    grid = PictureGrid(2, 1, cols=2, rows=1, tile=1)  # two one-token tiles, then a 2x1 thumbnail
    tiled = Picture("t", 4, grid)
    prompt = expand_image_pads([1, pad, 2], pad, [tiled], markers.__getitem__)
    assert prompt.ids == [1, 51, pad, 52, pad, 60, 61, pad, pad, 2]
    assert prompt.keys == [1, 51, ("t", 0), 52, ("t", 1), 60, 61, ("t", 2), ("t", 3), 2]
    assert [first for first, _ in prompt.spans] == [2, 4, 7]
    assert [rows.nx for _, rows in prompt.spans] == [1, 1, 2]  # each part its own grid
    assert np.array_equal(np.concatenate([rows.rows for _, rows in prompt.spans]), tiled.rows)
    assert marker_tokens(grid, markers.__getitem__) == 4
    # a picture in one piece has no markers
    assert expand_image_pads([1, pad, 2], pad, [Picture("a", 2)], markers.__getitem__).ids == [1, pad, pad, 2]


def test_two_pictures_with_the_same_pads_have_different_keys():
    pad = 9
    one = expand_image_pads([1, pad, 2], pad, [Picture("a", 2)])
    other = expand_image_pads([1, pad, 2], pad, [Picture("b", 2)])
    assert one.ids == other.ids and one.keys != other.keys


def test_pad_count_must_match_the_pictures():
    with pytest.raises(ImageRejected, match="1 image placeholders for 2 pictures"):
        expand_image_pads([1, 9, 2], 9, [Picture("a", 1), Picture("b", 1)])


def test_embeds_window():
    rows = np.arange(10, dtype=np.float32).reshape(5, 2)
    spans = [(3, rows)]
    (index, part), = embeds_from(spans, 5, 20)  # the first two rows are already in the cache
    assert index == 0 and np.array_equal(part, rows[2:])
    (index, part), = embeds_from(spans, 0, 20)
    assert index == 3 and part is not None and np.array_equal(part, rows)
    assert embeds_from(spans, 8, 20) == []


def test_a_picture_cut_between_calls_keeps_its_grid():
    rows = PictureRows(np.arange(12, dtype=np.float32).reshape(6, 2), nx=3)  # a 3 x 2 grid
    (index, part), = embeds_from([(3, rows)], 5, 20)  # the first two rows are already in the cache
    assert index == 0 and np.array_equal(part, rows.rows[2:])
    assert part.grid().tolist() == [[0, 2], [1, 0], [1, 1], [1, 2]]
    with pytest.raises(ValueError, match="grid of width 0"):
        PictureRows(rows.rows, nx=0)
