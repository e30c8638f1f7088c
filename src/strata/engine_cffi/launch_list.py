"""A run of kernel launches built once and queued by one call (`strata_dev_launch_list`): a layer of the device
backend, whose argument structs' pointers never change (activations, weights, the KV cache, the recurrent state), so
that a chunk costs a call per run of launches instead of a struct built and filled per launch.

A field whose value follows the chunk's size is given as a `Size` (`N * n_head`: the chunk's tokens times the
heads); `run` patches those fields when the sizes differ from the last run's (decode steps of the same sequences
patch nothing). Memsets between launches split the list into runs, each queued in order on the same stream.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from strata.engine_cffi.device import Device


@dataclass(frozen=True)
class Size:
    """A field's value that follows a size given to `LaunchList.run`: `factor` times the size `name`."""

    name: str
    factor: int = 1

    def __mul__(self, other: int) -> Size:
        return Size(self.name, self.factor * other)

    __rmul__ = __mul__


class LaunchList:
    """Kernel launches (and memsets) on `device`, queued in the order they were added by each `run`."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._items: list[tuple[Any, Any]] = []  # (name, argument struct) of each launch, in order
        self._memsets: list[tuple[int, Any, int | Size]] = []  # (launches before it, pointer, bytes)
        self._sized: list[tuple[Any, str, Size]] = []  # (struct, field, its size)
        self._names: dict[str, Any] = {}  # each kernel's name as a C string, kept alive with the list
        self._array: Any = None  # the items as strata_dev_launch_items, built at the first run
        self._runs: list[tuple[Any, int]] = []  # (pointer into the array, launches) before each memset and after
        self._sizes: dict[str, int] | None = None

    def launch(self, name: str, **fields: Any) -> None:
        """Add kernel `name` with its argument struct's fields (as `Device.launch` takes them, or `Size`s)."""
        sized = {field: value for field, value in fields.items() if isinstance(value, Size)}
        args = self.device.arguments(name, **(fields | dict.fromkeys(sized, 0)))
        self._sized += [(args[0], field, size) for field, size in sized.items()]
        if name not in self._names:
            self._names[name] = self.device.ffi.new("char[]", name.encode())
        self._items.append((self._names[name], args))
        self._runs = []

    def memset(self, ptr: Any, nbytes: int | Size) -> None:
        """Add the zeroing of `nbytes` at `ptr`."""
        self._memsets.append((len(self._items), ptr, nbytes))
        self._runs = []

    def __len__(self) -> int:
        return len(self._items)

    def run(self, stream: int = 0, **sizes: int) -> None:
        """Queue the list on `stream`, each `Size` field set from `sizes` (every size the list's fields name)."""
        self.resize(**sizes)
        for op in self.operations():
            if op[0] == "launches":
                if op[2]:
                    self.device.launch_list(op[1], op[2], stream)
            else:
                nbytes = op[2]
                self.device.memset(op[1], 0, nbytes if isinstance(nbytes, int) else nbytes.factor * sizes[nbytes.name],
                                   stream)

    def resize(self, **sizes: int) -> None:
        """Set each `Size` field from `sizes`, where they differ from the last ones."""
        if sizes != self._sizes:
            for struct, field, size in self._sized:
                setattr(struct, field, size.factor * sizes[size.name])
            self._sizes = sizes

    def operations(self) -> list[tuple[str, Any, Any]]:
        """The list in order: ("launches", pointer to the items, how many) between ("memset", pointer, bytes)."""
        if not self._runs:
            self._build()
        ops: list[tuple[str, Any, Any]] = []
        for i, (items, n) in enumerate(self._runs):
            ops.append(("launches", items, n))
            if i < len(self._memsets):
                ops.append(("memset", self._memsets[i][1], self._memsets[i][2]))
        return ops

    def _build(self) -> None:
        """The items' array, and the runs of launches between the memsets: (pointer into the array, count)."""
        ffi = self.device.ffi
        self._array = ffi.new("strata_dev_launch_item[]", max(1, len(self._items)))
        for i, (name, args) in enumerate(self._items):
            self._array[i].name, self._array[i].args = name, args
        bounds = [0, *(before for before, _, _ in self._memsets), len(self._items)]
        self._runs = [(self._array + start, end - start) for start, end in itertools.pairwise(bounds)]


class Pass:
    """Launch lists and layers' experts queued and computed by one call (`strata_dev_run_pass`): a step's pass where
    the expert cache holds some experts, built once from its parts in order (`LaunchList`s and `strata_moe_layer *`
    structs). The lists' `Size` fields and memsets follow the sizes given to each `run`."""

    def __init__(self, device: Device, parts: list[Any]) -> None:
        self.device = device
        self._lists = list({id(part): part for part in parts if isinstance(part, LaunchList)}.values())
        ops: list[tuple[str, Any, Any]] = []
        for part in parts:
            ops += part.operations() if isinstance(part, LaunchList) else [("experts", part, None)]
        ops = [op for op in ops if op[0] != "launches" or op[2]]
        ffi = device.ffi
        self._ops = ffi.new("strata_dev_op[]", max(1, len(ops)))
        self._n_ops = len(ops)
        self._sized: list[tuple[Any, Size]] = []  # memsets whose bytes follow a size
        lib = device.lib
        kinds = {"launches": lib.STRATA_DEV_OP_LAUNCHES, "memset": lib.STRATA_DEV_OP_MEMSET,
                 "experts": lib.STRATA_DEV_OP_EXPERTS}
        for op, (kind, target, amount) in zip(self._ops, ops, strict=False):
            op.kind = kinds[kind]
            if kind == "launches":
                op.items, op.n = target, amount
            elif kind == "memset":
                op.dst = target
                if isinstance(amount, Size):
                    self._sized.append((op, amount))
                else:
                    op.bytes = amount
            else:
                op.layer = target
        self._sizes: dict[str, int] | None = None

    def run(self, slots: Any, n_tok: int, records: Any, stream: int = 0, **sizes: int) -> None:
        """Queue and compute the pass for `n_tok` tokens on `stream` with the expert slots `slots` (a
        `strata_expert_slots *`), each experts operation's routing into `records` (`int *`, or NULL)."""
        for launches in self._lists:
            launches.resize(**sizes)
        if sizes != self._sizes:
            for op, size in self._sized:
                op.bytes = size.factor * sizes[size.name]
            self._sizes = sizes
        dev = self.device
        dev.check(dev.lib.strata_dev_run_pass(dev.handle, slots, stream, self._ops, self._n_ops, n_tok, records))
