"""`KvTier`: the disk tier as the batcher sees it: a prompt's block names, the blocks that extend a cached prefix
(read on the reader thread), and a slot's blocks saved when its job leaves (written on the writer thread).

When a job leaves its slot, the slot's whole blocks not yet stored are exported on the engine thread and queued.
An export is a memcpy: 0.03 ms a 1.5 MiB block of the small Q8_0 qwen3moe in f16 (measured); Qwen3-30B-A3B's
blocks are 24 MiB, a few ms each at memory speed, and the writer's queue bounds what one leave exports. Blocks
that do not fit the queue are dropped, and saved at the slot's next leave. Saving on leave rather than on
eviction means a restart finds every conversation that ended before it, and no slot ever waits for the disk;
`Batcher.save_all` saves every idle slot's blocks, waiting for room, at a clean shutdown.

A hybrid model's slot resumes only where it has its recurrent state, so with its blocks it saves state records
(`save_states`): the state at the end of what it holds and at its snapshots, each with the rows from its block's
start (`store`). A job then resumes from the longest position of its prompt with a stored record whose blocks are
stored (`resumable`): it reads the blocks, then the record, and computes the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from strata.kv_disk.blocks import BLOCK_TOKENS, block_hashes, state_name
from strata.kv_disk.reader import BlockReader, Load
from strata.kv_disk.store import BlockStore
from strata.kv_disk.writer import BlockWriter

WRITE_QUEUE_BYTES = 256 * 2**20  # blocks exported and waiting for the disk, at most


class KvTier:
    """The blocks of one engine's KV identity in `path`.

    Raises:
        KvDiskError: (from the constructor) the directory cannot be used (another server holds it).
    """

    def __init__(self, path: str, identity: str, max_bytes: int, position_bytes: int,
                 block_tokens: int = BLOCK_TOKENS, log: Callable[[str], None] = print,
                 queue_bytes: int = WRITE_QUEUE_BYTES):
        self.identity, self.block_tokens, self.position_bytes = identity, block_tokens, position_bytes
        self.store = BlockStore(path, identity, max_bytes)
        self.writer = BlockWriter(self.store, queue_bytes, log)
        self.reader = BlockReader(self.store, log, self.writer.touch)
        if self.store.removed:
            log(f"kv_disk: removed {self.store.removed} files of {path} that were another model's, another KV "
                "type's, or damaged")

    def names(self, keys: Sequence[Hashable], start: Sequence[bytes] = ()) -> list[bytes]:
        """The names of the whole blocks of `keys` (`block_hashes`), continuing after `start`."""
        return block_hashes(self.identity, keys, self.block_tokens, start)

    def state_name(self, keys: Sequence[Hashable], position: int, names: Sequence[bytes]) -> bytes:
        """The name of the state record after keys[:position] (`blocks.state_name`; `names`: the blocks' names)."""
        return state_name(self.identity, keys, position, names, self.block_tokens)

    def stored(self, names: list[bytes], start: int) -> int:
        """How many blocks from names[start] are stored, one after another."""
        return self.store.present(names, start)

    def resumable(self, keys: Sequence[Hashable], names: list[bytes], first_block: int, after: int,
                  limit: int) -> int:
        """The longest position in (after, limit] of `keys` (whose whole blocks are `names`) with a stored state
        record whose blocks from `first_block` are stored too; 0 if none."""
        block = self.block_tokens
        top = min(limit, (first_block + self.stored(names, first_block) + 1) * block - 1)
        for end in self.store.state_ends(after, top):
            if self.state_name(keys, end, names) in self.store:
                return end
        return 0

    def read(self, names: list[bytes]) -> Load:
        """Read the blocks `names` (stored, consecutive; a state record may be the last) on the reader thread."""
        return self.reader.read(names)

    def wait(self, seconds: float) -> None:
        """Wait until some load has news (a block read, a load ended), at most `seconds`."""
        self.reader.arrived.wait(seconds)
        self.reader.arrived.clear()

    def wake(self) -> None:
        """End a `wait` now (a job was cancelled)."""
        self.reader.arrived.set()

    def save(self, engine: Any, seq: int, names: list[bytes], wait: bool = False) -> int:
        """Export the blocks `names` of `engine`'s (an `EngineLike`) sequence `seq` (its first len(names) whole
        blocks) that are neither stored nor queued, and queue them; stops at the first that finds the queue full
        (unless `wait`). Returns the blocks queued."""
        block = self.block_tokens
        n_bytes = block * self.position_bytes
        queued = 0
        self.writer.touch(names)  # the ones stored were just used: the last to go
        for i, name in enumerate(names):
            if name in self.store or self.writer.queued(name):
                continue
            if not self.writer.room(n_bytes, wait=wait):
                self.writer.drop(sum(name not in self.store for name in names[i:]))
                break
            payload = memoryview(engine.export_kv(seq, i * block, block))
            queued += self.writer.offer(name, i * block, block, payload)
        return queued

    def save_states(self, engine: Any, seq: int, keys: Sequence[Hashable], names: list[bytes],
                    states: Sequence[tuple[int, Callable[[], bytes]]], wait: bool = False) -> int:
        """Export the state records of `engine`'s sequence `seq` (which holds `keys`, whose whole blocks are
        `names`) at the positions of `states` ((position, its state when asked)), most wanted first, and queue
        those that are neither stored nor queued and whose blocks are (a record is read only after them); stops
        at the first that finds the queue full (unless `wait`). Returns the records queued."""
        block = self.block_tokens
        wanted = []
        for position, state in states:
            whole = position // block
            name = self.state_name(keys, position, names)
            saved = [n for n in names[:whole] if n in self.store or self.writer.queued(n)]
            if position > 0 and len(saved) == whole:
                wanted.append((name, whole * block, position - whole * block, state))
        self.writer.touch([name for name, *_ in wanted])
        wanted = [record for record in wanted if record[0] not in self.store and not self.writer.queued(record[0])]
        queued = 0
        for i, (name, first, n, state) in enumerate(wanted):
            if not self.writer.room(n * self.position_bytes + engine.state_bytes, wait=wait):
                self.writer.drop(len(wanted) - i)
                break
            queued += self.writer.offer(name, first, n, memoryview(engine.export_kv(seq, first, n)), state())
        return queued

    def status(self) -> dict[str, Any]:
        """The tier's size and traffic, for `/v1/status`."""
        reader, writer = self.reader, self.writer
        return {"path": str(self.store.path), "bytes": self.store.bytes, "blocks": len(self.store) - self.store.states,
                "state_records": self.store.states,
                "max_bytes": self.store.max_bytes, "block_tokens": self.block_tokens,
                "read_blocks": reader.blocks, "read_bytes": reader.bytes, "read_seconds": round(reader.seconds, 6),
                "read_failures": reader.failed, "written_blocks": writer.written, "dropped_writes": writer.dropped,
                "write_failures": writer.failed, "queued_bytes": writer.queued_bytes}

    def close(self) -> None:
        """Write what is queued, stop the threads, release the directory."""
        self.reader.close()
        self.writer.close()
        self.store.close()


