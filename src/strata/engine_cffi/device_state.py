"""A hybrid model's recurrent state on the device (`DeviceEngine`): per sequence, each recurrent layer's conv state
then its delta-rule state, the CPU engine's layout (`rec_state_of`), so `save_state` gives the bytes the CPU
engine's gives and either engine loads them.

The rules are the CPU engine's (`strata_keep`, `strata_copy_prefix`, `strata_state_save`/`_load`): a state cannot
be cut back, so keeping fewer positions than a sequence holds, copying a shorter prefix or importing rows leaves
the sequence's state invalid until `load` sets it (or a keep(0) clears it); an invalid state is neither saved nor
evaluated. What differs: an abort drops a sequence between two chunks (the device backend's chunks are whole),
so the state of a dropped sequence is the one at the positions it holds, and stays valid.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from strata.engine_cffi import EngineError
from strata.engine_cffi.device import Device


class RecurrentState:
    """`n_seq` slots of `floats` float32 values each in one allocation of `device`, zero (an empty sequence's);
    `floats` 0 for a model without recurrent layers, whose every prefix stays valid."""

    def __init__(self, device: Device, n_seq: int, floats: int) -> None:
        self.device, self.n_seq, self.floats = device, n_seq, floats
        self.base = device.alloc(max(4 * n_seq * floats, 1))
        device.memset(self.base, 0, max(4 * n_seq * floats, 1))
        self.valid = [True] * n_seq
        self.spare: Any = None  # a slot's spare each, for `checkpoint` (allocated at the first)

    def at(self, seq: int, offset: int = 0) -> Any:
        """A device pointer to value `offset` of slot `seq`."""
        return self.device.ffi.cast("float *", self.base) + seq * self.floats + offset

    def clear(self, seq: int) -> None:
        """Slot `seq` = an empty sequence's state (zero), valid."""
        if self.floats:
            self.device.memset(self.at(seq), 0, 4 * self.floats)
        self.valid[seq] = True

    def cut(self, seq: int) -> None:
        """Sequence `seq` lost positions its state took in (or gained rows without one): invalid, where there is a
        state."""
        if self.floats:
            self.valid[seq] = False

    def check(self, seq: int) -> None:
        """Raise unless sequence `seq` can be evaluated."""
        if not self.valid[seq]:
            raise EngineError(f"sequence {seq}'s recurrent state was cut back (keep or copy_prefix to fewer positions "
                              "than it held, or rows imported): load a saved state or keep(0)")

    def save(self, seq: int) -> bytes:
        if not self.valid[seq]:
            raise EngineError(f"sequence {seq}: its recurrent state was cut back; nothing to save")
        out = np.empty(self.floats, np.float32)
        if self.floats:
            self.device.download(out, self.at(seq))
            self.device.sync()
        return out.tobytes()

    def load(self, seq: int, data: bytes) -> None:
        if len(data) != 4 * self.floats:
            raise EngineError(f"a state of {len(data)} bytes; this model's is {4 * self.floats}")
        if self.floats:
            self.device.upload(self.at(seq), np.frombuffer(data, np.float32))
            self.device.sync()  # the caller's bytes are read by now
        self.valid[seq] = True

    def checkpoint(self, seq: int) -> None:
        """Slot `seq`'s state kept in its spare for `restore`: a copy on the device, queued before the step that
        changes the slot. The spares are allocated at the first (DeviceError where the device has no room)."""
        if not self.floats:
            return
        if self.spare is None:
            self.spare = self.device.alloc(4 * self.n_seq * self.floats)
        self.device.copy(self._spare_at(seq), self.at(seq), 4 * self.floats)

    def restore(self, seq: int) -> None:
        """Slot `seq` = its spare (a copy on the device), valid."""
        if self.floats:
            self.device.copy(self.at(seq), self._spare_at(seq), 4 * self.floats)
        self.valid[seq] = True

    def _spare_at(self, seq: int) -> Any:
        return self.device.ffi.cast("float *", self.spare) + seq * self.floats

    def copy(self, src: int, dst: int) -> None:
        """Slot `dst` = slot `src` (a copy on the device), and its validity."""
        if self.floats:
            self.device.copy(self.at(dst), self.at(src), 4 * self.floats)
        self.valid[dst] = self.valid[src]
