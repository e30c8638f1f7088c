"""The cache of encoded pictures: their rows by content hash, so a picture sent again (the next turn of a chat
carries the same pictures) costs no encoder time."""

from __future__ import annotations

import collections
import hashlib
from typing import Any

CACHE_BYTES = 256 * 1024 * 1024  # encoded rows kept by the cache


def content_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class EmbeddingCache:
    """Encoded pictures by content hash, least recently used dropped first, bounded by the bytes of their rows.

    Attributes:
        hits, misses: lookups that found / did not find their picture.
    """

    def __init__(self, max_bytes: int = CACHE_BYTES):
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self._items: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, digest: str) -> Any | None:
        item = self._items.get(digest)
        if item is None:
            self.misses += 1
            return None
        self._items.move_to_end(digest)
        self.hits += 1
        return item

    def put(self, digest: str, item: Any) -> None:
        """Keep `item` (it has `.nbytes`); an item larger than the whole cache is not kept."""
        if digest in self._items:
            self._bytes -= self._items.pop(digest).nbytes
        if item.nbytes > self.max_bytes:
            return
        self._items[digest] = item
        self._bytes += item.nbytes
        while self._bytes > self.max_bytes:
            _, dropped = self._items.popitem(last=False)
            self._bytes -= dropped.nbytes

    def clear(self) -> None:
        self._items.clear()
        self._bytes = 0
