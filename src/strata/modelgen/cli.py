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
    parser.add_argument("--full-attention-interval", type=int, metavar="N",
                        help="qwen35moe/qwen35: every N-th layer full attention, the others Gated DeltaNet "
                             "(default 4, as Qwen3.5)")
    parser.add_argument("--no-mtp", action="store_true",
                        help="qwen35moe/qwen35: leave out the MTP layer (the converter's --no-mtp)")
    parser.add_argument("--out", required=True, metavar="FILE.gguf", help="output file (overwritten)")
    parser.add_argument("--mmproj", action="store_true",
                        help="write an image encoder (mmproj) for --text-model instead of a text model: Qwen3.5's "
                             "(projector qwen3vl_merger) for a qwen35moe/qwen35 model, else our lfm2-type one")
    parser.add_argument("--text-model", metavar="T.gguf", help="with --mmproj: the text model whose width it feeds")
    parser.add_argument("--demo", action="store_true",
                        help="train the demo model and its encoder into the directory --out (needs torch; "
                             "an hour or more)")
    parser.add_argument("--threads", type=int, default=1,
                        help="with --demo: torch threads (results depend on it: the shipped files were trained on "
                             "the 1 demo.json records)")
    parser.add_argument("--encoder", metavar="MMPROJ.gguf",
                        help="with --demo: the encoder file the demo's training starts from (the previous demo's "
                             "demo-mmproj.gguf, docs/DEMO_MODEL.md)")


def run(args: argparse.Namespace) -> int:
    if args.mmproj:
        return _run_mmproj(args)
    if args.demo:
        from strata.modelgen.demo import train

        return train.main(["--out", args.out, "--threads", str(args.threads)]
                          + (["--encoder", args.encoder] if args.encoder else []))
    import time

    from strata.modelgen.hparams import hparams_for
    from strata.modelgen.vocab import get_vocab
    from strata.modelgen.writer import parameter_count, tensor_specs, write_random_model

    overrides = _hybrid_overrides(args)
    start = time.perf_counter()
    path = write_random_model(args.out, arch=args.arch, size=args.size, dtype=args.dtype, vocab=args.vocab,
                              seed=args.seed, **overrides)
    seconds = time.perf_counter() - start
    hp = hparams_for(args.arch, args.size, **overrides)
    n_params = parameter_count(tensor_specs(args.arch, hp, get_vocab(args.vocab).n_vocab, args.dtype))
    print(f"wrote {path}: {args.arch} {args.size} {args.dtype}, vocab {args.vocab}, seed {args.seed}")
    print(f"  {n_params / 1e6:.1f} M parameters, {path.stat().st_size / 2**20:.1f} MiB on disk, {seconds:.1f} s")
    print(f"  {hp}")
    return 0


def _hybrid_overrides(args: argparse.Namespace) -> dict[str, int]:
    from strata.modelgen.hparams import HYBRID_ARCHS

    overrides = {}
    if args.full_attention_interval is not None:
        overrides["full_attention_interval"] = args.full_attention_interval
    if args.no_mtp:
        overrides["n_nextn"] = 0
    if overrides and args.arch not in HYBRID_ARCHS:
        raise SystemExit(f"make-model: --full-attention-interval and --no-mtp apply to {' and '.join(HYBRID_ARCHS)}")
    if args.full_attention_interval is not None and args.full_attention_interval < 1:
        raise SystemExit("make-model: --full-attention-interval must be at least 1")
    return overrides


MMPROJ_SIZES = ("tiny", "small")
MMPROJ_DTYPES = ("f16", "f32")


def _run_mmproj(args: argparse.Namespace) -> int:
    from strata.modelgen.hparams import HYBRID_ARCHS
    from strata.modelgen.mmproj import text_model_shape, write_random_mmproj
    from strata.modelgen.mmproj_qwen35 import write_random_qwen35_mmproj

    if not args.text_model:
        raise SystemExit("make-model: --mmproj needs --text-model T.gguf (the projection matches its width)")
    if args.size not in MMPROJ_SIZES or args.dtype not in MMPROJ_DTYPES:
        raise SystemExit(f"make-model: --mmproj takes --size {'|'.join(MMPROJ_SIZES)} "
                         f"and --dtype {'|'.join(MMPROJ_DTYPES)}")
    arch, width = text_model_shape(args.text_model)
    write = write_random_qwen35_mmproj if arch in HYBRID_ARCHS else write_random_mmproj
    hp = write(args.out, width, size=args.size, seed=args.seed, dtype=args.dtype)
    print(f"wrote {args.out}: mmproj {hp.projector} {args.size} {args.dtype}, seed {args.seed}, "
          f"for {args.text_model}")
    print(f"  {hp}")
    return 0
