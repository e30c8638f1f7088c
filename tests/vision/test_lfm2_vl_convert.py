"""An LFM2-VL mmproj file written by llama.cpp's own converter (`convert_hf_to_gguf.py --mmproj` on a random
`Lfm2VlForConditionalGeneration`), run by strata-vision against the checkpoint's `get_image_features`.

transformers 5 saves LFM2-VL's SigLIP2 tower one level flatter than the published checkpoints:
`model.vision_tower.embeddings...` where they have `model.vision_tower.vision_model.embeddings...` (it drops that
level when loading, `Siglip2VisionModel`'s prefix change in its conversion mapping, and does not put it back when
saving). The converter's tensor map knows only the published names, so it stops at the first tower tensor. The
checkpoint is therefore re-saved in the published layout, which transformers reads back to the same weights
(checked). The converter also maps the projector's `linear_2` through the vision blocks' numbering, so the tower
needs at least three layers. Error: relative Frobenius norm of the embeddings.
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
from safetensors.torch import load_file, save_file
from transformers import Lfm2VlForConditionalGeneration, Lfm2VlModel

from strata.vision.encoder import Encoder
from strata.vision.mmproj import Mmproj, read_hparams
from strata.vision.preprocess import load_image, preprocess, token_budget
from strata.vision.protocol import parse_sve

from .test_lfm2_vl import N_TEXT, PATCH, checkpoint, reference

N_LAYER = 3
# F32 files: only the arithmetic differs (measured 6-8e-7); F16 weights: their rounding (measured 4.5-4.9e-4)
TOLERANCE = {"f32": 1e-4, "f16": 2e-3}


def _published_layout(hf_dir: pathlib.Path) -> None:
    """Rename the saved tower's tensors to the published checkpoints' names (`vision_tower.vision_model.`)."""
    path = hf_dir / "model.safetensors"
    tensors = load_file(path)
    prefix = "model.vision_tower."
    assert any(name.startswith(prefix + "embeddings.") for name in tensors), "the flat layout this works around"
    renamed = {(prefix + "vision_model." + name[len(prefix):] if name.startswith(prefix) else name): value
               for name, value in tensors.items()}
    save_file(renamed, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Lfm2VlModel, dict[str, pathlib.Path]]:
    require_converter()
    hf_dir = tmp_path_factory.mktemp("lfm2vl-hf")
    model = checkpoint(N_LAYER)
    full = Lfm2VlForConditionalGeneration(model.config)
    full.model.load_state_dict(model.state_dict())
    full.save_pretrained(hf_dir)
    _published_layout(hf_dir)
    reloaded = Lfm2VlForConditionalGeneration.from_pretrained(hf_dir).model
    for (name, want), (_, got) in zip(model.state_dict().items(), reloaded.state_dict().items(), strict=True):
        assert torch.equal(want, got), name
    # LFM2-VL's processor configuration (the published keys); the converter reads the normalisation from it
    (hf_dir / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Lfm2VlImageProcessor", "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_image_splitting": True, "downsample_factor": 2, "encoder_patch_size": PATCH, "max_image_tokens": 256,
        "min_image_tokens": 64, "max_tiles": 10, "min_tiles": 2, "tile_size": 512, "use_thumbnail": True,
        "max_pixels_tolerance": 2.0}))
    files = {outtype: convert(hf_dir, hf_dir.parent / f"mmproj-{outtype}.gguf", outtype, "--mmproj")
             for outtype in TOLERANCE}
    return model, files


def test_the_converters_file_is_read_as_lfm2_vl(converted: tuple) -> None:
    model, files = converted
    hp = read_hparams(gguf.GGUFReader(files["f32"]))
    vision = model.config.vision_config
    assert (hp.projector, hp.variant, hp.patch_size, hp.n_layer, hp.n_embd, hp.n_proj, hp.merge) == (
        "lfm2", "lfm2-vl", PATCH, N_LAYER, vision.hidden_size, N_TEXT, 2)
    assert hp.image_size == 256 and hp.eps == pytest.approx(vision.layer_norm_eps)
    assert token_budget(hp) == (64, 256)


@pytest.mark.parametrize("outtype", sorted(TOLERANCE))
@pytest.mark.parametrize("size", [(384, 256), (320, 224)])
def test_embeddings_match_the_checkpoint(converted: tuple, outtype: str, size: tuple[int, int]) -> None:
    model, files = converted
    width, height = size
    pixels = np.random.default_rng(width + height).uniform(-1, 1, (3, height, width)).astype(np.float32)
    expected = reference(model, pixels)
    got = Encoder(Mmproj.load(files[outtype]), threads=2).encode(pixels)
    assert got.shape == expected.shape
    err = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    assert err < TOLERANCE[outtype], f"relative error {err:.2e}"


def test_strata_vision_encodes_a_tiled_picture_with_it(converted: tuple, tmp_path: pathlib.Path) -> None:
    """A picture large enough to be split, through the `strata-vision encode` process: each part's rows are the
    checkpoint's for that part's pixels, in order."""
    model, files = converted
    image = Image.fromarray(np.random.default_rng(3).uniform(0, 255, (9, 16, 3)).astype(np.uint8)).resize(
        (1100, 600), Image.Resampling.BICUBIC)
    path = tmp_path / "wide.png"
    image.save(path)
    done = subprocess.run([sys.executable, "-m", "strata.vision.worker", "encode", str(path), "--mmproj",
                           str(files["f32"]), "--out", str(tmp_path / "wide.sve"), "--threads", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert (summary["tiles"], summary["nx"], summary["ny"], summary["n_tokens"]) == ([2, 1, 16], 21, 11, 743)
    header, rows = parse_sve((tmp_path / "wide.sve").read_bytes())
    assert header.grid.tiled and rows.shape == (743, N_TEXT)
    hp = read_hparams(gguf.GGUFReader(files["f32"]))
    min_tokens, max_tokens = token_budget(hp)
    parts = preprocess(load_image(str(path)), hp, max_tokens, min_tokens).parts
    expected = np.concatenate([reference(model, part) for part in parts])
    err = np.linalg.norm(rows - expected) / np.linalg.norm(expected)
    assert err < TOLERANCE["f32"], f"relative error {err:.2e}"
