"""What the end-to-end picture tests of Qwen-style models (Qwen3-VL, Qwen3.5) share: one picture question asked
through the openai client (of a server in the process, or of a `strata serve` command), the picture as the encoder
process sees it, and the checkpoint's own greedy answer.

Both tests use the same picture, patch size, merge size and answer length (the constants below)."""

from __future__ import annotations

import base64
import os
import pathlib
import re
import signal
import subprocess
import sys

import numpy as np
import openai
import torch

import strata
from strata.vision.load import open_encoder
from strata.vision.preprocess import load_image, preprocess, token_budget

from .conftest import noise_png, qwen_patches

PATCH, MERGE = 16, 2
MAX_TOKENS = 8  # answer tokens
PICTURE = noise_png(160, 96, seed=7)  # 10 x 6 patches, 5 x 3 merged tokens: no resize, not square
QUESTION = [{"role": "user", "content": [
    {"type": "text", "text": "What is in the picture?"},
    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(PICTURE).decode()}}]}]


def ask(url: str) -> tuple[str, int]:
    """The greedy answer to QUESTION and the prompt's token count, through the openai client."""
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120) as client:
        reply = client.chat.completions.create(model="m", max_tokens=MAX_TOKENS, temperature=0,
                                               reasoning_effort="none", messages=QUESTION)
    return reply.choices[0].message.content or "", reply.usage.prompt_tokens


def ask_strata_serve(text: pathlib.Path, mmproj: pathlib.Path) -> tuple[str, int, str]:
    """`ask` of a `strata serve` command on the two files (its own engine and encoder process), and its startup
    lines up to the one that names its address."""
    command = [sys.executable, "-m", "strata.cli", "serve", "--model", str(text), "--vision.mmproj", str(mmproj),
               "--vision.threads", "1", "--threads", "2", "--context", "512", "--port", "0"]
    env = {key: value for key, value in os.environ.items() if not key.startswith("STRATA_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pathlib.Path(strata.__file__).parents[1]),
                                                      env.get("PYTHONPATH")]))
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert process.stdout is not None
    try:
        lines: list[str] = []
        while not (found := re.search(r"serving \S+ on (http://\S+)", lines[-1] if lines else "")):
            line = process.stdout.readline()
            assert line, f"strata serve ended: {lines}"
            lines.append(line)
        answer, n_prompt = ask(found.group(1))
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        process.stdout.close()
    return answer, n_prompt, "".join(lines)


def encoder_pixels(mmproj: pathlib.Path) -> np.ndarray:
    """The picture as the encoder process sees it: normalised (3, H, W) at its token grid."""
    hp = open_encoder(mmproj, threads=1).hp
    min_tokens, max_tokens = token_budget(hp)
    return preprocess(load_image(PICTURE), hp, max_tokens, min_tokens).pixels


def greedy_reference(model: torch.nn.Module, ids: list[int], pixels: np.ndarray) -> tuple[list[int], list[float]]:
    """The checkpoint's greedy tokens after `ids` (the picture's pads expanded) and each step's gap between its top
    two logits relative to the largest, from full forward passes with the pixels patched as Qwen's processor does."""
    _, height, width = pixels.shape
    patches = torch.from_numpy(qwen_patches(pixels, PATCH, MERGE))
    grid = torch.tensor([[1, height // PATCH, width // PATCH]])
    tokens, gaps = list(ids), []
    for _ in range(MAX_TOKENS):
        input_ids = torch.tensor([tokens])
        with torch.no_grad():
            logits = model(input_ids=input_ids, pixel_values=patches, image_grid_thw=grid,
                           mm_token_type_ids=(input_ids == model.config.image_token_id).int()).logits[0, -1]
        top = torch.topk(logits, 2).values
        gaps.append(float((top[0] - top[1]) / logits.abs().max()))
        tokens.append(int(logits.argmax()))
    return tokens[len(ids):], gaps
