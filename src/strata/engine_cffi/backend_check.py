"""The device backend's forward pass against the CPU engine on generated qwen3moe and qwen35moe models
(`scripts/gpu-check.sh`).

A prompt in chunks beside two short ones, then decode steps of the three sequences at once, on the CPU engine and
on the device backend twice, f32 KV caches: with an expert cache of half the experts (so that both hits and misses
run, layer by layer), and with every expert held (the model fully on the card: each step resident, queued at once
with the experts grouped and computed on the device; the run fails where it cannot take that path). Printed per
call: the largest logit difference over the largest logit of each, and whether the greedy tokens agree; each run's
expert cache counts beside the simulator's on the routing the backend recorded; the wall time of each. A
qwen35moe's MTP block runs on both sides (`mtp`): after the calls, each sequence's drafts are compared the same way
(the block's whole history in the first run, the server's window, `speculative.mtp_window`, in the second).

Two models of each architecture (qwen35moe: Gated DeltaNet layers with their recurrent state between gated
attention ones, and a gated shared expert). F16 weights, whose products on both sides take f32 activations: the
backend must be within the device's tolerance of the CPU engine (host: 1e-5, the host device's double-precision
norms, RoPE and attention; cuda: 1e-3, float sums in other orders over every layer, and for qwen35moe's prompt the
card's token loop of the delta rule against the CPU engine's chunked form). Q4_K weights, whose products
quantise the activations (the CPU engine in Q8_K's 256-value blocks, a card in 32-value ones): a last-bit
difference moves an activation by a step, and a random model amplifies that over its layers, so the differences
are printed beside the CPU engine's own between an f32 and an f16 KV cache, for scale, without a bound. The check
passes when the F16 models are within tolerance and every model's counts are the simulator's.

    python -m strata.engine_cffi.backend_check --device cuda     # the small models (on a GPU)
    python -m strata.engine_cffi.backend_check --device host --quick
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata.config import SpeculativeConfig
from strata.engine_cffi import BatchItem, Engine
from strata.engine_cffi.device import DeviceUnavailable
from strata.engine_cffi.device_engine import DeviceEngine, open_device
from strata.engine_cffi.expert_slots import UPLOADS_PER_STEP
from strata.experts.simulate import AdaptiveLrfuCache, replay
from strata.experts.trace import read_trace
from strata.gguf_file import read_metadata
from strata.modelgen.writer import write_random_model

TOLERANCE = {"host": 1e-5, "cuda": 1e-3}
WINDOW = SpeculativeConfig().mtp_window  # the MTP block's, in the second run (the server's)


def calls(prompt: int, steps: int) -> list[list[BatchItem]]:
    """A prompt of `prompt` tokens in chunks beside a short one, then `steps` decode steps of three sequences."""
    first = [BatchItem(0, [(7 * i) % 200 + 40 for i in range(prompt)], logits="last"),
             BatchItem(1, [5, 6, 7]), BatchItem(2, [70])]
    return [first] + [[BatchItem(s, [(11 * n + 3 * s) % 200 + 40]) for s in range(3)] for n in range(steps)]


def run(engine: Engine, work: list[list[BatchItem]]) -> tuple[list[np.ndarray], float]:
    """Each call's logits rows (stacked) and the seconds all the calls took."""
    started = time.perf_counter()
    out = [np.concatenate([rows.copy() for rows in engine.eval_batch(call)]) for call in work]
    return out, time.perf_counter() - started


def drafts(engine: Engine) -> np.ndarray:
    """The MTP block's 3 drafts' logits (n_seq, 3, n_vocab) for each sequence, after a token 41 + its index."""
    seqs = list(range(engine.n_seq))
    _, logits = engine.mtp_draft(seqs, [engine.seq_n_past(s) for s in seqs], [41 + s for s in seqs], 3, logits=True)
    assert logits is not None
    return logits


def rel_diffs(got: list[np.ndarray], want: list[np.ndarray]) -> list[float]:
    return [float(np.max(np.abs(g - w)) / np.max(np.abs(w))) for g, w in zip(got, want, strict=True)]


def check_model(kind: str, arch: str, dtype: str, quick: bool, folder: Path) -> bool:
    size = "tiny" if quick else "small"
    prompt, steps = (150, 6) if quick else (400, 32)
    path = write_random_model(folder / f"{arch}-{size}-{dtype}.gguf", arch=arch, size=size, dtype=dtype,
                              vocab="bytes")
    work, trace = calls(prompt, steps), folder / f"{arch}-{dtype}.trace"
    meta = read_metadata(path)
    n_nextn = int(meta.get(f"{arch}.nextn_predict_layers", 0))  # an MTP block: run on both sides
    n_layer, mtp = int(meta[f"{arch}.block_count"]) - n_nextn, n_nextn > 0
    n_expert = int(meta[f"{arch}.expert_count"])
    capacity = n_layer * n_expert // 2
    cpu_runs: dict[str, tuple[list[np.ndarray], float]] = {}
    want_drafts: dict[int, np.ndarray] = {}  # by the block's window
    for kv, window in (("f32", 0), ("f16", 0), ("f32", WINDOW)):
        if window and not mtp:
            continue
        with Engine.load(path, n_ctx=512, n_batch=64, n_seq=3, kv=kv, mapped_weights=True,
                         mtp=mtp and kv == "f32", mtp_window=window) as cpu:
            if not window:
                cpu_runs[kv] = run(cpu, work)
            else:
                run(cpu, work)
            if cpu.mtp:
                want_drafts[window] = drafts(cpu)
    (want, cpu_s), spread = cpu_runs["f32"], rel_diffs(cpu_runs["f16"][0], cpu_runs["f32"][0])
    every = n_layer * n_expert
    half = device_run(kind, path, work, trace, capacity, False, mtp, 0)
    whole = device_run(kind, path, work, trace.with_suffix(".resident"), every, True, mtp, WINDOW)
    strict = dtype == "f16"
    print(f"\nbackend check: {half.name}, {arch} {size} {dtype}, expert cache {capacity} of {every} "
          f"experts, then all of them (resident)" + (f", tolerance {TOLERANCE[kind]:g}" if strict
                                                    else ", no bound (see the docstring)"))
    print("| call | tokens | max diff / max logit | every expert held | the CPU engine's f16 vs f32 KV | greedy |")
    print("|---|---|---|---|---|---|")
    passed = True
    for i, (rel, rel_whole, ref, call) in enumerate(zip(rel_diffs(half.logits, want), rel_diffs(whole.logits, want),
                                                        spread, work, strict=True)):
        same = all(np.array_equal(got[i].argmax(axis=-1), want[i].argmax(axis=-1)) for got in (half.logits,
                                                                                               whole.logits))
        passed &= not strict or max(rel, rel_whole) <= TOLERANCE[kind]
        print(f"| {i} | {sum(len(item.tokens) for item in call)} | {rel:.2e} | {rel_whole:.2e} | {ref:.2e} | "
              f"{'same' if same else 'differs'} |")
    for run_drafts, window, label in ((half.drafts, 0, ""),
                                      (whole.drafts, WINDOW, f", every expert held, a window of {WINDOW}")):
        if run_drafts is not None and window in want_drafts:
            rel = rel_diffs([run_drafts], [want_drafts[window]])[0]
            same = bool(np.array_equal(run_drafts.argmax(axis=-1), want_drafts[window].argmax(axis=-1)))
            passed &= not strict or rel <= TOLERANCE[kind]
            print(f"MTP drafts (3 a sequence){label}: max diff / max logit {rel:.2e}, tokens "
                  f"{'same' if same else 'differ'}")
    held = [(il, e) for il in range(n_layer) for e in range(n_expert)]
    policies = (AdaptiveLrfuCache(n_layer, n_expert, capacity, uploads_per_step=UPLOADS_PER_STEP),
                AdaptiveLrfuCache(n_layer, n_expert, every, prior=held))
    for result, cache, label in zip((half, whole), policies, ("expert cache", "every expert held"), strict=True):
        stats, counts = replay(read_trace(result.trace), cache), result.counts
        agree = (stats.hits, stats.misses, stats.uploads) == (counts["hits"], counts["misses"], counts["uploads"])
        passed &= agree
        print(f"{label}: {counts['hits']} hits, {counts['misses']} misses, {counts['uploads']} uploads; the "
              f"simulator: {stats.hits}, {stats.misses}, {stats.uploads} ({'agree' if agree else 'DISAGREE'})")
    print(f"wall time: CPU engine {cpu_s:.2f} s, device backend {half.seconds:.2f} s, every expert held "
          f"{whole.seconds:.2f} s")
    return passed


@dataclass
class DeviceRun:
    name: str
    logits: list[np.ndarray]
    seconds: float
    drafts: np.ndarray | None
    counts: dict[str, int]
    trace: Path


def device_run(kind: str, path: Path, work: list[list[BatchItem]], trace: Path, capacity: int, resident: bool,
               mtp: bool, window: int) -> DeviceRun:
    """The calls on the backend with an expert cache of `capacity` experts; `resident`: all of them, each step
    queued at once (an error where the device cannot hold them); the MTP block (`mtp`) with `window`."""
    with DeviceEngine.open(path, open_device(kind, None), n_ctx=512, n_batch=64, n_seq=3, kv="f32",
                           record_routing=trace, capacity=capacity, paced=False, mtp=mtp,
                           mtp_window=window if mtp else 0, resident=resident) as dev:
        got, seconds = run(dev, work)
        return DeviceRun(dev.device.name, got, seconds, drafts(dev) if mtp else None, dev.expert_counts(), trace)


def check(kind: str, quick: bool, folder: Path) -> bool:
    results = [check_model(kind, arch, dtype, quick, folder)  # every one runs, whatever the first
               for arch in ("qwen3moe", "qwen35moe") for dtype in ("f16", "q4_k")]
    passed = all(results)
    print("pass" if passed else "FAIL")
    return passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("host", "cuda"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="the tiny model and a short run")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="strata-backend-check-") as folder:
        try:
            return 0 if check(args.device, args.quick, Path(folder)) else 1
        except DeviceUnavailable as exc:
            print(f"backend check: {exc}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
