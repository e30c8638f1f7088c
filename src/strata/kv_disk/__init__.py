"""The prefix cache's second tier: sequences' KV rows in a directory, by content, across restarts.

`blocks` names a prompt's fixed-size blocks by the chained hash of their keys; `store` is the directory (one file
per block, an index rebuilt at startup, LRU by bytes, a lock); `writer` and `reader` move blocks on threads of
their own; `tier.KvTier` is what the batcher calls.
"""

from strata.kv_disk.blocks import BLOCK_TOKENS, block_hashes
from strata.kv_disk.store import BlockStore, KvDiskError
from strata.kv_disk.tier import KvTier

__all__ = ["BLOCK_TOKENS", "BlockStore", "KvDiskError", "KvTier", "block_hashes"]
