"""The encoder on a device (`strata-vision --gpu`), run on the host device (the test device): its rows against the
CPU encoder's for each projector it runs, the device memory it says it takes, and a cancellation between layers.

Tolerance: the largest |device - CPU| over the largest |CPU| value, 1e-5 (measured 2-3e-7: the host device's
products are the CPU engine's own, its LayerNorm, GELU and attention sums in double against numpy's float32).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from strata.engine_cffi.device import Device, DeviceError
from strata.modelgen.mmproj import VisionShape, write_random_mmproj
from strata.modelgen.mmproj_qwen35 import write_random_qwen35_mmproj
from strata.models import DEMO_MMPROJ
from strata.vision import device_encoder
from strata.vision.device_encoder import DeviceEncoder, encoder_share, part_tokens, planned_bytes
from strata.vision.encoder import EncodeCancelled, Encoder
from strata.vision.load import open_encoder
from strata.vision.preprocess import load_image, preprocess, token_budget

from .conftest import N_EMBD_TEXT, noise_png

TOLERANCE = 1e-5
MAX_TOKENS = 64


def on_host(encoder: Encoder, max_tokens: int = MAX_TOKENS) -> DeviceEncoder:
    return DeviceEncoder(encoder, Device("host"), part_tokens(encoder.hp, None, max_tokens))


def pictures(encoder: Encoder, sizes: list[tuple[int, int]]) -> list[np.ndarray]:
    """Each size's noise picture as the encoder's parts (pixels), sized by its budget."""
    low, high = token_budget(encoder.hp, None, MAX_TOKENS)
    parts = []
    for i, (w, h) in enumerate(sizes):
        parts += preprocess(load_image(noise_png(w, h, seed=60 + i)), encoder.hp, high, low).parts
    return parts


def assert_rows_match(path: Path, sizes: list[tuple[int, int]]) -> None:
    cpu = open_encoder(path, 1)
    device = on_host(cpu)
    try:
        for pixels in pictures(cpu, sizes):
            want = cpu.encode(pixels)
            got = device.encode(pixels)
            assert got.shape == want.shape == (want.shape[0], cpu.n_embd)
            assert np.abs(got - want).max() <= TOLERANCE * np.abs(want).max()
    finally:
        device.close()


@pytest.fixture(scope="module")
def qwen_files(tmp_path_factory) -> dict[str, Path]:
    """A Qwen3-VL tower with deepstack mergers after layers 0 and 1 (F32) and a Qwen3.5 one (F16)."""
    directory = tmp_path_factory.mktemp("device-encoder")
    files = {"qwen3vl": directory / "qwen3vl-f32.gguf", "qwen35": directory / "qwen35-f16.gguf"}
    write_random_qwen35_mmproj(files["qwen3vl"], N_EMBD_TEXT, "tiny", seed=3, dtype="f32", deepstack=(0, 1))
    write_random_qwen35_mmproj(files["qwen35"], N_EMBD_TEXT, "tiny", seed=4, dtype="f16")
    return files


def test_the_demo_encoder_gives_the_cpu_encoders_rows():
    assert_rows_match(DEMO_MMPROJ, [(128, 128), (140, 100), (40, 300)])


def test_an_lfm2_vl_encoder_gives_the_cpu_encoders_rows_tiles_included(tmp_path):
    """LFM2-VL's variant: antialiased bilinear positions, the erf GELU and epsilon 1e-5 in the projector, and a
    large picture split into 512-pixel tiles plus a thumbnail (the workspace holds a tile's 256 rows)."""
    path = tmp_path / "lfm2-vl.gguf"
    write_random_mmproj(path, N_EMBD_TEXT, VisionShape(image_size=64, patch_size=16, n_embd=32, n_ff=64, n_head=2,
                                                       n_layer=2), dtype="f32", variant="lfm2-vl")
    assert_rows_match(path, [(96, 80), (1100, 600)])


@pytest.mark.parametrize("kind", ["qwen3vl", "qwen35"])
def test_a_qwen_encoder_gives_the_cpu_encoders_rows(qwen_files, kind):
    """Fused QKV, the 2-D RoPE, the main merger and (Qwen3-VL) the deepstack mergers' rows after it."""
    assert_rows_match(qwen_files[kind], [(128, 96), (64, 64), (32, 160)])
    if kind == "qwen3vl":
        assert open_encoder(qwen_files[kind], 1).n_embd == 3 * N_EMBD_TEXT


@pytest.mark.parametrize("source", ["demo", "qwen3vl"])
def test_the_device_memory_is_known_from_the_file_before_it_starts(qwen_files, source):
    path = DEMO_MMPROJ if source == "demo" else qwen_files[source]
    cpu = open_encoder(path, 1)
    device = on_host(cpu)
    try:
        assert device.device_bytes == device.device.used
        assert device.device_bytes == planned_bytes(cpu.mmproj, part_tokens(cpu.hp, None, MAX_TOKENS))
        assert device.device_bytes == encoder_share(path, None, MAX_TOKENS)
        assert encoder_share(path, None, 4 * MAX_TOKENS) > device.device_bytes  # a larger budget, more workspace
    finally:
        device.close()


def test_a_cancelled_encode_stops_at_the_next_layer_boundary_and_the_encoder_goes_on():
    cpu = open_encoder(DEMO_MMPROJ, 1)
    device = on_host(cpu)
    try:
        pixels = pictures(cpu, [(128, 128)])[0]
        checks = 0

        def cancel_on_the_second_check() -> bool:
            nonlocal checks
            checks += 1
            return checks >= 2

        with pytest.raises(EncodeCancelled):
            device.encode(pixels, cancel_on_the_second_check)
        assert checks == 2  # the check before layer 1 stopped it: no layer after
        assert np.abs(device.encode(pixels) - cpu.encode(pixels)).max() <= TOLERANCE * np.abs(cpu.encode(pixels)).max()
    finally:
        device.close()


def test_what_the_device_cannot_run_is_refused_at_start(tmp_path, monkeypatch):
    wide = tmp_path / "wide-heads.gguf"
    write_random_mmproj(wide, N_EMBD_TEXT, VisionShape(image_size=32, patch_size=8, n_embd=288, n_ff=64, n_head=1,
                                                        n_layer=1), dtype="f32")
    with pytest.raises(DeviceError, match="attention heads of 288 values; the device's attention takes up to 256"):
        on_host(open_encoder(wide, 1))
    with pytest.raises(DeviceError, match="pictures of up to 65536 patches; the device encoder takes up to 65535"):
        on_host(open_encoder(DEMO_MMPROJ, 1), max_tokens=16384)
    monkeypatch.setattr(device_encoder, "DEVICE_TYPES", frozenset())
    with pytest.raises(DeviceError, match="weight type F32 has no device product"):
        on_host(open_encoder(DEMO_MMPROJ, 1))
