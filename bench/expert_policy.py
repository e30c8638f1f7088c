"""The expert cache's policy per decode step: the reference (`strata.experts.simulate.AdaptiveLrfuCache`, Python)
against `ExpertPolicy` (the same decisions in C), at upload budgets from the default's to what a PCIe link allows.

    python bench/expert_policy.py [--layers 40] [--experts 256] [--used 8] [--share 0.33] [--steps 300]
                                  [--budgets 4,32,200] [--rounds 3]

A routing of Qwen3.5-35B-A3B's shape by default (40 layers of 256 experts, top-8, one token a step), drawn from a
skewed distribution whose favourites move every 100 steps, against a cache of a third of the experts. The GPU
backend steps the policy at every layer of every step, so its time adds to each step's: the table gives the
median over `--rounds` of the milliseconds a step, and checks that both made the same decisions.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from strata.engine_cffi.expert_policy import ExpertPolicy
from strata.experts.simulate import AdaptiveLrfuCache


def routing(n_layer: int, n_expert: int, used: int, steps: int) -> list[list[list[int]]]:
    rng = np.random.default_rng(0)
    out = []
    for step in range(steps):
        p = np.roll(np.geomspace(1, 0.02, n_expert), 17 * (step // 100))
        out.append([sorted(rng.choice(n_expert, used, replace=False, p=p / p.sum()).tolist())
                    for _ in range(n_layer)])
    return out


def run(policy: AdaptiveLrfuCache | ExpertPolicy, steps: list[list[list[int]]]) -> tuple[float, list]:
    """Seconds a step, and every outcome."""
    outcomes = []
    started = time.perf_counter()
    for layers in steps:
        policy.begin_step()
        for layer, experts in enumerate(layers):
            outcomes.append(policy.step(layer, experts))
    return (time.perf_counter() - started) / len(steps), outcomes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--used", type=int, default=8)
    ap.add_argument("--share", type=float, default=0.33, help="the cache's capacity, a share of every expert")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--budgets", default="4,32,200", help="uploads a step may start")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    steps = routing(args.layers, args.experts, args.used, args.steps)
    capacity = int(args.share * args.layers * args.experts)
    print(f"{args.layers} layers x {args.experts} experts, top-{args.used}, capacity {capacity}, {args.steps} steps\n")
    print("| uploads a step | uploads, evictions | reference: ms a step | C: ms a step | ratio |")
    print("|---|---|---|---|---|")
    for budget in (float(b) for b in args.budgets.split(",")):
        times: dict[str, list[float]] = {"reference": [], "c": []}
        for _ in range(args.rounds):
            ref_s, want = run(AdaptiveLrfuCache(args.layers, args.experts, capacity, uploads_per_step=budget), steps)
            c_s, got = run(ExpertPolicy(args.layers, args.experts, capacity, uploads_per_step=budget), steps)
            assert got == want, "the C policy decided otherwise than the reference"
            times["reference"].append(ref_s)
            times["c"].append(c_s)
        ref, c = (statistics.median(times[k]) for k in ("reference", "c"))
        uploads, evictions = sum(len(o.uploads) for o in want), sum(len(o.evictions) for o in want)
        print(f"| {budget:g} | {uploads}, {evictions} | {ref * 1e3:.3f} | {c * 1e3:.3f} | {ref / c:.1f}x |",
              flush=True)


if __name__ == "__main__":
    main()
