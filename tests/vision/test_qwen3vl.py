"""Qwen3-VL's vision tower (projector type `qwen3vl_merger`) from a file llama.cpp's own converter wrote
(`convert_hf_to_gguf.py --mmproj` on a random `Qwen3VLForConditionalGeneration`), against that checkpoint's
`model.visual` in transformers: the main merger's rows and each deepstack merger's, side by side as llama.cpp
gives them. Error: relative Frobenius norm, float32 weights.
"""

from __future__ import annotations

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
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from strata.vision.load import open_encoder
from strata.vision.mmproj import read_hparams
from strata.vision.preprocess import token_budget
from strata.vision.protocol import parse_sve
from vision.conftest import qwen_patches

TOLERANCE = 1e-4
PATCH, MERGE, N_TEXT, DEEPSTACK = 16, 2, 64, [0, 1]


def _checkpoint() -> Qwen3VLForConditionalGeneration:
    config = Qwen3VLConfig(
        vision_config={"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": PATCH,
                       "spatial_merge_size": MERGE, "temporal_patch_size": 2, "out_hidden_size": N_TEXT,
                       "num_position_embeddings": 64, "deepstack_visual_indexes": DEEPSTACK},
        text_config={"hidden_size": N_TEXT, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 1024, "rms_norm_eps": 1e-6,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [8, 4, 4],
                                         "mrope_interleaved": True}})
    config.vision_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config)
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
def qwen3vl(tmp_path_factory: pytest.TempPathFactory) -> tuple[Qwen3VLForConditionalGeneration, pathlib.Path]:
    require_converter()
    hf_dir = tmp_path_factory.mktemp("qwen3vl-hf")
    model = _checkpoint()
    model.save_pretrained(hf_dir)
    (hf_dir / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "patch_size": PATCH, "merge_size": MERGE, "temporal_patch_size": 2}))
    return model, convert(hf_dir, hf_dir.parent / "mmproj.gguf", "f32", "--mmproj")


def _reference(model: Qwen3VLForConditionalGeneration, pixels: np.ndarray) -> np.ndarray:
    """The tower on normalised pixels (3, H, W), patched as Qwen's processor does."""
    _, height, width = pixels.shape
    patches = torch.from_numpy(qwen_patches(pixels, PATCH, MERGE))
    with torch.no_grad():
        out = model.model.visual(patches, grid_thw=torch.tensor([[1, height // PATCH, width // PATCH]]))
    return torch.cat([out.pooler_output, *out.deepstack_features], dim=1).numpy()


def test_the_converted_file_is_read(qwen3vl: tuple) -> None:
    _, path = qwen3vl
    hp = read_hparams(gguf.GGUFReader(path))
    assert (hp.projector, hp.variant, hp.merge, hp.deepstack, hp.pos_side) == ("qwen3vl_merger", "qwen3-vl", 2,
                                                                               (0, 1), 8)
    assert token_budget(hp) == (8, 4096)  # llama.cpp's for Qwen-VL when the file gives none


# 128x128 is the native 8x8 position grid; 192x128 enlarges it along x, 64x96 shrinks it
@pytest.mark.parametrize("size", [(128, 128), (192, 128), (64, 96)])
def test_embeddings_match_the_checkpoint(qwen3vl: tuple, size: tuple[int, int]) -> None:
    model, path = qwen3vl
    width, height = size
    pixels = np.random.default_rng(width + height).uniform(-1, 1, (3, height, width)).astype(np.float32)
    expected = _reference(model, pixels)
    encoder = open_encoder(path, threads=2)
    got = encoder.encode(pixels)
    assert encoder.n_embd == N_TEXT * (1 + len(DEEPSTACK))
    assert got.shape == expected.shape == (width * height // (MERGE * PATCH) ** 2, encoder.n_embd)
    err = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    assert err < TOLERANCE, f"relative error {err:.2e}"


def test_strata_vision_encodes_a_picture_with_it(qwen3vl: tuple, tmp_path: pathlib.Path) -> None:
    _, path = qwen3vl
    picture = tmp_path / "p.png"
    Image.new("RGB", (100, 60), (200, 30, 90)).save(picture)
    done = subprocess.run([sys.executable, "-m", "strata.vision.worker", "encode", str(picture), "--mmproj", str(path),
                           "--out", str(tmp_path / "p.sve"), "--threads", "1"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    # 3x2 tokens as it is, under the minimum of 8: scaled up, each side rounded up (Qwen's smart_resize)
    assert (result["nx"], result["ny"], result["n_embd"]) == (4, 3, N_TEXT * 3)
    _, rows = parse_sve((tmp_path / "p.sve").read_bytes())
    assert rows.shape == (12, N_TEXT * 3)
