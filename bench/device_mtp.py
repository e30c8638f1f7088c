"""The MTP block on the device backend: what running it costs a decode step (its rows filled at every eval) and
what a draft call costs, on the host device, beside the same on the CPU engine (whose fill waits for a draft).

    python bench/device_mtp.py [--steps 32] [--runs 5] [--seqs 1,4] [--draft 3]

A generated `qwen35moe` (16 layers, three Gated DeltaNet layers to one gated attention layer, 32 experts top-8 and
a shared expert, width 256, its MTP block; Q8_0) is opened on the host device with an expert cache holding every
expert (hits after a few untimed steps, a card's steady state) with `mtp` off and on, and on the CPU engine with
`mtp` off and on. Each times `--steps` decode steps of `--seqs` sequences after a 48-token prompt, then as many
`mtp_draft` calls of `--draft` tokens for all the sequences (engines with `mtp`). Each round runs every case once,
so a change in the machine's load hits all alike; the table shows medians over `--runs` rounds, in milliseconds.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import time

import numpy as np

from strata.engine_cffi import BatchItem, Engine
from strata.engine_cffi.device import Device
from strata.engine_cffi.device_engine import DeviceEngine
from strata.modelgen import write_random_model

SHAPE = dict(n_layer=16, n_expert=32, n_expert_used=8, n_ff_exp=128)
PROMPT = 48


def open_engine(path: str, backend: str, mtp: bool, n_seq: int) -> Engine:
    options = dict(n_ctx=512, threads=2, n_batch=64, n_seq=n_seq, mtp=mtp)
    if backend == "cpu":
        return Engine.load(path, **options)  # type: ignore[arg-type]
    return DeviceEngine.open(path, Device("host"), uploads_per_step=None, paced=False, **options)  # type: ignore[arg-type]


def case(path: str, backend: str, mtp: bool, n_seq: int, steps: int, n_draft: int) -> tuple[float, float | None]:
    """(ms a decode step, ms a draft call or None without `mtp`)."""
    rng = np.random.default_rng(0)
    with open_engine(path, backend, mtp, n_seq) as engine:
        logits = engine.eval_batch([BatchItem(s, [int(t) for t in rng.integers(0, 256, PROMPT)])
                                    for s in range(n_seq)])
        tokens = [int(row[-1].argmax()) for row in logits]

        def step() -> None:
            rows = engine.eval_batch([BatchItem(s, [tokens[s]]) for s in range(n_seq)])
            tokens[:] = [int(row[-1].argmax()) for row in rows]

        for _ in range(4):
            step()
        started = time.perf_counter()
        for _ in range(steps):
            step()
        step_ms = (time.perf_counter() - started) * 1e3 / steps
        if not mtp:
            return step_ms, None
        seqs = list(range(n_seq))
        pos = [engine.seq_n_past(s) for s in seqs]
        started = time.perf_counter()
        for _ in range(steps):
            engine.mtp_draft(seqs, pos, tokens, n_draft)
        return step_ms, (time.perf_counter() - started) * 1e3 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seqs", default="1,4")
    parser.add_argument("--draft", type=int, default=3)
    args = parser.parse_args()
    seqs = [int(n) for n in args.seqs.split(",")]
    cases = [(backend, mtp, n) for n in seqs for backend in ("host", "cpu") for mtp in (False, True)]
    results: dict[tuple[str, bool, int], list[tuple[float, float | None]]] = {c: [] for c in cases}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_random_model(pathlib.Path(tmp) / "q35.gguf", arch="qwen35moe", size="tiny", dtype="q8_0",
                                      seed=5, **SHAPE))  # type: ignore[arg-type]
        for _ in range(args.runs):
            for c in cases:
                results[c].append(case(path, *c, args.steps, args.draft))
    print("| backend | seqs | step, mtp off | step, mtp on | on / off | draft call |")
    print("|---|---|---|---|---|---|")
    for n in seqs:
        for backend in ("host", "cpu"):
            off = statistics.median(r[0] for r in results[(backend, False, n)])
            on = statistics.median(r[0] for r in results[(backend, True, n)])
            draft = statistics.median(r[1] or 0.0 for r in results[(backend, True, n)])
            print(f"| {backend} | {n} | {off:.2f} | {on:.2f} | {on / off:.2f} | {draft:.2f} |")


if __name__ == "__main__":
    main()
