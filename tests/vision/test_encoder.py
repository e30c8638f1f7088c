"""The encoder's forward pass against independent references.

The ViT (up to its post-layernorm) against Hugging Face `transformers`' SiglipVisionModel (torch, CPU, float32)
loaded with the same random weights, on the native grid and on other grids (position embeddings interpolated the
way SigLIP's `interpolate_pos_encoding` does); the merge and projector against a numpy float64 reference written
here. Relative error is ||ours - reference|| / ||reference|| (Frobenius), bound 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from strata.engine_cffi._engine import lib

from strata.modelgen.mmproj import write_random_mmproj
from strata.vision import encoder as encoder_module
from strata.vision.encoder import EncodeCancelled, Encoder, position_embeddings
from strata.vision.mmproj import Mmproj

from .conftest import N_EMBD_TEXT

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

RTOL = 1e-4


def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.linalg.norm(ours.astype(np.float64) - reference) / np.linalg.norm(reference))


def file_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor as float64 in numpy order, read with the gguf package alone."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        shape = [int(d) for d in reversed(t.shape)]
        out[t.name] = np.asarray(t.data, dtype=np.float64).reshape(shape)
    return out


def siglip_from_file(path: Path, hp) -> torch.nn.Module:
    config = transformers.SiglipVisionConfig(
        hidden_size=hp.n_embd, intermediate_size=hp.n_ff, num_hidden_layers=hp.n_layer,
        num_attention_heads=hp.n_head, num_channels=3, image_size=hp.image_size, patch_size=hp.patch_size,
        hidden_act="gelu_pytorch_tanh", layer_norm_eps=hp.eps, vision_use_head=False, attn_implementation="eager",
    )
    model = transformers.SiglipVisionModel(config).eval()
    t = {k: torch.tensor(v, dtype=torch.float32) for k, v in file_tensors(path).items()}
    state = {
        "embeddings.patch_embedding.weight": t["v.patch_embd.weight"],
        "embeddings.patch_embedding.bias": t["v.patch_embd.bias"],
        "embeddings.position_embedding.weight": t["v.position_embd.weight"],
        "post_layernorm.weight": t["v.post_ln.weight"],
        "post_layernorm.bias": t["v.post_ln.bias"],
    }
    names = [("layer_norm1", "ln1"), ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
             ("self_attn.v_proj", "attn_v"), ("self_attn.out_proj", "attn_out"), ("layer_norm2", "ln2"),
             ("mlp.fc1", "ffn_up"), ("mlp.fc2", "ffn_down")]
    for i in range(hp.n_layer):
        for hf, ours in names:
            for part in ("weight", "bias"):
                state[f"encoder.layers.{i}.{hf}.{part}"] = t[f"v.blk.{i}.{ours}.{part}"]
    model.load_state_dict(state, strict=True)
    return model


@pytest.fixture(scope="module", params=["f32", "f16"])
def model_file(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("enc") / f"tiny-{request.param}.gguf"
    write_random_mmproj(path, N_EMBD_TEXT, "tiny", seed=3, dtype=request.param)
    return path


# (height, width): the native 32x32 grid of 4x4 patches, then grids the position embeddings must be resized to
@pytest.mark.parametrize("size", [(32, 32), (48, 80), (96, 64), (16, 112)])
def test_vit_matches_transformers_siglip(model_file: Path, size: tuple[int, int]):
    mmproj = Mmproj.load(model_file)
    encoder = Encoder(mmproj, threads=2)
    pixels = np.random.default_rng(sum(size)).standard_normal((3, *size)).astype(np.float32)
    ours = encoder.vit(pixels)
    with torch.no_grad():
        reference = siglip_from_file(model_file, mmproj.hparams)(
            pixel_values=torch.tensor(pixels)[None], interpolate_pos_encoding=True
        ).last_hidden_state[0].numpy()
    gy, gx = size[0] // 8, size[1] // 8
    assert ours.shape == (gy, gx, mmproj.hparams.n_embd)
    assert relative_error(ours.reshape(gy * gx, -1), reference) < RTOL


@pytest.mark.parametrize(("side", "gy", "gx"), [(4, 6, 10), (4, 2, 3), (16, 25, 40), (16, 16, 7), (5, 5, 5)])
def test_position_interpolation_matches_torch_bicubic(side: int, gy: int, gx: int):
    pos = np.random.default_rng(side).standard_normal((side * side, 24)).astype(np.float32)
    grid = torch.tensor(pos).reshape(1, side, side, 24).permute(0, 3, 1, 2)
    reference = torch.nn.functional.interpolate(grid, size=(gy, gx), mode="bicubic", align_corners=False)
    reference = reference.permute(0, 2, 3, 1).reshape(gy * gx, 24).numpy()
    assert relative_error(position_embeddings(pos, side, gy, gx), reference) < 1e-6


def projector_reference(features: np.ndarray, t: dict[str, np.ndarray], eps: float) -> np.ndarray:
    """Merge each 2x2 square (row-major within it), LayerNorm if present, mm.1, GELU (tanh), mm.2; float64."""
    gy, gx, _ = features.shape
    rows = []
    for y in range(0, gy, 2):
        for x in range(0, gx, 2):
            square = [features[y, x], features[y, x + 1], features[y + 1, x], features[y + 1, x + 1]]
            rows.append(np.concatenate(square))
    h = np.array(rows, dtype=np.float64)
    if "mm.input_norm.weight" in t:
        mu, var = h.mean(axis=1, keepdims=True), h.var(axis=1, keepdims=True)
        h = (h - mu) / np.sqrt(var + eps) * t["mm.input_norm.weight"] + t["mm.input_norm.bias"]
    h = h @ t["mm.1.weight"].T + t["mm.1.bias"]
    h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
    return h @ t["mm.2.weight"].T + t["mm.2.bias"]


@pytest.mark.parametrize("input_norm", [True, False])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_projector_matches_numpy_reference(tmp_path: Path, dtype: str, input_norm: bool):
    path = tmp_path / "v.gguf"
    write_random_mmproj(path, N_EMBD_TEXT, "tiny", seed=4, dtype=dtype, input_norm=input_norm)
    encoder = Encoder(Mmproj.load(path), threads=2)
    features = np.random.default_rng(5).standard_normal((6, 10, 32)).astype(np.float32)
    ours = encoder.project(features)
    assert ours.shape == (3 * 5, N_EMBD_TEXT)
    assert relative_error(ours, projector_reference(features, file_tensors(path), encoder.hp.eps)) < RTOL


def test_encode_is_vit_then_projector(tiny_mmproj: Path):
    encoder = Encoder(Mmproj.load(tiny_mmproj), threads=1)
    pixels = np.random.default_rng(6).standard_normal((3, 48, 64)).astype(np.float32)
    rows = encoder.encode(pixels)
    assert rows.shape == (3 * 4, encoder.n_embd) and rows.dtype == np.float32
    reference = projector_reference(encoder.vit(pixels).astype(np.float64), file_tensors(tiny_mmproj), encoder.hp.eps)
    assert relative_error(rows, reference) < RTOL
    np.testing.assert_allclose(Encoder(Mmproj.load(tiny_mmproj), threads=2).encode(pixels), rows, rtol=1e-5, atol=1e-6)


class RecordingLib:
    """The engine's `lib`, recording each weight product in a shared event list."""

    def __init__(self, events: list[str]):
        self._events = events

    def strata_matmul(self, *args):
        self._events.append("product")
        return lib.strata_matmul(*args)

    def __getattr__(self, name: str):
        return getattr(lib, name)


def test_cancellation_is_checked_before_every_product_and_layer(slow_mmproj: Path, monkeypatch):
    events: list[str] = []
    monkeypatch.setattr(encoder_module, "lib", RecordingLib(events))
    encoder = Encoder(Mmproj.load(slow_mmproj), threads=1)
    pixels = np.zeros((3, 48, 32), dtype=np.float32)

    def never() -> bool:
        events.append("check")
        return False

    encoder.encode(pixels, never)
    products = events.count("product")
    assert products == 1 + 6 * encoder.hp.n_layer + 2  # patches, six per block, the projector's two
    assert all(events[i - 1] == "check" for i, e in enumerate(events) if e == "product")
    assert events.count("check") >= products + encoder.hp.n_layer

    for stop_at in (1, 2, 30, events.count("check")):
        events.clear()

        def cancelled(stop_at: int = stop_at) -> bool:
            events.append("check")
            return events.count("check") >= stop_at

        with pytest.raises(EncodeCancelled):
            encoder.encode(pixels, cancelled)
        first_stop = [i for i, e in enumerate(events) if e == "check"][stop_at - 1]
        assert "product" not in events[first_stop:]  # nothing heavy runs once a check has said stop


def test_picture_must_fill_whole_merged_patches(tiny_mmproj: Path):
    encoder = Encoder(Mmproj.load(tiny_mmproj), threads=1)
    with pytest.raises(ValueError, match="multiple of 16"):
        encoder.encode(np.zeros((3, 24, 32), dtype=np.float32))


def test_sliced_products_equal_whole_ones(tiny_mmproj: Path, monkeypatch):
    encoder = Encoder(Mmproj.load(tiny_mmproj), threads=2)
    pixels = np.random.default_rng(7).standard_normal((3, 64, 48)).astype(np.float32)  # 48 patch rows
    whole = encoder.encode(pixels)
    monkeypatch.setattr(encoder_module, "SLICE_ROWS", 5)  # 10 slices, the last one short
    np.testing.assert_allclose(encoder.encode(pixels), whole, rtol=1e-6, atol=1e-6)
