"""Prompt processing in one engine call beside calls of `batch` tokens, as the service makes them so that it can
report the prompt's progress between chunks (`Service._advance`). The engine chunks by `n_batch` inside a call
too; the calls only add the last position's logits per chunk (one output row per `batch` tokens).

    python bench/prompt_chunks.py [--size small] [--dtype q8_0] [--tokens 2048] [--rounds 6]

Rounds alternate the two ways, so that a noisy machine affects both alike; the best of each is compared.
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import time

import numpy as np

from strata.engine_cffi import Engine
from strata.modelgen import write_random_model

BATCH = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--dtype", default="q8_0")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = write_random_model(pathlib.Path(folder) / "model.gguf", arch="qwen3moe", size=args.size,
                                  dtype=args.dtype, vocab="qwen", seed=0)
        engine = Engine.load(path, n_ctx=args.tokens + 16, n_batch=BATCH)
        ids = [int(i) for i in np.random.default_rng(0).integers(1000, 100_000, args.tokens)]

        def one_call() -> None:
            engine.keep(0)
            engine.eval(ids)

        def chunked() -> None:
            engine.keep(0)
            for start in range(0, len(ids), BATCH):
                engine.eval(ids[start:start + BATCH])

        ways = {"one call": one_call, f"calls of {BATCH}": chunked}
        times: dict[str, list[float]] = {name: [] for name in ways}
        for fn in ways.values():
            fn()  # warm: pages mapped, caches filled
        for _ in range(args.rounds):
            for name, fn in ways.items():
                started = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - started)
        engine.close()
    print(f"| {args.size} {args.dtype}, {args.tokens}-token prompt | best s | median s | tokens/s (best) |")
    print("|---|---|---|---|")
    for name, values in times.items():
        values.sort()
        print(f"| {name} | {values[0]:.3f} | {values[len(values) // 2]:.3f} | {args.tokens / values[0]:.0f} |")
    one, calls = (min(values) for values in times.values())
    print(f"\ncalls / one call (best): {calls / one:.3f}")


if __name__ == "__main__":
    main()
