"""The LRU cache of encoded pictures, bounded by the bytes of their rows."""

from __future__ import annotations

import numpy as np

from strata.pictures.cache import EmbeddingCache


class Rows:
    def __init__(self, nbytes: int):
        self.nbytes = nbytes


def test_cache_is_lru_bounded_by_bytes():
    cache = EmbeddingCache(max_bytes=100)
    a, b, c = Rows(40), Rows(40), Rows(40)
    cache.put("a", a)
    cache.put("b", b)
    assert cache.get("a") is a  # a is now the most recently used
    cache.put("c", c)  # 120 bytes: the least recently used (b) goes
    assert cache.get("b") is None and cache.get("a") is a and cache.get("c") is c
    assert (cache.hits, cache.misses) == (3, 1)
    cache.put("huge", Rows(101))
    assert cache.get("huge") is None and len(cache) == 2


def test_cache_keeps_real_rows():
    cache = EmbeddingCache(max_bytes=1 << 20)
    rows = np.zeros((10, 8), np.float32)
    cache.put("x", rows)
    assert cache.get("x") is rows
