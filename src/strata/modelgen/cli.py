"""`strata make-model`: write a GGUF model with generated weights."""

from __future__ import annotations

import argparse

from strata.modelgen.hparams import ARCHS, SIZES

# Kept here rather than imported from the writer, so building the parser does not load numpy or gguf.
DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_k")
VOCABS = ("bytes", "qwen")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", choices=ARCHS, default="qwen3moe")
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--dtype", choices=DTYPES, default="f16")
    parser.add_argument("--vocab", choices=VOCABS, default="bytes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, metavar="FILE.gguf", help="output file (overwritten)")


def run(args: argparse.Namespace) -> int:
    import time

    from strata.modelgen.hparams import hparams_for
    from strata.modelgen.writer import count_parameters, write_random_model

    start = time.perf_counter()
    path = write_random_model(args.out, arch=args.arch, size=args.size, dtype=args.dtype, vocab=args.vocab,
                              seed=args.seed)
    seconds = time.perf_counter() - start
    n_params = count_parameters(path)
    hp = hparams_for(args.arch, args.size)
    print(f"wrote {path}: {args.arch} {args.size} {args.dtype}, vocab {args.vocab}, seed {args.seed}")
    print(f"  {n_params / 1e6:.1f} M parameters, {path.stat().st_size / 2**20:.1f} MiB on disk, {seconds:.1f} s")
    print(f"  {hp}")
    return 0
