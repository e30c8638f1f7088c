"""The directory of KV blocks: one file per block or state record, an index of them in memory, LRU by bytes, a
lock.

A block's file, `<name in hex>.kvb`, is a header then the payload:

    magic "STKV", format version (u32), sha256 of the KV identity (32 bytes), the block's name (32 bytes),
    first position (u32), positions (u32), payload bytes (u64), state bytes (u64), CRC-32C of payload and state
    (u32), zeros to 128 bytes

The payload is the block's exported rows (`Engine.export_kv`), and a block has no state bytes. A hybrid model's
state record (named by `blocks.state_name`) is a file of the same form: its payload is the rows from the start of
the block its position falls in up to that position (none at a block's end), its state bytes the recurrent state
there (`Engine.save_state`); the positions its header names end where the state belongs. Records and blocks share
the budget, the LRU order and every check below. A file is written under a temporary name and renamed, so a
reader sees a whole file or none.

At startup the index is rebuilt from the headers: a file of another identity (model file, KV type, layout) or
format, with a bad header, or whose size is not what its header says (truncated), is removed. The payload's
checksum is checked as a block is read: a corrupt block is removed then, never imported. One server at a time
uses a directory: it holds an exclusive `flock` on its `LOCK` file, and a second one is refused with a message
naming the directory.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import os
import struct
import threading
from pathlib import Path

import numpy as np

from strata.engine_cffi import crc32c

MAGIC = b"STKV"
VERSION = 1
_HEADER = struct.Struct("<4sI32s32sIIQQI")
HEADER_BYTES = 128
SUFFIX = ".kvb"


class KvDiskError(OSError):
    """The KV directory cannot be used (another server holds it, or it cannot be created)."""


class CorruptBlock(OSError):
    """A block whose payload does not match its checksum (it is removed)."""


class BlockStore:
    """The blocks of one KV identity in `path`, at most `max_bytes` of files (the least recently used go first).

    Thread-safe: the writer thread puts, the reader thread gets, the engine thread asks what is there.

    Raises:
        KvDiskError: (from the constructor) the directory cannot be created, or another process holds its lock.
    """

    def __init__(self, path: str | os.PathLike[str], identity: str, max_bytes: int):
        self.path, self.max_bytes = Path(path), max_bytes
        self._identity = hashlib.sha256(identity.encode()).digest()
        try:
            self.path.mkdir(parents=True, exist_ok=True, mode=0o700)  # the blocks are prompts' KV: owner only
            self._lock_fd = os.open(self.path / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as error:
            raise KvDiskError(f"kv_disk: cannot use {self.path}: {error.strerror or error}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise KvDiskError(f"kv_disk: {self.path} is in use by another server (its LOCK file is held); give each "
                              "server a directory of its own") from None
        self._lock = threading.Lock()
        self._index: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # file bytes, least recent first
        self._state_ends: dict[bytes, int] = {}  # the state records' names -> the positions their states belong at
        self._ends: collections.Counter[int] = collections.Counter()  # those positions, counted
        self.bytes = 0
        self.removed = 0  # files removed at startup or on reading: another identity, truncated, corrupt
        try:
            self._scan()
            self._evict()
        except OSError as error:
            self.close()
            raise KvDiskError(f"kv_disk: cannot read {self.path}: {error.strerror or error}") from None

    # --- the index

    def _scan(self) -> None:
        """Rebuild the index from the files' headers, oldest use first; remove what cannot be ours."""
        found = []
        for entry in os.scandir(self.path):
            if entry.name.endswith(".tmp"):  # a write that a crash cut short
                self._remove_file(Path(entry.path), bad=True)
                continue
            if not entry.name.endswith(SUFFIX):
                continue
            checked = self._checked(Path(entry.path))
            if checked is None:
                self._remove_file(Path(entry.path), bad=True)
                continue
            found.append((entry.stat().st_mtime_ns, bytes.fromhex(entry.name[:-len(SUFFIX)]), *checked))
        for _, name, size, end in sorted(found, key=lambda row: row[0]):
            self._add(name, size, end)

    def _checked(self, file: Path) -> tuple[int, int | None] | None:
        """The file's size and, for a state record, the position its state belongs at, if its header is ours and
        says that size; else None."""
        try:
            with open(file, "rb") as f:
                header = f.read(HEADER_BYTES)
                size = os.fstat(f.fileno()).st_size
        except OSError:
            return None
        if len(header) < HEADER_BYTES:
            return None
        magic, version, identity, name, first, n, payload, state, _ = _HEADER.unpack_from(header)
        if (magic, version, identity) != (MAGIC, VERSION, self._identity) or name.hex() + SUFFIX != file.name:
            return None
        if size != HEADER_BYTES + payload + state:
            return None
        return size, first + n if state else None

    def _add(self, name: bytes, size: int, end: int | None) -> None:
        """Index a file (the caller holds the lock, or the constructor runs)."""
        self._index[name] = size
        self.bytes += size
        if end is not None:
            self._state_ends[name] = end
            self._ends[end] += 1

    def _pop(self, name: bytes) -> None:
        """Unindex a file (the caller holds the lock)."""
        size = self._index.pop(name, None)
        if size is not None:
            self.bytes -= size
        end = self._state_ends.pop(name, None)
        if end is not None:
            self._ends[end] -= 1
            if not self._ends[end]:
                del self._ends[end]

    def __contains__(self, name: bytes) -> bool:
        return name in self._index

    def __len__(self) -> int:
        return len(self._index)

    @property
    def states(self) -> int:
        """How many of the files are state records."""
        return len(self._state_ends)

    def state_ends(self, after: int, limit: int) -> list[int]:
        """The positions in (after, limit] that some state record's state belongs at, decreasing."""
        with self._lock:
            return sorted((end for end in self._ends if after < end <= limit), reverse=True)

    def present(self, names: list[bytes], start: int = 0) -> int:
        """How many of names[start:] are stored, consecutively from start."""
        end = start
        with self._lock:
            while end < len(names) and names[end] in self._index:
                end += 1
        return end - start

    # --- blocks

    def put(self, name: bytes, first: int, n: int, payload: bytes | memoryview, state: bytes = b"") -> None:
        """Store a block, or with `state` a state record (then drop the least recently used files beyond
        `max_bytes`; a file larger than that is not stored).

        Raises:
            OSError: the write failed (a full disk: ENOSPC); nothing of it is left.
        """
        size = HEADER_BYTES + len(payload) + len(state)
        if size > self.max_bytes or name in self._index:
            return
        header = _HEADER.pack(MAGIC, VERSION, self._identity, name, first, n, len(payload), len(state),
                              crc32c(state, crc32c(payload)))
        final = self.path / (name.hex() + SUFFIX)
        temporary = final.with_suffix(".tmp")
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with open(fd, "wb") as f:
                f.write(header.ljust(HEADER_BYTES, b"\0"))
                f.write(payload)
                f.write(state)
            temporary.rename(final)
        except OSError:
            self._remove_file(temporary)
            raise
        with self._lock:
            self._add(name, size, first + n if state else None)
        self._evict()

    def get(self, name: bytes) -> tuple[int, memoryview, memoryview]:
        """(first position, payload, state) of a stored block or state record, now the most recently used.

        Raises:
            KeyError: not stored.
            CorruptBlock: its bytes do not match its checksum, or its header changed (it is removed).
            OSError: the read failed.
        """
        with self._lock:
            expected = self._index[name]
            self._index.move_to_end(name)
        file = self.path / (name.hex() + SUFFIX)
        # one byte more: a file that grew is seen; not zeroed, as a bytearray is (1.5x slower from the page cache)
        data = memoryview(np.empty(expected + 1, np.uint8)).cast("B")  # type: ignore[arg-type]
        try:
            with open(file, "rb", buffering=0) as f:
                size = f.readinto(data)
        except FileNotFoundError:
            self._forget(name)
            raise
        if size != expected:
            self._drop(name, file)
            raise CorruptBlock(f"{file.name}: {size} bytes, not {expected}")
        _, _, _, _, first, _, payload, state, crc = _HEADER.unpack_from(data)
        body = data[HEADER_BYTES:size]
        if crc32c(body) != crc or len(body) != payload + state:
            self._drop(name, file)
            raise CorruptBlock(f"{file.name}: its bytes do not match its checksum")
        return first, body[:payload], body[payload:]

    def touch(self, names: list[bytes]) -> list[bytes]:
        """Make stored blocks the most recently used (a slot that holds them in memory just used them); returns
        those that are stored, whose files' times `touch_files` then moves."""
        with self._lock:
            stored = [name for name in names if name in self._index]
            for name in stored:
                self._index.move_to_end(name)
        return stored

    def touch_files(self, names: list[bytes]) -> None:
        """Set the blocks' files' times to now: the order a restart rebuilds."""
        for name in names:
            with contextlib.suppress(OSError):
                os.utime(self.path / (name.hex() + SUFFIX))

    def prefetch(self, name: bytes) -> int:
        """Ask the kernel to read a block's file into its page cache in the background (the reader checks one
        block's checksum while the disk reads the next); returns its bytes (0: not stored)."""
        size = self._index.get(name, 0)
        try:
            fd = os.open(self.path / (name.hex() + SUFFIX), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return 0
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
        return size

    def close(self) -> None:
        """Release the directory's lock (the files stay)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # --- removal

    def _evict(self) -> None:
        while True:
            with self._lock:
                if self.bytes <= self.max_bytes or not self._index:
                    return
                name = next(iter(self._index))
                self._pop(name)
            self._remove_file(self.path / (name.hex() + SUFFIX))

    def _forget(self, name: bytes) -> None:
        with self._lock:
            self._pop(name)

    def _drop(self, name: bytes, file: Path) -> None:
        self._forget(name)
        self._remove_file(file, bad=True)

    def _remove_file(self, file: Path, bad: bool = False) -> None:
        with contextlib.suppress(FileNotFoundError):
            file.unlink()
            self.removed += bad
