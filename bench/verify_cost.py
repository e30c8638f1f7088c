"""What a speculative verification step costs against the number of distinct experts its tokens read.

    python bench/verify_cost.py [--threads 2] [--rounds 15]

On the small Q8_0 qwen3moe (`strata make-model --arch qwen3moe --size small --dtype q8_0`: 6 layers of 16
experts, top-4), after a context of 300 random tokens, steps of one sequence carrying 1 + k tokens, k = 0..8
(every row's logits where k > 0, as a verification asks; the last row's for k = 0), whose tokens are chosen by
their recorded routing (`Engine.load(record_routing=...)`) so that the experts the step reads range from the
fewest to the most for each k:

1. the routing of each of 64 random tokens, alone after the context;
2. for each k and each m = 1..1 + k, m distinct tokens filling the 1 + k places in turn, picked greedily to add
   the fewest experts to the union so far (the tokens routing most alike) and, again, the most;
3. each such step run once with the routing recorded: its expert reads, the distinct (layer, expert) pairs of
   all its tokens (a step computes each once for all its tokens);
4. each step timed `--rounds` times, all of them taking turns, on an engine without the record: the median of the
   engine threads' CPU time (which other processes' load stretches less than the wall time) and of the wall time.

Then the least-squares fit of cost = fixed + per_token * (1 + k) + per_expert * expert reads, and the cost of a
draft token from it: per_token plus per_expert times the experts it adds.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import tempfile
import time

import numpy as np
from speculative import small_model

from strata.engine_cffi import BatchItem, Engine
from strata.experts.trace import read_trace

MAX_DRAFT = 8
CONTEXT = 300
POOL = 64


def reads(routing: list[list[np.ndarray]]) -> int:
    """Distinct (layer, expert) pairs of tokens whose routing is `routing[token][layer]` (expert ids)."""
    return sum(len(np.unique(np.concatenate([token[il] for token in routing]))) for il in range(len(routing[0])))


def candidates(routing: list[list[np.ndarray]]) -> list[tuple[int, list[int]]]:
    """(k, indices into the pool) of steps of 1 + k tokens: for each m distinct pool tokens, the greedy pick
    that adds the fewest experts and the one that adds the most, filling the 1 + k places in turn."""
    steps = []
    for k in range(MAX_DRAFT + 1):
        for m in range(1, k + 2):
            for sign in (1, -1):
                chosen = [0]
                while len(chosen) < m:
                    rest = [i for i in range(len(routing)) if i not in chosen]
                    chosen.append(min(rest, key=lambda i: sign * reads([routing[j] for j in [*chosen, i]])))
                steps.append((k, [chosen[i % m] for i in range(k + 1)]))
    return steps


def eval_step(engine: Engine, tokens: list[int]) -> None:
    engine.eval_batch([BatchItem(0, tokens, None, "all" if len(tokens) > 1 else "last")])
    engine.keep(CONTEXT)


def recorded(model: pathlib.Path, threads: int, context: list[int], pool: list[int],
             steps: list[list[int]] | None) -> list[list[list[np.ndarray]]]:
    """The routing (token, layer -> experts) of each step of `steps` after the context (each pool token alone
    when None), from an engine that records it."""
    runs = steps if steps is not None else [[t] for t in pool]
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "routing.bin"
        with Engine.load(model, n_ctx=1024, threads=threads, n_batch=512, record_routing=path) as engine:
            engine.eval_batch([BatchItem(0, context, None, "none")])
            for tokens in runs:
                eval_step(engine, tokens)
        trace = read_trace(path)
    by_step = list(trace.steps())[1:]  # the context's step first
    assert len(by_step) == len(runs)
    return [[[layer.experts[t] for layer in step] for t in range(len(layer_tokens))]
            for step, layer_tokens in zip(by_step, runs, strict=True)]


def timed(model: pathlib.Path, threads: int, context: list[int], steps: list[list[int]],
          rounds: int) -> list[tuple[float, float]]:
    """(median wall s, median engine CPU s) of each step, all of them taking turns each round after one to warm."""
    times: list[list[tuple[float, float]]] = [[] for _ in steps]
    with Engine.load(model, n_ctx=1024, threads=threads, n_batch=512) as engine:
        engine.eval_batch([BatchItem(0, context, None, "none")])
        engine.keep(CONTEXT)
        for r in range(rounds + 1):
            order = range(len(steps)) if r % 2 else reversed(range(len(steps)))
            for i in order:
                started, cpu = time.perf_counter(), engine.cpu_seconds()
                eval_step(engine, steps[i])
                if r:
                    times[i].append((time.perf_counter() - started, engine.cpu_seconds() - cpu))
    return [(statistics.median(w for w, _ in t), statistics.median(c for _, c in t)) for t in times]


def fit(k: np.ndarray, experts: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """(fixed, per_token, per_expert) of the least-squares fit seconds = fixed + per_token (1 + k) + per_expert
    experts."""
    design = np.stack([np.ones_like(k, dtype=float), 1.0 + k, experts.astype(float)], axis=1)
    return np.linalg.lstsq(design, seconds, rcond=None)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}, {args.threads} engine threads", flush=True)
    model = small_model()
    rng = np.random.default_rng(0)
    context = [int(t) for t in rng.integers(0, 151936, CONTEXT)]
    pool = [int(t) for t in rng.integers(0, 151936, POOL)]
    alone = [routing[0] for routing in recorded(model, args.threads, context, pool, None)]
    picks = candidates(alone)
    steps = [[pool[i] for i in idx] for _, idx in picks]
    experts = np.array([reads(r) for r in recorded(model, args.threads, context, pool, steps)])
    k = np.array([kk for kk, _ in picks])
    times = timed(model, args.threads, context, steps, args.rounds)
    wall, cpu = np.array([w for w, _ in times]), np.array([c for _, c in times])
    print("\n| draft tokens k | expert reads: fewest - most | CPU ms at the fewest - the most | wall ms |\n"
          "|---|---|---|---|")
    for kk in range(MAX_DRAFT + 1):
        at = np.flatnonzero(k == kk)
        lo, hi = at[np.argmin(experts[at])], at[np.argmax(experts[at])]
        print(f"| {kk} | {experts[lo]} - {experts[hi]} | {cpu[lo] * 1e3:.2f} - {cpu[hi] * 1e3:.2f} | "
              f"{wall[lo] * 1e3:.2f} - {wall[hi] * 1e3:.2f} |")
    for name, seconds in (("CPU", cpu), ("wall", wall)):
        fixed, per_token, per_expert = fit(k, experts, seconds)
        residual = seconds - (fixed + per_token * (1 + k) + per_expert * experts)
        plain = float(np.median(seconds[k == 0]))
        print(f"\n{name}: cost = {fixed * 1e3:.3f} ms + {per_token * 1e3:.3f} ms a token + {per_expert * 1e3:.4f} "
              f"ms an expert read (RMS residual {np.sqrt(np.mean(residual ** 2)) * 1e3:.3f} ms; plain step "
              f"{plain * 1e3:.2f} ms, {int(np.median(experts[k == 0]))} expert reads); a draft token adding no expert "
              f"{per_token / plain:.1%} of the plain step, adding 4 (one token's top-4 in one layer) "
              f"{(per_token + 4 * per_expert) / plain:.1%}, 24 (in all six) "
              f"{(per_token + 24 * per_expert) / plain:.1%}")
    print(f"\nload average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
