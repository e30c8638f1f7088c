"""Random mmproj files: what the writer puts in them (read back with the gguf package), and the reader's checks."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_rewrite import rewrite

from strata.modelgen.mmproj import IMAGE_MEAN, IMAGE_STD, SIZES, VisionShape, text_model_width, write_random_mmproj
from strata.vision.load import open_encoder
from strata.vision.mmproj import Mmproj, MmprojError

from .conftest import N_EMBD_TEXT

F32, F16 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16
KV = gguf.Keys.ClipVision


def mmproj_tensor_names(n_layer: int) -> set[str]:
    """Every `.weight` / `.bias` name llama.cpp's mmproj tensor list allows for n_layer blocks."""
    names = set()
    for kind in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.MMPROJ]:
        template = gguf.TENSOR_NAMES[kind]
        for bid in range(max(n_layer, 3)) if "{bid}" in template else [None]:
            names |= {f"{template.format(bid=bid)}.weight", f"{template.format(bid=bid)}.bias"}
    return names


def field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_tiny_file_has_llama_cpp_keys_and_tensors(tmp_path: Path, dtype: str):
    path = tmp_path / "v.gguf"
    write_random_mmproj(path, N_EMBD_TEXT, "tiny", dtype=dtype)
    shape = SIZES["tiny"]
    reader = gguf.GGUFReader(path)
    assert field(reader, gguf.Keys.General.ARCHITECTURE) == "clip"
    assert field(reader, gguf.Keys.General.TYPE) == gguf.GGUFType.MMPROJ
    assert field(reader, gguf.Keys.Clip.PROJECTOR_TYPE) == gguf.VisionProjectorType.LFM2
    assert field(reader, gguf.Keys.Clip.HAS_VISION_ENCODER) is True
    expected = {
        KV.IMAGE_SIZE: shape.image_size, KV.PATCH_SIZE: shape.patch_size, KV.EMBEDDING_LENGTH: shape.n_embd,
        KV.FEED_FORWARD_LENGTH: shape.n_ff, KV.BLOCK_COUNT: shape.n_layer, KV.Attention.HEAD_COUNT: shape.n_head,
        KV.PROJECTION_DIM: N_EMBD_TEXT, KV.Projector.SCALE_FACTOR: 2,
    }
    assert {key: field(reader, key) for key in expected} == expected
    assert field(reader, KV.IMAGE_MEAN) == pytest.approx(IMAGE_MEAN)
    assert field(reader, KV.IMAGE_STD) == pytest.approx(IMAGE_STD)

    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) <= mmproj_tensor_names(shape.n_layer)
    n, p = shape.n_embd, shape.patch_size
    assert list(tensors["v.patch_embd.weight"].shape) == [p, p, 3, n]  # GGML order: a conv kernel
    assert list(tensors["v.position_embd.weight"].shape) == [n, (shape.image_size // p) ** 2]
    assert list(tensors["v.blk.1.ffn_up.weight"].shape) == [n, shape.n_ff]
    assert list(tensors["mm.input_norm.weight"].shape) == [4 * n]
    assert list(tensors["mm.1.weight"].shape) == [4 * n, N_EMBD_TEXT]
    assert list(tensors["mm.2.weight"].shape) == [N_EMBD_TEXT, N_EMBD_TEXT]
    matrix_type = F16 if dtype == "f16" else F32
    for name, tensor in tensors.items():
        is_matrix = len(tensor.shape) >= 2 and name != "v.position_embd.weight"
        assert tensor.tensor_type == (matrix_type if is_matrix else F32), name


def test_weights_are_scaled_by_fan_in(tmp_path: Path):
    shape = VisionShape(image_size=32, patch_size=8, n_embd=128, n_ff=256, n_head=4, n_layer=1)
    write_random_mmproj(tmp_path / "v.gguf", 64, shape, dtype="f32")
    tensors = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(tmp_path / "v.gguf").tensors}
    assert tensors["v.blk.0.attn_q.weight"].std() == pytest.approx(128**-0.5, rel=0.05)
    assert tensors["v.blk.0.ffn_up.weight"].std() == pytest.approx(128**-0.5, rel=0.05)
    assert tensors["mm.1.weight"].std() == pytest.approx(512**-0.5, rel=0.05)
    assert tensors["v.patch_embd.weight"].std() == pytest.approx((3 * 64) ** -0.5, rel=0.05)


def test_small_file_is_tens_of_megabytes(tmp_path: Path):
    write_random_mmproj(tmp_path / "v.gguf", 2048, "small")
    assert 10e6 < (tmp_path / "v.gguf").stat().st_size < 100e6
    hp = Mmproj.load(tmp_path / "v.gguf").hparams
    assert (hp.n_embd, hp.n_layer, hp.patch_size, hp.n_proj) == (384, 6, 16, 2048)


def test_reader_reads_what_the_writer_wrote(tmp_path: Path):
    hp_written = write_random_mmproj(tmp_path / "v.gguf", N_EMBD_TEXT, "tiny", dtype="f16")
    mmproj = Mmproj.load(tmp_path / "v.gguf")
    assert mmproj.hparams == hp_written
    raw = {t.name: t for t in gguf.GGUFReader(tmp_path / "v.gguf").tensors}
    q = mmproj.blocks[1].q.weight
    assert (q.type, q.n_rows, q.n_cols) == (F16, 32, 32)
    np.testing.assert_array_equal(q.data.view(np.float16).reshape(32, 32), raw["v.blk.1.attn_q.weight"].data)
    assert mmproj.patch.weight.n_cols == 3 * 8 * 8
    np.testing.assert_array_equal(mmproj.pos, raw["v.position_embd.weight"].data)
    assert mmproj.input_norm is not None


def test_the_picture_budget_is_written_in_pixels_and_read_back(tmp_path: Path):
    hp_written = write_random_mmproj(tmp_path / "v.gguf", N_EMBD_TEXT, "tiny", budget=(16, 64))
    reader = gguf.GGUFReader(tmp_path / "v.gguf")
    assert (field(reader, KV.IMAGE_MIN_PIXELS), field(reader, KV.IMAGE_MAX_PIXELS)) == (16 * 256, 64 * 256)
    assert Mmproj.load(tmp_path / "v.gguf").hparams == hp_written
    write_random_mmproj(tmp_path / "none.gguf", N_EMBD_TEXT, "tiny")
    hp = Mmproj.load(tmp_path / "none.gguf").hparams
    assert (hp.min_pixels, hp.max_pixels) == (None, None)


def test_projector_layernorm_is_optional(tmp_path: Path):
    write_random_mmproj(tmp_path / "v.gguf", N_EMBD_TEXT, "tiny", input_norm=False)
    assert "mm.input_norm.weight" not in {t.name for t in gguf.GGUFReader(tmp_path / "v.gguf").tensors}
    assert Mmproj.load(tmp_path / "v.gguf").input_norm is None


def test_same_arguments_write_the_same_bytes_and_fingerprint(tmp_path: Path):
    for name, seed in [("a", 0), ("b", 0), ("c", 1)]:
        write_random_mmproj(tmp_path / f"{name}.gguf", N_EMBD_TEXT, "tiny", seed=seed)
    a, b, c = (tmp_path / f"{name}.gguf" for name in "abc")
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    fingerprints = [Mmproj.load(p).fingerprint for p in (a, b, c)]
    assert fingerprints[0] == fingerprints[1] != fingerprints[2]
    assert fingerprints[0].startswith("sha256:") and len(fingerprints[0]) == len("sha256:") + 64


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"drop": "v.blk.1.attn_k.bias"}, "tensor v.blk.1.attn_k.bias is missing"),
        ({"drop": "mm.2.weight"}, "tensor mm.2.weight is missing"),
        ({"reshape": "v.blk.0.ffn_down.weight"}, "tensor v.blk.0.ffn_down.weight has shape"),
        ({"keys": {gguf.Keys.Clip.PROJECTOR_TYPE: "mlp"}}, "projector type 'mlp' is not supported"),
    ],
)
def test_reader_refuses_other_models_and_names_the_file(tiny_mmproj: Path, tmp_path: Path, change, message):
    bad = rewrite(tiny_mmproj, tmp_path / "bad.gguf", **change)
    with pytest.raises(MmprojError, match=message) as info:
        Mmproj.load(bad)
    assert f"'{bad}'" in str(info.value)


@pytest.mark.parametrize("projector", ["qwen2.5vl_merger", "qwen2vl_merger", "gemma3", "idefics3", "mlp"])
def test_projectors_it_does_not_run_are_named_in_one_line(tiny_mmproj: Path, tmp_path: Path, projector: str):
    # every other key is wrong for such a file too: the projector is checked before any of them is read
    bad = rewrite(tiny_mmproj, tmp_path / "bad.gguf", keys={gguf.Keys.Clip.PROJECTOR_TYPE: projector},
                  drop="v.patch_embd.weight")
    with pytest.raises(MmprojError) as info:
        open_encoder(bad, threads=1)
    assert str(info.value) == (f"cannot load mmproj '{bad}': projector type '{projector}' is not supported (this "
                               "encoder runs 'lfm2', 'qwen3vl_merger')")


def test_reader_refuses_missing_and_non_gguf_files(tmp_path: Path):
    missing = tmp_path / "missing.gguf"
    with pytest.raises(MmprojError, match=f"cannot load mmproj '{missing}'.*No such file"):
        Mmproj.load(missing)
    text = tmp_path / "notes.txt"
    text.write_text("not a model at all, just some text\n" * 10)
    with pytest.raises(MmprojError, match=f"cannot load mmproj '{text}'"):
        Mmproj.load(text)


def test_reader_refuses_truncated_files(tiny_mmproj: Path, tmp_path: Path):
    data = tiny_mmproj.read_bytes()
    for size in (0, 10, 100, len(data) // 2, len(data) - 10):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(MmprojError, match=f"cannot load mmproj '{cut}'"):
            Mmproj.load(cut)


def test_text_model_width_reads_the_embedding_length(tmp_path: Path):
    writer = gguf.GGUFWriter(tmp_path / "t.gguf", "qwen3")
    writer.add_embedding_length(1536)
    writer.add_tensor("token_embd.weight", np.zeros((4, 1536), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert text_model_width(tmp_path / "t.gguf") == 1536
    with pytest.raises(ValueError, match="no embedding length"):
        text_model_width(rewrite(tmp_path / "t.gguf", tmp_path / "u.gguf", keys={"general.architecture": "llama"}))
