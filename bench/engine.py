"""Engine speed: prompt processing and decode tokens/s, Strata beside llama.cpp, on the same GGUF files.

    python bench/engine.py [--arch qwen3moe|qwen35moe|qwen35] [--sizes small,medium] [--dtypes f16,q8_0,q4_k]
                           [--threads 1,2] [--presets Q5_K_M,Q3_K_M,Q2_K,IQ4_XS,IQ4_NL,IQ3_S,MXFP4_MOE] [--repeat 3]

--presets (with llama-cpp-python) also runs files that llama.cpp's quantizer made from the F32 model, one per
preset: the weight types users download.

Each measurement runs in its own process, so its peak resident memory is its own. With --repeat N the engines
take turns N times on each file (the first one alternating), and the table shows each figure's median, so that
load from other processes on a shared machine falls on both sides alike; the load average is printed before and
after. llama.cpp is measured through
`llama-cpp-python` (the optional `bench` extra) when it is installed. The decode floor is the time needed to read
the weights one token touches (attention, the router's chosen experts' share, embedding row, output) at the
machine's measured read bandwidth: no engine can decode faster.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
from kernels import bandwidth_gbs  # bench/kernels.py: read bandwidth by numpy streaming over a large array

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
PROMPT_TOKENS = 512
DECODE_TOKENS = 64


# --- measurements inside a worker process

def _prompt_ids(n_vocab: int, n: int) -> list[int]:
    rng = np.random.default_rng(1)
    return [int(t) for t in rng.integers(10, min(n_vocab, 30000), size=n)]


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_strata(model: str, threads: int, clock=time.perf_counter) -> dict:
    from strata.engine_cffi import Engine

    engine = Engine.load(model, n_ctx=PROMPT_TOKENS + DECODE_TOKENS + 8, threads=threads, kv="f16", n_batch=512)
    ids = _prompt_ids(engine.n_vocab, PROMPT_TOKENS)
    engine.eval(ids[:16])  # warm-up: page in the weights once
    engine.keep(0)
    t0 = clock()
    logits = engine.eval(ids)
    pp = PROMPT_TOKENS / (clock() - t0)
    token = int(np.argmax(logits))
    t0 = clock()
    for _ in range(DECODE_TOKENS):
        token = int(np.argmax(engine.eval([token])))
    tg = DECODE_TOKENS / (clock() - t0)
    return {"pp": pp, "tg": tg, "rss_mib": _peak_rss_mib()}


def _llama_next(llm) -> int:
    """Greedy next token from the last evaluated position (llama-cpp-python keeps no scores without logits_all)."""
    logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
    return int(np.argmax(logits))


def run_llama_cpp(model: str, threads: int, clock=time.perf_counter) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=model, n_ctx=PROMPT_TOKENS + DECODE_TOKENS + 8, n_threads=threads,
                n_threads_batch=threads, n_batch=512, n_ubatch=512, verbose=False)
    ids = _prompt_ids(llm.n_vocab(), PROMPT_TOKENS)
    llm.eval(ids[:16])
    llm.reset()
    t0 = clock()
    llm.eval(ids)
    pp = PROMPT_TOKENS / (clock() - t0)
    token = _llama_next(llm)
    t0 = clock()
    for _ in range(DECODE_TOKENS):
        llm.eval([token])
        token = _llama_next(llm)
    tg = DECODE_TOKENS / (clock() - t0)
    return {"pp": pp, "tg": tg, "rss_mib": _peak_rss_mib()}


# --- the driver

def active_bytes_per_token(model: pathlib.Path) -> int:
    """Bytes of weights one decoded token reads: every tensor but the embedding table and the unchosen experts."""
    from gguf import GGUFReader

    reader = GGUFReader(model)
    arch = reader.fields["general.architecture"].contents()
    used = reader.fields.get(f"{arch}.expert_used_count")
    total = reader.fields.get(f"{arch}.expert_count")
    share = used.contents() / total.contents() if used and total else 1.0
    n_bytes = 0.0
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            n_bytes += t.n_bytes / int(t.shape[-1])  # one row
        elif "_exps" in t.name:
            n_bytes += t.n_bytes * share
        else:
            n_bytes += t.n_bytes
    return int(n_bytes)


def make_model(arch: str, size: str, dtype: str) -> pathlib.Path:
    from strata.modelgen import write_random_model

    path = OUT / f"{arch}-{size}-{dtype}.gguf"
    if not path.exists():
        OUT.mkdir(parents=True, exist_ok=True)
        write_random_model(path, arch=arch, size=size, dtype=dtype, vocab="qwen", seed=0)
    return path


def quantize_preset(arch: str, size: str, preset: str) -> pathlib.Path:
    """The F32 model of `size` quantised by llama.cpp's `llama_model_quantize` to `preset` (e.g. Q5_K_M)."""
    import llama_cpp

    path = OUT / f"{arch}-{size}-{preset.lower()}.gguf"
    if not path.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{preset}")
        source = make_model(arch, size, "f32")
        if llama_cpp.llama_model_quantize(str(source).encode(), str(path).encode(), params) != 0:
            raise RuntimeError(f"llama_model_quantize failed for {preset}")
    return path


def measure(engine: str, model: pathlib.Path, threads: int, clock: str) -> dict | None:
    cmd = [sys.executable, __file__, "--worker", engine, "--model", str(model), "--threads", str(threads),
           "--clock", clock]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"  {engine} failed on {model.name}: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_turns(peers: list[str], model: pathlib.Path, threads: int, repeat: int,
                  clock: str) -> dict[str, dict | None]:
    """Median of each figure over `repeat` measurements per peer, the peers taking turns."""
    runs: dict[str, list[dict]] = {peer: [] for peer in peers}
    for rep in range(repeat):
        for peer in peers[rep % len(peers):] + peers[:rep % len(peers)]:
            r = measure(peer, model, threads, clock)
            if r is not None:
                runs[peer].append(r)
    return {peer: {key: float(np.median([r[key] for r in rs])) for key in rs[0]} if rs else None
            for peer, rs in runs.items()}


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="qwen3moe", choices=["qwen3moe", "qwen35moe", "qwen35"])
    parser.add_argument("--sizes", default="small,medium")
    parser.add_argument("--dtypes", default="f16,q8_0,q4_k")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--presets", default="", help="llama.cpp quantisation presets, e.g. Q5_K_M,IQ4_XS")
    parser.add_argument("--repeat", type=int, default=1, help="measurements per engine and file (medians shown)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: the process's CPU time, which other processes on a busy machine do not inflate; "
                             "meaningful at 1 thread only (more threads may spin while they wait)")
    parser.add_argument("--worker", choices=["strata", "llama.cpp"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        run = run_strata if args.worker == "strata" else run_llama_cpp
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        print(json.dumps(run(args.model, int(args.threads), clock)))
        return 0

    thread_counts = [int(t) for t in args.threads.split(",")]
    bandwidth = {n: bandwidth_gbs(n, "read") for n in thread_counts}
    peers = ["strata"] + (["llama.cpp"] if llama_cpp_available() else [])
    print(f"read bandwidth {', '.join(f'{bandwidth[n]:.1f} GB/s at {n} threads' for n in thread_counts)}; "
          f"prompt {PROMPT_TOKENS} tokens, decode {DECODE_TOKENS} tokens; engines: {', '.join(peers)}; "
          f"medians of {args.repeat}; {args.clock} clock; load average {os.getloadavg()[0]:.1f}")
    if len(peers) == 1:
        print("(llama.cpp not measured: install the `bench` extra, `pip install -e '.[bench]'`)")
    header = (f"{'model':<26}{'file MiB':>9}{'thr':>4}{'engine':>11}{'pp tok/s':>10}{'tg tok/s':>10}"
              f"{'tg bound':>10}{'% bound':>9}{'RSS MiB':>9}{'pp ratio':>10}{'tg ratio':>10}")
    print(header)
    print("-" * len(header))
    for size in args.sizes.split(","):
        models = [make_model(args.arch, size, dtype) for dtype in args.dtypes.split(",") if dtype]
        models += [quantize_preset(args.arch, size, preset) for preset in args.presets.split(",") if preset]
        for model in models:
            file_mib = model.stat().st_size / 2**20
            for threads in thread_counts:
                bound = bandwidth[threads] * 1e9 / active_bytes_per_token(model)
                results = measure_turns(peers, model, threads, args.repeat, args.clock)
                base = results.get("llama.cpp")
                for peer, r in results.items():
                    if r is None:
                        continue
                    ratio_pp = f"{r['pp'] / base['pp']:.2f}" if base else "-"
                    ratio_tg = f"{r['tg'] / base['tg']:.2f}" if base else "-"
                    print(f"{model.stem:<26}{file_mib:>9.0f}{threads:>4}{peer:>11}{r['pp']:>10.1f}{r['tg']:>10.1f}"
                          f"{bound:>10.1f}{100 * r['tg'] / bound:>8.0f}%{r['rss_mib']:>9.0f}{ratio_pp:>10}"
                          f"{ratio_tg:>10}")
    print(f"ratios are Strata / llama.cpp (above 1: Strata is faster); load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
