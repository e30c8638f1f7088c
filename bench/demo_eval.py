"""Scores of the shipped demo model on a held-out set, through the C engine and the `strata-vision` process, and
through the torch model holding the same weights (greedy both ways): per-task scores and engine-vs-torch agreement.

    python bench/demo_eval.py [--n 500] [--n-edit 100] [--n-edit-long 50] [--threads 1] [--kv f16] [--no-torch]
                              [--model F --mmproj F] [--json F]

Targets: colour_shape >= 95%, count >= 90%, arithmetic >= 90%, tool_call >= 95%, thinking >= 95%, agreement >= 99%.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import pathlib
import tempfile
import time

from strata.modelgen.demo import evaluate

TARGETS = {"colour_shape": 0.95, "count": 0.90, "arithmetic": 0.90, "tool_call": 0.95, "thinking": 0.95}


def shipped(name: str) -> pathlib.Path:
    return pathlib.Path(str(importlib.resources.files("strata.models").joinpath(name)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=pathlib.Path, default=None, help="text model (default: the shipped one)")
    parser.add_argument("--mmproj", type=pathlib.Path, default=None, help="encoder (default: the shipped one)")
    parser.add_argument("--n", type=int, default=500,
                        help="items per score (a hundred are too few to judge a 90%% target to a few points)")
    parser.add_argument("--n-edit", type=int, default=100,
                        help="edits scored (each a hundred tokens or more, which the torch model recomputes whole "
                             "for every token)")
    parser.add_argument("--n-edit-long", type=int, default=50,
                        help="long edits scored (modules of three to nine functions: up to 1,024 tokens each)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kv", default="f16", help="the engine's KV cache type (the server's default: f16)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="most rows per picture (the encoder's --max-tokens; default: the file's budget)")
    parser.add_argument("--no-torch", action="store_true", help="engine only")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="write the summary and outputs here")
    parser.add_argument("--show-errors", type=int, default=3, help="wrong engine answers printed per score")
    args = parser.parse_args()
    model, mmproj = args.model or shipped("demo.gguf"), args.mmproj or shipped("demo-mmproj.gguf")

    with tempfile.TemporaryDirectory() as workdir:
        items = evaluate.held_out(args.n, pathlib.Path(workdir), sizes={"edit": args.n_edit,
                                                                               "edit_long": args.n_edit_long})
        start = time.monotonic()
        results = evaluate.evaluate(model, mmproj, items, args.threads, args.kv, args.max_tokens,
                                    with_torch=not args.no_torch)
        seconds = time.monotonic() - start
    table = evaluate.summary(results)

    print(f"{len(items)} items in {seconds:.0f} s ({args.threads} thread(s), kv {args.kv})\n")
    print("| score | n | engine | torch | agreement | target |\n|---|---|---|---|---|---|")
    for score, line in table.items():
        cells = [f"{line[k]:.1%}" if k in line else "-" for k in ("engine", "torch", "agreement")]
        target = f">= {TARGETS[score]:.0%}" if score in TARGETS else ""
        print(f"| {score} | {line['n']} | {' | '.join(cells)} | {target} |")
    if not args.no_torch:
        agreement = sum(r.engine == r.torch for r in results) / len(results)
        print(f"| all (engine = torch) | {len(results)} | | | {agreement:.1%} | >= 99% |")

    for score in evaluate.SCORES:
        wrong = [r for r in results if r.item.score == score and not evaluate.correct(r.item, r.engine)]
        for r in wrong[:args.show_errors]:
            print(f"\n[{score}] expected {r.item.example.check}\n  engine: {r.engine!r}\n  torch:  {r.torch!r}")
    if args.json:
        outputs = [{"score": r.item.score, "task": r.item.example.task, "thinking": r.item.example.thinking,
                    "check": r.item.example.check, "engine": r.engine, "torch": r.torch} for r in results]
        args.json.write_text(json.dumps({"summary": table, "outputs": outputs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
