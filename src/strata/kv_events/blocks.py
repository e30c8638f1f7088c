"""Which KV blocks a replica holds, as the batcher's slots change: the events that say so.

A slot's cache is cut into blocks of `block_size` positions; a block is announced (`BlockStored`) once the slot's
cache covers it whole, and removed (`BlockRemoved`) when no slot holds it any more (its slot was cut back or
overwritten by another conversation). Several slots may hold the same block (a shared system prompt copied from
slot to slot): it is announced by the first and removed with the last, so a consumer's index is a set.

Block hashes chain as vLLM's do: a block's hash covers its parent's hash and its own token ids (`block_hash`), so
equal tokens after different prefixes are different blocks. A prompt's `cache_salt` joins the first block's hash
(the keys the batcher gives a salted prompt start with `("salt", salt, key)`, `strata.scheduling.batcher.salted`).
A slot announces only its plain-token prefix: a picture's rows (keyed by its digest) and everything after them
are left out, since a router that holds only a request's token ids cannot match them.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Callable, Hashable, Sequence

from strata.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

# A block: (its hash, its token ids).
_Block = tuple[int, tuple[int, ...]]


def block_hash(parent: int | None, tokens: Sequence[int], salt: str | None = None) -> int:
    """A block's hash: SHA-256 over its parent's hash (8 bytes, big-endian; none for a prompt's first block), its
    salt and its token ids (4 bytes each, little-endian), cut to the first 8 bytes, as an unsigned integer (what
    vLLM's `ExternalBlockHash` is on the wire)."""
    digest = hashlib.sha256()
    if parent is not None:
        digest.update(parent.to_bytes(8, "big"))
    if salt is not None:
        digest.update(b"salt\0" + salt.encode() + b"\0")
    digest.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return int.from_bytes(digest.digest()[:8], "big")


class KvBlocks:
    """The replica's blocks, slot by slot, and the events that follow them (the batcher's observer).

    `on_blocks` runs in the engine thread and hands its events to `publish` there, under `lock`; `restate` (the
    publisher's thread) takes the same lock to read the whole state.

    Args:
        block_size: positions per block (the router's `--kv-event-block-size`).
        publish: takes one call's events; must not block.
    """

    def __init__(self, block_size: int, publish: Callable[[list[KvEvent]], object]):
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self._publish = publish
        self._slots: dict[int, list[_Block]] = {}  # seq -> its announced blocks, in order
        self._refs: dict[int, int] = {}  # block hash -> slots holding it
        self.lock = threading.Lock()

    def on_blocks(self, seq: int, keys: Sequence[Hashable], n: int, kept: int) -> None:
        """Slot `seq` now holds `keys[:n]` in a form a request can resume from; its first `kept` positions are
        unchanged since the last call for it."""
        size = self.block_size
        with self.lock:
            have = self._slots.setdefault(seq, [])
            keep = min(len(have), kept // size, n // size)
            gone = have[keep:]
            del have[keep:]
            for i in range(keep, n // size):
                block = _block_tokens(keys, i * size, size)
                if block is None:
                    break
                salt, tokens = block
                have.append((block_hash(have[-1][0] if have else None, tokens, salt), tokens))
            events = self._count(have[keep:], have[keep - 1][0] if keep else None, gone)
            if events:
                self._publish(events)

    def restate(self, under_lock: Callable[[], object] = lambda: None) -> list[KvEvent]:
        """Everything held, as the events that rebuild a consumer's index from nothing (`AllBlocksCleared` first);
        `under_lock` runs while no slot can change (the publisher drops the events it had not sent yet)."""
        with self.lock:
            under_lock()
            events: list[KvEvent] = [AllBlocksCleared()]
            seen: set[int] = set()
            for blocks in self._slots.values():
                fresh = [i for i, (block, _) in enumerate(blocks) if block not in seen]
                seen.update(block for block, _ in blocks)
                events += self._runs(blocks, fresh)
            return events

    def held(self) -> set[int]:
        """The hashes of every block some slot holds."""
        with self.lock:
            return set(self._refs)

    def _count(self, added: list[_Block], parent: int | None, gone: list[_Block]) -> list[KvEvent]:
        """Count the slot's new blocks in and its lost ones out: the blocks no other slot held are stored (in runs
        of consecutive blocks), those no slot holds any more removed."""
        fresh = []
        for i, (block, _) in enumerate(added):
            self._refs[block] = self._refs.get(block, 0) + 1
            if self._refs[block] == 1:
                fresh.append(i)
        removed = []
        for block, _ in reversed(gone):
            self._refs[block] -= 1
            if not self._refs[block]:
                del self._refs[block]
                removed.append(block)
        events: list[KvEvent] = self._runs(added, fresh, parent)
        if removed:
            events.append(BlockRemoved(tuple(removed)))
        return events

    def _runs(self, blocks: list[_Block], fresh: list[int], parent: int | None = None) -> list[KvEvent]:
        """`BlockStored` events for `blocks[i]` for i in `fresh` (increasing), one per run of consecutive ones,
        each naming its first block's parent (`parent` for `blocks[0]`)."""
        events: list[KvEvent] = []
        start = None
        for j, i in enumerate(fresh):
            if start is None:
                start = i
            if j + 1 == len(fresh) or fresh[j + 1] != i + 1:
                run = blocks[start:i + 1]
                events.append(BlockStored(tuple(block for block, _ in run),
                                          blocks[start - 1][0] if start else parent,
                                          tuple(token for _, tokens in run for token in tokens), self.block_size))
                start = None
        return events


def _block_tokens(keys: Sequence[Hashable], start: int, size: int) -> tuple[str | None, tuple[int, ...]] | None:
    """The salt and token ids of the block at `start`, or None when a position there holds no plain token."""
    block = list(keys[start:start + size])
    salt = None
    first = block[0]
    if start == 0 and isinstance(first, tuple) and len(first) == 3 and first[0] == "salt":
        salt, block[0] = str(first[1]), first[2]
    if all(type(key) is int for key in block):
        return salt, tuple(block)  # type: ignore[arg-type]  # checked: every key is an int
    return None
