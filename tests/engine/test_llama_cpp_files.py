"""Files written by llama.cpp's own quantizer, read by our engine: logits against llama.cpp's on the same file.

The files are in the repository (`tests/llama_cpp_quantize.py` says what they are and how
`scripts/make-llama-cpp-fixtures.py` makes them): a one-layer qwen3moe from our generator, quantised by
`llama_model_quantize` to 27 presets — the 8 that llama.cpp refuses without an importance matrix with a random one
—, and llama.cpp's logits on 16 tokens of each. These tests need no llama.cpp: they rebuild each file (sha256
checked), check the tensor types llama.cpp chose, and compare our logits with the stored ones. With llama-cpp-python
installed, the live tests also redo the quantisation and scoring and must get the same files and logits.

Both engines run with an f32 KV cache, which isolates the weight formats. Measured here (max over the 16
positions of max |ours - llama.cpp| / max |llama.cpp|):
- F32 source: 3.8e-7. With llama.cpp's default f16 cache 2.9e-4: ggml's f16 products convert their f32 operand
  to f16, so llama.cpp also rounds the query and the attention weights to f16 where we keep f32.
- 18 of the 27 presets: 1.4e-7 to 1.2e-6 at every position, i.e. float rounding alone.
- Presets with Q4_1 or Q5_1 tensors: 6e-3 to 2e-2 at every position for Q4_1 and Q5_1, 1e-3 to 5e-3 at most
  positions for Q3_K_L and Q5_K_S (Q5_1 in their ffn_down). ggml pairs these types with Q8_1 activations,
  whose per-block sum (times the weights' min) is stored as f16; we use the exact sum of the same int8 values.
  On this file's Q4_1 attn_q and a random input, that alone moves the product by 4e-4 of its largest output.
  Not a format difference.
- Isolated jumps at one position (Q4_K_M 7e-3, Q5_0 7e-3, IQ3_S 3e-3, IQ2_M 2e-3, Q2_K 3e-6; elsewhere ~3e-7), on
  quantised files: a 1e-7 difference moves an activation across a rounding boundary of its int8 (Q8_0/Q8_K)
  block, and one step of that grid is a far larger change than the difference that caused it.
That mechanism is the "~1.5% gap on every quantised file" seen with the default f16 cache: the f16 roundings
(~3e-4 relative) flip many activation roundings at once. Each engine does it to itself: llama.cpp's logits with
an f16 and with an f32 cache differ by 1.1-1.7% on these files (3.9e-4 on the F32 source), ours by 1.1-1.7%
(2.0e-4). With an f32 cache, evaluating 1 token per call instead of 16 moves llama.cpp's logits by <5e-7 (with
its f16 cache it jumped by 1.1e-2 on IQ1_M) and leaves ours bit-identical; 1 thread instead of 2 changes neither.
Built for AVX2 (`STRATA_MARCH=haswell`) or without SIMD (`x86-64`) our engine passes these checks too; there the
Q5_0, IQ3_S and IQ2_M jumps are gone (their sums are rounded otherwise), and with AVX2 Q8_0 and MXFP4_MOE match
llama.cpp's logits bit for bit. With both engines' default f16 cache, ours against llama.cpp's is 1.0-1.7%.
`bench/llama_cpp_gap.py` prints these figures.

So each file is checked in two ways: the median position must agree to TIGHT (float rounding), and every position
to JUMP (one rounding flip). Presets whose files hold Q4_1 or Q5_1 tensors only get the second check. A block
layout read differently gives O(1); the scale of one block of one tensor 10% off (Q4_K attn_q, IQ2_XXS gate
experts, Q8_0 output) gave medians of 3e-3 to 1e-2, which TIGHT catches and JUMP alone would not.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from gguf import GGUFReader, LlamaFileType
from llama_cpp_quantize import IMATRIX_PRESETS, PRESETS, Packed, importance_matrix, quantize, sha256, write_source

from strata.engine_cffi import Engine

TIGHT = 1e-5
JUMP = 3e-2
Q8_1_TYPES = {"Q4_1", "Q5_1"}

# The types llama.cpp 0.3.36 gives each tensor, per preset: (most tensors, {tensor: exception}). `output` gets
# Q6_K (Q5_K in the IQ1/IQ2/IQ3_XXS mixes); attn_v more bits (4 query heads per KV head); the experts' down
# projection, with rows of 128, the 32-element fallback of its type (Q4_0, Q5_0, Q5_1, Q8_0, IQ4_NL); MXFP4_MOE
# keeps Q8_0 outside the experts.
EXPECTED_TYPES: dict[str, tuple[str, dict[str, str]]] = {
    "Q4_0": ("Q4_0", {"output": "Q6_K"}),
    "Q4_1": ("Q4_1", {"output": "Q6_K"}),
    "Q5_0": ("Q5_0", {"output": "Q6_K"}),
    "Q5_1": ("Q5_1", {"output": "Q6_K"}),
    "Q8_0": ("Q8_0", {}),
    "Q2_K": ("Q2_K", {"output": "Q6_K", "attn_output": "Q3_K", "attn_v": "Q4_K", "ffn_down_exps": "Q4_0"}),
    "Q3_K_S": ("Q3_K", {"output": "Q6_K", "ffn_down_exps": "Q4_0"}),
    "Q3_K_M": ("Q3_K", {"output": "Q6_K", "attn_output": "Q4_K", "attn_v": "Q5_K", "ffn_down_exps": "Q5_0"}),
    "Q3_K_L": ("Q3_K", {"output": "Q6_K", "attn_output": "Q5_K", "attn_v": "Q5_K", "ffn_down_exps": "Q5_1"}),
    "Q4_K_S": ("Q4_K", {"output": "Q6_K", "attn_v": "Q5_K", "ffn_down_exps": "Q5_0"}),
    "Q4_K_M": ("Q4_K", {"output": "Q6_K", "attn_v": "Q6_K", "ffn_down_exps": "Q8_0"}),
    "Q5_K_S": ("Q5_K", {"output": "Q6_K", "ffn_down_exps": "Q5_1"}),
    "Q5_K_M": ("Q5_K", {"output": "Q6_K", "attn_v": "Q6_K", "ffn_down_exps": "Q8_0"}),
    "Q6_K": ("Q6_K", {"ffn_down_exps": "Q8_0"}),
    "IQ4_NL": ("IQ4_NL", {"output": "Q6_K", "attn_v": "Q5_K"}),
    "IQ4_XS": ("IQ4_XS", {"output": "Q6_K", "attn_v": "Q5_K", "ffn_down_exps": "IQ4_NL"}),
    "IQ3_S": ("IQ3_S", {"output": "Q6_K", "attn_v": "Q4_K", "ffn_down_exps": "IQ4_NL"}),
    "IQ3_M": ("IQ3_S", {"output": "Q6_K", "attn_output": "Q4_K", "attn_v": "Q4_K", "ffn_down_exps": "IQ4_NL"}),
    "MXFP4_MOE": ("Q8_0", {"ffn_gate_exps": "MXFP4", "ffn_up_exps": "MXFP4", "ffn_down_exps": "MXFP4"}),
    "IQ3_XXS": ("IQ3_S", {"output": "Q5_K", "attn_q": "IQ2_S", "attn_k": "IQ2_S", "attn_v": "Q4_K",
                          "ffn_gate_exps": "IQ3_XXS", "ffn_up_exps": "IQ3_XXS", "ffn_down_exps": "IQ4_NL"}),
    "IQ2_XXS": ("IQ2_XXS", {"output": "Q5_K", "token_embd": "Q2_K", "attn_v": "Q4_K", "ffn_down_exps": "IQ4_NL"}),
    "IQ2_XS": ("IQ2_XS", {"output": "Q5_K", "token_embd": "Q2_K", "attn_v": "Q4_K", "ffn_down_exps": "IQ4_NL"}),
    "IQ2_S": ("IQ2_XS", {"output": "Q5_K", "token_embd": "IQ3_S", "attn_output": "IQ3_S", "attn_v": "Q4_K",
                         "ffn_down_exps": "IQ4_NL"}),
    "IQ2_M": ("IQ2_S", {"output": "Q5_K", "token_embd": "IQ3_S", "attn_output": "IQ3_S", "attn_v": "Q4_K",
                        "ffn_down_exps": "IQ4_NL"}),
    "IQ1_S": ("IQ1_S", {"output": "Q5_K", "token_embd": "Q2_K", "attn_output": "IQ2_XXS", "attn_v": "Q4_K",
                        "ffn_down_exps": "IQ4_NL"}),
    "IQ1_M": ("IQ1_M", {"output": "Q5_K", "token_embd": "Q2_K", "attn_output": "IQ2_XXS", "attn_v": "Q4_K",
                        "ffn_down_exps": "IQ4_NL"}),
    "Q2_K_S": ("Q2_K", {"output": "Q6_K", "attn_v": "Q4_K", "ffn_down_exps": "Q4_0"}),
}
MATRICES = ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_exps", "ffn_up_exps",
            "ffn_down_exps")
# Every block type that the presets write (the list plus Q4_0, Q8_0, Q4_K, Q6_K).
QUANTISED_TYPES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
                   "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "MXFP4"}


@pytest.fixture(scope="module")
def packed() -> Packed:
    return Packed()


@pytest.fixture(scope="module")
def files(packed: Packed, tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    work = tmp_path_factory.mktemp("llama_cpp_quants")
    return {preset: packed.unpack(preset, work / f"{preset}.gguf") for preset in PRESETS}


def matrix_types(path: pathlib.Path) -> dict[str, str]:
    """Block type of each weight matrix, by role (`attn_q`, not `blk.0.attn_q.weight`)."""
    return {t.name.removeprefix("blk.0.").removesuffix(".weight"): t.tensor_type.name
            for t in GGUFReader(path).tensors if t.name.removeprefix("blk.0.").removesuffix(".weight") in MATRICES}


def our_logits(path: pathlib.Path, tokens: list[int]) -> np.ndarray:
    with Engine.load(path, n_ctx=64, threads=2, kv="f32", n_batch=64) as engine:
        return engine.eval(tokens, all_logits=True)


def relative_errors(ours: np.ndarray, theirs: np.ndarray) -> np.ndarray:
    """Per position: max |ours - theirs| / max |theirs|."""
    return np.abs(ours - theirs).max(axis=1) / np.abs(theirs).max(axis=1)


def check_agreement(preset: str, types: set[str], ours: np.ndarray, theirs: np.ndarray) -> None:
    err = relative_errors(ours, theirs)
    detail = f"{preset} ({sorted(types)}): relative errors per position {np.array2string(err, precision=1)}"
    assert err.max() < JUMP, detail
    if not types & Q8_1_TYPES:
        assert np.median(err) < TIGHT, detail


def test_every_preset_is_packed(packed: Packed) -> None:
    assert list(packed.manifest["presets"]) == PRESETS
    assert list(EXPECTED_TYPES) == PRESETS


def test_presets_cover_every_quantised_type() -> None:
    written = {t for main, exceptions in EXPECTED_TYPES.values() for t in (main, *exceptions.values())}
    assert written == QUANTISED_TYPES


@pytest.mark.parametrize("preset", PRESETS)
def test_file_holds_the_preset_mixture(files: dict[str, pathlib.Path], preset: str) -> None:
    main, exceptions = EXPECTED_TYPES[preset]
    assert matrix_types(files[preset]) == {m: exceptions.get(m, main) for m in MATRICES}
    file_type = GGUFReader(files[preset]).get_field("general.file_type")
    assert file_type is not None
    assert file_type.contents() == LlamaFileType[f"MOSTLY_{preset}"]


@pytest.mark.parametrize("preset", PRESETS)
def test_quantised_file_matches_llama_cpp(packed: Packed, files: dict[str, pathlib.Path], preset: str) -> None:
    tokens = packed.manifest["tokens"]
    types = set(matrix_types(files[preset]).values())
    check_agreement(preset, types, our_logits(files[preset], tokens), packed.logits(preset))


def test_source_matches_llama_cpp(packed: Packed, tmp_path: pathlib.Path) -> None:
    source = write_source(tmp_path / "source.gguf")
    if sha256(source) != packed.manifest["source"]["sha256"]:
        pytest.skip("the model generator now writes another source model: run scripts/make-llama-cpp-fixtures.py")
    err = relative_errors(our_logits(source, packed.manifest["tokens"]), packed.logits("source"))
    assert err.max() < TIGHT, np.array2string(err, precision=1)


# --- live: llama.cpp itself (skipped without llama-cpp-python)


@pytest.fixture(scope="module")
def live_source(packed: Packed, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    source = write_source(tmp_path_factory.mktemp("llama_cpp_live") / "source.gguf")
    assert sha256(source) == packed.manifest["source"]["sha256"], \
        "the model generator now writes another source model: run scripts/make-llama-cpp-fixtures.py"
    return source


@pytest.mark.parametrize("preset", PRESETS)
def test_llama_cpp_reproduces_the_packed_file(packed: Packed, live_source: pathlib.Path, tmp_path: pathlib.Path,
                                              preset: str) -> None:
    from llama_cpp_quantize import llama_cpp_logits

    imatrix = importance_matrix(live_source) if preset in IMATRIX_PRESETS else None
    path = quantize(live_source, tmp_path / f"{preset}.gguf", preset, imatrix)
    assert sha256(path) == packed.manifest["presets"][preset]["sha256"], \
        f"llama.cpp now writes another {preset} file: run scripts/make-llama-cpp-fixtures.py"
    theirs = llama_cpp_logits(path, packed.manifest["tokens"])
    check_agreement(preset, set(), theirs, packed.logits(preset))
