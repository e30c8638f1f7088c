"""Pictures in the prompt: each picture's pad token expanded to the positions of its rows (and its parts'
markers), and the rows an engine call over a window of positions takes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from strata.pictures.rows import PictureRows
from strata.pictures.sources import ImageRejected


@dataclasses.dataclass(frozen=True)
class PromptImages:
    """A prompt with its pictures in place.

    Attributes:
        ids: token ids; each picture's positions hold the pad token (the engine replaces their embeddings).
        keys: one per position, what the KV cache holds there: the token id, or (picture digest, row) for a
            picture's row, so prefix reuse tells two pictures apart although their ids are the same pads.
        spans: (first position, rows) of each picture, in order: `PictureRows`, which know their grid.
    """

    ids: list[int]
    keys: list[Any]
    spans: list[tuple[int, Any]]


def expand_image_pads(ids: list[int], pad_id: int, embeddings: list[Any],
                      marker_ids: Callable[[str], list[int]] | None = None) -> PromptImages:
    """Replace the i-th pad token of `ids` by `embeddings[i].n_tokens` pad positions; a picture split into tiles
    (its `grid`) gets the ids of each part's marker (`marker_ids`, e.g. LFM2-VL's `<|img_row_1_col_1|>`) before
    that part's rows, as its model was trained to read them.

    Raises:
        ImageRejected: the prompt holds a different number of pads than there are pictures (a chat template
            without vision markers, or a pad token typed into the text); the caller names the family's form.
    """
    n_pads = ids.count(pad_id)
    if n_pads != len(embeddings):
        raise ImageRejected(f"the prompt has {n_pads} image placeholders for {len(embeddings)} pictures")
    out_ids: list[int] = []
    keys: list[Any] = []
    spans: list[tuple[int, Any]] = []
    pictures = iter(embeddings)
    for token in ids:
        if token != pad_id:
            out_ids.append(token)
            keys.append(token)
            continue
        embedding = next(pictures)
        first = 0  # the picture's row that the next part starts at
        for marker, nx, ny in embedding.grid.segments():
            if marker and marker_ids is not None:
                marked = marker_ids(marker)
                out_ids.extend(marked)
                keys.extend(marked)
            # each part is a grid of its own (Qwen3-VL's positions read it; a tiled picture is LFM2-VL's)
            rows = embedding.rows if nx * ny == embedding.n_tokens else embedding.rows[first:first + nx * ny]
            spans.append((len(out_ids), PictureRows(rows, nx)))
            out_ids.extend([pad_id] * (nx * ny))
            keys.extend((embedding.digest, row) for row in range(first, first + nx * ny))
            first += nx * ny
    return PromptImages(out_ids, keys, spans)


def marker_tokens(grid: Any, marker_ids: Callable[[str], list[int]]) -> int:
    """The prompt positions a picture's part markers take (see `expand_image_pads`)."""
    return sum(len(marker_ids(marker)) for marker, _, _ in grid.segments() if marker)


def embeds_from(spans: list[tuple[int, Any]], start: int, end: int) -> list[tuple[int, Any]]:
    """The `Engine.eval` embeds for positions [start, end): each span cut to that window, indexed from `start`."""
    out = []
    for first, rows in spans:
        lo, hi = max(first, start), min(first + len(rows), end)
        if lo < hi:
            out.append((lo - start, rows[lo - first: hi - first]))
    return out
