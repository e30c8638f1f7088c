"""A picture question to a Qwen3.5/3.6 model end to end: a random `Qwen3_5MoeForConditionalGeneration` (the
architecture of Qwen3.5-35B-A3B) and a random `Qwen3_5ForConditionalGeneration`, each with Qwen's real tokenizer and
the Qwen3.5 chat template, saved as published checkpoints are (the last decoder layer as the MTP block), turned into
a text file and an mmproj file by llama.cpp's own converter, served by hypercorn with the real engine and a real
`strata-vision` process (in-process, where the engine's calls are recorded, and as the `strata serve` command),
asked through the official client.

The answer (greedy) must be the checkpoint's own greedy answer to the same prompt ids and picture pixels, computed
by transformers over the whole model (the saved checkpoint reloaded, MTP block aside): its vision tower, Gated
DeltaNet layers and gated attention with multi-axis RoPE on a quarter of each head. Random weights can leave two
tokens nearly tied: tokens are compared up to the first step whose top two logits are closer than `TIE` of the
largest, and at least `MIN_COMPARED` must be.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import numpy as np
import pytest
import torch
from conftest import live_server, server_config
from fakes import RecordingEngine
from llama_cpp_convert import convert, save_qwen35
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
)

from strata.engine_cffi import Engine, PictureRows
from strata.modelgen.vocab import ENDOFTEXT
from strata.modelgen.writer import chat_template
from strata.text.tokenizer import Tokenizer

from .conftest import qwen_patches
from .picture_question import MERGE, PATCH, ask, ask_strata_serve, encoder_pixels, greedy_reference

pytestmark = pytest.mark.timeout(600)

N_TEXT = 64
TIE, MIN_COMPARED = 1e-3, 4  # TIE: 7x what the engine's logits error (<= 7e-5 here) can do to a gap

# DeltaNet x3, gated attention, then the layer that becomes the MTP block; head_dim 64 with a quarter rotated:
# 8 frequency pairs in sections (t, h, w) = (4, 2, 2), interleaved
_TEXT = {"hidden_size": N_TEXT, "num_hidden_layers": 5, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
         "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "vocab_size": 151936, "rms_norm_eps": 1e-6,
         "max_position_embeddings": 4096, "layer_types": ["linear_attention"] * 3 + ["full_attention"] * 2,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                             "mrope_section": [4, 2, 2], "mrope_interleaved": True}}
# the picture tokens of Qwen's tokenizer here (Qwen3.5's own, larger vocabulary puts them at 248053...)
_TOKENS = {"vision_start_token_id": 151652, "vision_end_token_id": 151653, "image_token_id": 151655,
           "video_token_id": 151656}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
MODELS = {"qwen35moe": (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, _MOE),
          "qwen35": (Qwen3_5Config, Qwen3_5ForConditionalGeneration, {"intermediate_size": 96})}


def _checkpoint(arch: str) -> torch.nn.Module:
    config_class, model_class, extra = MODELS[arch]
    config = config_class(
        vision_config={"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": PATCH,
                       "spatial_merge_size": MERGE, "temporal_patch_size": 2, "out_hidden_size": N_TEXT,
                       "num_position_embeddings": 64},
        text_config={**_TEXT, **extra}, **_TOKENS)
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():  # weights of order one: the picture and the positions change the answer
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):  # about their init: 1, or 0 where the scale is 1 + w
                param.add_(0.1 * torch.randn_like(param))
            elif param.ndim == 1:
                param.normal_(0, 0.1)
            elif "embed_tokens" in name or "pos_embed" in name:
                param.normal_(0, 1)
            else:  # 1 / sqrt(fan-in); packed experts (experts, n_out, n_in), conv kernels (channels, 1, 4)
                param.normal_(0, param.shape[-1] ** -0.5 if param.ndim == 3 else param[0].numel() ** -0.5)
    return model.float().eval()


@pytest.fixture(scope="module", params=list(MODELS))
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
              qwen_tokenizer_dir: pathlib.Path) -> tuple:
    arch = request.param
    hf_dir = tmp_path_factory.mktemp(f"{arch}-serve-hf")
    save_qwen35(_checkpoint(arch), hf_dir, qwen_tokenizer_dir)
    tokenizer_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    tokenizer_config |= {"bos_token": ENDOFTEXT, "chat_template": chat_template("qwen35")}
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (hf_dir / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "patch_size": PATCH, "merge_size": MERGE, "temporal_patch_size": 2}))
    text = convert(hf_dir, hf_dir.parent / f"{arch}.gguf", "f32")
    mmproj = convert(hf_dir, hf_dir.parent / f"{arch}-mmproj.gguf", "f32", "--mmproj")
    # the model the files hold: the saved checkpoint without its MTP block, which transformers does not run
    model = MODELS[arch][1].from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    shutil.rmtree(hf_dir)
    return model, text, mmproj


@pytest.fixture(scope="module")
def served(converted: tuple) -> tuple:
    """The question through an in-process server whose engine records its calls: the answer, the prompt ids and
    picture rows the engine got (in two calls, the second from the assistant's turn), and the checkpoint's greedy
    answer to those ids with the picture's pixels. Asked again, the server restores the recurrent state after the
    picture and evaluates the assistant's turn alone: the same answer."""
    model, text, mmproj = converted
    tokenizer = Tokenizer.from_gguf(text)
    config = server_config(model=str(text), context=512, vision={"mmproj": str(mmproj), "threads": 1})
    with Engine.load(text, n_ctx=512, threads=2) as real:
        engine = RecordingEngine(real)
        with live_server(config, engine, tokenizer) as server:
            answer, n_prompt = ask(server.url)
            n_calls = len(engine.calls)
            again = ask(server.url)  # from the snapshot at the end of the user's turn, picture included
        width = real.picture_width
    prompt, embeds = [], []  # the prompt comes in calls: a snapshot of the recurrent state ends the user's turn
    for tokens, spans in engine.calls:
        if len(prompt) == n_prompt:
            break
        embeds += [(len(prompt) + index, rows) for index, rows in spans]
        prompt += tokens
    assert again == (answer, n_prompt)
    assert engine.calls[n_calls][0] == prompt[len(engine.calls[0][0]):]  # the second asking: the assistant's turn
    expected, gaps = greedy_reference(model, prompt, encoder_pixels(mmproj))
    n = next((i + 1 for i, gap in enumerate(gaps) if gap < TIE), len(gaps))  # up to the first near-tie
    assert n >= MIN_COMPARED, f"the reference's top logits are nearly tied at step {n - 1}: {gaps}"
    return tokenizer, answer, n_prompt, prompt, embeds, width, tokenizer.decode(expected[:n])


def test_a_picture_question_gets_the_checkpoints_answer(served: tuple) -> None:
    tokenizer, answer, n_prompt, prompt, embeds, width, expected = served
    ((index, rows),) = embeds
    assert isinstance(rows, PictureRows) and (rows.nx, len(rows)) == (5, 15)  # the grid reached the engine
    assert rows.shape[1] == width == N_TEXT  # the merger's rows alone: no deepstack
    assert prompt[index - 1] == tokenizer.token_to_id("<|vision_start|>")
    assert answer.startswith(expected), (answer, expected)
    assert n_prompt == len(prompt)


def test_the_engines_logits_match_the_checkpoints(converted: tuple, served: tuple) -> None:
    """The engine's logits over the served prompt and picture rows (f32 cache) against the checkpoint's: the bound
    that the greedy comparison rests on. Measured 7e-5 (MoE) and 4e-5 (dense), logits of std 1. The same rows
    without their grid (placed as text: one position each) miss by 0.4: the multi-axis positions are seen."""
    model, text, mmproj = converted
    *_, prompt, embeds, _, _ = served
    with Engine.load(text, n_ctx=512, threads=2, kv="f32") as engine:
        got = engine.eval(prompt, embeds=embeds, all_logits=True)
    with Engine.load(text, n_ctx=512, threads=2, kv="f32") as engine:
        flat = engine.eval(prompt, embeds=[(index, np.asarray(rows)) for index, rows in embeds], all_logits=True)
    input_ids = torch.tensor([prompt])
    _, height, width = (pixels := encoder_pixels(mmproj)).shape
    with torch.no_grad():
        expected = model(input_ids=input_ids, pixel_values=torch.from_numpy(qwen_patches(pixels, PATCH, MERGE)),
                         image_grid_thw=torch.tensor([[1, height // PATCH, width // PATCH]]),
                         mm_token_type_ids=(input_ids == model.config.image_token_id).int()).logits[0].numpy()
    error = np.abs(got - expected).max() / expected.std()
    assert error < 1e-3, f"max |engine - transformers| / std = {error:.1e}"
    assert np.abs(flat - expected).max() / expected.std() > 0.1


def test_strata_serve_answers_it_too(converted: tuple, served: tuple) -> None:
    """The `strata serve` command with the two files: the same answer (its own engine and encoder process), after
    startup lines that name the recurrent state and its snapshots."""
    _, text, mmproj = converted
    *_, prompt, _, _, expected = served
    answer, n_prompt, startup = ask_strata_serve(text, mmproj)
    assert f"model: {text} ({text.stem})" in startup, startup  # the files are named after their architecture
    state = re.search(r"recurrent state: ([\d.]+) MiB a sequence; snapshots for prefix reuse: \d+", startup)
    assert state and float(state.group(1)) > 0, startup  # a tiny model's state is a fraction of a MiB, not 0.0
    assert "vision: cpu encoder" in startup, startup
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
