"""Qwen3.5/3.6's vision tower: the file llama.cpp's converter writes from a random
`Qwen3_5MoeForConditionalGeneration` (`convert_hf_to_gguf.py --mmproj`), our writer's file for the same weights,
and `strata-vision` running it against the checkpoint's `model.visual` in transformers.

The tower is Qwen3-VL's without the deepstack mergers: projector type `qwen3vl_merger`, `is_deepstack_layers` all
false, so `strata.vision.qwen3vl` runs it as it is and a token's row is the main merger's output alone.
Error: relative Frobenius norm, float32 weights.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from llama_cpp_convert import convert, require_converter
from PIL import Image
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

from strata.modelgen import cli
from strata.modelgen.hf_qwen35 import gguf_vision_from_hf, vision_hparams_from_hf
from strata.modelgen.mmproj_qwen35 import write_qwen35_mmproj
from strata.vision.load import open_encoder
from strata.vision.mmproj import read_hparams
from strata.vision.protocol import parse_sve
from vision.conftest import qwen_patches

TOLERANCE = 1e-4
PATCH, MERGE, N_TEXT = 16, 2, 64
PRODUCER_KEYS = {"general.name", "general.size_label"}  # the converter's guesses from the directory name
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5], "patch_size": PATCH, "merge_size": MERGE, "temporal_patch_size": 2}


def _checkpoint() -> Qwen3_5MoeForConditionalGeneration:
    config = Qwen3_5MoeConfig(
        vision_config={"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": PATCH,
                       "spatial_merge_size": MERGE, "temporal_patch_size": 2, "out_hidden_size": N_TEXT,
                       "num_position_embeddings": 64},
        text_config={"hidden_size": N_TEXT, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                     "linear_value_head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                     "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "vocab_size": 1024,
                     "rms_norm_eps": 1e-6})
    config.vision_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen3_5MoeForConditionalGeneration(config)
    with torch.no_grad():  # weights of order one: every part of the tower shows in the result
        for name, param in model.model.visual.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif param.ndim == 1:
                param.normal_(0, 0.1)
            elif "pos_embed" in name:
                param.normal_(0, 1)
            else:
                param.normal_(0, param[0].numel() ** -0.5)
    return model.float().eval()


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory: pytest.TempPathFactory) -> tuple[Qwen3_5MoeForConditionalGeneration, pathlib.Path]:
    require_converter()
    hf_dir = tmp_path_factory.mktemp("qwen35-hf")
    model = _checkpoint()
    model.save_pretrained(hf_dir)
    (hf_dir / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return model, hf_dir


@pytest.fixture(scope="module")
def converted(qwen35: tuple, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    _, hf_dir = qwen35
    return convert(hf_dir, tmp_path_factory.mktemp("qwen35-mmproj") / "mmproj.gguf", "f32", "--mmproj")


def _metadata(reader: gguf.GGUFReader) -> dict[str, object]:
    return {key: (f.types, f.contents()) for key, f in reader.fields.items()
            if key not in PRODUCER_KEYS and not key.startswith("GGUF.")}


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_our_file_is_the_converters(qwen35: tuple, dtype: str, tmp_path: pathlib.Path) -> None:
    import safetensors.numpy

    _, hf_dir = qwen35
    theirs = gguf.GGUFReader(convert(hf_dir, tmp_path / "converted.gguf", dtype, "--mmproj"))
    hp = vision_hparams_from_hf(json.loads((hf_dir / "config.json").read_text()), PREPROCESSOR)
    tensors = gguf_vision_from_hf(safetensors.numpy.load_file(hf_dir / "model.safetensors"))
    write_qwen35_mmproj(tmp_path / "ours.gguf", hp, tensors, dtype)
    ours = gguf.GGUFReader(tmp_path / "ours.gguf")
    assert _metadata(ours) == _metadata(theirs)
    expected = {t.name: t for t in theirs.tensors}
    got = {t.name: t for t in ours.tensors}
    assert got.keys() == expected.keys()
    for name, t in expected.items():
        assert (got[name].tensor_type, got[name].shape.tolist()) == (t.tensor_type, t.shape.tolist()), name
        assert np.array_equal(got[name].data.view(np.uint8), t.data.view(np.uint8)), name
    assert read_hparams(ours) == hp


# 128x128 is the native 8x8 position grid; 192x128 enlarges it along x, 64x96 shrinks it
@pytest.mark.parametrize("size", [(128, 128), (192, 128), (64, 96)])
def test_embeddings_match_the_checkpoint(qwen35: tuple, converted: pathlib.Path, size: tuple[int, int]) -> None:
    model, _ = qwen35
    width, height = size
    pixels = np.random.default_rng(width + height).uniform(-1, 1, (3, height, width)).astype(np.float32)
    with torch.no_grad():
        expected = model.model.visual(torch.from_numpy(qwen_patches(pixels, PATCH, MERGE)),
                                      grid_thw=torch.tensor([[1, height // PATCH, width // PATCH]])).pooler_output
    encoder = open_encoder(converted, threads=2)
    assert encoder.hp.deepstack == () and encoder.n_embd == N_TEXT
    got = encoder.encode(pixels)
    assert got.shape == expected.shape == (width * height // (MERGE * PATCH) ** 2, N_TEXT)
    err = np.linalg.norm(got - expected.numpy()) / np.linalg.norm(expected.numpy())
    assert err < TOLERANCE, f"relative error {err:.2e}"


def test_strata_vision_encodes_a_picture_with_the_converted_file(converted: pathlib.Path,
                                                                 tmp_path: pathlib.Path) -> None:
    picture = tmp_path / "p.png"
    Image.new("RGB", (100, 60), (200, 30, 90)).save(picture)
    done = subprocess.run([sys.executable, "-m", "strata.vision.worker", "encode", str(picture), "--mmproj",
                           str(converted), "--out", str(tmp_path / "p.sve"), "--threads", "1"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    # 3x2 tokens as it is, under llama.cpp's minimum of 8: scaled up, each side rounded up (Qwen's smart_resize);
    # rows of the text model's width alone (no deepstack slices)
    assert (result["nx"], result["ny"], result["n_embd"]) == (4, 3, N_TEXT)
    _, rows = parse_sve((tmp_path / "p.sve").read_bytes())
    assert rows.shape == (12, N_TEXT)


def test_make_model_writes_a_qwen35_encoder_for_a_qwen35_model(tmp_path: pathlib.Path) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    text, vision = tmp_path / "text.gguf", tmp_path / "vision.gguf"
    assert cli.run(parser.parse_args(["--arch", "qwen35moe", "--out", str(text)])) == 0
    assert cli.run(parser.parse_args(["--mmproj", "--text-model", str(text), "--out", str(vision)])) == 0
    reader = gguf.GGUFReader(vision)
    hp = read_hparams(reader)
    assert (hp.projector, hp.variant, hp.deepstack, hp.n_proj) == ("qwen3vl_merger", "qwen3-vl", (), 256)
    assert reader.fields["clip.vision.is_deepstack_layers"].contents() == [False] * hp.n_layer
    pixels = np.random.default_rng(0).uniform(-1, 1, (3, 64, 96)).astype(np.float32)
    rows = open_encoder(vision, threads=1).encode(pixels)
    assert rows.shape == (6, 256) and np.isfinite(rows).all()
    assert 0.1 < rows.std() < 10  # the random weights keep activations of order one
