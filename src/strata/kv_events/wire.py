"""vLLM's KV event wire format, pure: events to msgpack batches and back.

A batch is the msgpack array `[timestamp, [event, ...], data_parallel_rank]`; each event a map tagged by its
class name under `"type"` (vLLM's `msgspec` structs with `tag=True`: `vllm-router` 0.1.17 refuses the older
array-shaped events with "KV event must be a tagged map"). A ZMQ message is three frames: the topic, the batch's
sequence number (8 bytes, big-endian) and the batch. A replay request is one frame, the first sequence number
wanted; the answer is one `[sequence, batch]` message per batch still held, then `[-1, b""]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

MEDIUM = "GPU"  # vLLM's name for the engine's own KV memory (here RAM): the tier routers credit in full
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class BlockStored:
    """Consecutive blocks now cached: `block_hashes[i]` holds `token_ids[i*block_size:(i+1)*block_size]`, each the
    child of the one before it, the first the child of `parent_block_hash` (None: it starts a prompt)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


def event_map(event: KvEvent) -> dict[str, Any]:
    """An event as vLLM's encoder writes it (fields without a default are always present)."""
    if isinstance(event, BlockStored):
        return {"type": "BlockStored", "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
                "block_size": event.block_size, "lora_id": None, "medium": MEDIUM, "lora_name": None}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": MEDIUM}
    return {"type": "AllBlocksCleared"}


def encode_batch(timestamp: float, events: list[KvEvent], rank: int = 0) -> bytes:
    return msgpack.packb([timestamp, [event_map(event) for event in events], rank])


def decode_batch(payload: bytes) -> tuple[float, list[KvEvent], int | None]:
    """A batch back to (timestamp, events, rank), as a consumer reads it.

    Raises:
        ValueError: not a batch in the current layout (naming what is wrong).
    """
    batch = msgpack.unpackb(payload)
    if not isinstance(batch, list) or len(batch) not in (2, 3):
        raise ValueError("a KV event batch must be an array [timestamp, events, rank]")
    timestamp, raw = batch[0], batch[1]
    if not isinstance(timestamp, float) or not isinstance(raw, list):
        raise ValueError("a KV event batch holds a float timestamp and an array of events")
    return timestamp, [_event(item) for item in raw], batch[2] if len(batch) == 3 else None


def _event(item: Any) -> KvEvent:
    if not isinstance(item, dict) or "type" not in item:
        raise ValueError("KV event must be a tagged map")
    kind = item["type"]
    if kind == "BlockStored":
        return BlockStored(tuple(item["block_hashes"]), item["parent_block_hash"], tuple(item["token_ids"]),
                           item["block_size"])
    if kind == "BlockRemoved":
        return BlockRemoved(tuple(item["block_hashes"]))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event type {kind!r}")


def sequence_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big")
