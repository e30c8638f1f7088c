"""Adaptive speculation against speculation off on free text, two source trees side by side in one run.

    python bench/speculative_policy.py --base BASE/src [--layers 8] [--tokens 256] [--rounds 2] [--pairs 3]
        [--traces one,four] [--threads 1]

The small Q8_0 qwen35moe with its MTP block (`bench/speculative.py --parts mtp`'s file; random weights: the block's
guesses are about never right, so this is what adaptive speculation costs where drafts do not pay), greedy,
200-token random prompts: one stream and four. Each tree's batcher and drafts run in a child process of their
own (`BASE/src`, then this tree's `src`), the two taking turns `--rounds` times; a child runs `--pairs` pairs of
runs back to back, speculation off on an engine without the block, then adaptive ("mtp", from the first decode
step on) on one with it, then speculation off on that one ("block run": what keeping the block's rows filled
costs, the floor of adaptive where no draft is ever sent). A pair's ratios (adaptive and block run over off, per
CPU second of the engine's threads and per wall second) cancel the load's slow drifts; the table gives the
medians over all pairs of each tree, with the draft tokens sent and the block's passes (`Engine.mtp_fills`) of
each adaptive run. One engine thread by default: on
a loaded 2-core host two threads' CPU time grows with a partner that lost its core.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def child(src: str, layers: int, tokens: int, pairs: int, traces: list[str], threads: int) -> None:
    """Print a JSON line: per trace, each pair's adaptive [wall ratio, CPU ratio, drafted, the block's passes] and
    block run's [wall ratio, CPU ratio]."""
    sys.path.insert(0, src)  # the tree's strata, before the bench's own imports add this tree's
    import numpy as np

    from strata.config import SpeculativeConfig
    from strata.engine_cffi import Engine
    from strata.scheduling.batcher import Job
    from strata.scheduling.drafts import speculation
    from strata.text.sampling import Sampler

    sys.path.insert(1, str(ROOT / "bench"))
    from speculative import GREEDY, run_jobs, small_model

    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, 151000, 200)] for _ in range(4)]
    out: dict[str, list[list[float]]] = {}
    path = small_model("qwen35moe", layers if layers != 8 else None)
    # the block as the tree's server runs it (its `speculative.mtp_window`, in a tree that has one)
    window = {"mtp_window": SpeculativeConfig().mtp_window} if hasattr(SpeculativeConfig, "mtp_window") else {}
    with Engine.load(path, n_ctx=1024, threads=threads, n_seq=4) as plain, \
            Engine.load(path, n_ctx=1024, threads=threads, n_seq=4, mtp=True, **window) as block:
        for _ in range(pairs):
            for trace, batch in (("one", prompts[:1]), ("four", prompts)):
                if trace not in traces:
                    continue
                off, _ = run_jobs(plain, [Job(p, Sampler(GREEDY, plain.n_vocab), tokens, set()) for p in batch])
                specs = [speculation(SpeculativeConfig(source="mtp"), mtp=block) for _ in batch]
                passes = block.mtp_fills()[0]
                adaptive, _ = run_jobs(block, [Job(p, Sampler(GREEDY, block.n_vocab), tokens, set())
                                               for p in batch], later=list(specs))
                passes = block.mtp_fills()[0] - passes
                run, _ = run_jobs(block, [Job(p, Sampler(GREEDY, block.n_vocab), tokens, set()) for p in batch])
                out.setdefault(trace, []).append([adaptive[0] / off[0], adaptive[1] / off[1],
                                                  sum(spec.drafted for spec in specs if spec), passes,
                                                  run[0] / off[0], run[1] / off[1]])
    print(json.dumps(out), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the other tree's src (its engine built)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--traces", default="one,four")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    traces = args.traces.split(",")
    if args.child:
        child(args.child, args.layers, args.tokens, args.pairs, traces, args.threads)
        return
    trees = {"base": str(pathlib.Path(args.base).resolve()), "this": str(ROOT / "src")}
    ratios: dict[tuple[str, str], list[list[float]]] = {}
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    for _ in range(args.rounds):
        for name, src in trees.items():
            command = [sys.executable, __file__, "--child", src, "--base", args.base, "--layers", str(args.layers),
                       "--tokens", str(args.tokens), "--pairs", str(args.pairs), "--traces", args.traces,
                       "--threads", str(args.threads)]
            result = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
            for trace, pairs in result.items():
                ratios.setdefault((trace, name), []).extend(pairs)
            print(f"  {name}: {result} (load average {os.getloadavg()[0]:.2f})", flush=True)
    print(f"| {args.layers} layers, over off | adaptive per CPU s: median (pairs) | wall | drafted, passes a run | "
          "block run per CPU s (wall) |\n|---|---|---|---|---|")
    for (trace, name), pairs in sorted(ratios.items()):
        cpu = sorted(round(p[1], 3) for p in pairs)
        print(f"| {trace} stream{'s' if trace != 'one' else ''}, {name} | {statistics.median(cpu):.3f}x ({cpu}) | "
              f"{statistics.median(p[0] for p in pairs):.3f}x | {sorted({(int(p[2]), int(p[3])) for p in pairs})} | "
              f"{statistics.median(p[5] for p in pairs):.3f}x ({statistics.median(p[4] for p in pairs):.3f}x) |")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
