"""The token embeddings' lookup of the GPU backend's steps: the engine's `get_rows` (`strata_get_rows`, the C
dequantisers) against the gguf package's Python dequantiser called row by row, as the backend looked them up
before (issue 32), for a decode step's few tokens and a prompt's many.

    python bench/embedding_lookup.py [--width 256,2048] [--tokens 1,4,2000] [--types q8_0,f16,q4_k,q6_k]

A table of 4,096 random rows of each type (the writer's encodings: `strata.modelgen.quants.encode`) and random
ids; the calling thread's CPU time a call, the best of 5 repeats of a run of calls long enough to measure. Both
give the same bits (checked on every case).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants

from strata.engine_cffi import get_rows
from strata.modelgen.quants import encode

TYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_k": Q.Q4_K, "q6_k": Q.Q6_K}
N_ROWS = 4096


def cpu_seconds(call: Callable[[], object], min_seconds: float = 0.05) -> float:
    """CPU seconds of one call: the best of 5 runs of enough calls to take `min_seconds`."""
    n = 1
    while True:
        started = time.thread_time()
        for _ in range(n):
            call()
        if time.thread_time() - started >= min_seconds:
            break
        n *= 4
    runs = []
    for _ in range(5):
        started = time.thread_time()
        for _ in range(n):
            call()
        runs.append((time.thread_time() - started) / n)
    return min(runs)


def gguf_rows(qtype: Q, table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The rows by the gguf package, one call a row, an F32 row viewed as it is (the backend's lookup before
    `get_rows`)."""
    return np.stack([table[i].view(np.float32) if qtype == Q.F32 else quants.dequantize(table[i], qtype).reshape(-1)
                     for i in ids.tolist()])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", default="256,2048", help="values a row (the model's n_embd)")
    ap.add_argument("--tokens", default="1,4,2000", help="ids a call")
    ap.add_argument("--types", default="q8_0,f16,q4_k,q6_k", help=f"of {','.join(TYPES)}")
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    print(f"load average {os.getloadavg()[0]:.1f}; CPU microseconds a call (a token), best of 5")
    print(f"{'type':6} {'width':>5} {'tokens':>6} {'gguf':>16} {'get_rows':>16} {'ratio':>7}")
    for name in args.types.split(","):
        qtype = TYPES[name]
        for width in (int(w) for w in args.width.split(",")):
            table = encode(rng.standard_normal((N_ROWS, width), dtype=np.float32), qtype)
            for n in (int(t) for t in args.tokens.split(",")):
                ids = rng.integers(0, N_ROWS, n)
                want, got = gguf_rows(qtype, table, ids), get_rows(qtype, table, N_ROWS, width, ids)
                assert np.array_equal(want.view(np.uint32), got.view(np.uint32)), (name, width, n)
                old = cpu_seconds(lambda: gguf_rows(qtype, table, ids))  # noqa: B023 (timed at once)
                new = cpu_seconds(lambda: get_rows(qtype, table, N_ROWS, width, ids))  # noqa: B023
                print(f"{name:6} {width:5d} {n:6d} {old * 1e6:9.1f} ({old / n * 1e6:5.2f}) "
                      f"{new * 1e6:9.1f} ({new / n * 1e6:5.2f}) {old / new:6.1f}x")


if __name__ == "__main__":
    main()
