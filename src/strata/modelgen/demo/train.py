"""Train the demo model from scratch and write `demo.gguf` and `demo-mmproj.gguf`.

    python -m strata.modelgen.demo.train --out DIR [--threads N] [--arch qwen35moe|qwen3moe] [--small]
                                           [--encoder MMPROJ] [--steps N] [--resume]

Steps: generate the training text and train the BPE vocabulary on it; teach the vision encoder on its own what
its pictures hold (a probe reads the shape, colour, place and counts from its rows), or, with `--encoder`, start
from a trained encoder file and teach only the probe to read it; then train the text model and the encoder
together on the answers of generated conversations (the loss covers only the tokens the assistant writes;
pictures enter as the encoder's rows in place of the `<|image_pad|>` run; the probe's loss keeps the rows
legible; a qwen35moe's MTP block learns beside the trunk to predict the token after next); then export.
Everything is seeded: the same configuration and thread count give the same files.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import pathlib
import random
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from strata.modelgen.demo import bpe, data, export
from strata.modelgen.demo.hybrid import HybridTextModel, rope_positions
from strata.modelgen.demo.model import TextModel, VisionModel
from strata.modelgen.hparams import HParams
from strata.modelgen.vocab import Vocab
from strata.modelgen.writer import chat_template
from strata.text.tokenizer import Tokenizer
from strata.vision.mmproj import VisionHParams
from strata.vision.preprocess import preprocess, token_budget

IMAGE_PAD = "<|image_pad|>"
IGNORE = -100
BALANCE_WEIGHT = 0.01  # load-balancing loss: keeps every expert in use without fighting the main loss
PROBE_WEIGHT = 0.3  # the probe's share of the loss in joint training: keeps what the encoder learnt alone
ARCHS = ("qwen35moe", "qwen3moe")
PROBE_STEPS = 100  # batches for the probe alone to learn to read a given encoder


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    text: HParams
    vision: VisionHParams
    steps: int
    batch: int
    lr: float
    warmup: int
    seed: int = 0
    vocab_examples: int = 20000  # conversations the BPE is trained on
    n_merges: int = 768
    max_len: int = 512  # longer conversations are skipped
    vision_steps: int = 0  # batches of the encoder's own lessons, before joint training
    vision_batch: int = 64  # pictures per such batch
    vision_lr: float = 2e-3
    encoder: str = ""  # the weights digest of the encoder file training starts from ("": the encoder's own lessons)
    probe_steps: int = 0  # batches of pictures the probe alone learns from before joint training (a given encoder)
    task_weights: dict[str, float] = dataclasses.field(default_factory=lambda: dict(data.TASK_WEIGHTS))


def vision_hparams(n_proj: int, n_embd: int = 64, n_layer: int = 3, tokens: int = 64) -> VisionHParams:
    """The encoder's shape; eps as the file stores it (float32), so a file's hyper-parameters compare equal.

    Every picture is resized to about `tokens` rows (the file's budget, minimum and maximum): small pictures are
    scaled up, so a shape always spans several patches."""
    pixels = tokens * (8 * 2) ** 2
    return VisionHParams(image_size=96, patch_size=8, n_embd=n_embd, n_ff=4 * n_embd, n_head=2, n_layer=n_layer,
                         eps=float(np.float32(1e-6)), n_proj=n_proj, merge=2, image_mean=(0.5, 0.5, 0.5),
                         image_std=(0.5, 0.5, 0.5), min_pixels=pixels, max_pixels=pixels, variant="strata")


_TEXT = HParams(n_layer=4, n_embd=128, n_head=4, n_head_kv=2, head_dim=32, n_ff=384, n_expert=8, n_expert_used=2,
                n_ff_exp=128, n_ctx_train=4096, rope_base=10_000.0, rms_eps=1e-6)
# Training leans on the tasks that take longest to learn (pictures, counts, sums); tool use and the other text
# tasks are learnt from fewer, longer conversations. The vocabulary is trained on the generator's own mix of them.
TRAIN_MIX = {"picture": 0.18, "count": 0.34, "arithmetic": 0.16, "capital": 0.04, "spelling": 0.05, "greeting": 0.03,
             "weather_call": 0.05, "weather_answer": 0.04, "add_call": 0.04, "add_answer": 0.03, "time_call": 0.02,
             "no_tool": 0.02}
FULL_QWEN3MOE = TrainConfig(text=_TEXT, vision=vision_hparams(_TEXT.n_embd), steps=7500, batch=32, lr=3e-3,
                            warmup=200, task_weights=TRAIN_MIX, vision_steps=3500)
# qwen35moe: Gated DeltaNet and gated attention layers in turn, so two layers attend: copying a prompt's text (an
# edit) takes an attention layer that finds where the text was, after a layer whose short convolution has put
# the token before into each position. A shared expert beside the routed ones, half of each head rotated, the
# MTP block. Edits take 8 points of the mix, from the tasks learnt with most room.
_HYBRID_TEXT = dataclasses.replace(_TEXT, n_ff=0, n_ff_shexp=128, full_attention_interval=2, ssm_conv_kernel=4,
                                   ssm_state_size=32, ssm_group_count=2, ssm_time_step_rank=4, ssm_inner_size=128,
                                   n_rot=16, rope_sections=(3, 3, 2, 0), n_nextn=1)
HYBRID_MIX = TRAIN_MIX | {"picture": 0.15, "arithmetic": 0.14, "capital": 0.03, "weather_call": 0.04,
                          "weather_answer": 0.03, "edit": 0.08}
# Its encoder starts from the qwen3moe demo's (`--encoder`: the demo-mmproj.gguf of the previous model, whose
# weights digest this is), the probe learning to read it in PROBE_STEPS batches; the joint phase as long as the
# qwen3moe's needed to count 90% of the time.
FULL_QWEN35MOE = TrainConfig(text=_HYBRID_TEXT, vision=vision_hparams(_TEXT.n_embd), steps=7500, batch=32, lr=3e-3,
                             warmup=200, task_weights=HYBRID_MIX,
                             encoder="sha256:26ef42f0ab7b202b545e1fcf267df599cac05a08227574424a6f99883b8215bf",
                             probe_steps=PROBE_STEPS)
FULL = FULL_QWEN35MOE  # the shipped model's
# Variants small enough to train in seconds: the tests' check that training is reproducible and exports.
_SMALL_TEXT = dataclasses.replace(_TEXT, n_layer=1, n_embd=64, n_head=2, n_head_kv=1, n_ff=192, n_expert=4,
                                  n_ff_exp=64)
SMALL_QWEN3MOE = TrainConfig(text=_SMALL_TEXT, vision=vision_hparams(_SMALL_TEXT.n_embd, n_embd=32, n_layer=1),
                             steps=4, batch=4, lr=3e-3, warmup=2, vocab_examples=500, n_merges=128, vision_steps=2,
                             vision_batch=4)
_SMALL_HYBRID_TEXT = dataclasses.replace(_HYBRID_TEXT, n_layer=2, n_embd=64, n_head=2, n_head_kv=1, n_expert=4,
                                         n_ff_exp=64, n_ff_shexp=64, ssm_state_size=16, ssm_group_count=1,
                                         ssm_time_step_rank=2, ssm_inner_size=32, n_rot=8, rope_sections=(2, 1, 1, 0))
SMALL_QWEN35MOE = dataclasses.replace(SMALL_QWEN3MOE, text=_SMALL_HYBRID_TEXT, task_weights=HYBRID_MIX)
CONFIGS = {("qwen3moe", False): FULL_QWEN3MOE, ("qwen3moe", True): SMALL_QWEN3MOE,
           ("qwen35moe", False): FULL_QWEN35MOE, ("qwen35moe", True): SMALL_QWEN35MOE}
SHIPPED_ARCH = "qwen35moe"


# --- data to tensors


@dataclasses.dataclass
class Encoded:
    ids: list[int]  # prompt then answer, every picture's pad expanded to its rows
    n_prompt: int
    pictures: list[np.ndarray]  # normalised pixels (3, H, W), in prompt order
    scenes: list[data.Scene]  # what each picture shows
    grids: list[tuple[int, int, int]]  # each picture's (first row's index in ids, rows, columns)


def picture_pixels(scene: data.Scene, hp: VisionHParams, max_tokens: int) -> np.ndarray:
    """The scene drawn and preprocessed as the encoder does with a budget of at most `max_tokens` rows."""
    min_tokens, max_tokens = token_budget(hp, max_tokens=max_tokens)
    return preprocess(data.draw(scene), hp, max_tokens, min_tokens).pixels


def encode(example: data.Example, tok: Tokenizer, template: str, hp: VisionHParams,
           max_tokens: int) -> Encoded:
    """Token ids of the prompt and answer, each `<|image_pad|>` widened to its picture's rows."""
    prompt, answer = data.render(example, template)
    pad = tok.require_id(IMAGE_PAD)
    unit = hp.unit
    ids, pictures, grids = [], [], []
    for i in tok.encode(prompt):
        if i != pad:
            ids.append(i)
            continue
        assert example.scene is not None  # a prompt with a picture has its scene
        pixels = picture_pixels(example.scene, hp, max_tokens)
        pictures.append(pixels)
        ny, nx = pixels.shape[1] // unit, pixels.shape[2] // unit
        grids.append((len(ids), ny, nx))
        ids += [pad] * (ny * nx)
    scenes = [example.scene] * len(pictures) if example.scene is not None else []
    return Encoded(ids + tok.encode(answer), len(ids), pictures, scenes, grids)


def _picture_budget(rng: random.Random, hp: VisionHParams) -> int:
    """Mostly the file's budget, as the server uses it; sometimes down to half as many rows (a server configured
    with a smaller `max_tokens`), so smaller grids are seen too. Fewer rows than that make shapes to count too small
    to tell apart, and training on them only costs the encoder."""
    full = token_budget(hp)[1]
    return full if rng.random() < 0.75 else rng.randint(max(1, full // 2), full)


def encoded_stream(config: TrainConfig, tok: Tokenizer, seed: int) -> Iterator[Encoded]:
    template = chat_template()
    rng = random.Random(seed + 1)
    for example in data.examples(seed, config.task_weights):
        item = encode(example, tok, template, config.vision, _picture_budget(rng, config.vision))
        if len(item.ids) <= config.max_len:
            yield item


@dataclasses.dataclass
class Batch:
    tokens: torch.Tensor  # (B, T) ids, padded
    targets: torch.Tensor  # (B, T) the next id where it is an answer token, else IGNORE
    image_mask: torch.Tensor  # (B, T) true at picture rows
    rope: torch.Tensor  # (B, T, 3) each token's RoPE position (t, h, w), as the engine gives a qwen35moe's
    pictures: list[np.ndarray]  # in row-major order of image_mask
    scenes: list[data.Scene]  # what each picture shows
    n_answer: int


def collate(items: Sequence[Encoded], pad_id: int, image_pad: int) -> Batch:
    length = max(len(item.ids) for item in items)
    tokens = torch.full((len(items), length), pad_id, dtype=torch.long)
    targets = torch.full((len(items), length), IGNORE, dtype=torch.long)
    rope = torch.empty((len(items), length, 3), dtype=torch.long)
    for row, item in enumerate(items):
        ids = torch.tensor(item.ids)
        tokens[row, :len(ids)] = ids
        targets[row, item.n_prompt - 1:len(ids) - 1] = ids[item.n_prompt:]
        rope[row] = rope_positions(length, item.grids)
    return Batch(tokens, targets, tokens == image_pad, rope, [p for item in items for p in item.pictures],
                 [s for item in items for s in item.scenes], int((targets != IGNORE).sum()))


def batch_stream(config: TrainConfig, tok: Tokenizer, pool: int = 8) -> Iterator[Batch]:
    """Batches of examples of similar length (a pool of `pool` batches sorted by length, then shuffled), so
    little of each batch is padding."""
    stream = encoded_stream(config, tok, config.seed)
    rng = random.Random(config.seed + 2)
    pad, image_pad = tok.require_id("<|endoftext|>"), tok.require_id(IMAGE_PAD)
    while True:
        items = sorted((next(stream) for _ in range(pool * config.batch)), key=lambda item: len(item.ids))
        groups = [items[i:i + config.batch] for i in range(0, len(items), config.batch)]
        rng.shuffle(groups)
        for group in groups:
            yield collate(group, pad, image_pad)


def picture_rows(vision: VisionModel, pictures: Sequence[np.ndarray]) -> list[torch.Tensor]:
    """The encoder's rows of each picture, in order; pictures of one size share a forward pass."""
    rows: list[torch.Tensor | None] = [None] * len(pictures)
    by_size: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(pictures):
        by_size.setdefault(p.shape, []).append(i)
    for indices in by_size.values():
        out = vision(torch.from_numpy(np.stack([pictures[i] for i in indices])))
        for i, r in zip(indices, out, strict=True):
            rows[i] = r
    return rows  # type: ignore[return-value]


# --- the encoder's own lessons

_KINDS = {kind: i for i, kind in enumerate(data.SHAPES)}
_COLOURS = {colour: i for i, colour in enumerate(data.COLOURS)}
_MOST = len(data.NUMBER_WORDS)  # counts 0..6


def _centres(scene: data.Scene, nx: int, ny: int) -> torch.Tensor:
    """Per row of an nx x ny grid: 1 + the kind of the shape centred in its cell, else 0. Shapes to count stand
    further apart than a cell's diagonal, so no cell holds two centres."""
    cells = torch.zeros(ny * nx, dtype=torch.long)
    for shape in scene.shapes:
        cells[min(ny - 1, int(shape.cy * ny)) * nx + min(nx - 1, int(shape.cx * nx))] = 1 + _KINDS[shape.kind]
    return cells


# Most cells hold no centre: their class counts for less, so marking centres is worth learning.
_CELL_WEIGHTS = torch.tensor([0.25] + [1.0] * len(_KINDS))


class Probe(nn.Module):
    """Reads a scene from a picture's rows, as the text model will: attention pooling (four learnt queries), then
    linear heads for the shape, colour and place of a lone shape, each kind's count and the total; and, row by row,
    which kind of shape is centred in the row's cell (what counting needs). Used in training only; its loss gives
    the encoder a direct signal, which it learns from far faster than through the text model.
    """

    def __init__(self, n: int, unit: int) -> None:
        super().__init__()
        self.unit = unit
        self.cell = nn.Linear(n, 1 + len(_KINDS))
        self.score = nn.Linear(n, 4)
        self.value = nn.Linear(n, n)  # each query pools a quarter of the width
        self.kind, self.colour, self.place = nn.Linear(n, len(_KINDS)), nn.Linear(n, len(_COLOURS)), nn.Linear(n, 3)
        self.counts, self.total = nn.Linear(n, len(_KINDS) * _MOST), nn.Linear(n, _MOST)

    def forward(self, rows: list[torch.Tensor], pictures: Sequence[np.ndarray],
                scenes: Sequence[data.Scene]) -> tuple[torch.Tensor, dict[str, float]]:
        """The mean cross-entropy of every head over the pictures, and each head's accuracy."""
        pooled = torch.stack([(torch.softmax(self.score(r), 0).unsqueeze(-1) * self.value(r).view(len(r), 4, -1))
                              .sum(0).reshape(-1) for r in rows])
        counts = torch.tensor([[sum(s.kind == k for s in scene.shapes) for k in data.SHAPES] for scene in scenes])
        total = torch.tensor([len(scene.shapes) for scene in scenes])
        heads = [(self.counts(pooled).view(-1, _MOST), counts.reshape(-1), "counts"),
                 (self.total(pooled), total, "total")]
        lone = [i for i, scene in enumerate(scenes) if len(scene.shapes) == 1]
        if lone:
            shapes = [scenes[i].shapes[0] for i in lone]
            alone = pooled[lone]
            heads += [(self.kind(alone), torch.tensor([_KINDS[s.kind] for s in shapes]), "kind"),
                      (self.colour(alone), torch.tensor([_COLOURS[s.colour] for s in shapes]), "colour"),
                      (self.place(alone), torch.tensor([min(2, int(s.cx * 3)) for s in shapes]), "place")]
        cells = torch.cat([_centres(scene, p.shape[2] // self.unit, p.shape[1] // self.unit)
                           for scene, p in zip(scenes, pictures, strict=True)])
        cell_logits = self.cell(torch.cat(rows))
        loss = (sum(F.cross_entropy(logits, target) for logits, target, _ in heads)
                + F.cross_entropy(cell_logits, cells, weight=_CELL_WEIGHTS)) / (len(heads) + 1)
        accuracy = {name: (logits.argmax(-1) == target).float().mean().item() for logits, target, name in heads}
        centred = cells > 0
        accuracy["centres"] = (cell_logits.argmax(-1)[centred] == cells[centred]).float().mean().item()
        return loss, accuracy


def picture_batches(config: TrainConfig) -> Iterator[tuple[list[np.ndarray], list[data.Scene]]]:
    """Batches of `vision_batch` pictures of either picture task, with the budgets joint training uses."""
    rng = random.Random(config.seed + 3)
    while True:
        scenes = [data.picture_scene(rng) for _ in range(config.vision_batch)]
        yield [picture_pixels(s, config.vision, _picture_budget(rng, config.vision)) for s in scenes], scenes


def schedule(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then a cosine decay to a tenth."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def optimizer(params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    # Norm weights and biases are not decayed.
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.98), eps=1e-8)


def teach_vision(config: TrainConfig, vision: VisionModel, probe: Probe, log: bool = True) -> None:
    """The encoder's own lessons: `vision_steps` batches of pictures, the probe's loss only. With a given encoder
    (`config.encoder`), `probe_steps` batches in which only the probe learns, reading the encoder as it is."""
    given = bool(config.encoder)
    steps = config.probe_steps if given else config.vision_steps
    params = [*probe.parameters()] if given else [*vision.parameters(), *probe.parameters()]
    opt = optimizer(params, config.vision_lr)
    batches = picture_batches(config)
    start, total = time.monotonic(), 0.0
    for step in range(steps):
        pictures, scenes = next(batches)
        for group in opt.param_groups:
            group["lr"] = schedule(step, steps, config.vision_lr, steps // 20 + 1)
        with torch.no_grad() if given else contextlib.nullcontext():
            rows = picture_rows(vision, pictures)
        loss, accuracy = probe(rows, pictures, scenes)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total += loss.item()
        if log and (step + 1) % 50 == 0:
            print(f"{'probe' if given else 'vision'} step {step + 1}/{steps} loss {total / 50:.4f} "
                  + " ".join(f"{k} {v:.2f}" for k, v in accuracy.items())
                  + f" {time.monotonic() - start:.0f}s", flush=True)
            total = 0.0


# --- training


def build_vocab(config: TrainConfig) -> Vocab:
    """The BPE trained on the generator's own mix (`data.TASK_WEIGHTS`) of the tasks the configuration trains."""
    template = chat_template()
    mix = {task: weight for task, weight in data.TASK_WEIGHTS.items() if task in config.task_weights}
    texts = ("".join(data.render(ex, template))
             for ex in itertools.islice(data.examples(config.seed + 7, mix), config.vocab_examples))
    return bpe.train_vocab(texts, config.n_merges)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """Where and how often the joint phase saves everything it needs to go on: the three models, the optimizer's
    moments, torch's generator and the step. A run resumed from it writes the same files as one never stopped
    (the conversations are a seeded stream, drawn again up to the step)."""

    path: pathlib.Path
    every: int = 500


def save_checkpoint(state: dict, path: pathlib.Path) -> None:
    """Write `state` beside `path` and rename it over it, so that a run stopped while saving keeps the last one."""
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    partial.replace(path)


def answer_losses(text: TextModel | HybridTextModel, rows: list[torch.Tensor],
                  batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The text model's cross-entropy on the batch's answer tokens, its routers' balance loss, and a qwen35moe's
    MTP block's cross-entropy on the token after next (zero for a qwen3moe)."""
    select = batch.targets != IGNORE
    if isinstance(text, HybridTextModel):
        x = text.embed(batch.tokens, torch.cat(rows) if rows else None, batch.image_mask)
        hidden, balance = text.trunk(x, batch.rope)
        logits = hidden[select] @ text.output.T
        # the block's pair at p predicts the token at p + 2: the trunk's target at p + 1
        drafts, draft_balance = text.draft_logits(hidden, x, batch.rope, select[:, 1:])
        draft_loss = F.cross_entropy(drafts, batch.targets[:, 1:][select[:, 1:]])
        balance = balance + draft_balance  # each router's own loss: the block's reads only its inputs
    else:
        logits, balance = text(batch.tokens, torch.cat(rows) if rows else None, batch.image_mask, select=select)
        draft_loss = logits.new_zeros(())
    return F.cross_entropy(logits, batch.targets[select]), balance, draft_loss


def train(config: TrainConfig, tok: Tokenizer, log: bool = True, checkpoint: Checkpoint | None = None,
          vision: VisionModel | None = None, resume: bool = False) -> tuple[TextModel | HybridTextModel, VisionModel]:
    """Train both models from their seeded initialisation (the encoder: from `vision` where the configuration
    names a given one): the encoder's own lessons, then `config.steps` batches of conversations. With `resume`
    and a saved `checkpoint`, the joint phase goes on from it instead."""
    torch.manual_seed(config.seed)
    hybrid = config.text.hybrid
    text = (HybridTextModel if hybrid else TextModel)(config.text, tok.n_vocab, seed=config.seed)
    if vision is None:
        vision = VisionModel(config.vision, seed=config.seed)
    probe = Probe(config.text.n_embd, config.vision.unit)
    saved = torch.load(checkpoint.path, weights_only=True) if resume and checkpoint and checkpoint.path.exists() \
        else None
    if saved is None:
        teach_vision(config, vision, probe, log)
    # The MTP block learns from its own loss only (it reads the trunk's states, embeddings and head without
    # training them), clipped on its own: the trunk trains as it would without it.
    draft = [*text.mtp.parameters()] if isinstance(text, HybridTextModel) else []
    params = [*(p for name, p in text.named_parameters() if not name.startswith("mtp.")), *vision.parameters(),
              *probe.parameters()]
    opt = optimizer(params + draft, config.lr)
    batches = batch_stream(config, tok)
    first = 0
    if saved is not None:
        if saved["config"] != config_record(config):
            raise ValueError(f"{checkpoint.path if checkpoint else ''} was saved by another configuration")
        for model, key in ((text, "text"), (vision, "vision"), (probe, "probe"), (opt, "optimizer")):
            model.load_state_dict(saved[key])
        torch.set_rng_state(saved["rng"])
        first = saved["step"]
        for _ in range(first):
            next(batches)
        if log:
            print(f"resumed at step {first}", flush=True)
    start, seen, total, total_draft = time.monotonic(), 0, 0.0, 0.0
    for step in range(first, config.steps):
        batch = next(batches)
        lr = schedule(step, config.steps, config.lr, config.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        rows = picture_rows(vision, batch.pictures)
        loss, balance, draft_loss = answer_losses(text, rows, batch)
        total_draft += draft_loss.item()
        read = probe(rows, batch.pictures, batch.scenes)[0] if rows else loss.new_zeros(())
        (loss + BALANCE_WEIGHT * balance + PROBE_WEIGHT * read + draft_loss).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        if draft:
            torch.nn.utils.clip_grad_norm_(draft, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen += batch.tokens.numel()
        total += loss.item()
        if log and (step + 1) % 50 == 0:
            print(f"step {step + 1}/{config.steps} loss {total / 50:.4f} "
                  + (f"draft {total_draft / 50:.4f} " if draft else "")
                  + f"probe {read.item():.3f} balance {balance.item():.3f} lr {lr:.2e} "
                  f"{seen / (time.monotonic() - start):.0f} tok/s {time.monotonic() - start:.0f}s", flush=True)
            total, total_draft = 0.0, 0.0
        if checkpoint and (step + 1) % checkpoint.every == 0:
            save_checkpoint({"step": step + 1, "config": config_record(config), "text": text.state_dict(),
                             "vision": vision.state_dict(), "probe": probe.state_dict(),
                             "optimizer": opt.state_dict(), "rng": torch.get_rng_state()}, checkpoint.path)
    return text, vision


def config_record(config: Any) -> dict:
    """A configuration dataclass as `demo.json` records it (JSON's types: tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


def run(config: TrainConfig, out: pathlib.Path, threads: int, log: bool = True,
        encoder: pathlib.Path | None = None, checkpoint_every: int | None = 500, resume: bool = False) -> dict:
    """Train with `config` on `threads` threads and write the two GGUF files and `demo.json` into `out`; a
    configuration that starts from a given encoder reads it from `encoder`. Every `checkpoint_every` joint steps
    the state goes to `demo.ckpt` in `out` (None: never), which `resume` goes on from. `train_seconds` counts
    this run's time only.

    Raises:
        ValueError: the configuration names a given encoder and `encoder` is not that file.
    """
    vision = None
    if config.encoder:
        if encoder is None or export.weights_digest(encoder) != config.encoder:
            raise ValueError(f"this configuration starts from the encoder file whose weights digest is "
                             f"{config.encoder}; {encoder} is not it")
        vision = export.read_vision(encoder)
    torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    vocab = build_vocab(config)
    with tempfile.TemporaryDirectory() as scratch:
        tok = bpe.tokenizer_of(vocab, scratch)
    checkpoint = Checkpoint(out / "demo.ckpt", checkpoint_every) if checkpoint_every else None
    text, vision = train(config, tok, log, checkpoint=checkpoint, vision=vision, resume=resume)
    text_path = export.write_text(out / "demo.gguf", text, vocab)
    vision_path = export.write_vision(out / "demo-mmproj.gguf", vision)
    record = {
        "config": config_record(config),
        "threads": threads,
        "train_seconds": round(time.monotonic() - started),
        "weights": {text_path.name: export.weights_digest(text_path),
                    vision_path.name: export.weights_digest(vision_path)},
    }
    (out / "demo.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def given_encoder(config: TrainConfig, path: pathlib.Path) -> TrainConfig:
    """`config` starting from the encoder file at `path`: its own lessons skipped, PROBE_STEPS batches for the probe
    to learn to read it."""
    return dataclasses.replace(config, encoder=export.weights_digest(path), vision_steps=0,
                               probe_steps=PROBE_STEPS if config.vision_steps >= PROBE_STEPS else config.vision_steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m strata.modelgen.demo.train", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=pathlib.Path, help="directory for the model files")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads: results depend on it (the shipped files were trained on the 1 "
                             "demo.json records, the fastest on a busy machine, where two threads wait on each "
                             "other)")
    parser.add_argument("--arch", choices=ARCHS, default=SHIPPED_ARCH, help="the text model's architecture")
    parser.add_argument("--steps", type=int, default=None, help="override the number of training steps")
    parser.add_argument("--small", action="store_true", help="the seconds-long variant the tests train")
    parser.add_argument("--encoder", type=pathlib.Path, default=None,
                        help="start from this encoder file (an earlier demo-mmproj.gguf) instead of teaching one "
                             "from scratch; the shipped configuration names the one it started from")
    parser.add_argument("--resume", action="store_true",
                        help="go on from the last checkpoint in --out (demo.ckpt, saved every 500 joint steps) of "
                             "the same configuration; the files are the same as an unstopped run's")
    args = parser.parse_args(argv)
    config = CONFIGS[args.arch, args.small]
    if args.encoder is not None and not config.encoder:
        config = given_encoder(config, args.encoder)
    if args.steps is not None:
        config = dataclasses.replace(config, steps=args.steps)
    record = run(config, args.out, args.threads, encoder=args.encoder, resume=args.resume)
    print(json.dumps(record["weights"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
