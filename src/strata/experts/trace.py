"""Routing traces: which experts each MoE layer chose for each token of each engine step.

The engine fills a record buffer as it runs (`strata_record_routing`); `RoutingRecorder` drains it after each eval
into a file, and `read_trace` reads the file back.

The file (little-endian):
    8 bytes   b"STRATART"  magic, format version 1
    4 bytes   uint32       length of the JSON header that follows
    header    JSON         {"model": name, "arch": ..., "n_layer": ..., "n_expert": ..., "n_expert_used": k}
    records   int32        one per (step, MoE layer): step, layer, n_tok, then n_tok x k expert ids (each token's
                           experts, the most probable first)
A step is one forward pass of the engine (an eval call of more than `batch` tokens takes several), counted from 0
when recording started. A record cut short (a process that died while writing) ends the trace.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

MAGIC = b"STRATART"
RECORD_HEAD = 3  # ints before a record's expert ids


class TraceError(ValueError):
    """A file that is not a routing trace, or one whose header lacks a field."""


@dataclass(frozen=True)
class TraceInfo:
    """What a trace is of: the model and its routing's shape."""

    model: str
    arch: str
    n_layer: int
    n_expert: int
    n_expert_used: int

    def to_json(self) -> bytes:
        return json.dumps({"model": self.model, "arch": self.arch, "n_layer": self.n_layer,
                           "n_expert": self.n_expert, "n_expert_used": self.n_expert_used}).encode()


@dataclass(frozen=True)
class LayerStep:
    """One MoE layer's choices in one step."""

    step: int
    layer: int
    experts: np.ndarray  # (n_tok, n_expert_used) int32 expert ids

    def used(self) -> np.ndarray:
        """The distinct experts the step needs in this layer, ascending."""
        return np.unique(self.experts)


@dataclass(frozen=True)
class RoutingTrace:
    info: TraceInfo
    records: list[LayerStep]  # in the order the engine ran them: by step, then by layer

    @property
    def n_steps(self) -> int:
        return self.records[-1].step + 1 if self.records else 0

    def steps(self) -> Iterator[list[LayerStep]]:
        """The records grouped by step, each step's layers in order."""
        group: list[LayerStep] = []
        for record in self.records:
            if group and record.step != group[0].step:
                yield group
                group = []
            group.append(record)
        if group:
            yield group


class RoutingRecorder:
    """Writes the engine's routing records to a trace file: `buffer` before each eval gives the array the engine
    fills, `write` after it appends what the engine wrote. Not thread-safe: the thread that evaluates owns it."""

    def __init__(self, path: str | os.PathLike[str], info: TraceInfo) -> None:
        self.info = info
        self._steps = 0  # forward passes recorded so far
        self._buffer = np.zeros(0, np.int32)
        self._file: BinaryIO | None = open(path, "wb")  # noqa: SIM115 (closed by close())
        header = info.to_json()
        self._file.write(MAGIC + struct.pack("<I", len(header)) + header)

    def buffer(self, n_tokens: int, n_chunks: int) -> np.ndarray:
        """The record buffer for an eval of `n_tokens` tokens in `n_chunks` chunks: room for every layer's record
        of every chunk."""
        need = self.info.n_layer * (RECORD_HEAD * n_chunks + n_tokens * self.info.n_expert_used)
        if self._buffer.size < need:
            self._buffer = np.zeros(need, np.int32)
        return self._buffer

    def write(self, used: int, n_chunks: int) -> None:
        """Append the first `used` ints of the buffer, records of the eval that ran `n_chunks` chunks (their chunk
        field becomes the step)."""
        assert self._file is not None, "write after close"
        records = self._buffer[:used].copy()
        at = 0
        while at < used:
            records[at + 1] += self._steps  # the chunk's index in its call -> the step
            records[[at, at + 1]] = records[[at + 1, at]]  # (layer, step) -> (step, layer)
            at += RECORD_HEAD + int(records[at + 2]) * self.info.n_expert_used
        self._file.write(records.astype("<i4").tobytes())
        self._steps += n_chunks

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_trace(path: str | os.PathLike[str]) -> RoutingTrace:
    """The trace in a file that `RoutingRecorder` wrote.

    Raises:
        TraceError: not a routing trace (magic), or a header that is not JSON or lacks a field.
    """
    with open(path, "rb") as file:
        data = file.read()
    if data[: len(MAGIC)] != MAGIC or len(data) < len(MAGIC) + 4:
        raise TraceError(f"{path}: not a routing trace (no {MAGIC.decode()} magic)")
    (n_header,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        header = json.loads(data[start : start + n_header])
        info = TraceInfo(str(header["model"]), str(header["arch"]), int(header["n_layer"]), int(header["n_expert"]),
                         int(header["n_expert_used"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise TraceError(f"{path}: bad trace header: {exc!r}") from None
    body = data[start + n_header :]
    ints = np.frombuffer(body[: len(body) // 4 * 4], dtype="<i4")
    records: list[LayerStep] = []
    at, k = 0, info.n_expert_used
    while at + RECORD_HEAD <= ints.size:
        step, layer, n_tok = (int(v) for v in ints[at : at + RECORD_HEAD])
        end = at + RECORD_HEAD + n_tok * k
        if end > ints.size:
            break  # cut short
        records.append(LayerStep(step, layer, ints[at + RECORD_HEAD : end].reshape(n_tok, k).astype(np.int32)))
        at = end
    return RoutingTrace(info, records)
