"""The Engine's contract: prefix reuse, abort, KV cache types, embedding rows, reproducibility, errors."""

from __future__ import annotations

import pathlib
import struct
import threading
import time

import numpy as np
import pytest
from engine_helpers import abort_mid_prefill
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from hf_reference import load_hf_model
from strata.engine_cffi._engine import ffi, lib

from strata.engine_cffi import SUPPORTED_ARCHITECTURES, Engine, EngineAborted, EngineError
from strata.modelgen import write_random_model

# The engine computes each token's row independently of how tokens are chunked, but a kernel may take another
# path for another number of rows; results that should be equal are compared at this relative tolerance.
SAME = 1e-5


def assert_same(a: np.ndarray, b: np.ndarray, tol: float = SAME) -> None:
    err = float(np.abs(a - b).max() / np.abs(b).max())
    assert err <= tol, f"relative difference {err:.2e} > {tol:.0e}"


def tokens(n: int, seed: int = 0, n_vocab: int = 256) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, n_vocab, n)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("engine_api")
    return {name: write_random_model(root / f"{name}.gguf", arch=arch, size="tiny", dtype=dtype)
            for name, arch, dtype in [("moe", "qwen3moe", "f32"), ("dense", "qwen3", "f32"),
                                      ("llama_q8", "llama", "q8_0"), ("moe_q4k", "qwen3moe", "q4_k")]}


# --- prefix reuse


@pytest.mark.parametrize("name", ["moe", "llama_q8"])
def test_keep_then_eval_equals_fresh_eval(models: dict[str, pathlib.Path], name: str) -> None:
    prompt = tokens(30)
    with Engine.load(models[name], n_ctx=64, threads=2, n_batch=8) as engine:
        fresh = engine.eval(prompt, all_logits=True)
        engine.eval(tokens(5, seed=1))  # a different continuation, then drop it and more
        engine.keep(12)
        assert engine.n_past == 12
        again = engine.eval(prompt[12:], all_logits=True)
        assert engine.n_past == 30
    assert_same(again, fresh[12:])


def test_keep_beyond_n_past_is_an_error(models: dict[str, pathlib.Path]) -> None:
    with Engine.load(models["dense"], n_ctx=64, threads=1) as engine:
        engine.eval(tokens(4))
        with pytest.raises(EngineError, match="holds 4"):
            engine.keep(5)
        engine.keep(0)
        assert engine.n_past == 0


# --- abort


def test_abort_during_prefill_returns_promptly_and_keeps_finished_chunks(models: dict[str, pathlib.Path]) -> None:
    prompt, n_batch = tokens(768, seed=2), 32
    with Engine.load(models["moe"], n_ctx=1024, threads=2, n_batch=n_batch) as fresh:
        expected = fresh.eval(prompt, all_logits=True)
    with Engine.load(models["moe"], n_ctx=1024, threads=2, n_batch=n_batch) as engine:
        # the flag is checked between layers: one layer of one 32-token chunk takes a few ms
        assert abort_mid_prefill(engine, prompt) < 0.5
        kept = engine.n_past
        assert kept % n_batch == 0 and 0 < kept < len(prompt)
        rest = engine.eval(prompt[kept:], all_logits=True)  # the context is usable, its finished chunks intact
    assert_same(rest, expected[kept:])


def test_abort_during_decode_loop_leaves_context_usable(models: dict[str, pathlib.Path]) -> None:
    prompt = tokens(8, seed=3)
    history = list(prompt)
    outcome: dict[str, float] = {}
    with Engine.load(models["dense"], n_ctx=4096, threads=2) as engine:
        logits = engine.eval(prompt)

        def decode_loop() -> None:
            nonlocal logits
            try:
                while len(history) < 4000:
                    nxt = int(np.argmax(logits))
                    logits = engine.eval([nxt])
                    history.append(nxt)
            except EngineAborted:
                outcome["aborted_at"] = time.perf_counter()

        worker = threading.Thread(target=decode_loop)
        worker.start()
        time.sleep(0.2)
        abort_at = time.perf_counter()
        engine.abort()
        worker.join(timeout=5)
        assert not worker.is_alive()
        assert "aborted_at" in outcome and outcome["aborted_at"] - abort_at < 0.5
        assert engine.n_past == len(history)  # the aborted step added nothing
        nxt = int(np.argmax(logits))
        after = engine.eval([nxt])
    with Engine.load(models["dense"], n_ctx=4096, threads=2, n_batch=512) as fresh:
        assert_same(after, fresh.eval(history + [nxt]))


def test_abort_while_idle_stops_the_next_call_only(models: dict[str, pathlib.Path]) -> None:
    with Engine.load(models["dense"], n_ctx=64, threads=1) as engine:
        engine.abort()
        with pytest.raises(EngineAborted):
            engine.eval(tokens(3))
        assert engine.n_past == 0
        engine.eval(tokens(3))
        assert engine.n_past == 3


def test_clear_abort_drops_a_stale_flag(models: dict[str, pathlib.Path]) -> None:
    with Engine.load(models["dense"], n_ctx=64, threads=1) as engine:
        engine.abort()
        engine.clear_abort()
        engine.eval(tokens(3))
        assert engine.n_past == 3


# --- KV cache types


def test_int8_kv_cache_is_within_its_bound_of_f16(models: dict[str, pathlib.Path]) -> None:
    # int8 rows keep max|row| / 127 steps, so each cached value is off by at most max|row| / 254 (0.4% of the
    # row's largest value), against f16's 2^-11 relative; over a 2-layer model that stays below 2% of the logits.
    # A dense model: in a MoE model a cache error can flip a near-tied routing choice, a larger jump.
    prompt = tokens(100, seed=4)
    logits = {}
    for kv in ("f32", "f16", "int8"):
        with Engine.load(models["dense"], n_ctx=128, threads=2, kv=kv, n_batch=32) as engine:
            logits[kv] = engine.eval(prompt, all_logits=True)
    assert_same(logits["f16"], logits["f32"], tol=1e-3)
    assert_same(logits["int8"], logits["f16"], tol=2e-2)
    assert not np.allclose(logits["int8"], logits["f16"], rtol=0, atol=1e-6)  # int8 really is a different cache


# --- embedding rows


def token_embedding_rows(path: pathlib.Path, ids: list[int]) -> np.ndarray:
    """Rows of token_embd for `ids`, dequantised by the gguf package."""
    tensor = next(t for t in GGUFReader(path).tensors if t.name in ("token_embd", "token_embd.weight"))
    return np.asarray(dequantize(tensor.data[ids], tensor.tensor_type), dtype=np.float32)


@pytest.mark.parametrize("name", ["moe", "llama_q8"])
def test_embedding_rows_replace_token_embeddings(models: dict[str, pathlib.Path], name: str) -> None:
    prompt = tokens(24, seed=5)
    placeholders = list(prompt)
    placeholders[6:10] = [0] * 4
    placeholders[20:22] = [0] * 2
    embeds = [(6, token_embedding_rows(models[name], prompt[6:10])),
              (20, token_embedding_rows(models[name], prompt[20:22]))]
    with Engine.load(models[name], n_ctx=64, threads=2, n_batch=8) as engine:
        expected = engine.eval(prompt, all_logits=True)
        engine.keep(0)
        got = engine.eval(placeholders, embeds=embeds, all_logits=True)
        engine.keep(0)
        plain = engine.eval(placeholders, all_logits=True)
    assert_same(got, expected)
    assert not np.allclose(plain[6:], expected[6:], atol=1e-3)  # the rows did replace something


def test_embedding_rows_are_checked(models: dict[str, pathlib.Path]) -> None:
    with Engine.load(models["dense"], n_ctx=64, threads=1) as engine:
        with pytest.raises(EngineError, match="shape"):
            engine.eval([1, 2, 3], embeds=[(0, np.zeros((1, engine.n_embd + 1), np.float32))])
        with pytest.raises(EngineError, match="outside"):
            engine.eval([1, 2, 3], embeds=[(2, np.zeros((2, engine.n_embd), np.float32))])
        assert engine.n_past == 0


# --- golden: greedy decoding


def greedy(path: pathlib.Path, prompt: list[int], n: int, threads: int) -> list[int]:
    with Engine.load(path, n_ctx=128, threads=threads, n_batch=16) as engine:
        logits, out = engine.eval(prompt), []
        for _ in range(n):
            out.append(int(np.argmax(logits)))
            logits = engine.eval([out[-1]])
    return out


def test_greedy_tokens_reproducible_across_runs_and_threads_and_match_transformers(
        models: dict[str, pathlib.Path]) -> None:
    import torch

    prompt = tokens(20, seed=6)
    runs = [greedy(models["moe"], prompt, 32, threads) for threads in (1, 2, 2)]
    assert runs[0] == runs[1] == runs[2]
    reference, expected = load_hf_model(models["moe"]), []
    with torch.no_grad():
        out = reference(torch.tensor([prompt]), use_cache=True)
        for _ in range(32):
            expected.append(int(out.logits[0, -1].argmax()))
            out = reference(torch.tensor([expected[-1:]]), cache=out.cache, use_cache=True)
    assert runs[0] == expected


# --- errors


def test_missing_file(tmp_path: pathlib.Path) -> None:
    with pytest.raises(EngineError, match="not found"):
        Engine.load(tmp_path / "absent.gguf")


def test_non_gguf_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "notes.gguf"
    path.write_text("hello, this is not a model\n" * 10)
    with pytest.raises(EngineError, match="not a GGUF file"):
        Engine.load(path)


def test_truncated_file(tmp_path: pathlib.Path, models: dict[str, pathlib.Path]) -> None:
    data = models["dense"].read_bytes()
    for keep in (len(data) * 3 // 4, 100):  # cut in the tensor data, and in the header
        path = tmp_path / f"cut{keep}.gguf"
        path.write_bytes(data[:keep])
        with pytest.raises(EngineError, match="truncated"):
            Engine.load(path, n_ctx=64)


def test_unsupported_architecture(tmp_path: pathlib.Path, models: dict[str, pathlib.Path]) -> None:
    data = models["llama_q8"].read_bytes()
    arch_value = struct.pack("<Q", 5) + b"llama"  # general.architecture's value: length-prefixed string
    assert arch_value in data
    path = tmp_path / "mamba.gguf"
    path.write_bytes(data.replace(arch_value, struct.pack("<Q", 5) + b"mamba", 1))
    with pytest.raises(EngineError, match="unsupported architecture 'mamba'"):
        Engine.load(path, n_ctx=64)


def test_the_c_table_of_architectures_is_the_wrappers() -> None:
    """The wrapper refuses an architecture before C sees it; C's own refusal names the rows of its table (archs.c),
    which must be the architectures the wrapper lets through."""
    params = ffi.new("strata_model_params *")
    name = ffi.new("char[]", b"mamba")
    params.arch = name
    model = ffi.new("strata_model **")
    assert lib.strata_model_create(params, model) == lib.STRATA_ERR_UNSUPPORTED
    assert model[0] == ffi.NULL
    message = ffi.string(lib.strata_last_error()).decode()
    assert message == f"unsupported architecture 'mamba' ({', '.join(SUPPORTED_ARCHITECTURES)})"


def test_unsupported_tensor_type(tmp_path: pathlib.Path, models: dict[str, pathlib.Path]) -> None:
    source = models["dense"]
    field = next(t for t in GGUFReader(source).tensors if t.name.startswith("token_embd")).field
    # tensor info: name length, name, n_dims, dims, type (uint32), offset
    type_at = field.offset + sum(part.nbytes for part in field.parts[:4])
    data = bytearray(source.read_bytes())
    data[type_at:type_at + 4] = struct.pack("<I", GGMLQuantizationType.TQ1_0)  # smaller than F32: still in file
    path = tmp_path / "tq1_0.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(EngineError, match="token_embd.*unsupported type 34"):
        Engine.load(path, n_ctx=64)


def test_context_larger_than_the_model_allows(models: dict[str, pathlib.Path]) -> None:
    with pytest.raises(EngineError, match="larger than the model's 4096"):
        Engine.load(models["dense"], n_ctx=4097)


def test_bad_kv_type(models: dict[str, pathlib.Path]) -> None:
    with pytest.raises(EngineError, match="kv must be one of"):
        Engine.load(models["dense"], kv="q4")


def test_token_out_of_range_leaves_the_engine_usable(models: dict[str, pathlib.Path]) -> None:
    with Engine.load(models["dense"], n_ctx=64, threads=1) as engine:
        for bad in (-1, engine.n_vocab, 2**40):
            with pytest.raises(EngineError, match="out of range"):
                engine.eval([1, bad, 2])
        assert engine.n_past == 0
        assert engine.eval([1, 2]).shape == (engine.n_vocab,)


def test_context_full(models: dict[str, pathlib.Path]) -> None:
    with Engine.load(models["dense"], n_ctx=16, threads=1) as engine:
        engine.eval(tokens(10))
        with pytest.raises(EngineError, match="exceed the context of 16"):
            engine.eval(tokens(7))
        assert engine.n_past == 10


def test_closed_engine(models: dict[str, pathlib.Path]) -> None:
    engine = Engine.load(models["dense"], n_ctx=16, threads=1)
    engine.close()
    engine.close()
    with pytest.raises(EngineError, match="closed"):
        engine.eval([1])


def test_properties_and_timings(models: dict[str, pathlib.Path]) -> None:
    with Engine.load(models["moe"], n_ctx=64, threads=2, n_batch=8) as engine:
        assert (engine.arch, engine.backend, engine.threads, engine.n_ctx) == ("qwen3moe", "cpu", 2, 64)
        assert engine.metadata["qwen3moe.embedding_length"] == engine.n_embd
        engine.eval(tokens(20))
        t = engine.timings
        assert (t["n_tokens"], t["n_chunks"], t["decode_ms"]) == (20, 3, 0.0) and t["prompt_ms"] > 0
        engine.eval([1])
        assert engine.timings["n_tokens"] == 1 and engine.timings["decode_ms"] > 0


# --- attention shapes and thread splits off the common path


@pytest.mark.parametrize("kv, tol", [("f32", 1e-4), ("f16", 1e-3), ("int8", 2e-2)])
def test_odd_head_shapes_decode_match_transformers(tmp_path: pathlib.Path, kv: str, tol: float) -> None:
    # head_dim 40 is no whole number of 16- or 64-value slices, and 3 query heads per kv head leave one head
    # without a partner: every leftovers path of attention runs. Three threads split the q, k and v rows
    # unevenly, so a thread's share starts inside one weight and ends inside another.
    import torch

    path = write_random_model(tmp_path / "odd.gguf", arch="qwen3", size="tiny", head_dim=40, n_head=6,
                              n_head_kv=2)
    prompt = tokens(40, seed=8)
    with Engine.load(path, n_ctx=64, threads=3, kv=kv, n_batch=16) as engine:
        got = [engine.eval(prompt[:30])] + [engine.eval([t]) for t in prompt[30:]]
    reference = load_hf_model(path)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, 29:].numpy()
    for row, want in zip(got, expected, strict=True):
        assert_same(row, want, tol=tol)


def test_a_transformer_has_no_recurrent_state_and_keeps_any_prefix(models: dict[str, pathlib.Path]) -> None:
    with Engine.load(models["moe"], n_ctx=64, n_seq=2) as engine:
        assert not engine.recurrent and engine.state_bytes == 0
        engine.eval(list(range(10)))
        assert engine.save_state(0) == b""
        engine.load_state(1, b"")  # nothing to set
        engine.keep(4)  # any prefix stays usable
        engine.copy_prefix(0, 1, 2)
        assert engine.eval([7], seq=0).shape == engine.eval([7], seq=1).shape == (engine.n_vocab,)
