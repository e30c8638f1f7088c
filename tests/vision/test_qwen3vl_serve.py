"""A picture question to a Qwen3-VL model end to end: a random `Qwen3VLForConditionalGeneration`, and a random
`Qwen3VLMoeForConditionalGeneration` (the architecture of Qwen3-VL-30B-A3B), each with Qwen's real tokenizer and the
Qwen3 chat template, turned into a text file and an mmproj file by llama.cpp's own converter, served by hypercorn
with the real engine and a real `strata-vision` process (in-process, where the engine's calls are recorded, and as
the `strata serve` command), asked through the official client.

The answer (greedy) must be the checkpoint's own greedy answer to the same prompt ids and picture pixels, computed
by transformers over the whole model: its vision tower, M-RoPE positions and deepstack features included. Random
weights can leave two tokens nearly tied, where 1e-6 of float rounding may pick either: tokens are compared up to
the first step whose top two logits are closer than `TIE` of the largest, and at least `MIN_COMPARED` must be.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest
import torch
from conftest import live_server, server_config
from fakes import RecordingEngine
from llama_cpp_convert import convert, save_qwen3vl
from transformers import (
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

from strata.engine_cffi import Engine, PictureRows
from strata.modelgen.writer import chat_template
from strata.text.tokenizer import Tokenizer

from .picture_question import MERGE, PATCH, ask, ask_strata_serve, encoder_pixels, greedy_reference

pytestmark = pytest.mark.timeout(600)

N_TEXT = 64
TIE, MIN_COMPARED = 2e-5, 4  # TIE: 30x the engine's logits error against transformers (~6e-7)


_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1}
MODELS = {"qwen3vl": (Qwen3VLConfig, Qwen3VLForConditionalGeneration, {}),
          "qwen3vlmoe": (Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration, _MOE)}


def _checkpoint(arch: str) -> torch.nn.Module:
    config_class, model_class, extra = MODELS[arch]
    config = config_class(
        vision_config={"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": PATCH,
                       "spatial_merge_size": MERGE, "temporal_patch_size": 2, "out_hidden_size": N_TEXT,
                       "num_position_embeddings": 64, "deepstack_visual_indexes": [0, 1]},
        text_config={"hidden_size": N_TEXT, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 151936, "rms_norm_eps": 1e-6,
                     "max_position_embeddings": 4096,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [8, 4, 4],
                                         "mrope_interleaved": True}, **extra})
    config.vision_config._attn_implementation = config.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():  # weights of order one: the picture and the positions change the answer
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif param.ndim == 1:
                param.normal_(0, 0.1)
            elif "embed_tokens" in name or "pos_embed" in name:
                param.normal_(0, 1)
            else:  # 1 / sqrt(fan-in); packed experts (experts, n_out, n_in)
                param.normal_(0, param.shape[-1] ** -0.5 if param.ndim == 3 else param[0].numel() ** -0.5)
    return model.float().eval()


@pytest.fixture(scope="module", params=list(MODELS))
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
              qwen_tokenizer_dir: pathlib.Path) -> tuple:
    arch = request.param
    hf_dir = tmp_path_factory.mktemp(f"{arch}-serve-hf")
    model = _checkpoint(arch)
    save_qwen3vl(model, hf_dir, qwen_tokenizer_dir)
    tokenizer_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = chat_template()  # renders a picture as <|vision_start|><|image_pad|>...
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (hf_dir / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "patch_size": PATCH, "merge_size": MERGE, "temporal_patch_size": 2}))
    text = convert(hf_dir, hf_dir.parent / f"{arch}.gguf", "f32")
    mmproj = convert(hf_dir, hf_dir.parent / f"{arch}-mmproj.gguf", "f32", "--mmproj")
    shutil.rmtree(hf_dir)
    return model, text, mmproj


@pytest.fixture(scope="module")
def served(converted: tuple) -> tuple:
    """The question through an in-process server whose engine records its calls: the answer, the prompt ids and
    picture rows the engine got, and the checkpoint's greedy answer to those ids with the picture's pixels."""
    model, text, mmproj = converted
    tokenizer = Tokenizer.from_gguf(text)
    config = server_config(model=str(text), context=512, vision={"mmproj": str(mmproj), "threads": 1})
    with Engine.load(text, n_ctx=512, threads=2) as real:
        engine = RecordingEngine(real)
        with live_server(config, engine, tokenizer) as server:
            answer, n_prompt = ask(server.url)
        width = real.picture_width
    prompt, embeds = engine.calls[0]
    expected, gaps = greedy_reference(model, prompt, encoder_pixels(mmproj))
    n = next((i + 1 for i, gap in enumerate(gaps) if gap < TIE), len(gaps))  # up to the first near-tie
    assert n >= MIN_COMPARED, f"the reference's top logits are nearly tied at step {n - 1}: {gaps}"
    return tokenizer, answer, n_prompt, prompt, embeds, width, tokenizer.decode(expected[:n])


def test_a_picture_question_gets_the_checkpoints_answer(served: tuple) -> None:
    tokenizer, answer, n_prompt, prompt, embeds, width, expected = served
    ((index, rows),) = embeds
    assert isinstance(rows, PictureRows) and (rows.nx, len(rows)) == (5, 15)  # the grid reached the engine
    assert rows.shape[1] == width == 3 * N_TEXT  # main rows and two deepstack slices
    assert prompt[index - 1] == tokenizer.token_to_id("<|vision_start|>")
    assert answer.startswith(expected), (answer, expected)
    assert n_prompt == len(prompt)


def test_strata_serve_answers_it_too(converted: tuple, served: tuple) -> None:
    """The `strata serve` command with the two files: the same answer (its own engine and encoder process)."""
    _, text, mmproj = converted
    *_, prompt, _, _, expected = served
    answer, n_prompt, _ = ask_strata_serve(text, mmproj)
    assert answer.startswith(expected), (answer, expected)
    assert n_prompt == len(prompt)


def test_the_answer_needs_the_picture(converted: tuple) -> None:
    """The same prompt with other pixels gets another answer: the comparison above sees the picture."""
    model, _, mmproj = converted
    pixels = encoder_pixels(mmproj)
    image_id = model.config.image_token_id
    ids = [151644, 872, 198, 151652, *[image_id] * 15, 151653, 151645, 198, 151644, 77091, 198]
    first, _ = greedy_reference(model, ids, pixels)
    other, _ = greedy_reference(model, ids, np.ascontiguousarray(pixels[:, ::-1, :]))
    assert first != other

