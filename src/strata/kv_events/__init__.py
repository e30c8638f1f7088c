"""KV events: what a replica's prefix cache holds, published for the routers in front of a fleet of replicas.

vLLM's wire format (msgpack event batches on a ZMQ PUB socket, a ROUTER socket that replays recent batches) and
block hashes chained over fixed-size token blocks, so that a KV-aware router (`vllm-router --policy kv_aware`,
llm-d's precise prefix scorer) sends a conversation back to the replica that holds its prefix. See
docs/SCALE_OUT.md for the protocol and its sources.

`blocks` follows the batcher's slots and says which blocks appear and disappear (`KvBlocks`, the batcher's
observer); `wire` is the format, pure; `publisher` is the thread that sends it.
"""

from strata.kv_events.blocks import KvBlocks, block_hash
from strata.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KvBlocks", "KvEvent", "block_hash"]
