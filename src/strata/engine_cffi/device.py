"""The device interface (`cuda/device.h`) from Python: memory, streams, events and kernel launches on the host
device or, when `libstrata_cuda.so` was built and a GPU is there, the CUDA one.

The interface lives in the engine's shared library but not in its cffi module (it is not part of
`strata_engine.h`): this module parses `device.h` with its own cdef and opens the same library, as the kernel
tests reach `kernels.h`.
"""

from __future__ import annotations

import functools
import pathlib
import re
from typing import Any

import cffi  # type: ignore[import-untyped]
import numpy as np

import strata.engine_cffi._engine as engine_module

HEADER = pathlib.Path(__file__).with_name("cuda") / "device.h"
CUDA_LIBRARY = pathlib.Path(__file__).with_name("libstrata_cuda.so")
KERNELS = ("matmul", "rms_norm", "rope", "attention", "swiglu", "topk", "add_rows", "kv_store", "dn_conv", "l2_norm",
           "dn_gates", "delta_rule", "delta_rule_chunked", "gated_rms_norm", "sigmoid_gate", "layer_norm", "gelu",
           "vit_attention", "moe_group", "moe_matmul")
_CONSTANT = re.compile(r"#define \w+ \d+$")


class DeviceError(RuntimeError):
    """A call of the device interface failed; the message is the interface's reason."""


class DeviceUnavailable(DeviceError):
    """The device asked for cannot be opened here (no CUDA library built, no GPU): one line says why."""


@functools.cache
def interface() -> tuple[Any, Any]:
    """The cffi FFI of device.h and the engine's library opened with it."""
    ffi = cffi.FFI()
    lines = HEADER.read_text().splitlines()
    ffi.cdef("\n".join(line for line in lines if not line.startswith("#") or _CONSTANT.match(line)))
    return ffi, ffi.dlopen(engine_module.__file__)


class Device:
    """An open device. Pointers it returns are cffi `void *` values (device addresses on a GPU)."""

    def __init__(self, kind: str = "host", budget: int = 0) -> None:
        """Open `kind` ("host" or "cuda") with `budget` bytes (0: the card's free memory, unlimited on the host).

        Raises:
            DeviceUnavailable: cuda was asked for and this build or machine has none.
            DeviceError: anything else (an unknown kind, a budget over the card's memory).
        """
        self.ffi, self.lib = interface()
        err = self.ffi.new("char[]", 512)
        library = str(CUDA_LIBRARY).encode() if CUDA_LIBRARY.exists() else self.ffi.NULL
        self._d = self.lib.strata_dev_open(kind.encode(), library, budget, err, len(err))
        if self._d == self.ffi.NULL:
            message = self.ffi.string(err).decode()
            raise (DeviceUnavailable if kind == "cuda" else DeviceError)(message)
        self.kind = kind
        self.name = self.ffi.string(self.lib.strata_dev_name(self._d)).decode()
        self.bandwidth = float(self.lib.strata_dev_bandwidth(self._d))  # bytes per second, 0 unknown

    def close(self) -> None:
        if self._d is not None:
            self.lib.strata_dev_close(self._d)
            self._d = None

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def handle(self) -> Any:
        """The `strata_device *` the interface's calls take."""
        return self._d

    def check(self, status: int) -> None:
        """Raise the device's reason for the last failure where `status` (a call's) is not 0."""
        if status != 0:
            raise DeviceError(self.ffi.string(self.lib.strata_dev_error(self._d)).decode())

    # --- memory

    @property
    def used(self) -> int:
        return int(self.lib.strata_dev_used(self._d))

    @property
    def budget(self) -> int:
        return int(self.lib.strata_dev_budget(self._d))

    def alloc(self, nbytes: int) -> Any:
        p = self.lib.strata_dev_alloc(self._d, nbytes)
        if p == self.ffi.NULL:
            self.check(1)
        return p

    def free(self, p: Any) -> None:
        self.check(self.lib.strata_dev_free(self._d, p))

    def upload(self, dst: Any, array: np.ndarray, stream: int = 0) -> None:
        self.check(self.lib.strata_dev_upload(self._d, stream, dst, self.ffi.from_buffer(array), array.nbytes))

    def upload_rows(self, dst: Any, array: np.ndarray, first: np.ndarray, count: np.ndarray, stream: int = 0) -> None:
        """Upload runs of `array`'s rows (first[i] .. first[i] + count[i] - 1, int32) to the same rows at `dst`, in
        one call (`strata_dev_upload_rows`)."""
        self.check(self.lib.strata_dev_upload_rows(self._d, stream, dst, self.ffi.from_buffer(array),
                                                     array.strides[0], len(first),
                                                     self.ffi.from_buffer("int[]", first),
                                                     self.ffi.from_buffer("int[]", count)))

    def download(self, array: np.ndarray, src: Any, stream: int = 0) -> None:
        self.check(self.lib.strata_dev_download(self._d, stream, self.ffi.from_buffer(array), src, array.nbytes))

    def copy(self, dst: Any, src: Any, nbytes: int, stream: int = 0) -> None:
        """Queue a copy of `nbytes` from one place of the device to another."""
        self.check(self.lib.strata_dev_copy(self._d, stream, dst, src, nbytes))

    def memset(self, dst: Any, value: int, nbytes: int, stream: int = 0) -> None:
        self.check(self.lib.strata_dev_memset(self._d, stream, dst, value, nbytes))

    def to_device(self, array: np.ndarray) -> Any:
        """A new allocation holding a copy of `array` (stream 0, synchronised)."""
        array = np.ascontiguousarray(array)
        p = self.alloc(max(array.nbytes, 1))
        self.upload(p, array)
        self.sync()
        return p

    def to_host(self, p: Any, shape: tuple[int, ...], dtype: Any, stream: int = 0) -> np.ndarray:
        out = np.empty(shape, dtype=dtype)
        self.download(out, p, stream)
        self.sync(stream)
        return out

    # --- streams and events

    def stream(self) -> int:
        s = self.lib.strata_dev_stream_create(self._d)
        if s < 0:
            self.check(1)
        return int(s)

    def sync(self, stream: int = 0) -> None:
        self.check(self.lib.strata_dev_stream_sync(self._d, stream))

    def record(self, stream: int = 0) -> int:
        e = self.lib.strata_dev_event_record(self._d, stream)
        if e < 0:
            self.check(1)
        return int(e)

    def rerecord(self, stream: int, event: int) -> None:
        """Move `event` (recorded before) to what `stream` has queued so far."""
        self.check(self.lib.strata_dev_event_rerecord(self._d, stream, event))

    def wait(self, stream: int, event: int) -> None:
        self.check(self.lib.strata_dev_stream_wait_event(self._d, stream, event))

    def event_sync(self, event: int) -> None:
        self.check(self.lib.strata_dev_event_sync(self._d, event))

    def elapsed_ms(self, start: int, end: int) -> float:
        ms = float(self.lib.strata_dev_event_elapsed_ms(self._d, start, end))
        if ms < 0:
            self.check(1)
        return ms

    # --- kernels

    def launch(self, name: str, stream: int = 0, **fields: Any) -> None:
        """Queue kernel `name` ("matmul", ..., or "<name>_ref") with its argument struct's fields (device.h);
        pointers may be any cffi pointer: each is cast to its field's type."""
        self.check(self.lib.strata_dev_launch(self._d, stream, name.encode(), self.arguments(name, **fields)))

    def launch_list(self, items: Any, n: int, stream: int = 0) -> None:
        """Queue n launches at once: `items` points to n `strata_dev_launch_item`s (see `launch_list.LaunchList`)."""
        self.check(self.lib.strata_dev_launch_list(self._d, stream, items, n))

    def launch_experts(self, args: Any, slots: Any, first: np.ndarray, count: np.ndarray, stream: int = 0) -> None:
        """Queue the expert cache's hits of a layer (`strata_dev_launch_experts`): `args` a
        `strata_dev_experts_args *`, `slots` the hits' slots, `first` and `count` (int32) their rows."""
        self.check(self.lib.strata_dev_launch_experts(self._d, stream, args, len(first), slots,
                                                       self.ffi.from_buffer("int[]", first),
                                                       self.ffi.from_buffer("int[]", count)))

    def arguments(self, name: str, **fields: Any) -> Any:
        """A new argument struct of kernel `name` (a cffi pointer to it) holding `fields`; the others zero."""
        struct, pointers = _argument_struct(name)
        unknown = sorted(set(fields) - set(pointers))
        if unknown:
            raise DeviceError(f"{name}: no argument named {', '.join(unknown)}")
        args = self.ffi.new(struct)
        a = args[0]
        for field, value in fields.items():
            ftype = pointers[field]
            setattr(a, field, value if ftype is None else self.ffi.cast(ftype, value))
        return args


@functools.cache
def _argument_struct(name: str) -> tuple[str, dict[str, Any]]:
    """Kernel `name`'s argument struct ("strata_dev_<kernel>_args *") and its fields: each pointer field's type,
    None for the others (a launch looks them up once per kernel, not once per call)."""
    kernel = name.removesuffix("_ref")
    if kernel not in KERNELS:
        raise DeviceError(f"no kernel named '{name}'")
    struct = f"strata_dev_{kernel}_args"
    ffi = interface()[0]
    return f"{struct} *", {field: f.type if f.type.kind == "pointer" else None
                           for field, f in ffi.typeof(struct).fields}
