"""Copies of GGUF files with one thing changed, for tests of what readers make of such files."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


def rewrite(src: Path, dst: Path, *, drop: str = "", keys: dict | None = None, reshape: str = "",
            replace: dict[str, np.ndarray] | None = None, split_max_tensors: int = 0) -> Path:
    """Copy a GGUF file, leaving out tensor `drop`, flattening tensor `reshape`, giving the tensors in `replace`
    new data of their type (rows of bytes for a quantised one), and overriding string `keys`; with
    `split_max_tensors`, as a split model of that many tensors a part (`dst`'s stem `-0000K-of-0000N.gguf`, as
    llama.cpp's `gguf-split` writes them): returns the first part."""
    reader = gguf.GGUFReader(src)
    keys = keys or {}
    replace = replace or {}
    arch = keys.get(gguf.Keys.General.ARCHITECTURE, reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    writer = gguf.GGUFWriter(dst, arch, split_max_tensors=split_max_tensors)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == gguf.Keys.General.ARCHITECTURE:
            continue
        if key in keys:
            writer.add_string(key, keys[key])
            continue
        sub_type = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), f.types[0], sub_type)
    for t in reader.tensors:
        if t.name != drop:
            data = np.asarray(replace.get(t.name, t.data))
            writer.add_tensor(t.name, data.reshape(-1) if t.name == reshape else data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parts = len(writer.tensors)
    return dst if parts == 1 else dst.with_name(f"{dst.stem}-00001-of-{parts:05d}.gguf")
