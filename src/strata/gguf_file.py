"""A GGUF file, memory-mapped: its metadata, its tensor table and views of the tensors' bytes. A model split into
several files (llama.cpp's `gguf-split`: `NAME-00001-of-0000N.gguf`, each part a GGUF file whose `split.*` keys
say which part it is, the first with all the metadata, each with its share of the tensors) reads as one file from
its first part.

`gguf.GGUFReader` builds numpy objects for every element of every metadata array up front: for a file with
Qwen's 151,936-token vocabulary that took 12 s and 520 MB of memory here, against 0.25 s and a few MB for this
sequential parse. The `gguf` package still supplies the format's constants, and tests hold this reader to
`GGUFReader`'s results.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import mmap
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
FINGERPRINT_SAMPLE = 1 << 16  # bytes of tensor data at each end that `GGUFFile.fingerprint` reads

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


class GGUFError(ValueError):
    """The file is not a GGUF file this reader understands, or it is truncated or corrupt."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGML order: shape[0] is the row length
    type: int               # GGML type id
    offset: int             # absolute byte offset of the data in the file (its part's, for a split model)
    n_bytes: int
    part: int = 0           # the part of a split model that holds it (0: the first, or the only file)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_part_path(first: str, no: int, count: int) -> str:
    """The path of part `no` (1-based) of a model split into `count` files whose first part is `first`."""
    match = SPLIT_NAME.match(first)
    stem = match["stem"] if match else first.removesuffix(".gguf")
    return f"{stem}-{no:05d}-of-{count:05d}.gguf"


class GGUFFile:
    """An open, memory-mapped GGUF file (v2 or v3), or every part of a split model from its first part. Close it,
    or use `with`, when done.

    Attributes:
        path: the file (a split model's first part).
        paths: every file it reads (a split model's parts, in order).
        metadata: key -> value: str, int, float, bool, list[str], list of lists, or a numpy array of numbers.
        tensors: the tensor table in file order (a split model's: part after part).
    Raises:
        GGUFError: (from the constructor) not GGUF, an unsupported version, a truncated or corrupt file; a part of
            a split model other than the first, or a part missing or not of the same model.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.paths = [self.path]
        self._maps: list[mmap.mmap] = []
        try:
            self.metadata, self.tensors = self._open_part(self.path, 0)
            self._map = self._maps[0]  # the (first) file's mapping
            count = int(self.metadata.get("split.count", 1))
            if count > 1:
                self._open_other_parts(count)
        except BaseException:
            for mapping in self._maps:
                mapping.close()
            raise
        self._by_name = {t.name: t for t in self.tensors}

    def _open_part(self, path: str, part: int) -> tuple[dict[str, Any], list[TensorInfo]]:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < 24:
                raise GGUFError(f"{path}: not a GGUF file (too short)")
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._maps.append(mapping)
        metadata, tensors = _Parser(mapping, path).parse()
        return metadata, [dataclasses.replace(t, part=part) for t in tensors] if part else tensors

    def _open_other_parts(self, count: int) -> None:
        """The parts after the first, named as llama.cpp names them, each checked to be the part it should be."""
        no = int(self.metadata.get("split.no", 0))
        if no != 0:
            raise GGUFError(f"{self.path}: part {no + 1} of {count} of a split model: name its first part "
                            f"({split_part_path(self.path, 1, count)})")
        for part in range(1, count):
            path = split_part_path(self.path, part + 1, count)
            if not os.path.isfile(path):
                raise GGUFError(f"{self.path}: part {part + 1} of {count} of the split model is missing ({path})")
            metadata, tensors = self._open_part(path, part)
            if int(metadata.get("split.no", -1)) != part or int(metadata.get("split.count", 0)) != count:
                raise GGUFError(f"{path}: not part {part + 1} of {count} of the split model {self.path} "
                                "(its split.no and split.count say otherwise)")
            self.paths.append(path)
            self.tensors += tensors
        expected = self.metadata.get("split.tensors.count")
        if expected is not None and int(expected) != len(self.tensors):
            raise GGUFError(f"{self.path}: the split model's parts hold {len(self.tensors)} tensors, not the "
                            f"{int(expected)} its split.tensors.count says")

    def tensor(self, name: str) -> TensorInfo | None:
        """The tensor `name`, or `name.weight` (llama.cpp's converters add the suffix), or None."""
        return self._by_name.get(name) or self._by_name.get(f"{name}.weight")

    def data(self, tensor: TensorInfo) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the mapping (never a copy)."""
        return np.frombuffer(self._maps[tensor.part], dtype=np.uint8, count=tensor.n_bytes, offset=tensor.offset)

    def release(self, tensors: Iterable[TensorInfo]) -> None:
        """Unmap the pages that lie wholly within `tensors` (bytes a reader has copied and no longer reads) from
        this process: they stop counting as its memory, the kernel keeps them in its page cache while memory
        allows, and a later read maps them in again."""
        page = mmap.PAGESIZE
        for tensor in tensors:
            start, end = -(-tensor.offset // page) * page, (tensor.offset + tensor.n_bytes) // page * page
            if end > start:
                self._maps[tensor.part].madvise(mmap.MADV_DONTNEED, start, end - start)

    def fingerprint(self) -> str:
        """A digest that names this file's contents without reading them all: its header (metadata and tensor
        table), its size, and the first and last `FINGERPRINT_SAMPLE` bytes of its tensor data (two files of one
        shape made from different weights differ there). Hex sha256."""
        start = min((t.offset for t in self.tensors), default=len(self._map))
        digest = hashlib.sha256(self._map[:start])
        digest.update(len(self._map).to_bytes(8, "little"))
        digest.update(self._map[start:start + FINGERPRINT_SAMPLE])
        digest.update(self._map[max(start, len(self._map) - FINGERPRINT_SAMPLE):])
        return digest.hexdigest()

    def close(self) -> None:
        """Unmap the file; while a view returned by `data` is still referenced, the mapping lives on with it."""
        # The views keep the mmap object alive; it unmaps when the last one goes.
        for mapping in self._maps:
            with contextlib.suppress(BufferError):
                mapping.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The metadata of a GGUF file, without mapping its tensors for longer than the parse."""
    with GGUFFile(path) as file:
        return file.metadata


class _Parser:
    """Sequential little-endian reader of a GGUF header, key-value section and tensor table."""

    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf, self.path, self.pos = buf, path, 0

    def _fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what}")

    def _unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise self._fail(f"truncated GGUF file (ends inside the header at byte {self.pos})")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def _take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise self._fail(f"truncated or corrupt GGUF file (a field of {n} bytes at byte {self.pos})")
        self.pos += n
        return self.buf[self.pos - n:self.pos]

    def _string(self) -> str:
        raw = self._take(self._unpack("<Q"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self._fail(f"corrupt GGUF file (a string at byte {self.pos - len(raw)} is not UTF-8)") from None

    def _value_type(self) -> GGUFValueType:
        raw = self._unpack("<I")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self._fail(f"corrupt GGUF file (unknown value type {raw} at byte {self.pos - 4})") from None

    def _value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype == GGUFValueType.ARRAY:
            return self._array()
        return self._unpack(_SCALAR_FORMATS[vtype])

    def _array(self) -> Any:
        vtype, count = self._value_type(), self._unpack("<Q")
        if vtype == GGUFValueType.STRING:
            if count > len(self.buf) - self.pos:  # every string costs at least its 8-byte length
                raise self._fail(f"corrupt GGUF file (an array of {count} strings at byte {self.pos})")
            return [self._string() for _ in range(count)]
        if vtype == GGUFValueType.ARRAY:
            return [self._array() for _ in range(count)]
        dtype = np.dtype(_SCALAR_FORMATS[vtype])
        values = np.frombuffer(self._take(dtype.itemsize * count), dtype)
        return values

    def parse(self) -> tuple[dict[str, Any], list[TensorInfo]]:
        if self._take(4) != GGUF_MAGIC:
            raise self._fail("not a GGUF file (it does not start with the GGUF magic)")
        version = self._unpack("<I")
        if version not in (2, 3):
            raise self._fail(f"unsupported GGUF version {version}")
        n_tensors, n_kv = self._unpack("<Q"), self._unpack("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            metadata[key] = self._value(self._value_type())
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0:
            raise self._fail(f"bad general.alignment {alignment}")
        data_start = -(-self.pos // alignment) * alignment
        tensors = []
        for name, shape, ggml_type, offset in infos:
            n_bytes = _n_bytes(name, shape, ggml_type, self.path)
            start = data_start + offset
            if start + n_bytes > len(self.buf):
                raise self._fail(f"truncated GGUF file (tensor {name} ends past the end of the file)")
            tensors.append(TensorInfo(name, shape, ggml_type, start, n_bytes))
        return metadata, tensors

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        n_dims = self._unpack("<I")
        if n_dims > 4:
            raise self._fail(f"corrupt GGUF file (tensor {name} has {n_dims} dimensions)")
        shape = tuple(self._unpack("<Q") for _ in range(n_dims))
        return name, shape, self._unpack("<I"), self._unpack("<Q")


def _n_bytes(name: str, shape: tuple[int, ...], ggml_type: int, path: str) -> int:
    try:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise GGUFError(f"{path}: tensor {name} has unknown type id {ggml_type}") from None
    n = int(np.prod(shape, dtype=np.int64))
    if shape and shape[0] % block_size:
        raise GGUFError(f"{path}: tensor {name} rows of {shape[0]} are not whole blocks of {block_size}")
    return n // block_size * type_size
