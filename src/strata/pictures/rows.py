"""`PictureRows`: a picture's embedding rows with their place in its grid, as the engine takes them."""

from __future__ import annotations

from typing import Any

import numpy as np


class PictureRows:
    """A picture's embedding rows, or a run of them, with their place in its grid: multi-axis RoPE (Qwen3-VL)
    positions each row by its (row, column) in the picture. Slicing keeps the place, so a picture cut between two
    calls is positioned as one.

    Args:
        rows: float32 (n, width), in row-major order over a grid `nx` merged tokens wide.
        nx: the grid's width.
        first: the index in the picture of rows[0].
    """

    __slots__ = ("first", "nx", "rows")

    def __init__(self, rows: np.ndarray, nx: int, first: int = 0):
        if nx <= 0 or first < 0:
            raise ValueError(f"a picture's grid of width {nx} and first row {first}")
        self.rows, self.nx, self.first = rows, int(nx), int(first)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: slice) -> PictureRows:
        start, _, step = index.indices(len(self.rows))
        if step != 1:
            raise ValueError("picture rows are sliced in runs")
        return PictureRows(self.rows[index], self.nx, self.first + start)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        return np.asarray(self.rows, dtype=dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.rows.shape)

    def grid(self) -> np.ndarray:
        """int32 (n, 2): (row, column) of each row in the picture's grid."""
        at = self.first + np.arange(len(self.rows))
        return np.stack([at // self.nx, at % self.nx], axis=1).astype(np.int32)
