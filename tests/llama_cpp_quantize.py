"""Files written by llama.cpp's own quantizer, and llama.cpp's logits on them, kept in the repository.

llama-cpp-python builds only from source (~20 minutes on 2 cores), so the test suite does not install it. With it
installed, `scripts/make-llama-cpp-fixtures.py` calls `make`: it writes a small qwen3moe with our generator (F32,
`SOURCE`), quantises it with `llama_model_quantize` to every preset of `PRESETS` — the ones that need an importance
matrix (`IMATRIX_PRESETS`) get one built here, see `importance_matrix` — has llama.cpp score `prompt()` on each
file, and packs it all into `DATA` (`.json`: what each file holds; `.bin.xz`: the bytes). `unpack` rebuilds each
file byte for byte (its sha256 is checked) without llama.cpp.

The model is the smallest that gives every block type its real structure: rows of 256 (the K-quant and IQ
super-block) in every matrix but the experts' down projection, whose rows of 128 make llama.cpp fall back to a
32-element type there, as it does on real models with such widths; one layer; two experts, both used by every
token (llama.cpp keeps MXFP4 for models with more than one expert, and no near-tie in routing can send the two
engines down different experts). Identical tensors are stored once across presets.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import lzma
import pathlib
from collections.abc import Iterable
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "engine" / "data" / "llama_cpp_quants"  # .json and .bin.xz

SOURCE: dict[str, Any] = {"arch": "qwen3moe", "size": "tiny", "dtype": "f32", "vocab": "bytes", "seed": 0,
                          "n_layer": 1, "n_expert": 2, "n_expert_used": 2, "n_ff_exp": 128, "n_head_kv": 1}
PRESETS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M",
           "Q5_K_S", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_M", "MXFP4_MOE",
           "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M", "Q2_K_S"]
# llama.cpp refuses these without an importance matrix (IQ3_XXS, IQ2_*, IQ1_*, and the Q2_K of Q2_K_S).
IMATRIX_PRESETS = frozenset(PRESETS[PRESETS.index("IQ3_XXS"):])
N_TOKENS = 16
THREADS = 2  # quantising and scoring: llama.cpp's results do not depend on it, recorded for the record


def prompt() -> list[int]:
    return [int(t) for t in np.random.default_rng(0).integers(0, 256, N_TOKENS)]


def write_source(path: pathlib.Path) -> pathlib.Path:
    from strata.modelgen import write_random_model

    return write_random_model(path, **SOURCE)


def sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- llama.cpp (only `make` and the live test need it)


def importance_matrix(source: pathlib.Path) -> dict[str, np.ndarray]:
    """A stand-in for what `llama-imatrix` measures: per weight matrix and expert, one positive number per input
    column (the mean square of that input over a calibration text), here log-normal with a fixed seed, so that the
    weighted searches of the quantisers meet unequal weights. Every matrix but `token_embd` (which is looked up,
    not multiplied, and which real imatrix files leave out too)."""
    from gguf import GGUFReader

    rng = np.random.default_rng(1)
    out = {}
    for t in GGUFReader(source).tensors:
        if len(t.shape) >= 2 and t.name != "token_embd.weight":
            n_expert = int(t.shape[2]) if len(t.shape) > 2 else 1
            out[t.name] = rng.lognormal(0.0, 1.0, int(t.shape[0]) * n_expert).astype(np.float32)
    return out


def quantize(source: pathlib.Path, out: pathlib.Path, preset: str,
             imatrix: dict[str, np.ndarray] | None = None) -> pathlib.Path:
    """`llama_model_quantize(source -> out)` to `preset`, with `imatrix` (tensor name -> importances) if given.

    The importance matrix goes in as llama.h's `llama_model_imatrix_data` array (name, data, size), ended by an
    entry whose name is NULL; llama.cpp copies it into its own map before quantising.
    """
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{preset}")
    params.nthread = THREADS
    if imatrix is not None:
        entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        for entry, (name, values) in zip(entries, imatrix.items(), strict=False):
            entry.name = name.encode()
            entry.data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entry.size = values.size
        entries[len(imatrix)].name = None
        params.imatrix = entries
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params)
    assert status == 0, f"llama_model_quantize({preset}) returned {status}"
    return out


def llama_in_cpu_layout(**kwargs: Any) -> Any:
    """`llama_cpp.Llama(**kwargs)` with the weights in ggml's own CPU layout (llama.cpp's `--no-extra-bufts`): on an
    AMX Xeon, llama-cpp-python 0.3.36 built for the machine puts them in ggml's AMX layout, whose matrix product
    dies of an illegal instruction (`tileloadd` in `ggml_backend_amx_mul_mat`). `Llama` takes no such argument:
    the model parameters it asks llama.cpp for are changed while it loads."""
    import llama_cpp
    import llama_cpp.llama as high_level

    low_level = high_level.llama_cpp
    default = low_level.llama_model_default_params

    def cpu_layout() -> Any:
        params = default()
        params.use_extra_bufts = False
        return params

    low_level.llama_model_default_params = cpu_layout
    try:
        return llama_cpp.Llama(**kwargs)
    finally:
        low_level.llama_model_default_params = default


def llama_cpp_logits(path: pathlib.Path, tokens: list[int], kv: str = "f32", n_batch: int = 64,
                     n_threads: int = THREADS) -> np.ndarray:
    """llama.cpp's logits at every position of `tokens`, evaluated `n_batch` tokens per call, with a KV cache of
    `kv` ("f32" or "f16", llama.cpp's default). The packed logits use "f32": with an f16 cache llama.cpp also
    rounds the query and the attention weights to f16 (ggml's f16 product converts its f32 operand), which our
    engine does not, and that is not what these files test."""
    import llama_cpp

    kv_type = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16}[kv]
    llm = llama_in_cpu_layout(model_path=str(path), n_ctx=64, n_batch=n_batch, n_ubatch=n_batch, n_threads=n_threads,
                              n_threads_batch=n_threads, type_k=kv_type, type_v=kv_type, logits_all=True,
                              verbose=False)
    try:
        for start in range(0, len(tokens), n_batch):
            llm.eval(tokens[start:start + n_batch])
        return np.array(llm.scores[: len(tokens)], dtype=np.float32)
    finally:
        llm.close()


def make(work: pathlib.Path, presets: Iterable[str] = PRESETS, data: pathlib.Path = DATA) -> dict[str, Any]:
    """Write the source into `work`, quantise it to each preset there, score each file (and the source) with
    llama.cpp, and pack it all into `data`.json / `data`.bin.xz. Returns the manifest."""
    import llama_cpp

    source = write_source(work / "source.gguf")
    imatrix = importance_matrix(source)
    tokens = prompt()
    files = {preset: quantize(source, work / f"{preset}.gguf", preset,
                              imatrix if preset in IMATRIX_PRESETS else None) for preset in presets}
    logits = {name: llama_cpp_logits(path, tokens) for name, path in {"source": source, **files}.items()}
    manifest = {"llama_cpp_python": llama_cpp.__version__, "threads": THREADS, "kv": "f32", "tokens": tokens,
                "source": {**SOURCE, "sha256": sha256(source)}, **pack(files, logits, data)}
    data.with_suffix(".json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


# --- packing (no llama.cpp needed)


def pack(files: dict[str, pathlib.Path], logits: dict[str, np.ndarray], data: pathlib.Path) -> dict[str, Any]:
    """Pack GGUF files and logits into `data`.bin.xz: each file's header (everything before its tensor data),
    each distinct tensor's bytes once, the logits as little-endian float32. Returns the manifest's entries that
    `Packed` reads back."""
    from gguf import GGUFReader

    raw = bytearray()
    blobs: dict[str, int] = {}
    presets: dict[str, Any] = {}
    for preset, path in files.items():
        reader = GGUFReader(path)
        content = path.read_bytes()
        entry: dict[str, Any] = {"sha256": hashlib.sha256(content).hexdigest(), "size": len(content),
                                 "header": [len(raw), reader.data_offset]}
        raw += content[: reader.data_offset]
        tensors = []
        for t in reader.tensors:
            start, n = int(t.data_offset), int(t.n_bytes)
            blob = content[start:start + n]
            key = hashlib.sha256(blob).hexdigest()
            if key not in blobs:
                blobs[key] = len(raw)
                raw += blob
            tensors.append([t.name, t.tensor_type.name, blobs[key], n, start])
        entry["tensors"] = tensors
        presets[preset] = entry
    where = {}
    for name, values in logits.items():
        where[name] = [len(raw), *values.shape]
        raw += np.ascontiguousarray(values, "<f4").tobytes()
    data.parent.mkdir(parents=True, exist_ok=True)
    data.with_suffix(".bin.xz").write_bytes(lzma.compress(bytes(raw), preset=9 | lzma.PRESET_EXTREME))
    return {"presets": presets, "logits": where}


class Packed:
    """The committed files: `manifest` (the .json) and the unpacked bytes."""

    def __init__(self, data: pathlib.Path = DATA) -> None:
        self.manifest: dict[str, Any] = json.loads(data.with_suffix(".json").read_text())
        self.raw = lzma.decompress(data.with_suffix(".bin.xz").read_bytes())

    def logits(self, name: str) -> np.ndarray:
        """llama.cpp's logits on the file of preset `name` (or "source"), one row per token of the prompt."""
        offset, rows, columns = self.manifest["logits"][name]
        return np.frombuffer(self.raw, "<f4", rows * columns, offset).reshape(rows, columns)

    def unpack(self, preset: str, out: pathlib.Path) -> pathlib.Path:
        """Rebuild the file llama.cpp wrote for `preset` at `out`; its sha256 is checked."""
        entry = self.manifest["presets"][preset]
        content = bytearray(entry["size"])  # the gaps between tensors are GGUF's zero padding
        offset, n = entry["header"]
        content[:n] = self.raw[offset:offset + n]
        for _name, _type, blob, size, start in entry["tensors"]:
            content[start:start + size] = self.raw[blob:blob + size]
        digest = hashlib.sha256(content).hexdigest()
        assert digest == entry["sha256"], f"{preset}: rebuilt file's sha256 {digest} != {entry['sha256']}"
        out.write_bytes(content)
        return out
