"""Expert cache: the VRAM cache's policies replayed on recorded routing, and a modelled decode step.

    python bench/expert_cache.py [--threads 2] [--tokens 64] [--repeats 5] [--cpu-gbs GB/s]

1. Records the routing (`Engine.load(record_routing=...)`) of two models over the same prompts, one request after
   another as a server runs them (chat, code, a rename edit, arithmetic, tool calls):
   - the shipped demo model (4 layers, 8 experts top-2), each answer to its own end, greedy and then again at
     temperature 0.8;
   - a `qwen3moe` with random weights and Qwen3-30B-A3B's routing shape (128 experts, top-8; 4 layers, width
     256), saved by transformers, converted by llama.cpp's `convert_hf_to_gguf.py` and quantised to Q4_K_M by
     llama.cpp (`tests/llama_cpp_convert.py`, `tests/llama_cpp_quantize.py`), `--tokens` tokens a prompt at
     temperature 1. Random weights route nearly uniformly: no expert is hot for long, so this trace bounds what a
     cache can do when routing has no structure.
2. Replays each trace against caches of 5, 10, 25 and 50% of all experts (one budget over the layers): ours
   (`AdaptiveLrfuCache`: LRFU with admission, its half-life chosen by shadow caches, under the upload budget
   below; its prior the static placement below, learned on the same first half; and again without a prior), LRU
   and LFU (uploading every miss, as llama.cpp's VRAM-LRU PR does, and LRU under our budget), a static placement
   of the most frequent experts learned on the trace's first half, and the oracle static placement learned on the
   measured half. Every dynamic cache is warmed on the first half; hit rates are over the second half's decode
   steps. The goal: ours at least LRU's and the static placement's at every budget.
3. Models a decode step of Qwen3-30B-A3B at Q4_K (48 layers, 8 of 128 experts of 3 x 2048 x 768 weights, 2.65 MB
   each; ~0.82 GB of dense weights a token, attention and output) on a 16 GB card: the dense part on the GPU; in
   each layer the cached share of its 8 experts on the GPU while the CPU computes the rest, the layer taking the
   longer of the two; uploads on their own stream, the step taking at least their time. Each trace layer-step's
   hit fraction stands for a target layer's. Bandwidths: GPU 500 GB/s effective (a 16 GB card's 500-720 GB/s
   GDDR6X peak), PCIe 4.0 x16 25 GB/s, and the CPU's expert throughput measured here: a Q4_K product of one token
   over a matrix larger than the caches, `--threads` threads. The upload budget of a step is what PCIe moves in
   the step's modelled time with the hits and misses it has as it begins (the backend budgets each layer by the
   time its misses keep the CPU busy), so that uploads do not stall it.
4. Measures what recording costs: decode tok/s of the small Q8_0 qwen3moe with and without it (`--repeats`
   rounds, alternated, medians).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
# llama.cpp's converter and quantiser as the tests run them; in place of bench/, whose kernels.py would shadow the
# `kernels` package transformers looks for
sys.path[0] = str(ROOT / "tests")

from strata.engine_cffi import Engine  # noqa: E402
from strata.experts.simulate import (  # noqa: E402
    AdaptiveLrfuCache,
    ExpertCache,
    LfuCache,
    LruCache,
    ReplayStats,
    StaticCache,
    StepCounts,
    most_frequent,
    replay,
)
from strata.experts.trace import RoutingTrace, read_trace  # noqa: E402

BUDGETS = (0.05, 0.10, 0.25, 0.50)
PROMPTS = [  # (kind, text): the demo model answers the first kinds; the rest is text of other shapes
    ("chat", "Hello! Who are you?"),
    ("chat", "What is the capital of France?"),
    ("chat", "What is the capital of Japan?"),
    ("arithmetic", "What is 7 plus 5?"),
    ("arithmetic", "Calculate 9 - 2."),
    ("spelling", "Spell the word apple."),
    ("spelling", "Reverse the word garden."),
    ("code", "Write a Python function that returns the largest of three numbers."),
    ("code", "def mean(xs):\n    return sum(xs) / len(xs)\n\nAdd a docstring and handle an empty list."),
    ("edit", "Rename the variable `n` to `count` in:\nfor n in range(10):\n    total += n\nprint(n)"),
    ("edit", "In this JSON, rename the key \"name\" to \"title\": {\"name\": \"Strata\", \"version\": 3}"),
    ("chat", "Thank you!"),
    ("chat", "What is the capital of Peru?"),
    ("arithmetic", "3 x 4 ="),
    ("code", "Explain what `git rebase -i HEAD~3` does, in two sentences."),
    ("edit", "Rename the function `get_data` to `load_rows` everywhere:\ndef get_data(path):\n    return "
             "open(path).read()\nrows = get_data('a.csv')"),
]

# the modelled target: Qwen3-30B-A3B at Q4_K on a 16 GB card
TARGET_LAYERS, TARGET_EXPERTS, TARGET_USED = 48, 128, 8
EXPERT_BYTES = 3 * 2048 * 768 * 144 // 256  # gate, up, down at Q4_K's 144 bytes a 256-weight block
DENSE_BYTES = 0.82e9  # attention (Q4_K) 0.51 GB, output (Q6_K) 0.26, routers (F32) 0.05 a token
GPU_GBS, PCIE_GBS = 500.0, 25.0


# --- recording


def record_demo(trace: pathlib.Path, threads: int) -> None:
    from strata.models import DEMO_MODEL

    record(DEMO_MODEL, trace, threads, chat=True, temperatures=(0.0, 0.8), max_tokens=256, stop=True)


def converted_qwen3moe(work: pathlib.Path) -> pathlib.Path:
    """The random qwen3moe in Q4_K_M, made by llama.cpp's converter and quantiser (cached in bench/out)."""
    out = OUT / "qwen3moe-128x8-converted-q4_k_m.gguf"
    if out.is_file():
        return out
    import torch
    from llama_cpp_convert import convert, qwen_tokenizer
    from llama_cpp_quantize import quantize
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hf = work / "hf"
    hf.mkdir()
    qwen_tokenizer(hf)
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=151936, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64, moe_intermediate_size=256,
                            num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                            max_position_embeddings=4096, tie_word_embeddings=False)
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(hf)
    source = convert(hf, work / "f16.gguf", "f16")
    OUT.mkdir(parents=True, exist_ok=True)
    return quantize(source, out, "Q4_K_M")


def record(model: pathlib.Path | str, trace: pathlib.Path, threads: int, chat: bool, temperatures: Sequence[float],
           max_tokens: int, stop: bool) -> None:
    """Run every prompt at each temperature, one request after another through one batcher (as a server does),
    recording the routing."""
    from strata.scheduling.batcher import Batcher, generate
    from strata.text.prompt import render_chat
    from strata.text.sampling import Sampler, SamplingParams
    from strata.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(model)
    with Engine.load(model, n_ctx=2048, threads=threads, record_routing=trace) as engine:
        batcher = Batcher(engine)
        for i, (temperature, (_, text)) in enumerate((t, p) for t in temperatures for p in PROMPTS):
            if chat and tokenizer.chat_template is not None:
                text = render_chat(tokenizer.chat_template, [{"role": "user", "content": text}])
            sampler = Sampler(SamplingParams(temperature=temperature, seed=i), engine.n_vocab)
            ids = tokenizer.encode_prompt(text)
            for _ in generate(engine, ids, sampler, max_tokens, tokenizer.eos_ids if stop else (), batcher=batcher):
                pass


# --- replay and the step model


def capacity_of(trace: RoutingTrace, fraction: float) -> int:
    return max(1, round(fraction * trace.info.n_layer * trace.info.n_expert))


def policies(trace: RoutingTrace, capacity: int, uploads: float) -> dict[str, Callable[[], ExpertCache]]:
    info, half = trace.info, trace.n_steps // 2
    shape = (info.n_layer, info.n_expert, capacity)
    learned = most_frequent(trace, capacity, range(half))  # the static placement's, from the same first half
    return {
        "ours": lambda: AdaptiveLrfuCache(*shape, uploads_per_step=uploads, prior=learned),
        "ours, no prior": lambda: AdaptiveLrfuCache(*shape, uploads_per_step=uploads),
        "LRU": lambda: LruCache(*shape),
        "LRU, our budget": lambda: LruCache(*shape, uploads_per_step=uploads),
        "LFU": lambda: LfuCache(*shape),
        "static": lambda: StaticCache(info.n_layer, info.n_expert, learned),
        "static oracle": lambda: StaticCache(info.n_layer, info.n_expert,
                                             most_frequent(trace, capacity, range(half, trace.n_steps))),
    }


PACED = ("ours", "ours, no prior", "LRU, our budget")  # their upload budget follows the modelled step time


def decode_hit_rate(stats: ReplayStats) -> float:
    hits = sum(h for s in stats.steps if s.n_tok == 1 for h, _ in s.layers)
    misses = sum(m for s in stats.steps if s.n_tok == 1 for _, m in s.layers)
    return hits / max(hits + misses, 1)


def modelled_ns(counts: StepCounts, k: int, cpu_gbs: float) -> float:
    """The target's step (ns) with the hit fraction of each of the trace step's layers: in each layer the target
    needs TARGET_USED experts per k the trace step needs (all of its 128 at most; a decode step: 8)."""
    layers = []
    for h, m in counts.layers:
        needed = min(TARGET_USED * (h + m) / k, TARGET_EXPERTS) * EXPERT_BYTES
        hit = h / max(h + m, 1)
        layers.append(max(needed * hit / GPU_GBS, needed * (1 - hit) / cpu_gbs))
    compute = DENSE_BYTES / GPU_GBS + TARGET_LAYERS * float(np.mean(layers))
    needed = sum(h + m for h, m in counts.layers)
    uploads = counts.uploads / max(needed, 1) * TARGET_LAYERS * TARGET_USED * EXPERT_BYTES / PCIE_GBS
    return max(compute, uploads)


def step_ms(stats: ReplayStats, k: int, cpu_gbs: float) -> float:
    """The modelled decode step (ms), the mean over the replay's decode steps."""
    return float(np.mean([modelled_ns(s, k, cpu_gbs) for s in stats.steps if s.n_tok == 1])) / 1e6


def cpu_only_ms(cpu_gbs: float) -> float:
    return (DENSE_BYTES + TARGET_LAYERS * TARGET_USED * EXPERT_BYTES) / cpu_gbs / 1e6


def uploads_in(trace: RoutingTrace, ns: float) -> float:
    """Uploads a step of the trace may start when the target's step lasts `ns`: the target's uploads in that time
    as a share of the experts a target step needs, times those a trace step needs."""
    share = ns * PCIE_GBS / EXPERT_BYTES / (TARGET_LAYERS * TARGET_USED)
    return share * trace.info.n_layer * trace.info.n_expert_used


def evaluate(trace: RoutingTrace, cpu_gbs: float) -> list[dict[str, object]]:
    fastest = uploads_in(trace, (DENSE_BYTES + TARGET_LAYERS * TARGET_USED * EXPERT_BYTES) / GPU_GBS)
    half, k = trace.n_steps // 2, trace.info.n_expert_used
    rows = []
    for fraction in BUDGETS:
        capacity = capacity_of(trace, fraction)
        row: dict[str, object] = {"budget": fraction, "capacity": capacity, "first_uploads": fastest}
        for name, make in policies(trace, capacity, fastest).items():
            pace = (lambda c: uploads_in(trace, modelled_ns(c, k, cpu_gbs))) if name in PACED else None
            stats = replay(trace, make(), measure_from=half, pace=pace)
            decode = [s.uploads for s in stats.steps if s.n_tok == 1]
            row[name] = {"hit_rate": decode_hit_rate(stats), "step_ms": step_ms(stats, k, cpu_gbs),
                         "uploads_per_decode_step": float(np.mean(decode)) if decode else 0.0}
        rows.append(row)
    return rows


# --- measurements of this machine


def cpu_expert_gbs(threads: int, repeats: int) -> float:
    """GB/s of Q4_K weights one token's product reads on the CPU, over a matrix larger than the caches: the best
    of 10 x `repeats` products at each of 1 to `threads` threads (the machine is shared: the best is the nearest
    to it alone)."""
    from gguf import GGMLQuantizationType
    from strata.engine_cffi._engine import ffi, lib

    from strata.modelgen.quants import encode

    rows, cols, copies = 32 * 768, 2048, 6  # 32 experts' gate matrices (28 MB) six times over: past any L3
    w = np.tile(encode(np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32) * 0.02,
                       GGMLQuantizationType.Q4_K), (copies, 1))
    rows *= copies
    x, y = np.ones((1, cols), np.float32), np.zeros((1, rows), np.float32)
    wp, xp, yp = ffi.from_buffer(w), ffi.from_buffer("float[]", x), ffi.from_buffer("float[]", y)
    times = []
    for _ in range(repeats * 10):
        for n in range(1, threads + 1):
            t0 = time.perf_counter()
            lib.strata_matmul(lib.STRATA_TYPE_Q4_K, wp, rows, cols, xp, 1, yp, n)
            times.append(time.perf_counter() - t0)
    return w.nbytes / min(times) / 1e9


def recording_cost(threads: int, repeats: int) -> dict[str, float]:
    """Decode of the small Q8_0 qwen3moe without and with the routing record, alternated after a round to warm
    up: medians of tok/s and of the engine threads' CPU ms a token (which other processes' load moves less)."""
    from strata.modelgen import write_random_model

    model = OUT / "qwen3moe-small-q8_0.gguf"
    if not model.is_file():
        OUT.mkdir(parents=True, exist_ok=True)
        write_random_model(model, arch="qwen3moe", size="small", dtype="q8_0", vocab="qwen", seed=0)
    rates: dict[str, list[float]] = {"off": [], "on": [], "off_cpu_ms": [], "on_cpu_ms": []}
    n = 128
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats + 1):
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                path = pathlib.Path(tmp) / "t.bin" if mode == "on" else None
                with Engine.load(model, n_ctx=512, threads=threads, record_routing=path) as engine:
                    engine.eval(list(range(100, 132)))
                    t0, c0 = time.perf_counter(), engine.cpu_seconds()
                    for t in range(n):
                        engine.eval([200 + t])
                    if r > 0:
                        rates[mode].append(n / (time.perf_counter() - t0))
                        rates[f"{mode}_cpu_ms"].append((engine.cpu_seconds() - c0) / n * 1e3)
    return {key: statistics.median(v) for key, v in rates.items()}


# --- report


COLUMNS = ("ours", "ours, no prior", "LRU", "LRU, our budget", "LFU", "static", "static oracle")


def table(name: str, trace: RoutingTrace, rows: Sequence[dict[str, object]], cpu_gbs: float) -> str:
    decode = sum(1 for step in trace.steps() if len(step[0].experts) == 1)
    lines = [f"{name}: {trace.info.n_layer} layers x {trace.info.n_expert} experts, top-{trace.info.n_expert_used}; "
             f"{trace.n_steps} steps ({decode} decode); ours uploads "
             + ", ".join(f"{row['ours']['uploads_per_decode_step']:.2f}" for row in rows)  # type: ignore[index]
             + " a decode step",
             "", "| cache | " + " | ".join(COLUMNS) + " | step ms: ours / LRU / static / CPU only |",
             "|---|" + "---|" * (len(COLUMNS) + 1)]
    for row in rows:
        cells = [f"{row[c]['hit_rate']:.2%}" for c in COLUMNS]  # type: ignore[index]
        ms = [row[c]["step_ms"] for c in ("ours", "LRU", "static")]  # type: ignore[index]
        lines.append(f"| {row['budget']:.0%} ({row['capacity']}) | " + " | ".join(cells) +
                     f" | {ms[0]:.1f} / {ms[1]:.1f} / {ms[2]:.1f} / {cpu_only_ms(cpu_gbs):.1f} |")
    rate = {c: [row[c]["hit_rate"] for row in rows] for c in ("ours", "LRU", "static")}  # type: ignore[index]
    met = all(o >= max(lru, st) for o, lru, st in zip(rate["ours"], rate["LRU"], rate["static"], strict=True))
    lines.append(f"\nours >= LRU and >= static at every budget: {'met' if met else 'NOT MET'}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="tokens a prompt of the random model")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu-gbs", type=float, default=None,
                        help="the CPU's expert throughput the step model and the upload budgets use, in GB/s, "
                             "instead of this host's as measured (which moves with its load): tables of two "
                             "sittings or two trees compare only at the same value")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    cost = recording_cost(args.threads, args.repeats)
    print(f"recording's cost, small Q8_0 qwen3moe decode at {args.threads} threads: {cost['off']:.1f} tok/s off, "
          f"{cost['on']:.1f} on ({cost['on'] / cost['off'] - 1:+.1%}); CPU a token {cost['off_cpu_ms']:.3f} ms off, "
          f"{cost['on_cpu_ms']:.3f} on ({cost['on_cpu_ms'] / cost['off_cpu_ms'] - 1:+.1%}); load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    cpu_gbs = args.cpu_gbs or cpu_expert_gbs(args.threads, args.repeats)
    print(f"CPU expert throughput (Q4_K, 1 token, best of 1-{args.threads} threads"
          f"{', as given' if args.cpu_gbs else ''}): {cpu_gbs:.1f} GB/s; modelled CPU-only decode step "
          f"{cpu_only_ms(cpu_gbs):.1f} ms", flush=True)
    results: dict[str, object] = {"recording": cost, "cpu_gbs": cpu_gbs, "cpu": _cpu_name()}
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        demo_trace, random_trace = OUT / "routing-demo.bin", OUT / "routing-qwen3moe-random.bin"
        record_demo(demo_trace, args.threads)
        model = converted_qwen3moe(work)
        record(model, random_trace, args.threads, chat=False, temperatures=(1.0,), max_tokens=args.tokens,
               stop=False)
    for name, path in (("demo model", demo_trace), ("random qwen3moe, Q4_K_M by llama.cpp", random_trace)):
        trace = read_trace(path)
        rows = evaluate(trace, cpu_gbs)
        results[name] = rows
        print("\n" + table(name, trace, rows, cpu_gbs), flush=True)
    (OUT / "expert_cache.json").write_text(json.dumps(results, indent=1))


def _cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return f"{os.cpu_count()} x {line.split(':', 1)[1].strip()}"
    return "unknown"


if __name__ == "__main__":
    main()
