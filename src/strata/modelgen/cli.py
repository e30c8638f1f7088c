"""`strata make-model`: write a GGUF model with generated weights."""

from __future__ import annotations

import argparse

from strata.modelgen.hparams import ARCHS, DTYPES, SIZES, VOCABS


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
    from strata.modelgen.vocab import get_vocab
    from strata.modelgen.writer import parameter_count, tensor_specs, write_random_model

    start = time.perf_counter()
    path = write_random_model(args.out, arch=args.arch, size=args.size, dtype=args.dtype, vocab=args.vocab,
                              seed=args.seed)
    seconds = time.perf_counter() - start
    hp = hparams_for(args.arch, args.size)
    n_params = parameter_count(tensor_specs(args.arch, hp, get_vocab(args.vocab).n_vocab, args.dtype))
    print(f"wrote {path}: {args.arch} {args.size} {args.dtype}, vocab {args.vocab}, seed {args.seed}")
    print(f"  {n_params / 1e6:.1f} M parameters, {path.stat().st_size / 2**20:.1f} MiB on disk, {seconds:.1f} s")
    print(f"  {hp}")
    return 0
