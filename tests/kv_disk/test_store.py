"""The directory of blocks: what survives a restart, what is removed instead of loaded, the byte budget, the
lock, and a disk that is full."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from strata.kv_disk.blocks import block_hashes
from strata.kv_disk.store import HEADER_BYTES, BlockStore, CorruptBlock, KvDiskError
from strata.kv_disk.writer import BlockWriter

IDENTITY = "model-a:f16:layout1"


def _name(i: int) -> bytes:
    return block_hashes(IDENTITY, list(range(8 * (i + 1))), 8)[-1]


def _payload(i: int, size: int = 1000) -> bytes:
    return bytes([i % 251]) * size


def test_blocks_survive_a_restart(tmp_path: Path) -> None:
    store = BlockStore(tmp_path / "kv", IDENTITY, 10**6)
    store.put(_name(0), 0, 8, _payload(0))
    store.put(_name(1), 8, 8, _payload(1))
    store.close()
    again = BlockStore(tmp_path / "kv", IDENTITY, 10**6)
    assert len(again) == 2 and again.bytes == 2 * (HEADER_BYTES + 1000) and again.removed == 0
    # the blocks are prompts' KV: the directory and its files are the owner's only
    assert (tmp_path / "kv").stat().st_mode & 0o777 == 0o700
    assert {f.stat().st_mode & 0o777 for f in (tmp_path / "kv").iterdir()} == {0o600}
    first, payload, state = again.get(_name(1))
    assert (first, bytes(payload), bytes(state)) == (8, _payload(1), b"")
    again.close()


def test_another_model_a_truncated_file_and_a_corrupt_block_are_removed(tmp_path: Path) -> None:
    other = BlockStore(tmp_path, "model-b:f16:layout1", 10**6)
    other.put(_name(0), 0, 8, _payload(0))  # the same name under another model's identity
    other.close()
    store = BlockStore(tmp_path, IDENTITY, 10**6)
    assert len(store) == 0 and store.removed == 1 and not list(tmp_path.glob("*.kvb"))
    for i in (1, 2):
        store.put(_name(i), 8 * i, 8, _payload(i))
    store.close()
    files = {i: tmp_path / (_name(i).hex() + ".kvb") for i in (1, 2)}
    files[1].write_bytes(files[1].read_bytes()[:-10])  # truncated
    data = bytearray(files[2].read_bytes())
    data[HEADER_BYTES + 500] ^= 0xFF  # one byte of the payload flipped: the size is right, the checksum is not
    files[2].write_bytes(bytes(data))
    (tmp_path / "junk.tmp").write_bytes(b"half a write")
    store = BlockStore(tmp_path, IDENTITY, 10**6)
    assert _name(1) not in store and not files[1].exists() and not (tmp_path / "junk.tmp").exists()
    assert _name(2) in store  # only reading finds it corrupt
    with pytest.raises(CorruptBlock):
        store.get(_name(2))
    assert _name(2) not in store and not files[2].exists() and store.bytes == 0
    store.close()


def test_the_byte_budget_holds_least_recently_used_first(tmp_path: Path) -> None:
    block = HEADER_BYTES + 1000
    store = BlockStore(tmp_path, IDENTITY, 3 * block)
    for i in range(3):
        store.put(_name(i), 8 * i, 8, _payload(i))
    store.get(_name(0))  # used again: block 1 is now the least recently used
    store.put(_name(3), 24, 8, _payload(3))
    assert [i for i in range(4) if _name(i) in store] == [0, 2, 3]
    assert store.bytes == 3 * block == sum(f.stat().st_size for f in tmp_path.glob("*.kvb"))
    store.close()
    os.utime(tmp_path / (_name(2).hex() + ".kvb"), ns=(0, 0))  # the oldest use, as a restart reads it
    smaller = BlockStore(tmp_path, IDENTITY, 2 * block)  # a smaller budget at startup drops the oldest
    assert [i for i in range(4) if _name(i) in smaller] == [0, 3]
    smaller.close()


def test_state_records_are_indexed_by_position_and_share_the_budget(tmp_path: Path) -> None:
    """A hybrid model's state record (rows from its block's start, then a state) survives a restart with the
    position its state belongs at, counts in the byte budget, is evicted by the LRU order as a block is, and is
    removed at startup under another identity."""
    block, record = HEADER_BYTES + 1000, HEADER_BYTES + 300 + 2000
    store = BlockStore(tmp_path, IDENTITY, 2 * block + record)
    store.put(_name(0), 0, 8, _payload(0))
    store.put(_name(5), 8, 3, _payload(5, 300), state=_payload(6, 2000))  # the state at position 11
    store.put(_name(1), 8, 8, _payload(1))
    assert store.states == 1 and store.state_ends(0, 11) == [11] and store.state_ends(11, 100) == []
    store.close()
    again = BlockStore(tmp_path, IDENTITY, 2 * block + record)
    assert again.states == 1 and again.state_ends(0, 100) == [11] and again.bytes == 2 * block + record
    first, payload, state = again.get(_name(5))
    assert (first, bytes(payload), bytes(state)) == (8, _payload(5, 300), _payload(6, 2000))
    again.put(_name(2), 16, 8, _payload(2))  # over the budget: block 0, the least recently used, goes
    assert _name(0) not in again and again.states == 1
    again.put(_name(3), 24, 8, _payload(3))  # then block 1 (the record was read after it)
    assert _name(1) not in again and again.states == 1
    again.put(_name(4), 32, 8, _payload(4))  # then the record
    assert _name(5) not in again and again.states == 0 and again.state_ends(0, 100) == []
    assert again.bytes == 3 * block == sum(f.stat().st_size for f in tmp_path.glob("*.kvb"))
    again.put(_name(6), 40, 2, _payload(6, 200), state=_payload(7, 500))
    again.close()
    other = BlockStore(tmp_path, "model-b:f16:layout1", 10**6)  # another model: its records go with its blocks
    assert len(other) == other.states == 0 and other.removed == 4 and not list(tmp_path.glob("*.kvb"))
    other.close()


def test_blocks_a_slot_used_again_are_kept_longest(tmp_path: Path) -> None:
    """Blocks that a conversation used from memory (saved before, so not written again) are touched at its save:
    they go after blocks nobody used since, now and after a restart."""
    block = HEADER_BYTES + 1000
    store = BlockStore(tmp_path, IDENTITY, 3 * block)
    for i in range(3):
        store.put(_name(i), 8 * i, 8, _payload(i))
        os.utime(tmp_path / (_name(i).hex() + ".kvb"), ns=(i * 10**9, i * 10**9))  # written in this order
    writer = BlockWriter(store, 10**6)
    writer.touch([_name(0), _name(5)])  # one stored, one not
    writer.close()
    assert os.stat(tmp_path / (_name(0).hex() + ".kvb")).st_mtime_ns > 2 * 10**9
    store.put(_name(3), 24, 8, _payload(3))
    assert [i for i in range(4) if _name(i) in store] == [0, 2, 3]
    store.close()
    again = BlockStore(tmp_path, IDENTITY, 2 * block)  # the restart's order: 2, then 0 and 3 (just now)
    assert [i for i in range(4) if _name(i) in again] == [0, 3]
    again.close()


def test_a_second_process_on_the_directory_is_refused(tmp_path: Path) -> None:
    store = BlockStore(tmp_path, IDENTITY, 10**6)
    code = ("import sys\nfrom strata.kv_disk.store import BlockStore, KvDiskError\n"
            "try:\n    BlockStore(sys.argv[1], 'x', 1000)\nexcept KvDiskError as e:\n    print(e)\n    sys.exit(3)\n")
    other = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert other.returncode == 3, other.stderr
    assert "in use by another server" in other.stdout and str(tmp_path) in other.stdout
    with pytest.raises(KvDiskError, match="in use"):  # a second store in this process is refused too
        BlockStore(tmp_path, IDENTITY, 10**6)
    store.close()
    BlockStore(tmp_path, IDENTITY, 10**6).close()  # released: the next server takes it


class _FullDisk(BlockStore):
    def put(self, name: bytes, first: int, n: int, payload: bytes | memoryview, state: bytes = b"") -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_drops_writes_with_one_warning(tmp_path: Path) -> None:
    lines: list[str] = []
    store = _FullDisk(tmp_path, IDENTITY, 10**6)
    writer = BlockWriter(store, 10**6, lines.append)
    for i in range(3):
        assert writer.offer(_name(i), 8 * i, 8, memoryview(_payload(i)))
    writer.close()
    assert writer.failed == 3 and writer.written == 0 and len(store) == 0
    assert len(lines) == 1 and "No space left on device" in lines[0], lines
    store.close()


def test_the_write_queue_is_bounded(tmp_path: Path) -> None:
    store = BlockStore(tmp_path, IDENTITY, 10**6)
    writer = BlockWriter(store, 1500)
    gate = store.put
    started = time.monotonic()

    def slow_put(*args: object, **kw: object) -> None:
        time.sleep(0.05)
        gate(*args, **kw)  # type: ignore[arg-type]

    store.put = slow_put  # type: ignore[method-assign]
    assert writer.offer(_name(0), 0, 8, memoryview(_payload(0)))
    assert not writer.offer(_name(1), 8, 8, memoryview(_payload(1)))  # 2000 bytes would not fit 1500: dropped at once
    assert time.monotonic() - started < 0.04 and writer.dropped == 1
    writer.close()
    assert writer.written == 1 and _name(0) in store
    store.close()
