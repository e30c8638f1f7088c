"""Decode speed of the device backend against the card's memory-bandwidth bound and the CPU engine, as one table
(`scripts/gpu-check.sh`).

A generated qwen3moe model (Q8_0) decodes greedily after a short prompt, one sequence and then four at once, in
four layouts on the same machine:

- the CPU engine alone (`Engine.load`, every core);
- every routed expert held on the card (`DeviceEngine.open(..., resident=True)`: each step queued at once);
- an expert cache of a third of the experts, paced uploads as served; warmed up by some steps first, its hit rate
  over the timed steps printed;
- no expert cache (capacity 0): every routed expert computed by the CPU's threads from RAM, the rest on the card
  (llama.cpp's `--n-cpu-moe` layout).

Each layout runs `warmup` steps before its `steps` timed ones. The bound of a fully-on-card step is the bytes it
must read over the card's bandwidth: every weight on the card but the routed experts (the token embeddings are
looked up in RAM), the routed experts the step's tokens chose (each layer's distinct ones, from the routing the
run recorded) and the KV rows its tokens attend to; activations are left out. The bandwidth is a device-to-device
copy's, measured here (`device_check.copy_bandwidth`: bytes read plus bytes written); the card's nominal one (its
memory clock and bus width) is printed beside it. Figures are reported, not asserted: the check fails only on an
error.

The full model is a scaled-down Qwen3-MoE with wide layers (4 layers of width 4096, 12 experts of 3072, top-4:
about 2.1 GB, some 0.8 GB read by a step of one sequence), so that a step on a card moves enough bytes to be
bound by its memory rather than by its launches; `--quick` runs the tiny model on the host device in seconds.

    python -m strata.engine_cffi.decode_check --device cuda     # the full model (on a GPU)
    python -m strata.engine_cffi.decode_check --device host --quick
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from strata.engine_cffi import BatchItem, Engine
from strata.engine_cffi.device import Device, DeviceUnavailable
from strata.engine_cffi.device_check import copy_bandwidth
from strata.engine_cffi.device_engine import KV_ELEM, DeviceEngine, open_device
from strata.experts.trace import read_trace
from strata.gguf_file import GGUFFile, read_metadata
from strata.modelgen.writer import write_random_model

ARCH, DTYPE, KV = "qwen3moe", "q8_0", "f16"
N_SEQ = 4  # the sequences of the second part of each run (the first decodes sequence 0 alone)
N_BATCH = 64


@dataclass(frozen=True)
class Plan:
    """The model and the run: `prompt` tokens a sequence, `warmup` untimed decode steps then `steps` timed ones."""

    size: str
    overrides: dict[str, Any]
    prompt: int
    warmup: int
    steps: int
    copy_bytes: int  # the copy that measures the bandwidth

    @property
    def n_ctx(self) -> int:
        return self.prompt + 2 * (self.warmup + self.steps)


FULL = Plan("medium", dict(n_layer=4, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128, n_expert=12,
                           n_expert_used=4, n_ff_exp=3072), prompt=32, warmup=16, steps=32, copy_bytes=1 << 30)
QUICK = Plan("tiny", {}, prompt=8, warmup=4, steps=8, copy_bytes=8 << 20)
# (name, capacity): None the CPU engine; -1 every expert, resident; 0 none; a fraction of every expert otherwise
LAYOUTS: tuple[tuple[str, float | None], ...] = (
    ("CPU engine", None), ("every expert on the card", -1), ("a third of the experts cached", 1 / 3),
    ("no expert cache (--n-cpu-moe)", 0))


# --- the bytes of a step


@dataclass(frozen=True)
class ModelBytes:
    """What a decode step reads on the card, by part (the model file's tensor sizes)."""

    dense: int                # every weight on the card but the routed experts
    expert: tuple[int, ...]   # one routed expert (gate, up, down) of each layer
    kv_position: int          # one position's K and V rows of one layer (every KV head)
    n_layer: int              # attention layers, each with its KV rows

    def step(self, positions: Sequence[int], used: Sequence[int]) -> int:
        """The bytes of a step whose tokens sit at `positions` (each attends to its own and those before it) and
        whose layers chose `used[il]` distinct experts."""
        kv_rows = sum(p + 1 for p in positions) * self.n_layer
        return self.dense + sum(n * b for n, b in zip(used, self.expert, strict=True)) + kv_rows * self.kv_position


def model_bytes(path: Path, kv: str) -> ModelBytes:
    with GGUFFile(path) as file:
        meta, sizes = file.metadata, {t.name: t.n_bytes for t in file.tensors}

    def key(name: str, default: Any = 0) -> int:
        return int(meta.get(f"{ARCH}.{name}", default))

    n_layer, n_expert = key("block_count") - key("nextn_predict_layers"), key("expert_count")
    head_kv = key("attention.head_count_kv") * key("attention.key_length", key("embedding_length")
                                                    // key("attention.head_count"))
    tied = "output.weight" not in sizes  # the head is the embeddings, read on the card
    routed = {name for name in sizes if name.endswith("_exps.weight")}
    trunk = {name for name in sizes if not name.startswith("blk.") or int(name.split(".")[1]) < n_layer}
    dense = sum(sizes[name] for name in trunk - routed if name != "token_embd.weight" or tied)
    expert = tuple(sum(sizes[f"blk.{il}.ffn_{m}_exps.weight"] for m in ("gate", "up", "down")) // n_expert
                   for il in range(n_layer))
    return ModelBytes(dense, expert, 2 * head_kv * KV_ELEM[kv], n_layer)


# --- timed decoding


@dataclass
class Part:
    """One part of a run (its sequences' timed steps)."""

    n_seq: int
    seconds: float = 0.0
    positions: list[list[int]] = field(default_factory=list)  # each timed step's tokens' positions
    first_step: int = 0        # the engine's step (eval) count at the first timed step
    counts: dict[str, int] = field(default_factory=dict)      # the expert cache's counts over the timed steps


def decode(engine: Engine, plan: Plan) -> list[Part]:
    """Sequence 0's prompt and decode steps, then the other sequences' prompts and steps of all of them (greedy)."""
    chunks = 0  # the engine's steps so far (a call of more than N_BATCH tokens takes several)
    last: dict[int, int] = {}

    def step(items: list[BatchItem]) -> None:
        nonlocal chunks
        for item, logits in zip(items, engine.eval_batch(items), strict=True):
            last[item.seq] = int(np.argmax(logits[-1]))
        chunks += -(-sum(len(item.tokens) for item in items) // N_BATCH)

    parts = []
    for live in ([0], list(range(N_SEQ))):
        step([BatchItem(s, [(7 * i + 13 * s) % 200 + 40 for i in range(plan.prompt)]) for s in live if s not in last])
        for _ in range(plan.warmup):
            step([BatchItem(s, [last[s]]) for s in live])
        part, before, started = Part(len(live), first_step=chunks), _counts(engine), time.perf_counter()
        for _ in range(plan.steps):
            part.positions.append([engine.seq_n_past(s) for s in live])
            step([BatchItem(s, [last[s]]) for s in live])
        part.seconds = time.perf_counter() - started
        part.counts = {k: v - before.get(k, 0) for k, v in _counts(engine).items()}
        parts.append(part)
    return parts


def _counts(engine: Engine) -> dict[str, int]:
    return engine.expert_counts() if isinstance(engine, DeviceEngine) else {}


# --- the table


@dataclass(frozen=True)
class Row:
    layout: str
    n_seq: int
    tok_s: float
    ms_step: float
    vs_cpu: float             # tok/s over the CPU engine's at the same sequences
    hit_rate: float | None    # the expert cache's hits over hits and misses (None: the CPU engine)
    step_bytes: float | None  # the mean bytes a timed step reads on the card (fully on the card only)
    bound_tok_s: float | None  # tokens a second at the card's bandwidth over those bytes
    of_bound: float | None


@dataclass(frozen=True)
class Report:
    device: str
    path: Path        # the generated model
    model: str
    bandwidth: float  # bytes a second, a device-to-device copy's
    nominal: float    # the card's memory clock times its bus width (0 unknown)
    rows: list[Row]


def run(kind: str, plan: Plan, folder: Path) -> Report:
    """Generate the model, measure the copy bandwidth, time every layout (see the module's docstring).

    Raises:
        DeviceUnavailable: cuda, and no CUDA library was built or no GPU is there.
    """
    path = write_random_model(folder / f"{ARCH}-{plan.size}-{DTYPE}.gguf", arch=ARCH, size=plan.size, dtype=DTYPE,
                              vocab="bytes", **plan.overrides)
    with Device(kind) as dev:
        name, nominal, bandwidth = dev.name, dev.bandwidth, copy_bandwidth(dev, plan.copy_bytes)
    sizes = model_bytes(path, KV)
    every = sizes.n_layer * int(read_metadata(path)[f"{ARCH}.expert_count"])
    rows: list[Row] = []
    cpu_tok_s: dict[int, float] = {}
    for layout, share in LAYOUTS:
        trace = folder / "routing.trace" if share == -1 else None
        if share is None:
            engine: Engine = Engine.load(path, n_ctx=plan.n_ctx, n_batch=N_BATCH, n_seq=N_SEQ, kv=KV)
        else:
            capacity = every if share == -1 else int(every * share)
            engine = DeviceEngine.open(path, open_device(kind, None), n_ctx=plan.n_ctx, n_batch=N_BATCH, n_seq=N_SEQ,
                                       kv=KV, record_routing=trace, capacity=capacity, resident=share == -1 or None)
        with engine:
            parts = decode(engine, plan)
        steps = read_trace(trace).steps() if trace else None
        used = {group[0].step: [len(record.used()) for record in group] for group in steps} if steps else {}
        for part in parts:
            tok_s = part.n_seq * plan.steps / part.seconds
            cpu_tok_s.setdefault(part.n_seq, tok_s)
            hits, misses = part.counts.get("hits", 0), part.counts.get("misses", 0)
            step_bytes = bound = None
            if used:
                step_bytes = float(np.mean([sizes.step(pos, used[part.first_step + i])
                                            for i, pos in enumerate(part.positions)]))
                bound = part.n_seq * bandwidth / step_bytes
            rows.append(Row(layout, part.n_seq, tok_s, 1e3 * part.seconds / plan.steps, tok_s / cpu_tok_s[part.n_seq],
                            hits / (hits + misses) if part.counts else None, step_bytes, bound,
                            tok_s / bound if bound else None))
    size_mb = path.stat().st_size / 2**20
    model = (f"{ARCH} {plan.size} {DTYPE} ({size_mb:.0f} MiB; " + ", ".join(f"{k} {v}" for k, v in
                                                                          plan.overrides.items())).rstrip("; ") + ")"
    return Report(name, path, model, bandwidth, nominal, rows)


def format_table(report: Report) -> str:
    nominal = f"{report.nominal / 1e9:.0f} GB/s" if report.nominal else "unknown"
    lines = [f"decode check: {report.device}, {report.model}, KV {KV}",
             f"memory bandwidth {report.bandwidth / 1e9:.0f} GB/s by a device-to-device copy (nominal {nominal})",
             "| layout | seqs | tok/s | ms/step | vs CPU engine | hit rate | MiB read/step | bound tok/s | of bound |",
             "|---|---|---|---|---|---|---|---|---|"]

    def opt(value: float | None, fmt: str, scale: float = 1.0, unit: str = "") -> str:
        return "-" if value is None else format(value * scale, fmt) + unit

    for r in report.rows:
        lines.append(f"| {r.layout} | {r.n_seq} | {r.tok_s:.1f} | {r.ms_step:.2f} | {r.vs_cpu:.2f}x | "
                     f"{opt(r.hit_rate, '.0f', 100, '%')} | {opt(r.step_bytes, '.1f', 2**-20)} | "
                     f"{opt(r.bound_tok_s, '.0f')} | {opt(r.of_bound, '.0f', 100, '%')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m strata.engine_cffi.decode_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("host", "cuda"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="the tiny model and a short run")
    args = parser.parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="strata-decode-check-") as folder:
        try:
            report = run(args.device, QUICK if args.quick else FULL, Path(folder))
        except DeviceUnavailable as exc:
            print(f"decode check: {exc}", file=sys.stderr)
            return 2
    print(format_table(report))
    print(f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
