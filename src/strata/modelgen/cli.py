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
    parser.add_argument("--mmproj", action="store_true",
                        help="write an image encoder (mmproj) for --text-model instead of a text model")
    parser.add_argument("--text-model", metavar="T.gguf", help="with --mmproj: the text model whose width it feeds")
    parser.add_argument("--demo", action="store_true",
                        help="train the demo model and its encoder into the directory --out (needs torch; "
                             "about 40 minutes on two cores)")
    parser.add_argument("--threads", type=int, default=2,
                        help="with --demo: torch threads (the shipped files were trained on 2, reproducibly)")


def run(args: argparse.Namespace) -> int:
    if args.mmproj:
        return _run_mmproj(args)
    if args.demo:
        from strata.modelgen.demo import train

        return train.main(["--out", args.out, "--threads", str(args.threads)])
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


MMPROJ_SIZES = ("tiny", "small")
MMPROJ_DTYPES = ("f16", "f32")


def _run_mmproj(args: argparse.Namespace) -> int:
    from strata.modelgen.mmproj import text_model_width, write_random_mmproj

    if not args.text_model:
        raise SystemExit("make-model: --mmproj needs --text-model T.gguf (the projection matches its width)")
    if args.size not in MMPROJ_SIZES or args.dtype not in MMPROJ_DTYPES:
        raise SystemExit(f"make-model: --mmproj takes --size {'|'.join(MMPROJ_SIZES)} "
                         f"and --dtype {'|'.join(MMPROJ_DTYPES)}")
    hp = write_random_mmproj(args.out, text_model_width(args.text_model), size=args.size, seed=args.seed,
                             dtype=args.dtype)
    print(f"wrote {args.out}: mmproj {args.size} {args.dtype}, seed {args.seed}, for {args.text_model}")
    print(f"  {hp}")
    return 0
