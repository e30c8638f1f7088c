"""Scoring the demo model on held-out conversations, greedily, through the C engine with the `strata-vision`
process, and through the torch model holding the same files' weights.

The held-out items come from the training generator with seeds training never uses. Scores:
  colour_shape  a single-shape picture described: its colour and shape named
  count         a count of shapes: the right number word
  arithmetic    a sum, difference or product in the trained range: the right number
  tool_call     a `<tool_call>` holding valid JSON with the right name and arguments
  tool_answer   after a tool's result, an answer quoting it
  facts         capitals, spelling and reversing, greetings
  edit          a short piece of code given back with one name changed: exactly the expected code
  edit_long     the same with a module of three to nine such functions
  thinking      every item: a non-empty `<think>` section first when thinking is on, none when it is off
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import random
import re
import subprocess
import sys
from collections.abc import Callable, Iterable

import numpy as np
import torch

from strata.engine_cffi import Engine
from strata.modelgen.demo import data
from strata.modelgen.demo.export import read_text, read_vision
from strata.modelgen.demo.hybrid import HybridTextModel, rope_positions
from strata.modelgen.demo.model import TextModel, VisionModel
from strata.modelgen.demo.train import IMAGE_PAD
from strata.pictures.rows import PictureRows
from strata.text.tokenizer import Tokenizer
from strata.vision import protocol
from strata.vision.preprocess import load_image, preprocess, token_budget

HELD_OUT_SEED = 1_000_003  # training draws its examples from seeds 0..10
SCORES = {
    "colour_shape": ("picture",), "count": ("count",), "arithmetic": ("arithmetic",),
    "tool_call": ("weather_call", "add_call", "time_call"), "tool_answer": ("weather_answer", "add_answer"),
    "facts": ("capital", "spelling", "greeting", "no_tool"), "edit": ("edit",), "edit_long": ("edit_long",),
}
MAX_NEW_TOKENS = 192  # an edit's code with its think section
LONG_NEW_TOKENS = 1024  # a long edit's
N_CTX = 2048  # the engine's context: a long edit's prompt and LONG_NEW_TOKENS


def new_tokens(item: Item) -> int:
    """The most tokens generated for the item: enough for its answer and then some."""
    return LONG_NEW_TOKENS if item.score == "edit_long" else MAX_NEW_TOKENS


@dataclasses.dataclass
class Item:
    score: str
    example: data.Example
    picture: pathlib.Path | None  # PNG of the example's scene


def held_out(n: int, workdir: pathlib.Path, seed: int = HELD_OUT_SEED,
             sizes: dict[str, int] | None = None) -> list[Item]:
    """n items per score (`sizes`: other numbers for some), pictures written as PNG files into `workdir`."""
    rng = random.Random(seed)
    items: list[Item] = []
    for score, tasks in SCORES.items():
        while sum(item.score == score for item in items) < (sizes or {}).get(score, n):
            example = data.make_example(rng.choice(tasks), rng)
            if score == "colour_shape" and " " not in example.check["text"]:
                continue  # a colour-only or shape-only question
            picture = None
            if example.scene is not None:
                picture = workdir / f"{len(items):05d}.png"
                data.draw(example.scene).save(picture)
            items.append(Item(score, example, picture))
    return items


# --- scoring


def split_thinking(output: str) -> tuple[str | None, str]:
    """(reasoning or None, answer) of a generated text."""
    if output.startswith("<think>") and "</think>" in output:
        reasoning, answer = output[len("<think>"):].split("</think>", 1)
        return reasoning.strip(), answer.strip()
    return None, output.strip()


def tool_call_of(answer: str) -> dict | None:
    """The one `<tool_call>` of an answer as parsed JSON, or None when it is missing or malformed."""
    match = re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", answer, re.DOTALL)
    if not match:
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError:
        return None
    return call if isinstance(call, dict) and set(call) == {"name", "arguments"} else None


def correct(item: Item, output: str) -> bool:
    """Whether the output answers the item's question (thinking aside)."""
    _, answer = split_thinking(output)
    check = item.example.check
    if "tool" in check:
        call = tool_call_of(answer)
        return call is not None and call["name"] == check["tool"] and call["arguments"] == check["arguments"]
    return re.search(rf"(?<![\w-]){re.escape(check['text'])}(?![\w-])", answer, re.IGNORECASE) is not None


def thinking_obeyed(item: Item, output: str) -> bool:
    reasoning, _ = split_thinking(output)
    if item.example.thinking:
        return bool(reasoning)
    return "<think>" not in output and "</think>" not in output


# --- the two runners


def prompt_ids(item: Item, tok: Tokenizer, template: str) -> list[int]:
    prompt, _ = data.render(item.example, template)
    return tok.encode(prompt)


def expand(ids: list[int], pad: int, rows: PictureRows | torch.Tensor | None) -> tuple[list[int], int]:
    """ids with the picture's pad token widened to its rows, and the index of the first row."""
    if rows is None:
        return ids, -1
    at = ids.index(pad)
    return ids[:at] + [pad] * len(rows) + ids[at + 1:], at


class VisionProcess:
    """The `strata-vision` worker as a subprocess, encoding files with `ENC` jobs."""

    def __init__(self, mmproj: pathlib.Path, max_tokens: int | None, threads: int) -> None:
        argv = [sys.executable, "-m", "strata.vision.worker", "--mmproj", os.fspath(mmproj), "--threads", str(threads)]
        argv += ["--max-tokens", str(max_tokens)] if max_tokens else []
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.process.stdin is not None and self.process.stdout is not None  # PIPE both
        self.stdin, self.stdout = self.process.stdin, self.process.stdout
        ready = self.stdout.readline().decode()
        if not ready.startswith("READY "):
            raise RuntimeError(f"strata-vision did not start: {ready.strip()}")

    def encode(self, picture: pathlib.Path) -> PictureRows:
        out = picture.with_suffix(".sve")
        self.stdin.write(f"ENC {json.dumps(os.fspath(picture))} {json.dumps(os.fspath(out))}\n".encode())
        self.stdin.flush()
        reply = self.stdout.readline().decode()
        if not reply.startswith("OK "):
            raise RuntimeError(f"strata-vision: {reply.strip()}")
        header, rows = protocol.parse_sve(out.read_bytes())
        return PictureRows(rows, header.nx)

    def close(self) -> None:
        self.stdin.write(b"QUIT\n")
        self.stdin.close()
        self.process.wait(timeout=30)
        self.stdout.close()


def engine_runner(engine: Engine, vision: VisionProcess, tok: Tokenizer) -> Callable[[list[int], Item], str]:
    pad = tok.require_id(IMAGE_PAD)

    def run(ids: list[int], item: Item) -> str:
        rows = vision.encode(item.picture) if item.picture else None
        ids, at = expand(ids, pad, rows)
        engine.keep(0)
        logits = engine.eval(ids, embeds=[(at, rows)] if rows is not None else None)
        out: list[int] = []
        while len(out) < new_tokens(item) and (not out or out[-1] not in tok.eos_ids):
            out.append(int(np.argmax(logits)))
            logits = engine.eval([out[-1]])
        return tok.decode(t for t in out if t not in tok.eos_ids)

    return run


def torch_runner(text: TextModel | HybridTextModel, vision: VisionModel, tok: Tokenizer,
                 max_tokens: int | None) -> Callable[[list[int], Item], str]:
    pad = tok.require_id(IMAGE_PAD)
    min_tokens, max_tokens = token_budget(vision.hp, max_tokens=max_tokens)

    @torch.no_grad()
    def run(ids: list[int], item: Item) -> str:
        rows, grids = None, []
        if item.picture:
            picture = preprocess(load_image(item.picture), vision.hp, max_tokens, min_tokens)
            rows = vision(torch.from_numpy(picture.pixels[None]))[0]
            unit = vision.hp.unit
            grids = [(ids.index(pad), picture.pixels.shape[1] // unit, picture.pixels.shape[2] // unit)]
        ids, _ = expand(ids, pad, rows)
        out: list[int] = []
        while len(out) < new_tokens(item) and (not out or out[-1] not in tok.eos_ids):
            tokens = torch.tensor([ids + out])
            mask = tokens == pad if rows is not None else None
            if isinstance(text, HybridTextModel):  # positions as the engine gives a picture's rows
                logits, _ = text(tokens, rows, mask, rope=rope_positions(tokens.shape[1], grids)[None])
            else:
                logits, _ = text(tokens, rows, mask)
            out.append(int(logits[0, -1].argmax()))
        return tok.decode(t for t in out if t not in tok.eos_ids)

    return run


# --- the evaluation


@dataclasses.dataclass
class Result:
    item: Item
    engine: str
    torch: str | None


def evaluate(model: pathlib.Path, mmproj: pathlib.Path, items: Iterable[Item], threads: int = 1, kv: str = "f16",
             max_tokens: int | None = None, with_torch: bool = True) -> list[Result]:
    """Greedy outputs of every item through the engine (and the torch model of the same files); pictures get the
    encoder file's budget unless `max_tokens` lowers it."""
    tok = Tokenizer.from_gguf(model)
    vision = VisionProcess(mmproj, max_tokens, threads)
    engine = Engine.load(os.fspath(model), n_ctx=N_CTX, threads=threads, kv=kv)
    try:
        by_engine = engine_runner(engine, vision, tok)
        by_torch = torch_runner(read_text(model), read_vision(mmproj), tok, max_tokens) if with_torch else None
        template = tok.chat_template
        if template is None:
            raise ValueError(f"{model} has no chat template")
        results = []
        for item in items:
            ids = prompt_ids(item, tok, template)
            results.append(Result(item, by_engine(ids, item), by_torch(ids, item) if by_torch else None))
        return results
    finally:
        engine.close()
        vision.close()


def summary(results: list[Result]) -> dict[str, dict[str, float]]:
    """Per score: the fraction correct through the engine and through torch, and their agreement; then
    `thinking` over every item and `all` agreement."""
    out: dict[str, dict[str, float]] = {}

    def row(subset: list[Result], ok: Callable[[Item, str], bool]) -> dict[str, float]:
        line = {"n": len(subset), "engine": float(np.mean([ok(r.item, r.engine) for r in subset]))}
        if subset[0].torch is not None:
            line["torch"] = float(np.mean([ok(r.item, r.torch) for r in subset if r.torch is not None]))
            line["agreement"] = float(np.mean([r.engine == r.torch for r in subset]))
        return line

    for score in SCORES:
        subset = [r for r in results if r.item.score == score]
        if subset:
            out[score] = row(subset, correct)
    out["thinking"] = row(results, thinking_obeyed)
    return out
