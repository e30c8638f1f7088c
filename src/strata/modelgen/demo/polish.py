"""Train a trained demo text model further, from its files: a polish.

    python -m strata.modelgen.demo.polish --start DIR --out DIR [--threads N] [--steps N]

`--start` holds the files a run of `train` wrote (`demo.gguf`, `demo-mmproj.gguf`, `demo.json`). The polish reads
the text model from `demo.gguf`, trains it (its MTP block beside it, as in the joint phase) on a stream of
conversations of its own, with its own mix of tasks and its own learning rate, and writes the text model again;
the encoder is not trained (its file is copied, so the probe that kept its rows legible is not needed). Seeded: the
same start, configuration and thread count give the same file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shutil
import sys
import tempfile
import time

import torch

from strata.modelgen.demo import bpe, export, train
from strata.modelgen.demo.hybrid import HybridTextModel
from strata.modelgen.vocab import Vocab

POLISH_SEED = 8  # its conversations come from seeds 8..10 above the trained configuration's


@dataclasses.dataclass(frozen=True)
class PolishConfig:
    start: str  # the weights digest of the text model file the polish starts from
    steps: int
    batch: int
    lr: float  # after `warmup` steps, a cosine decay to a tenth of it
    warmup: int
    max_len: int  # longer conversations are skipped
    task_weights: dict[str, float]


# The shipped demo's polish: its facts' few errors were spelling after an earlier turn and questions asked with
# tools declared that need none (twice as many of each), with more edits (10 points), at a thirtieth of the joint
# phase's rate. A larger rate or a longer polish cost the demo its copy of a long file (the speed-up that
# speculative decoding shows on it, docs/DEMO_MODEL.md).
POLISH_MIX = train.HYBRID_MIX | {"spelling": 0.10, "no_tool": 0.04, "edit": 0.10}
POLISH = PolishConfig(start="sha256:1768de67d57f3e4edb7df2a67b3376e0ba0f244676ba9ec7c607547ae8c6bb01", steps=400,
                      batch=32, lr=1e-4, warmup=40, max_len=512, task_weights=POLISH_MIX)


def stream_config(base: train.TrainConfig, config: PolishConfig) -> train.TrainConfig:
    """The trained configuration with the polish's batches: its seeds, mix, batch size and length."""
    return dataclasses.replace(base, seed=base.seed + POLISH_SEED, task_weights=config.task_weights,
                               batch=config.batch, max_len=config.max_len)


def polish(base: train.TrainConfig, config: PolishConfig, start: pathlib.Path, vocab: Vocab, threads: int,
           log: bool = True) -> HybridTextModel:
    """The text model of `start`/demo.gguf (trained with `base`, whose vocabulary is `vocab`) after `config.steps`
    batches of the polish.

    Raises:
        ValueError: `start`/demo.gguf is not the file the configuration starts from, or not a qwen35moe.
    """
    text_file = start / "demo.gguf"
    if export.weights_digest(text_file) != config.start:
        raise ValueError(f"this polish starts from the text model whose weights digest is {config.start}; "
                         f"{text_file} is not it")
    text = export.read_text(text_file)
    if not isinstance(text, HybridTextModel):
        raise ValueError(f"{text_file}: the polish trains a qwen35moe text model")
    vision = export.read_vision(start / "demo-mmproj.gguf").requires_grad_(False)
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as scratch:
        tok = bpe.tokenizer_of(vocab, scratch)
    stream = stream_config(base, config)
    torch.manual_seed(stream.seed)
    trunk = [p for name, p in text.named_parameters() if not name.startswith("mtp.")]
    draft = [*text.mtp.parameters()]
    opt = train.optimizer(trunk + draft, config.lr)
    batches = train.batch_stream(stream, tok)
    started, total, total_draft = time.monotonic(), 0.0, 0.0
    for step in range(config.steps):
        batch = next(batches)
        lr = train.schedule(step, config.steps, config.lr, config.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        with torch.no_grad():
            rows = train.picture_rows(vision, batch.pictures)
        loss, balance, draft_loss = train.answer_losses(text, rows, batch)
        (loss + train.BALANCE_WEIGHT * balance + draft_loss).backward()
        torch.nn.utils.clip_grad_norm_(trunk, 1.0)
        torch.nn.utils.clip_grad_norm_(draft, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total, total_draft = total + loss.item(), total_draft + draft_loss.item()
        if log and (step + 1) % 50 == 0:
            print(f"polish step {step + 1}/{config.steps} loss {total / 50:.4f} draft {total_draft / 50:.4f} "
                  f"lr {lr:.2e} {time.monotonic() - started:.0f}s", flush=True)
            total, total_draft = 0.0, 0.0
    return text


def run(base: train.TrainConfig, config: PolishConfig, start: pathlib.Path, out: pathlib.Path, threads: int,
        log: bool = True) -> dict:
    """Polish the files in `start` into `out`: `demo.gguf` polished, `demo-mmproj.gguf` copied, and `demo.json`:
    the start's record (the trained configuration and its run) with the polish's configuration, thread count and
    seconds, and the new files' weights digests."""
    started = time.monotonic()
    vocab = train.build_vocab(base)
    text = polish(base, config, start, vocab, threads, log)
    out.mkdir(parents=True, exist_ok=True)
    text_path = export.write_text(out / "demo.gguf", text, vocab)
    vision_path = out / "demo-mmproj.gguf"
    if (start / vision_path.name).resolve() != vision_path.resolve():
        shutil.copyfile(start / vision_path.name, vision_path)
    record = json.loads((start / "demo.json").read_text())
    record["polish"] = {"config": train.config_record(config), "threads": threads,
                        "seconds": round(time.monotonic() - started)}
    record["weights"] = {text_path.name: export.weights_digest(text_path),
                         vision_path.name: export.weights_digest(vision_path)}
    (out / "demo.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m strata.modelgen.demo.polish", description=__doc__.split("\n")[0])
    parser.add_argument("--start", required=True, type=pathlib.Path,
                        help="the directory of the trained files (demo.gguf, demo-mmproj.gguf, demo.json)")
    parser.add_argument("--out", required=True, type=pathlib.Path, help="directory for the polished files")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads: results depend on it (the shipped polish ran on the 1 demo.json records)")
    parser.add_argument("--steps", type=int, default=None, help="override the number of polish steps")
    args = parser.parse_args(argv)
    config = POLISH if args.steps is None else dataclasses.replace(POLISH, steps=args.steps)
    record = run(train.FULL, config, args.start, args.out, args.threads)
    print(json.dumps(record["weights"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
