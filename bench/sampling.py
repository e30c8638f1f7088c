"""What drawing a token costs: the C draw (`strata.text.sampling.draw`) against the numpy pipeline it replaced, per draw
and in the batcher's decode, where every sequence's draw runs on the engine thread between two steps.

    python bench/sampling.py [--model bench/out/qwen3moe-small-q8_0.gguf] [--threads 2] [--tokens 64] [--runs 3]

Per draw: microseconds over 151,936 logits, median of 200: normal with standard deviation 1 ("flat") or 3, and
"trained-like": 300 tokens 8-20 above a normal background of deviation 2, as a trained model puts most of its mass
on a few tokens (a random model's logits are the flat kind). The
numpy side is the earlier sampler's: the candidates (`Sampler.distribution`, sorted windows for top-p and top-k),
then a search of their running sum. Decode: tokens/s of the batcher (`strata.scheduling.batcher.Batcher`, as the server
and `strata generate` run it) with 1 and 4 sequences of 40 random prompt tokens each, for each setting, both draws
alternated in the same process; median of `--runs`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from strata.scheduling.batcher import Batcher, Job
from strata.text.sampling import Sampler, SamplingParams

SMALL_MODEL = Path(__file__).parent / "out" / "qwen3moe-small-q8_0.gguf"
N_VOCAB = 151_936
SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "default (temperature 1)": SamplingParams(),
    "temperature 0.7, top-p 0.95": SamplingParams(temperature=0.7, top_p=0.95),
    "temperature 0.6, top-p 0.95, top-k 20": SamplingParams(temperature=0.6, top_p=0.95, top_k=20),
    "temperature 1, min-p 0.05": SamplingParams(min_p=0.05),
}


def trained_like(rng: np.random.Generator) -> np.ndarray:
    logits = rng.standard_normal(N_VOCAB) * 2
    logits[rng.choice(N_VOCAB, 300, replace=False)] += rng.uniform(8, 20, 300)
    return logits.astype(np.float32)


LOGITS = {"flat": (np.random.default_rng(0).standard_normal(N_VOCAB)).astype(np.float32),
          "normal, sd 3": (np.random.default_rng(0).standard_normal(N_VOCAB) * 3).astype(np.float32),
          "trained-like": trained_like(np.random.default_rng(0))}


def numpy_draw(sampler: Sampler, logits: np.ndarray, previous: Any = ()) -> int:
    """The earlier sampler's draw: the candidates, then a search of their running sum."""
    if sampler.params.greedy:
        return int(np.argmax(sampler.penalise(logits, previous)))
    ids, probs = sampler.distribution(logits, previous)
    cumulative = np.cumsum(probs, dtype=np.float64)
    pick = np.searchsorted(cumulative, sampler._rng.random() * cumulative[-1], side="right")
    return int(ids[min(pick, len(ids) - 1)])


def per_draw(params: SamplingParams, logits: np.ndarray, draw: Callable[[Sampler, np.ndarray], int]) -> float:
    sampler = Sampler(params, len(logits))
    times = []
    for _ in range(200):
        start = time.perf_counter()
        draw(sampler, logits)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def decode_rate(engine: Any, params: SamplingParams, n_seq: int, tokens: int, use_numpy: bool, seed: int) -> float:
    """Tokens/s of `n_seq` jobs decoding together, from their first token to their last."""
    draw = random.Random(seed)
    batcher = Batcher(engine)
    jobs = []
    for _ in range(n_seq):
        sampler = Sampler(params, engine.n_vocab)
        if use_numpy:
            sampler.sample = (lambda s: lambda logits, previous=(): numpy_draw(s, logits, previous))(sampler)
        jobs.append(Job([draw.randrange(1000, 100000) for _ in range(40)], sampler, tokens, set()))
    for job in jobs:
        batcher.add(job)
    while any(not job.tokens for job in jobs):
        batcher.step()
    start, before = time.perf_counter(), sum(len(job.tokens) for job in jobs)
    while batcher.jobs:
        batcher.step()
    return (sum(len(job.tokens) for job in jobs) - before) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=SMALL_MODEL)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print(f"per draw over {N_VOCAB:,} logits, microseconds (median of 200)\n")
    print("| setting | logits | numpy | C | numpy / C |\n|---|---|---|---|---|")
    for name, params in SETTINGS.items():
        for kind, logits in LOGITS.items():
            old, new = per_draw(params, logits, numpy_draw), per_draw(params, logits, Sampler.sample)
            print(f"| {name} | {kind} | {old:.0f} | {new:.0f} | {old / new:.1f} |")

    from strata.engine_cffi import Engine

    rates: dict[tuple[str, int, bool], list[float]] = {}
    with Engine.load(args.model, n_ctx=1024, threads=args.threads, n_seq=4) as engine:
        for run in range(args.runs):
            for name, params in SETTINGS.items():
                for n_seq in (1, 4):
                    for use_numpy in (True, False):  # alternated: a change of load hits both alike
                        rate = decode_rate(engine, params, n_seq, args.tokens, use_numpy, seed=run)
                        rates.setdefault((name, n_seq, use_numpy), []).append(rate)
    print(f"\nbatcher decode, {args.model.name}, {args.threads} threads, {args.tokens} tokens a sequence, tokens/s "
          f"(median of {args.runs})\n")
    print("| setting | sequences | numpy draw | C draw | C / numpy |\n|---|---|---|---|---|")
    for name in SETTINGS:
        for n_seq in (1, 4):
            old = statistics.median(rates[(name, n_seq, True)])
            new = statistics.median(rates[(name, n_seq, False)])
            print(f"| {name} | {n_seq} | {old:.1f} | {new:.1f} | {new / old:.2f} |")


if __name__ == "__main__":
    main()
