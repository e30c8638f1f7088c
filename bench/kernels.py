"""Kernel speed: y = x @ w^T per weight type, decode-shaped (1 token) and prompt-shaped (many tokens).

    python bench/kernels.py [--rows 4096] [--cols 4096] [--tokens 1,64,256] [--threads 1,2] [--types q8_0,q4_k]
                            [--clock wall|cpu]

Type q8_0b is Q8_0 read from the band layout the engine keeps of a Q8_0 output weight (`strata_bands_prepare`,
AVX-512 VNNI builds), built once outside the timed calls; put it beside q8_0 (`--types q8_0,q8_0b`). Where the
machine has the tile unit (AMX), q8_0b takes it from as many tokens as the engine does (4), and q8_0v is the same
bands read by the VNNI tiles alone.

GB/s counts the weight bytes one product reads; with one token the product is bound by memory, so the table
shows it as a share of the machine's read bandwidth, measured by numpy streaming over a large array with as
many threads (a copy's figure is printed too). Calls rotate between copies of w totalling WORKING_SET bytes, so
the weights come from memory, not the last-level cache. GFLOP/s counts 2 flops per multiply-add. "vs naive" is
the fast path's speed over the naive reference (dequantise, sum in double), single-threaded, in CPU time, the
reference timed on a slice of the rows. With llama-cpp-python installed, "vs ggml" is our speed over ggml's own
product (llama.cpp's CPU kernels) on the same weights, threads and clock.
"""

from __future__ import annotations

import argparse
import ctypes
import pathlib
import threading
import time

import numpy as np
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as Q
from strata.engine_cffi._engine import ffi, lib

from strata.modelgen.quants import random_blocks

TYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_k": Q.Q4_K,
         "q6_k": Q.Q6_K, "q5_k": Q.Q5_K, "q3_k": Q.Q3_K, "q2_k": Q.Q2_K, "iq4_xs": Q.IQ4_XS, "iq4_nl": Q.IQ4_NL,
         "iq3_s": Q.IQ3_S, "mxfp4": Q.MXFP4, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0, "q5_1": Q.Q5_1, "iq3_xxs": Q.IQ3_XXS,
         "iq2_xxs": Q.IQ2_XXS, "iq2_xs": Q.IQ2_XS, "iq2_s": Q.IQ2_S, "iq1_s": Q.IQ1_S, "iq1_m": Q.IQ1_M}
BANDS = {"q8_0b": Q.Q8_0, "q8_0v": Q.Q8_0}  # the band layout of a type, prepared once (strata_bands_prepare)
# From how many tokens the bands take the tile unit (AMX): as the engine does, and never.
TILE_UNIT_TOKENS = {"q8_0b": lib.strata_bands_amx(0), "q8_0v": 1 << 30}
DEFAULT_TYPES = "f32,f16,bf16,q8_0,q4_0,q4_k,q6_k,q5_k,q3_k,q2_k,iq4_xs,iq4_nl,iq3_s,mxfp4"
NAIVE_ROWS = 64  # the reference is slow: time it on this many rows and scale
WORKING_SET = 256 << 20


def bandwidth_gbs(threads: int, kind: str, clock=time.perf_counter, n_bytes: int = 1 << 29) -> float:
    """Best of 5 passes of `threads` threads over disjoint parts of a large array (numpy drops the GIL); one
    thread runs in the caller, timed by `clock`.

    kind "read": the max of f32 values, a streaming read with next to no arithmetic, counting bytes read.
    kind "copy": a copy, counting bytes read plus bytes written."""
    src = np.ones(n_bytes // 4, dtype=np.float32)
    if kind == "read":
        jobs = [(np.max, (part,)) for part in np.array_split(src, threads)]
    else:
        dst = np.empty_like(src)
        jobs = [(np.copyto, pair) for pair in zip(np.array_split(dst, threads), np.array_split(src, threads))]
    best = 0.0
    for _ in range(5):
        if threads == 1:
            fn, fn_args = jobs[0]
            t0 = clock()
            fn(*fn_args)
            seconds = clock() - t0
        else:
            workers = [threading.Thread(target=fn, args=fn_args) for fn, fn_args in jobs]
            t0 = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            seconds = time.perf_counter() - t0
        best = max(best, n_bytes * (1 if kind == "read" else 2) / seconds / 1e9)
    return best


def make_weights(qtype: Q, n_rows: int, n_cols: int, rng: np.random.Generator) -> np.ndarray:
    """(n_rows, row_bytes) uint8: gguf's quantiser where it has one, else random valid blocks."""
    if qtype == Q.F32:
        return rng.standard_normal((n_rows, n_cols), dtype=np.float32).view(np.uint8)
    if qtype == Q.F16:
        return rng.standard_normal((n_rows, n_cols), dtype=np.float32).astype(np.float16).view(np.uint8)
    if qtype in (Q.BF16, Q.Q8_0, Q.Q4_0):
        return quants.quantize(rng.standard_normal((n_rows, n_cols), dtype=np.float32), qtype)
    block = GGML_QUANT_SIZES[qtype][0]
    return random_blocks(qtype, n_rows * n_cols // block, rng).reshape(n_rows, -1)


def time_call(fn, clock=time.perf_counter, min_seconds: float = 0.3, max_calls: int = 50) -> float:
    """Best seconds per call, calling until min_seconds have passed (after one warm-up call)."""
    fn()
    best, spent, calls = float("inf"), 0.0, 0
    while spent < min_seconds and calls < max_calls:
        t0 = clock()
        fn()
        dt = clock() - t0
        best, spent, calls = min(best, dt), spent + dt, calls + 1
    return best


def prepare_bands(qtype: Q, w: np.ndarray, n_cols: int) -> np.ndarray:
    """w's rows in the band layout, or a clear stop where this build has none for the type."""
    n_bytes = lib.strata_bands_bytes(int(qtype), w.shape[0], n_cols)
    if not n_bytes:
        raise SystemExit(f"this build has no band layout for {qtype.name} (AVX-512 VNNI only)")
    room = np.empty(n_bytes + 64, dtype=np.uint8)
    bands = room[-room.ctypes.data % 64:][:n_bytes]  # 64-byte aligned, as the engine allocates them
    assert lib.strata_bands_prepare(int(qtype), ffi.from_buffer(w), w.shape[0], n_cols, ffi.from_buffer(bands)) == 0
    return bands


def matmul_call(qtype: Q, ws: list[np.ndarray], x: np.ndarray, y: np.ndarray, n_threads: int | None,
                bands: list[np.ndarray] | None = None):
    """A call of the fast (n_threads) or naive (None) product, on the next of the weight copies ws (or of their
    band layouts) each time."""
    rest = (x.shape[1], ffi.from_buffer("float[]", x), x.shape[0], ffi.from_buffer("float[]", y))
    calls = [(int(qtype), ffi.from_buffer(b if bands else w), w.shape[0], *rest)
             for w, b in zip(ws, bands or ws, strict=True)]
    turn = iter(range(1 << 62))

    def call():
        args = calls[next(turn) % len(calls)]
        if n_threads is None:
            status = lib.strata_matmul_naive(*args)
        else:
            status = (lib.strata_matmul_bands if bands else lib.strata_matmul)(*args, n_threads)
        assert status == lib.STRATA_OK

    return call


class Ggml:
    """ggml's own matrix product (llama.cpp's CPU kernels), from the libraries llama-cpp-python installs.

    The weights are copied into a ggml tensor of the same type (GGUF's block layouts are ggml's); ggml quantises
    the f32 activations to the type's vec_dot type as we do. ggml_graph_compute_with_ctx starts its threads on
    every call, which a decode-sized product at 2 threads pays for; llama.cpp itself keeps a thread pool."""

    class InitParams(ctypes.Structure):
        _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]

    def __init__(self):
        import llama_cpp  # optional: only for this comparison

        lib_dir = pathlib.Path(llama_cpp.__file__).parent / "lib"
        self.base = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self.cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        vp = ctypes.c_void_p
        for name, res, argtypes in [
            ("ggml_init", vp, [self.InitParams]), ("ggml_free", None, [vp]),
            ("ggml_new_tensor_2d", vp, [vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
            ("ggml_mul_mat", vp, [vp, vp, vp]), ("ggml_new_graph", vp, [vp]),
            ("ggml_build_forward_expand", None, [vp, vp]), ("ggml_get_data", vp, [vp]),
            ("ggml_tensor_overhead", ctypes.c_size_t, []), ("ggml_graph_overhead", ctypes.c_size_t, []),
        ]:
            fn = getattr(self.base, name)
            fn.restype, fn.argtypes = res, argtypes
        self.cpu.ggml_graph_compute_with_ctx.restype = ctypes.c_int
        self.cpu.ggml_graph_compute_with_ctx.argtypes = [vp, vp, ctypes.c_int]
        self.cpu.ggml_cpu_init()

    def matmul_call(self, qtype: Q, ws: list[np.ndarray], x: np.ndarray, y: np.ndarray, n_threads: int):
        """A call computing y = x @ w^T with ggml on the next of the weight copies ws each time, and the
        contexts to free afterwards."""
        graphs = [self._graph(qtype, w, x) for w in ws]
        turn = iter(range(1 << 62))

        def call():
            ctx, graph, out = graphs[next(turn) % len(graphs)]
            assert self.cpu.ggml_graph_compute_with_ctx(ctx, graph, n_threads) == 0
            ctypes.memmove(y.ctypes.data, self.base.ggml_get_data(out), y.nbytes)

        return call, [ctx for ctx, _, _ in graphs]

    def _graph(self, qtype: Q, w: np.ndarray, x: np.ndarray):
        b = self.base
        (n_tok, n_cols), n_rows = x.shape, w.shape[0]
        # room for the tensors, the graph, and the work buffer ggml allocates in the context while computing (for
        # some types as large as a converted copy of w); pages never touched cost nothing
        size = 8 * (w.nbytes + x.nbytes + 4 * n_tok * n_rows) + b.ggml_graph_overhead() + (64 << 20)
        ctx = b.ggml_init(self.InitParams(size, None, False))
        wt = b.ggml_new_tensor_2d(ctx, int(qtype), n_cols, n_rows)
        xt = b.ggml_new_tensor_2d(ctx, int(Q.F32), n_cols, n_tok)
        ctypes.memmove(b.ggml_get_data(wt), w.ctypes.data, w.nbytes)
        ctypes.memmove(b.ggml_get_data(xt), x.ctypes.data, x.nbytes)
        out = b.ggml_mul_mat(ctx, wt, xt)
        graph = b.ggml_new_graph(ctx)
        b.ggml_build_forward_expand(graph, out)
        return ctx, graph, out


def load_ggml() -> Ggml | None:
    try:
        return Ggml()
    except (ImportError, OSError, AttributeError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--tokens", default="1,64,256")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--types", default=DEFAULT_TYPES, help=f"of {','.join([*TYPES, *BANDS])}")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: the calling thread's CPU time, which other processes on a busy machine do not "
                             "inflate; meaningful at 1 thread only (the naive column always uses it)")
    args = parser.parse_args()
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    tokens = [int(t) for t in args.tokens.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    bandwidth = {n: bandwidth_gbs(n, "read", clock) for n in threads}
    print(f"weights {args.rows} x {args.cols}; memory bandwidth, read (numpy max): "
          + ", ".join(f"{bandwidth[n]:.1f} GB/s at {n} thread{'s' * (n > 1)}" for n in threads)
          + "; copy (read + write): "
          + ", ".join(f"{bandwidth_gbs(n, 'copy', clock):.1f} GB/s at {n} thread{'s' * (n > 1)}" for n in threads))
    ggml = load_ggml()
    if ggml is None:
        print("(ggml not measured: llama-cpp-python is not installed)")
    header = (f"{'type':<6}{'tokens':>7}{'threads':>8}{'ms':>9}{'GB/s':>8}{'% bw':>7}{'GFLOP/s':>9}{'vs naive':>10}"
              + (f"{'ggml ms':>9}{'vs ggml':>9}" if ggml else ""))
    print(header)
    print("-" * len(header))
    rng = np.random.default_rng(0)
    for name in args.types.split(","):
        qtype = BANDS.get(name) or TYPES[name]
        w = make_weights(qtype, args.rows, args.cols, rng)
        ws = [w] + [w.copy() for _ in range(WORKING_SET // w.nbytes)]
        bands = [prepare_bands(qtype, v, args.cols) for v in ws] if name in BANDS else None
        if TILE_UNIT_TOKENS.get(name):  # 0: no tile unit here
            lib.strata_bands_amx(TILE_UNIT_TOKENS[name])
        for n_tok in tokens:
            x = rng.standard_normal((n_tok, args.cols), dtype=np.float32)
            y = np.empty((n_tok, args.rows), dtype=np.float32)
            w_part, y_part = w[:NAIVE_ROWS], np.empty((n_tok, NAIVE_ROWS), dtype=np.float32)
            naive = matmul_call(qtype, [w_part], x, y_part, None)
            naive_seconds = time_call(naive, time.thread_time, 0.1, 3) * args.rows / NAIVE_ROWS
            for n_threads in threads:
                fast = matmul_call(qtype, ws, x, y, n_threads, bands)
                seconds = time_call(fast, clock)
                gbs = w.nbytes / seconds / 1e9
                gflops = 2 * args.rows * args.cols * n_tok / seconds / 1e9
                ratio = ""
                if n_threads == 1:  # CPU time on both sides
                    fast_cpu = seconds if args.clock == "cpu" else time_call(fast, time.thread_time)
                    ratio = f"{naive_seconds / fast_cpu:9.1f}x"
                line = (f"{name:<6}{n_tok:>7}{n_threads:>8}{seconds * 1e3:>9.2f}{gbs:>8.1f}"
                        f"{100 * gbs / bandwidth[n_threads]:>6.0f}%{gflops:>9.1f}{ratio:>10}")
                if ggml:
                    line += ggml_column(ggml, qtype, ws, x, y, n_threads, clock, seconds)
                print(line)


def ggml_column(ggml: Ggml, qtype: Q, ws: list[np.ndarray], x: np.ndarray, y: np.ndarray, n_threads: int,
                clock, seconds: float) -> str:
    """ggml's time for the same product, and our speed over it; checks that the two agree. With one token it
    rotates through the same weight copies; many tokens are bound by arithmetic, and one copy saves memory."""
    y_ggml = np.empty_like(y)
    call, contexts = ggml.matmul_call(qtype, ws[:1] if len(x) > 1 else ws, x, y_ggml, n_threads)
    try:
        ggml_seconds = time_call(call, clock)
    finally:
        for ctx in contexts:
            ggml.base.ggml_free(ctx)
    matmul_call(qtype, ws[:1], x, y, n_threads)()
    # a coarse check: ggml rounds the activations differently (to f16 or bf16 for those weights)
    assert np.abs(y_ggml - y).max() <= 0.05 * (np.abs(y).max() + 1e-30), "ggml and strata disagree"
    return f"{ggml_seconds * 1e3:>9.2f}{ggml_seconds / seconds:>8.2f}x"


if __name__ == "__main__":
    main()
