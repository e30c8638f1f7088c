"""Copies of GGUF files with one thing changed, for tests of what readers make of such files."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


def rewrite(src: Path | gguf.GGUFReader, dst: Path, *, drop: str = "", keys: dict | None = None, reshape: str = "",
            replace: dict[str, np.ndarray] | None = None, add: dict[str, np.ndarray] | None = None,
            drop_keys: str = "", dequantised: bool | frozenset[gguf.GGMLQuantizationType] = False,
            split_max_tensors: int = 0) -> Path:
    """Copy a GGUF file (or one a reader has parsed: a 150k-token vocabulary takes seconds to parse), leaving out
    tensor `drop` and the keys starting with `drop_keys`, flattening tensor `reshape`, giving the tensors in
    `replace` new data of their type (rows of bytes for a quantised one), overriding (or adding) string `keys`, and
    adding the float32 tensors in `add`; `dequantised`: every tensor as float32 (its values as `gguf` reads them),
    or those of the types it lists;
    with `split_max_tensors`, as a split model of that many tensors a part (`dst`'s stem `-0000K-of-0000N.gguf`, as
    llama.cpp's `gguf-split` writes them): returns the first part."""
    reader = src if isinstance(src, gguf.GGUFReader) else gguf.GGUFReader(src)
    keys = keys or {}
    replace = replace or {}
    arch = keys.get(gguf.Keys.General.ARCHITECTURE, reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    writer = gguf.GGUFWriter(dst, arch, split_max_tensors=split_max_tensors)
    for key, f in reader.fields.items():
        dropped = bool(drop_keys) and key.startswith(drop_keys)
        if key.startswith("GGUF.") or key == gguf.Keys.General.ARCHITECTURE or dropped:
            continue
        if key in keys:
            writer.add_string(key, keys[key])
            continue
        sub_type = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), f.types[0], sub_type)
    for key in keys.keys() - reader.fields.keys():
        writer.add_string(key, keys[key])
    for t in reader.tensors:
        as_f32 = dequantised is True or (not isinstance(dequantised, bool) and t.tensor_type in dequantised)
        if t.name != drop and as_f32:
            values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
            writer.add_tensor(t.name, values.reshape(tuple(int(n) for n in reversed(t.shape))))
        elif t.name != drop:
            data = np.asarray(replace.get(t.name, t.data))
            writer.add_tensor(t.name, data.reshape(-1) if t.name == reshape else data, raw_dtype=t.tensor_type)
    for name, array in (add or {}).items():
        writer.add_tensor(name, np.asarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parts = len(writer.tensors)
    return dst if parts == 1 else dst.with_name(f"{dst.stem}-00001-of-{parts:05d}.gguf")
