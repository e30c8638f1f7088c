"""Several sequences in one context: a batch computes each sequence as it is computed alone."""

from __future__ import annotations

import os
import pathlib
import threading
import time
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf_rewrite import rewrite
from strata.engine_cffi._engine import lib

from strata.engine_cffi import BatchItem, Engine, EngineAborted, EngineError
from strata.modelgen import write_random_model
from strata.text.sampling import SamplingParams, draw

DTYPES = ["f32", "f16", "q8_0", "q4_k"]


def tokens(n: int, seed: int, n_vocab: int = 256) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, n_vocab, n)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("batch")
    found = {dtype: write_random_model(root / f"moe_{dtype}.gguf", arch="qwen3moe", size="tiny", dtype=dtype)
             for dtype in DTYPES}
    found["llama"] = write_random_model(root / "llama.gguf", arch="llama", size="tiny", dtype="q8_0")
    found["dense_q4_k"] = write_random_model(root / "dense_q4_k.gguf", arch="qwen3", size="tiny", dtype="q4_k")
    return found


def alone(path: pathlib.Path, prompt: list[int], steps: list[int], **load: Any) -> list[np.ndarray]:
    """The prompt's logits (all rows), then one row per decode step, from a context of one sequence."""
    with Engine.load(path, n_ctx=128, threads=2, **load) as engine:
        rows = [engine.eval(prompt, all_logits=True)]
        rows += [engine.eval([t])[None] for t in steps]
    return rows


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0", "q4_k", "llama", "dense_q4_k"])
def test_a_sequence_in_a_batch_equals_the_sequence_alone(models: dict[str, pathlib.Path], dtype: str) -> None:
    # Three prompts of different lengths in one call (chunks mixing their tokens), then decode steps of one token
    # per sequence in one call each. Every product computes each token's row on its own, in the same order
    # whatever else is in the chunk, so the logits are bit-identical. That includes the K-quants, whose products
    # of 16 tokens or more (Q4_K and Q6_K: 10) take another path (weights unpacked once per tile) that ends in
    # the same integer sums and f32 steps as the direct one (a difference of ~2e-7 there, rounded to Q8_K in the
    # next layer, once moved logits by up to 1.9% of the largest).
    path = models[dtype]
    prompts = [tokens(n, seed) for n, seed in [(21, 1), (9, 2), (14, 3)]]
    steps = [tokens(4, 10 + s) for s in range(3)]
    with Engine.load(path, n_ctx=128, threads=2, n_batch=16, n_seq=4) as engine:
        # sequence 2 is left out (not every slot takes part); the third prompt goes to slot 3
        got = [[rows] for rows in engine.eval_batch(
            [BatchItem(0, prompts[0], logits="all"), BatchItem(1, prompts[1], logits="all"),
             BatchItem(3, prompts[2], logits="all")])]
        for i in range(4):
            step = engine.eval_batch([BatchItem(s, [steps[k][i]]) for k, s in enumerate([0, 1, 3])])
            for k in range(3):
                got[k].append(step[k])
        assert [engine.seq_n_past(s) for s in range(4)] == [25, 13, 0, 18]
    for k in range(3):
        want = alone(path, prompts[k], steps[k], n_batch=16)
        for a, b in zip(got[k], want, strict=True):
            np.testing.assert_array_equal(a, b)


def test_k_quant_decode_steps_in_a_batch_equal_the_steps_alone(models: dict[str, pathlib.Path]) -> None:
    # Decode-shaped products (fewer than 16 tokens) take the direct K-quant path alone and in a batch.
    path = models["q4_k"]
    prompts = [tokens(n, seed) for n, seed in [(21, 1), (9, 2), (14, 3)]]
    steps = [tokens(6, 10 + s) for s in range(3)]
    with Engine.load(path, n_ctx=128, threads=2, n_batch=16, n_seq=3) as engine:
        for s in range(3):
            engine.eval(prompts[s], seq=s)
        got = [engine.eval_batch([BatchItem(s, [steps[s][i]]) for s in range(3)]) for i in range(6)]
    for s in range(3):
        want = alone(path, prompts[s], steps[s], n_batch=16)[1:]
        for i in range(6):
            np.testing.assert_array_equal(got[i][s], want[i])


def test_greedy_answers_in_a_batch_equal_the_answers_alone(models: dict[str, pathlib.Path]) -> None:
    path = models["q8_0"]
    prompts = [tokens(n, seed) for n, seed in [(12, 4), (30, 5), (7, 6)]]

    def greedy_alone(prompt: list[int]) -> list[int]:
        with Engine.load(path, n_ctx=128, threads=2) as engine:
            out, logits = [], engine.eval(prompt)
            for _ in range(12):
                out.append(int(np.argmax(logits)))
                logits = engine.eval(out[-1:])
        return out

    with Engine.load(path, n_ctx=128, threads=2, n_seq=3) as engine:
        rows = engine.eval_batch([BatchItem(s, p) for s, p in enumerate(prompts)])
        outs: list[list[int]] = [[] for _ in prompts]
        for _ in range(12):
            for s in range(3):
                outs[s].append(int(np.argmax(rows[s][0])))
            rows = engine.eval_batch([BatchItem(s, outs[s][-1:]) for s in range(3)])
    assert outs == [greedy_alone(p) for p in prompts]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_draws_of_several_rows_on_the_engines_threads_are_the_draws_one_by_one(models: dict[str, pathlib.Path],
                                                                                 threads: int) -> None:
    rng = np.random.default_rng(threads)
    # Greedy rows (temperature 0, or top-k 1) take numpy's arg-max: the first of equal largest values, the first
    # NaN where there is one.
    settings = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9),
                SamplingParams(temperature=0.6, top_k=20, top_p=0.95), SamplingParams(min_p=0.05),
                SamplingParams(temperature=1.3, top_k=3), SamplingParams(temperature=0.0), SamplingParams(top_k=1)]
    with Engine.load(models["q8_0"], n_ctx=32, threads=threads) as engine:
        n = engine.n_vocab
        rows = [rng.normal(0.0, 2.0, n).astype(np.float32) for _ in range(9)]
        params = [settings[i % len(settings)] for i in range(9)]
        u = [float(x) for x in rng.random(9)]
        expected = [int(np.argmax(r)) if p.greedy else draw(r, p, x) for r, p, x in zip(rows, params, u, strict=True)]
        assert engine.sample_rows(rows, params, u) == expected
        greedy = SamplingParams(temperature=0.0)
        ties, nans, low = rng.normal(0.0, 1.0, n).astype(np.float32), rows[0].copy(), np.full(n, -np.inf, np.float32)
        ties[[n - 3, 77, 200]] = 9.0
        nans[[n - 1, 123]] = np.nan
        assert engine.sample_rows([ties, nans, low], [greedy] * 3, [0.0] * 3) == [77, 123, 0]
        assert engine.sample_rows([], [], []) == []
        with pytest.raises(EngineError, match="rows of"):
            engine.sample_rows([rows[0][:10]], params[:1], u[:1])


def test_pictures_in_two_sequences_at_once(models: dict[str, pathlib.Path]) -> None:
    path = models["f16"]
    rng = np.random.default_rng(7)
    with Engine.load(path, n_ctx=64, threads=2, n_seq=2) as engine:
        n_embd = engine.n_embd
        pics = [rng.standard_normal((5, n_embd)).astype(np.float32) for _ in range(2)]
        prompts = [tokens(12, 8), tokens(10, 9)]
        got = engine.eval_batch([BatchItem(0, prompts[0], [(3, pics[0])], "all"),
                                 BatchItem(1, prompts[1], [(0, pics[1])], "all")])
    for s, at in [(0, 3), (1, 0)]:
        with Engine.load(path, n_ctx=64, threads=2) as one:
            np.testing.assert_array_equal(got[s], one.eval(prompts[s], [(at, pics[s])], all_logits=True))
    with Engine.load(path, n_ctx=64, threads=2) as one:  # the rows did replace the embeddings
        assert not np.array_equal(got[0], one.eval(prompts[0], all_logits=True))


def test_abort_drops_only_its_own_sequence(models: dict[str, pathlib.Path]) -> None:
    # A long prompt in sequence 0 beside a short one in sequence 1, in chunks of 16: sequence 0 is aborted once
    # its first chunk is in; sequence 1 (whose tokens come last in the call) is still computed, exactly.
    path = models["f32"]
    long, short = tokens(480, 11), tokens(40, 12)
    with Engine.load(path, n_ctx=512, threads=2, n_batch=16, n_seq=2) as engine:
        result: dict[str, object] = {}

        def run() -> None:
            try:
                engine.eval_batch([BatchItem(0, long, logits="none"), BatchItem(1, short, logits="all")])
            except EngineAborted as exc:
                result["error"] = exc

        worker = threading.Thread(target=run)
        worker.start()
        while engine.seq_n_past(0) == 0 and worker.is_alive():
            time.sleep(0.0005)
        engine.abort(0)
        worker.join(timeout=30)
        error = result.get("error")
        assert isinstance(error, EngineAborted) and error.dropped == {0}
        kept = engine.seq_n_past(0)
        assert kept % 16 == 0 and 0 < kept < len(long)
        assert engine.seq_n_past(1) == len(short)
        nxt = engine.eval([5], seq=1)
        rest = engine.eval(long[kept:], all_logits=True, seq=0)  # its finished chunks are intact
    with Engine.load(path, n_ctx=512, threads=2, n_batch=16) as one:
        one.eval(short)
        np.testing.assert_array_equal(nxt, one.eval([5]))
    with Engine.load(path, n_ctx=512, threads=2, n_batch=16) as one:
        np.testing.assert_array_equal(rest, one.eval(long, all_logits=True)[kept:])


def test_abort_while_idle_stops_that_sequence_in_the_next_call(models: dict[str, pathlib.Path]) -> None:
    with Engine.load(models["f32"], n_ctx=64, threads=1, n_seq=2) as engine:
        engine.abort(1)
        with pytest.raises(EngineAborted) as caught:
            engine.eval_batch([BatchItem(0, tokens(3, 1)), BatchItem(1, tokens(3, 2))])
        assert caught.value.dropped == {1}
        assert (engine.seq_n_past(0), engine.seq_n_past(1)) == (3, 0)
        engine.eval(tokens(3, 2), seq=1)  # the flag was consumed
        assert engine.seq_n_past(1) == 3


def test_keep_clear_and_copy_prefix_per_sequence(models: dict[str, pathlib.Path]) -> None:
    path = models["q8_0"]
    system, a, b = tokens(20, 13), tokens(6, 14), tokens(9, 15)
    for kv in ["f16", "int8"]:
        with Engine.load(path, n_ctx=64, threads=2, n_seq=3, kv=kv) as engine:
            engine.eval(system + a, seq=0)
            engine.copy_prefix(0, 2, len(system))  # the shared system prompt, computed once
            assert engine.seq_n_past(2) == 20
            copied = engine.eval(b, all_logits=True, seq=2)
            engine.keep(len(system), seq=0)  # truncating one sequence leaves the others as they were
            again = engine.eval(b, all_logits=True, seq=0)
            engine.keep(0, seq=2)
            assert [engine.seq_n_past(s) for s in range(3)] == [29, 0, 0]
        with Engine.load(path, n_ctx=64, threads=2, kv=kv) as one:
            want = one.eval(system + b, all_logits=True)[len(system):]
        np.testing.assert_array_equal(copied, want)
        np.testing.assert_array_equal(again, want)


def test_batch_errors(models: dict[str, pathlib.Path]) -> None:
    with Engine.load(models["f32"], n_ctx=16, threads=1, n_seq=2) as engine:
        with pytest.raises(EngineError, match="twice"):
            engine.eval_batch([BatchItem(0, [1]), BatchItem(0, [2])])
        with pytest.raises(EngineError, match="outside"):
            engine.eval([1], seq=2)
        with pytest.raises(EngineError, match="outside"):
            engine.keep(0, seq=-1)
        engine.eval(tokens(10, 1), seq=1)
        with pytest.raises(EngineError, match="sequence 1"):  # each sequence has its own n_ctx positions
            engine.eval_batch([BatchItem(0, tokens(10, 2)), BatchItem(1, tokens(10, 3))])
        assert (engine.seq_n_past(0), engine.seq_n_past(1)) == (0, 10)  # a refused call changes nothing
        with pytest.raises(EngineError, match="holds 10"):
            engine.copy_prefix(1, 0, 11)
        with pytest.raises(EngineError, match="outside the 1 tokens"):
            engine.eval_batch([BatchItem(0, [1, 2]), BatchItem(1, [3], [(1, np.zeros((1, engine.n_embd)))])])


def test_a_call_adds_one_to_its_notify_eventfd_as_it_starts(models: dict[str, pathlib.Path]) -> None:
    fd = os.eventfd(0, os.EFD_NONBLOCK)
    try:
        with Engine.load(models["f32"], n_ctx=16, threads=2) as engine:
            engine.eval([1, 2, 3])
            with pytest.raises(BlockingIOError):  # no notify_fd: nothing written
                os.eventfd_read(fd)
            engine.eval_batch([BatchItem(0, [4])], notify_fd=fd)
            engine.eval_batch([BatchItem(0, [5])], notify_fd=fd)
            assert os.eventfd_read(fd) == 2
    finally:
        os.close(fd)


def test_the_pool_is_n_seq_times_one_sequence(models: dict[str, pathlib.Path]) -> None:
    with Engine.load(models["f32"], n_ctx=64, threads=1) as one, \
            Engine.load(models["f32"], n_ctx=64, threads=1, n_seq=5) as five:
        assert one.n_seq == 1 and five.n_seq == 5
        assert five.kv_bytes == 5 * one.kv_bytes > 0
    with pytest.raises(EngineError, match="n_seq"):
        Engine.load(models["f32"], n_ctx=64, threads=1, n_seq=0)


@pytest.mark.parametrize("kv", ["f32", "f16", "int8"])
def test_a_kv_budget_bounds_slots_times_context_before_anything_is_allocated(models, kv) -> None:
    with Engine.load(models["f32"], n_ctx=64, threads=1, n_seq=3, kv=kv) as three:
        need = three.kv_bytes
    with Engine.load(models["f32"], n_ctx=64, threads=1, n_seq=3, kv=kv, kv_budget=need) as fits:
        assert fits.kv_bytes == need  # the budget's arithmetic is the engine's
    with pytest.raises(EngineError, match=rf"3 slots x 64 positions \({kv}\) needs .* MiB, over the KV budget of "
                       r".* MiB: 2 slots of 64 positions fit, or 3 slots of 63 positions"):
        Engine.load(models["f32"], n_ctx=64, threads=1, n_seq=3, kv=kv, kv_budget=need - 1)


@pytest.mark.parametrize("dtype", ["q8_0", "f32"])
def test_only_a_q8_0_output_weight_is_laid_out_in_bands(models: dict[str, pathlib.Path], dtype: str) -> None:
    # The bands are a copy beside the mapped file: what they take is counted, and printed at startup.
    output = next(t for t in GGUFReader(models[dtype]).tensors if t.name in ("output.weight", "output"))
    n_cols, n_rows = (int(n) for n in output.shape[:2])
    with Engine.load(models[dtype], n_ctx=64, threads=1) as engine:
        assert output.tensor_type == (GGMLQuantizationType.Q8_0 if dtype == "q8_0" else GGMLQuantizationType.F32)
        if dtype == "q8_0" and lib.strata_bands_bytes(int(output.tensor_type), n_rows, n_cols):  # AVX-512 VNNI
            assert engine.prepared_bytes == lib.strata_bands_bytes(int(output.tensor_type), n_rows, n_cols)
            assert engine.prepared_bytes >= n_rows * n_cols // 32 * 34
        else:
            assert engine.prepared_bytes == 0


@pytest.mark.parametrize("dtype", ["q8_0", "q4_k", "f32", "llama", "dense_q4_k"])
def test_weights_copied_to_huge_pages_give_the_bits_of_the_mapped_file(models: dict[str, pathlib.Path],
                                                                       dtype: str) -> None:
    # By default load copies every layer's matrices, and an output weight without bands, into memory of its own
    # (in huge pages), Q8_0 ones laid out in bands where the build has them; mapped_weights reads the rows where
    # the file is mapped. Bands and rows end each block in the same f32 steps: the same logits, bit for bit, in
    # a prompt (the tile unit's paths) and in decode steps. The copy holds exactly those matrices (each on its
    # own cache lines; bands of whole 16-row groups take the rows' bytes).
    path = models[dtype]
    with Engine.load(path, n_ctx=64, threads=1, mapped_weights=True) as mapped:
        assert mapped.copied_bytes == 0
        banded = mapped.prepared_bytes > 0
    matrices = [t for t in GGUFReader(path).tensors if len(t.shape) >= 2 and (
        t.name.startswith("blk.") or (t.name.startswith("output") and not banded))]
    assert any("exps" in t.name for t in matrices) == (dtype not in ("llama", "dense_q4_k"))
    with Engine.load(path, n_ctx=64, threads=1) as copied:
        assert copied.copied_bytes == sum((int(t.n_bytes) + 63) // 64 * 64 for t in matrices)
        assert (copied.prepared_bytes > 0) == banded
    prompt, steps = tokens(13, 41), tokens(3, 42)
    for got, want in zip(alone(path, prompt, steps), alone(path, prompt, steps, mapped_weights=True), strict=True):
        np.testing.assert_array_equal(got, want)


def resident_bytes(engine: Engine) -> int:
    """Bytes of the engine's mapping of its file that are in this process's memory (Linux: /proc/self/smaps)."""
    start = np.frombuffer(engine._file._map, np.uint8).ctypes.data  # the mapping's first byte
    lines = pathlib.Path("/proc/self/smaps").read_text().splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith(f"{start:x}-"))  # its line in the table
    return next(int(line.split()[1]) * 1024 for line in lines[head + 1:] if line.startswith("Rss:"))


def test_the_copied_weights_pages_leave_the_process(models: dict[str, pathlib.Path]) -> None:
    # Once copied, the layers' pages of the file are unmapped from the process (the page cache may keep them):
    # its memory counts the weights once. Read where mapped, they stay in it.
    path = models["q8_0"]
    layers = sum(int(t.n_bytes) for t in GGUFReader(path).tensors if t.name.startswith("blk."))
    with Engine.load(path, n_ctx=64, threads=1, mapped_weights=True) as engine:
        engine.eval(tokens(13, 43))
        assert resident_bytes(engine) > layers / 2
    with Engine.load(path, n_ctx=64, threads=1) as engine:
        engine.eval(tokens(13, 43))
        assert resident_bytes(engine) < layers / 8


def test_a_tied_output_weight_gives_the_bits_of_an_untied_copy(models: dict[str, pathlib.Path],
                                                                tmp_path: pathlib.Path) -> None:
    # Without output.weight the file ties the output to token_embd: the output's bands (when laid out) are made
    # from the embedding, whose rows lookups still read as they are in the file. A copy that stores the same
    # bytes as output.weight must give the same logits, bit for bit, alone and in a batch.
    src = models["q8_0"]
    embd = next(t for t in GGUFReader(src).tensors if t.name == "token_embd.weight")
    assert embd.tensor_type == GGMLQuantizationType.Q8_0
    tied = rewrite(src, tmp_path / "tied.gguf", drop="output.weight")
    untied = rewrite(src, tmp_path / "untied.gguf", replace={"output.weight": np.asarray(embd.data)})
    assert "output.weight" not in {t.name for t in GGUFReader(tied).tensors}
    with Engine.load(tied, n_ctx=64, threads=1) as a, Engine.load(untied, n_ctx=64, threads=1) as b:
        assert a.prepared_bytes == b.prepared_bytes
    prompts = [tokens(n, seed) for n, seed in [(11, 21), (6, 22)]]
    steps = [tokens(3, 30 + s) for s in range(2)]
    want = [alone(untied, prompts[k], steps[k]) for k in range(2)]
    for k in range(2):
        for a_rows, b_rows in zip(alone(tied, prompts[k], steps[k]), want[k], strict=True):
            np.testing.assert_array_equal(a_rows, b_rows)
    with Engine.load(tied, n_ctx=128, threads=2, n_seq=2) as engine:
        got = [[rows] for rows in engine.eval_batch([BatchItem(s, prompts[s], logits="all") for s in range(2)])]
        for i in range(3):
            for k, rows in enumerate(engine.eval_batch([BatchItem(s, [steps[s][i]]) for s in range(2)])):
                got[k].append(rows)
    for k in range(2):
        for a_rows, b_rows in zip(got[k], want[k], strict=True):
            np.testing.assert_array_equal(a_rows, b_rows)
