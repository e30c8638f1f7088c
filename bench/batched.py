"""The engine's batched decode at 1, 2, 4 and 8 sequences, for one or more builds side by side.

    python bench/batched.py [--model bench/out/qwen3moe-small-q8_0.gguf] [--threads 2] [--seqs 1,2,4,8]
                            [--tokens 64] [--runs 3] [--distinct] [--engine src=src]
                            [--engine old=/path/to/an/older/src]

Each measurement is the steps of `bench/agents.py`'s batched decode for our engine (a 32-token prompt per
sequence, then `--tokens` steps of one token per sequence with its logits, after one untimed step) in a process
of its own, with the
`strata` package of each `--engine LABEL=DIR` source tree (an older build: a `git worktree` or `git archive` of
an earlier commit, after `python build_engine.py` there). Each round measures every case once, so a change in
the machine's load hits all alike; the table shows medians over `--runs` rounds of wall-clock tokens/s and of
tokens per CPU-second of the steps (all the child's threads: on a shared machine the steadier figure), and each
sequence count's ratio to one sequence.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "bench" / "out" / "qwen3moe-small-q8_0.gguf"


PROMPT = [100 + i for i in range(32)]


def worker(model: str, threads: int, n_seq: int, tokens: int, distinct: bool) -> dict[str, float]:
    """In the child: each sequence's prompt, then `tokens` + 1 steps of one token per sequence (the first one
    untimed). Wall tokens/s and tokens per CPU-second of this process's threads over the timed steps."""
    from strata.engine_cffi import BatchItem, Engine

    draw = random.Random(0)

    def token(same: int) -> int:
        return draw.randrange(1000, 100000) if distinct else same

    with Engine.load(model, n_ctx=512, threads=threads, n_seq=n_seq) as engine:
        for seq in range(n_seq):
            engine.eval_batch([BatchItem(seq, [token(t) for t in PROMPT])])
        engine.eval_batch([BatchItem(seq, [token(999)]) for seq in range(n_seq)])
        wall, cpu = time.perf_counter(), time.process_time()
        for step in range(tokens):
            engine.eval_batch([BatchItem(seq, [token(1000 + step)]) for seq in range(n_seq)])
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"wall": n_seq * tokens / wall, "cpu": n_seq * tokens / cpu}


def measure(src: str, model: str, threads: int, n_seq: int, tokens: int, distinct: bool) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=src)
    out = subprocess.run([sys.executable, __file__, "--worker", model, str(threads), str(n_seq), str(tokens),
                          str(int(distinct))],
                         env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seqs", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--engine", action="append", metavar="LABEL=DIR",
                    help="a source tree to measure (repeatable); default src=src (this tree)")
    ap.add_argument("--distinct", action="store_true", help="each sequence its own random tokens")
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        model, threads, n_seq, tokens, distinct = args.worker
        print(json.dumps(worker(model, int(threads), int(n_seq), int(tokens), distinct == "1")))
        return
    engines = [e.split("=", 1) for e in (args.engine or [f"src={ROOT / 'src'}"])]
    seqs = [int(n) for n in args.seqs.split(",")]
    results: dict[tuple[str, int], list[dict[str, float]]] = {(label, n): [] for label, _ in engines for n in seqs}
    for run in range(args.runs):
        for n in seqs:
            for label, src in engines:
                results[label, n].append(measure(src, args.model, args.threads, n, args.tokens, args.distinct))
        print(f"round {run + 1} of {args.runs} done", file=sys.stderr, flush=True)
    tokens = "each sequence its own tokens" if args.distinct else "every sequence the same tokens"
    print(f"{pathlib.Path(args.model).name}, {args.threads} threads, {args.tokens} steps, {tokens}, "
          f"medians of {args.runs}")
    print(f"{'engine':8} {'seqs':>4} {'tok/s':>8} {'x 1 seq':>7} {'tok/cpu-s':>10} {'x 1 seq':>7}")
    for label, _ in engines:
        one = {k: statistics.median(r[k] for r in results[label, seqs[0]]) for k in ("wall", "cpu")}
        for n in seqs:
            wall = statistics.median(r["wall"] for r in results[label, n])
            cpu = statistics.median(r["cpu"] for r in results[label, n])
            print(f"{label:8} {n:4d} {wall:8.1f} {wall / one['wall']:7.2f} {cpu:10.1f} {cpu / one['cpu']:7.2f}")


if __name__ == "__main__":
    main()
