"""The engine's thread pool: results independent of the thread count, no leaked or busy threads, prompt abort."""

from __future__ import annotations

import os
import pathlib
import threading
import time

import numpy as np
import pytest
from engine_helpers import abort_mid_prefill

from strata.engine_cffi import Engine
from strata.modelgen import write_random_model


def tokens(n: int, seed: int = 0, n_vocab: int = 256) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, n_vocab, n)]


def n_os_threads() -> int:
    """The engine's pool workers alive in this process (they are named; other tests' threads are not counted)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # a thread that ended while we looked
            pass
    return names.count("strata-engine")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("threads")
    return {name: write_random_model(root / f"{name}.gguf", arch=arch, size="tiny", dtype=dtype)
            for name, arch, dtype in [("moe", "qwen3moe", "f32"), ("moe_q4k", "qwen3moe", "q4_k"),
                                      ("llama_q8", "llama", "q8_0")]}


def prompt_then_decode(path: pathlib.Path, threads: int) -> np.ndarray:
    """Logits of a 21-token prompt in chunks of 8 (every position), then of 4 greedy decode steps."""
    with Engine.load(path, n_ctx=64, threads=threads, n_batch=8) as engine:
        rows = [engine.eval(tokens(21, seed=5), all_logits=True)]
        for _ in range(4):
            rows.append(engine.eval([int(np.argmax(rows[-1][-1]))])[None])
    return np.concatenate(rows)


@pytest.mark.parametrize("name", ["moe", "moe_q4k", "llama_q8"])
def test_logits_bit_identical_across_thread_counts_and_runs(models: dict[str, pathlib.Path], name: str) -> None:
    # every row of every step is computed by one thread whatever the split, so the bits cannot depend on it;
    # 3 and 4 threads on fewer cores also exercise the barrier with descheduled threads
    reference = prompt_then_decode(models[name], 1)
    for threads in (2, 3, 4, 2):
        assert np.array_equal(prompt_then_decode(models[name], threads), reference), f"{threads} threads"


def test_context_lifetime_is_the_pool_lifetime(models: dict[str, pathlib.Path]) -> None:
    before = n_os_threads()
    for i in range(30):
        with Engine.load(models["llama_q8"], n_ctx=32, threads=4) as engine:
            assert n_os_threads() == before + 3  # 3 workers beside the calling thread
            if i % 10 == 0:
                engine.eval(tokens(3))
    assert n_os_threads() == before


def test_idle_engine_burns_no_cpu(models: dict[str, pathlib.Path]) -> None:
    with Engine.load(models["moe"], n_ctx=32, threads=3) as engine:
        engine.eval(tokens(4))
        time.sleep(0.05)  # past the workers' short spin for a next job
        cpu0, wall0 = time.process_time(), time.perf_counter()
        time.sleep(0.5)
        cpu = time.process_time() - cpu0
        wall = time.perf_counter() - wall0
    assert cpu < 0.05 * wall, f"{cpu:.3f} s of CPU in {wall:.2f} s idle"


def test_cpu_seconds_counts_the_engines_threads_and_no_other(models: dict[str, pathlib.Path]) -> None:
    """`Engine.cpu_seconds` (the step budget's clock): the calling thread's and the workers' CPU, so an eval on
    3 threads counts more CPU than the caller's own, and a busy Python thread beside it counts for nothing."""
    with Engine.load(models["moe"], n_ctx=256, threads=3) as engine:
        engine.eval(tokens(4))
        start, own = engine.cpu_seconds(), time.thread_time()
        engine.eval(tokens(120, seed=1))
        spent, own = engine.cpu_seconds() - start, time.thread_time() - own
        assert spent > 1.3 * own > 0, f"{spent:.4f} s counted, the caller's own {own:.4f} s"
        stop = threading.Event()

        def burn() -> None:
            while not stop.is_set():
                pass

        burner = threading.Thread(target=burn)
        burner.start()
        try:
            before, process = engine.cpu_seconds(), time.process_time()
            time.sleep(0.3)  # the workers sleep; the burner runs
            counted, burnt = engine.cpu_seconds() - before, time.process_time() - process
        finally:
            stop.set()
            burner.join()
        assert burnt > 0.1 and counted < 0.02, f"{counted:.4f} s counted while another thread burnt {burnt:.3f}"


@pytest.mark.parametrize("threads", [3, 4])
def test_abort_from_another_thread_returns_promptly(models: dict[str, pathlib.Path], threads: int) -> None:
    prompt, n_batch = tokens(1024, seed=2), 16
    with Engine.load(models["moe"], n_ctx=1024, threads=threads, n_batch=n_batch) as engine:
        # the flag is checked before every layer of a chunk: a layer of 16 tokens takes milliseconds
        assert abort_mid_prefill(engine, prompt) < 0.5
        assert 0 < engine.n_past < len(prompt) and engine.n_past % n_batch == 0
        engine.eval(tokens(3))  # the pool runs the next call
