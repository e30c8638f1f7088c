"""The device backend's host-side overhead per layer: a decode step on the host device, the kernels' own time apart
from the Python around them, for one or more source trees side by side.

    python bench/device_overhead.py [--steps 64] [--runs 5] [--seqs 1,4] [--engine new=src]
                                    [--engine old=/path/to/an/older/src] [--modes layers,resident]

Two generated models with many narrow layers (so that a layer's kernels take little time and the host's part shows):
a `qwen3moe` (16 layers, width 256, 64 experts top-8, Qwen3-30B-A3B's routing shape scaled down) and a `qwen35moe`
(16 layers, three Gated DeltaNet layers to one gated attention layer, 32 experts top-8 and a shared expert), Q8_0
weights. Each is opened on the host device (`device: host`) with an expert cache holding every expert and no upload
bound, so that after a few untimed steps every expert is a hit (a card's steady state: no CPU misses), and then
`--steps` decode steps of `--seqs` sequences are timed. `--cached 0.33` holds a third of the experts instead (no
upload bound: the policy admits what beats its victim), so that misses run on the CPU. `--modes layers,resident`
runs each tree's engine both ways where the cache holds every expert: layer by layer (`resident=False`: each layer's
routing read back, the policy stepped) and resident (the whole step queued at once, the experts on the device);
`default` (the default) lets the engine choose, which an older tree needs.

Each case runs twice in a process of its own per source tree (`--engine LABEL=DIR`: the `strata` package of that
tree, e.g. a `git archive` of an earlier commit with its built engine): once plain (the step's wall time), once
with the calls into C that run kernels or copies timed (`WORK_CALLS`: launches one by one, in lists and a layer's
hits, copies, memsets, misses: on the host device a call returns when its work is done; where the tree has the
device's work clock, `strata_dev_time_work`, that clock instead, which times the same work inside a layer's one call
for its experts too). The host-side overhead is
the timed run's step time less its time inside those calls where the device's clock timed them (what the clock's
reads add, inside a piece of work and around it, measured on empty pieces and taken out; taking both from one run
leaves out the kernels' spread from run to run), otherwise the plain run's step time less the timed run's time
inside those calls, so the wrapper's own cost does not count
(its clocks' reads inside a call, measured on an empty call, are taken out of the calls' time: a tree that makes more
calls for the same work is not credited with them as work);
`CPU` is the same in the stepping thread's CPU time, which a busy machine's waits for a core do not inflate. Each
round runs every case once, so a change in the machine's load hits all alike; the table shows medians over
`--runs` rounds, per layer in microseconds. The logits of every step
(prompt, warm-up and timed) are hashed: the last line says whether every engine and run gave the same bits.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODELS = {
    "qwen3moe": dict(n_layer=16, n_expert=64, n_expert_used=8, n_ff_exp=128),
    "qwen35moe": dict(n_layer=16, n_expert=32, n_expert_used=8, n_ff_exp=128),
}
MODELS_EXPERTS = {arch: shape["n_layer"] * shape["n_expert"] for arch, shape in MODELS.items()}
# the calls into the device's C side that do a kernel's or a copy's work (on the host device, synchronously)
WORK_CALLS = ("strata_dev_launch", "strata_dev_launch_list", "strata_dev_launch_experts", "strata_dev_upload",
              "strata_dev_upload_rows", "strata_dev_upload_expert", "strata_dev_download", "strata_dev_memset",
              "strata_host_expert_ffn", "strata_host_experts_ffn", "strata_host_layer_misses")


class WorkClock:
    """The device's own work clock (`strata_dev_time_work`, in trees that have it): every call that does work, the
    ones a layer's experts' call makes inside it too, timed in C. Its reads cost something inside a timed piece of
    work and around it; both are measured on synchronisations of the host device (which do nothing), with the clock
    off and on, and taken out: `work` is the pieces' own time, `clock` what the reads added to the step."""

    CALIBRATION = 20000

    def __init__(self, device: Any) -> None:
        self._device, self._work = device, device.ffi.new("double[3]")
        lib, handle = device.lib, device.handle
        spent = {}
        for on in (0, 1):
            lib.strata_dev_time_work(handle, on)
            start, wall, cpu = self._read(), time.perf_counter(), time.thread_time()
            for _ in range(self.CALIBRATION):
                lib.strata_dev_stream_sync(handle, 0)
            spent[on] = time.perf_counter() - wall, time.thread_time() - cpu
        end = self._read()
        # a piece's clock reads: inside its timed span, and in all
        self._inside = ((end[0] - start[0]) / self.CALIBRATION, (end[1] - start[1]) / self.CALIBRATION)
        self._total = tuple(max(0.0, (spent[1][i] - spent[0][i]) / self.CALIBRATION) for i in range(2))
        self._start = self._read()

    def _read(self) -> tuple[float, float, float]:
        self._device.lib.strata_dev_work_seconds(self._device.handle, self._work)
        return self._work[0], self._work[1], self._work[2]

    def work(self) -> tuple[float, float]:
        """Seconds and CPU seconds in the work since the calibration, the clock's reads inside it left out."""
        end = self._read()
        pieces = end[2] - self._start[2]
        return (end[0] - self._start[0] - pieces * self._inside[0],
                end[1] - self._start[1] - pieces * self._inside[1])

    def clock(self) -> tuple[float, float]:
        """Seconds and CPU seconds the clock's reads added to the steps since the calibration."""
        pieces = self._read()[2] - self._start[2]
        return pieces * self._total[0], pieces * self._total[1]


class TimedLibrary:
    """The device's library with its work calls timed: their wall seconds summed in `seconds`, the calling
    thread's CPU seconds in them in `cpu`, less what the timing itself adds inside a call (reading the clocks,
    measured on an empty call at the start), so that a tree making more calls for the same work is not credited
    with the clocks' time as the calls' work."""

    CALIBRATION = 20000

    def __init__(self, lib: Any) -> None:
        self._lib, self.seconds, self.cpu, self.calls = lib, 0.0, 0.0, 0
        empty = self._timed(time.monotonic_ns)  # a C call that does next to nothing
        for _ in range(self.CALIBRATION):
            empty()
        self._inflation = (self.seconds / self.calls, self.cpu / self.calls)
        self.seconds, self.cpu, self.calls = 0.0, 0.0, 0

    def work(self) -> tuple[float, float]:
        """Seconds and CPU seconds in the work calls, the timing's own cost left out."""
        wall, cpu = self._inflation
        return self.seconds - self.calls * wall, self.cpu - self.calls * cpu

    def __getattr__(self, name: str) -> Any:
        function = getattr(self._lib, name)
        return self._timed(function) if name in WORK_CALLS else function

    def _timed(self, function: Any) -> Any:
        def timed(*args: Any) -> Any:
            started, cpu = time.perf_counter(), time.thread_time()
            try:
                return function(*args)
            finally:
                self.seconds += time.perf_counter() - started
                self.cpu += time.thread_time() - cpu
                self.calls += 1
        return timed


def worker(model: str, n_seq: int, steps: int, timed: bool, cached: float, mode: str) -> dict[str, Any]:
    """In the child: a 48-token prompt per sequence and 4 untimed steps (every expert uploaded), then `steps` decode
    steps of every sequence. Seconds a step, and with `timed` the seconds a step spent in the work calls."""
    from strata.engine_cffi import BatchItem
    from strata.engine_cffi.device import Device
    from strata.engine_cffi.device_engine import DeviceEngine

    capacity = None if cached >= 1 else int(cached * MODELS_EXPERTS[pathlib.Path(model).stem])
    options = {} if mode == "default" else {"resident": mode == "resident"}
    with DeviceEngine.open(model, Device("host"), n_ctx=256, threads=1, kv="f16", n_batch=32, n_seq=n_seq,
                           uploads_per_step=None, paced=False, capacity=capacity, **options) as engine:
        digest = hashlib.sha256()
        logits = engine.eval_batch([BatchItem(s, [(40 + 7 * i + s) % 250 for i in range(48)]) for s in range(n_seq)])
        for step in range(4):
            logits += engine.eval_batch([BatchItem(s, [50 + step + s]) for s in range(n_seq)])
        digest.update(b"".join(rows.tobytes() for rows in logits))
        before = engine.expert_counts()
        library: TimedLibrary | WorkClock = TimedLibrary(engine.device.lib)
        if timed and hasattr(engine.device.lib, "strata_dev_time_work"):
            library = WorkClock(engine.device)
        elif timed:
            engine.device.lib = library
        started, cpu = time.perf_counter(), time.thread_time()
        for step in range(steps):
            logits = engine.eval_batch([BatchItem(s, [60 + (7 * step + s) % 150]) for s in range(n_seq)])
            digest.update(b"".join(rows.tobytes() for rows in logits))
        wall, cpu = time.perf_counter() - started, time.thread_time() - cpu
        work, work_cpu = library.work()
        clock, clock_cpu = library.clock() if isinstance(library, WorkClock) else (0.0, 0.0)
        counts = {k: engine.expert_counts()[k] - before[k] for k in ("hits", "misses")}
        layers = engine.n_layer
    return {"step": wall / steps, "work": work / steps, "step_cpu": cpu / steps, "work_cpu": work_cpu / steps,
            "same_run": isinstance(library, WorkClock), "clock": clock / steps, "clock_cpu": clock_cpu / steps,
            "layers": layers, "digest": digest.hexdigest(),
            "hit_share": counts["hits"] / max(1, counts["hits"] + counts["misses"])}


def measure(src: str, model: str, n_seq: int, steps: int, timed: bool, cached: float, mode: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=src)
    out = subprocess.run([sys.executable, __file__, "--worker", model, str(n_seq), str(steps), str(int(timed)),
                          str(cached), mode],
                         env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seqs", default="1,4")
    ap.add_argument("--engine", action="append", metavar="LABEL=DIR",
                    help="a source tree to measure (repeatable); default src=src (this tree)")
    ap.add_argument("--cached", type=float, default=1.0,
                    help="the share of all experts the cache holds (1: every one, so every expert is a hit)")
    ap.add_argument("--modes", default="default",
                    help="comma-separated: layers (layer by layer), resident (the whole step queued), default")
    ap.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        model, n_seq, steps, timed, cached, mode = args.worker
        print(json.dumps(worker(model, int(n_seq), int(steps), timed == "1", float(cached), mode)))
        return
    sys.path.insert(0, str(ROOT / "src"))
    from strata.modelgen import write_random_model

    trees = [e.split("=", 1) for e in (args.engine or [f"src={ROOT / 'src'}"])]
    modes = args.modes.split(",")
    engines = [(label if mode == "default" else f"{label}/{mode}", src, mode) for label, src in trees for mode in modes]
    seqs = [int(n) for n in args.seqs.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        paths = {arch: str(write_random_model(pathlib.Path(tmp) / f"{arch}.gguf", arch=arch, size="tiny",
                                              dtype="q8_0", seed=5, **shape))
                 for arch, shape in MODELS.items()}
        cases = [(arch, n) for arch in MODELS for n in seqs]
        results: dict[tuple[str, str, int, bool], list[dict[str, Any]]] = {}
        for run in range(args.runs):
            for arch, n in cases:
                for label, src, mode in engines:
                    for timed in (False, True):
                        results.setdefault((label, arch, n, timed), []).append(
                            measure(src, paths[arch], n, args.steps, timed, args.cached, mode))
            print(f"round {run + 1} of {args.runs} done", file=sys.stderr, flush=True)
    cache = "every expert a hit" if args.cached >= 1 else f"{args.cached:.0%} of the experts cached"
    print(f"decode steps on the host device, {cache}; {args.steps} steps, medians of {args.runs} rounds, "
          f"load average {os.getloadavg()[0]:.1f}; microseconds per layer")
    width = max(8, *(len(label) for label, _, _ in engines))
    print(f"{'engine':{width}} {'model':10} {'seqs':>4} {'step':>8} {'kernels':>8} {'overhead':>8} {'CPU':>8} "
          f"{'hits':>6}")
    digests = set()
    for arch, n in cases:
        for label, _, _ in engines:
            plain, timed_runs = results[label, arch, n, False], results[label, arch, n, True]
            layers = plain[0]["layers"]

            def median(runs: list[dict[str, Any]], key: str) -> float:
                return statistics.median(r[key] for r in runs) / layers * 1e6  # noqa: B023 (used at once)
            step, work = median(plain, "step"), median(timed_runs, "work")
            if all(r["same_run"] for r in timed_runs):  # the device's clock: the work and the step of one run
                own = statistics.median((r["step"] - r["work"] - r["clock"]) / layers * 1e6 for r in timed_runs)
                cpu = statistics.median((r["step_cpu"] - r["work_cpu"] - r["clock_cpu"]) / layers * 1e6
                                        for r in timed_runs)
            else:
                own = step - work
                cpu = median(plain, "step_cpu") - median(timed_runs, "work_cpu")
            hits = statistics.median(r["hit_share"] for r in plain)
            print(f"{label:{width}} {arch:10} {n:4d} {step:8.1f} {work:8.1f} {own:8.1f} {cpu:8.1f} {hits:6.1%}")
            digests |= {(arch, n, r["digest"]) for r in plain + timed_runs}
    same = len(digests) == len(cases)
    print(f"logits of every engine and run {'bit-identical' if same else 'DIFFER'} for each model and sequence count")


if __name__ == "__main__":
    main()
