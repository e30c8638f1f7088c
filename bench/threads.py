"""Engine speed with 1 and 2 threads on an idle machine and beside busy processes competing for the cores.

    python bench/threads.py [--model bench/out/qwen3moe-small-q8_0.gguf] [--threads 1,2] [--competitors 0,1,2]
                            [--runs 3] [--engine src=src] [--engine old=/path/to/an/older/src]

A competitor is a process spinning in a loop, as another job (or the CPU image encoder beside generation) would
be. Each `--engine LABEL=DIR` is a source tree whose `strata` package (with its built extension) is measured, so
two builds of the engine can be compared in one table (an older build: a `git worktree` of an earlier commit, after
`python build_engine.py` there). Every measurement runs in its own process, and each round measures every case
once; the table shows medians over `--runs` rounds of prompt and decode tokens/s. On a machine other jobs share,
`chrt -f 1 python bench/threads.py --competitors 0` comes close to an idle machine (real-time threads run first).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "bench" / "out" / "qwen3moe-small-q8_0.gguf"
PROMPT_TOKENS = 128
DECODE_TOKENS = 32
SPIN = "while True: pass"


# --- one measurement, inside a worker process

def measure(model: str, threads: int) -> dict:
    from strata.engine_cffi import Engine

    with Engine.load(model, n_ctx=PROMPT_TOKENS + DECODE_TOKENS + 8, threads=threads, n_batch=PROMPT_TOKENS) as e:
        ids = [int(t) for t in np.random.default_rng(1).integers(10, min(e.n_vocab, 30000), PROMPT_TOKENS)]
        e.eval(ids[:8])  # warm-up: page in the weights once
        e.keep(0)
        t0 = time.perf_counter()
        token = int(np.argmax(e.eval(ids)))
        pp = PROMPT_TOKENS / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(DECODE_TOKENS):
            token = int(np.argmax(e.eval([token])))
        tg = DECODE_TOKENS / (time.perf_counter() - t0)
    return {"pp": pp, "tg": tg}


# --- the driver

def run_once(src: str, model: str, threads: int, competitors: int) -> dict:
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(competitors)]
    try:
        env = dict(os.environ, PYTHONPATH=src)
        out = subprocess.run([sys.executable, __file__, "--worker", model, str(threads)], env=env, check=True,
                             capture_output=True, text=True).stdout
        return json.loads(out)
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--competitors", default="0,1,2")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--engine", action="append", metavar="LABEL=DIR",
                    help="a source tree to measure (repeatable); default src=src (this tree)")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker[0], int(args.worker[1]))))
        return
    engines = [e.split("=", 1) for e in (args.engine or [f"src={ROOT / 'src'}"])]
    cases = [(label, src, threads, busy) for label, src in engines for threads in map(int, args.threads.split(","))
             for busy in map(int, args.competitors.split(","))]
    results: dict[tuple, list[dict]] = {case: [] for case in cases}
    for run in range(args.runs):  # every case once per round, so a change in the machine's load hits all alike
        for case in cases:
            results[case].append(run_once(case[1], args.model, case[2], case[3]))
        print(f"round {run + 1} of {args.runs} done", file=sys.stderr, flush=True)
    print(f"{'engine':8} {'threads':>7} {'busy':>4} {'prompt tok/s':>12} {'decode tok/s':>12}")
    for (label, _, threads, busy), runs in results.items():
        pp = statistics.median(r["pp"] for r in runs)
        tg = statistics.median(r["tg"] for r in runs)
        print(f"{label:8} {threads:7d} {busy:4d} {pp:12.1f} {tg:12.1f}")

if __name__ == "__main__":
    main()
