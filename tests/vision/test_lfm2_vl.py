"""An `lfm2` mmproj file of LFM2-VL (no `strata.vision.variant` key, as llama.cpp's converter writes it) runs as the
checkpoint does: transformers' `Lfm2VlModel.get_image_features` (SigLIP2 tower, pixel unshuffle, projector) on a
random checkpoint is the reference, and LFM2-VL's picture budget (64 to 256 tokens) and grid rounding apply.

The file is written from the checkpoint's weights with the converter's tensor names and layout (its SigLIP2 patch
embedding, a linear layer over (row, column, channel) patches, becomes the (n, 3, p, p) convolution weight);
llama.cpp's converter itself cannot read transformers 5's saved SigLIP towers.
Error: relative Frobenius norm ||ours - reference|| / ||reference|| of the embeddings, float32 weights.
"""

from __future__ import annotations

import pathlib

import gguf
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Lfm2VlConfig, Lfm2VlModel

from strata.modelgen.mmproj import add_vision_metadata
from strata.vision.encoder import Encoder
from strata.vision.mmproj import MM_DOWN_BID, MM_UP_BID, Mmproj, VisionHParams, read_hparams, tensor_name
from strata.vision.preprocess import preprocess, token_budget

TOLERANCE = 1e-4
PATCH, N_EMBD, N_TEXT = 16, 32, 64
_T = gguf.MODEL_TENSOR
_BLOCK = {"layer_norm1": _T.V_ENC_INPUT_NORM, "self_attn.q_proj": _T.V_ENC_ATTN_Q, "self_attn.k_proj": _T.V_ENC_ATTN_K,
          "self_attn.v_proj": _T.V_ENC_ATTN_V, "self_attn.out_proj": _T.V_ENC_ATTN_O,
          "layer_norm2": _T.V_ENC_POST_ATTN_NORM, "mlp.fc1": _T.V_ENC_FFN_UP, "mlp.fc2": _T.V_ENC_FFN_DOWN}


def checkpoint(n_layer: int = 2) -> Lfm2VlModel:
    config = Lfm2VlConfig(
        vision_config={"model_type": "siglip2_vision_model", "hidden_size": N_EMBD, "intermediate_size": 64,
                       "num_hidden_layers": n_layer, "num_attention_heads": 2, "patch_size": PATCH, "num_patches": 256,
                       "vision_use_head": False},
        text_config={"model_type": "lfm2", "hidden_size": N_TEXT, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 512,
                     "layer_types": ["conv", "full_attention"]},
        projector_hidden_size=48, downsample_factor=2, projector_use_layernorm=True, projector_hidden_act="gelu")
    config.vision_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Lfm2VlModel(config)
    with torch.no_grad():  # weights of order one, so that every part of the tower shows in the result
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or ("layer_norm" in name and name.endswith("weight")):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif param.ndim == 1:
                param.normal_(0, 0.1)
            elif "position_embedding" in name:
                param.normal_(0, 1)
            else:
                param.normal_(0, param.shape[1] ** -0.5)
    return model.float().eval()


def _mmproj_tensors(model: Lfm2VlModel) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, param in model.vision_tower.named_parameters():
        name = name.removeprefix("vision_model.")
        value = param.detach().numpy().astype(np.float32)
        kind, suffix = name.rsplit(".", 1)
        if kind == "embeddings.patch_embedding":
            if suffix == "weight":
                value = value.reshape(N_EMBD, PATCH, PATCH, 3).transpose(0, 3, 1, 2)
            out[tensor_name(_T.V_ENC_EMBD_PATCH, suffix)] = value
        elif kind == "embeddings.position_embedding":
            out[tensor_name(_T.V_ENC_EMBD_POS)] = value
        elif kind == "post_layernorm":
            out[tensor_name(_T.V_POST_NORM, suffix)] = value
        else:
            _, _, bid, layer = kind.split(".", 3)
            out[tensor_name(_BLOCK[layer], suffix, int(bid))] = value
    projector = model.multi_modal_projector
    for layer, kind, bid in ((projector.layer_norm, _T.V_MM_INP_NORM, None),
                             (projector.linear_1, _T.V_MMPROJ, MM_UP_BID),
                             (projector.linear_2, _T.V_MMPROJ, MM_DOWN_BID)):
        for suffix in ("weight", "bias"):
            out[tensor_name(kind, suffix, bid)] = getattr(layer, suffix).detach().numpy().astype(np.float32)
    return out


@pytest.fixture(scope="module")
def lfm2_vl(tmp_path_factory: pytest.TempPathFactory) -> tuple[Lfm2VlModel, pathlib.Path]:
    model = checkpoint()
    path = tmp_path_factory.mktemp("lfm2vl") / "mmproj.gguf"
    # image_size 256 is what the converter writes for LFM2-VL (16 x 16 learned positions)
    hp = VisionHParams(image_size=256, patch_size=PATCH, n_embd=N_EMBD, n_ff=64, n_head=2, n_layer=2,
                       eps=float(np.float32(model.config.vision_config.layer_norm_eps)), n_proj=N_TEXT, merge=2,
                       image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))
    writer = gguf.GGUFWriter(str(path), "clip")
    add_vision_metadata(writer, hp, "LFM2-VL random")
    for name, value in _mmproj_tensors(model).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, path


def reference(model: Lfm2VlModel, pixels: np.ndarray) -> np.ndarray:
    """get_image_features on normalised pixels (3, H, W): patches flattened in (row, column, channel) order."""
    _, height, width = pixels.shape
    gy, gx = height // PATCH, width // PATCH
    patches = pixels.reshape(3, gy, PATCH, gx, PATCH).transpose(1, 3, 2, 4, 0).reshape(1, gy * gx, -1)
    with torch.no_grad():
        features = model.get_image_features(
            pixel_values=torch.from_numpy(np.ascontiguousarray(patches)), spatial_shapes=torch.tensor([[gy, gx]]),
            pixel_attention_mask=torch.ones(1, gy * gx, dtype=torch.bool))
    rows = features.pooler_output if hasattr(features, "pooler_output") else features
    return torch.cat(list(rows)).numpy() if isinstance(rows, (list, tuple)) else rows.numpy()


def test_a_converted_file_runs_as_lfm2_vl(lfm2_vl: tuple) -> None:
    _, path = lfm2_vl
    hp = read_hparams(gguf.GGUFReader(path))
    assert hp.variant == "lfm2-vl"
    assert token_budget(hp) == (64, 256)


# 384x256 enlarges the 16x16 positions along x; 320x224 (a 128x96 picture's grid) shrinks them, antialiased
@pytest.mark.parametrize("size", [(384, 256), (320, 224), (256, 256)])
def test_embeddings_match_the_checkpoint(lfm2_vl: tuple, size: tuple[int, int]) -> None:
    model, path = lfm2_vl
    width, height = size
    pixels = np.random.default_rng(width).uniform(-1, 1, (3, height, width)).astype(np.float32)
    expected = reference(model, pixels)
    got = Encoder(Mmproj.load(path), threads=2).encode(pixels)
    assert got.shape == expected.shape == (width * height // (2 * PATCH) ** 2, N_TEXT)
    err = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    assert err < TOLERANCE, f"relative error {err:.2e}"


@pytest.mark.parametrize(("size", "grid"), [
    ((128, 96), (10, 7)),  # 12 tokens as they are: scaled up to at least 64, each side rounded up
    ((384, 256), (12, 8)),  # within the budget: each side rounded to whole tokens
    ((2000, 1000), (22, 11)),  # 62x31 rounded: scaled down to at most 256, each side floored
])
def test_the_picture_budget_is_lfm2_vls(lfm2_vl: tuple, size: tuple[int, int], grid: tuple[int, int]) -> None:
    _, path = lfm2_vl
    hp = read_hparams(gguf.GGUFReader(path))
    min_tokens, max_tokens = token_budget(hp)
    picture = preprocess(Image.new("RGB", size, (90, 140, 200)), hp, max_tokens, min_tokens)
    assert (picture.nx, picture.ny) == grid
    assert picture.pixels.shape == (3, grid[1] * 2 * PATCH, grid[0] * 2 * PATCH)
