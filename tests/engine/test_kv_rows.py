"""A sequence's cached positions as bytes (`Engine.export_kv` / `import_kv`): positions imported into another
sequence, or another context of the same model, continue exactly as the evaluated ones do."""

from __future__ import annotations

import pathlib

import gguf
import numpy as np
import pytest

from strata.engine_cffi import Engine, EngineError, PictureRows, crc32c
from strata.modelgen import hparams_for, write_random_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_random_model(tmp_path_factory.mktemp("kv_rows") / "moe.gguf", arch="qwen3moe", size="tiny",
                              dtype="q8_0")


@pytest.fixture(scope="module")
def mrope_model(model: pathlib.Path) -> pathlib.Path:
    """The tiny qwen3moe as Qwen3-VL's MoE text model: the same tensors, its keys under `qwen3vlmoe`, and
    multi-axis RoPE sections (12, 10, 10 of the 32 frequency pairs)."""
    reader = gguf.GGUFReader(model)
    path = model.with_name("vlmoe.gguf")
    writer = gguf.GGUFWriter(path, "qwen3vlmoe")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == gguf.Keys.General.ARCHITECTURE:
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key.replace("qwen3moe.", "qwen3vlmoe."), field.contents(), field.types[0], sub_type)
    writer.add_array("qwen3vlmoe.rope.dimension_sections", [12, 10, 10, 0])
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


@pytest.mark.parametrize("kv", ["f32", "f16", "int8"])
def test_imported_positions_continue_bit_for_bit(model: pathlib.Path, kv: str) -> None:
    prompt, rest = _tokens(40, 0), _tokens(9, 1)
    with Engine.load(model, n_ctx=64, threads=2, n_batch=16, kv=kv, n_seq=2) as engine:
        engine.eval(prompt[:32], seq=0)
        blocks = [engine.export_kv(0, first, 16) for first in (0, 16)]  # two whole blocks
        evaluated = engine.eval(prompt[32:] + rest, all_logits=True, seq=0)
        for first, block in zip((0, 16), blocks, strict=True):
            engine.import_kv(1, first, block.tobytes())
        assert engine.seq_n_past(1) == 32
        imported = engine.eval(prompt[32:] + rest, all_logits=True, seq=1)
    np.testing.assert_array_equal(imported, evaluated)  # the same rows, so the same arithmetic: bit-identical


def test_a_picture_s_rope_components_move_with_its_rows(mrope_model: pathlib.Path) -> None:
    """With multi-axis RoPE the text after a picture continues from the picture's largest component: positions
    imported after a picture carry those components, so the text after them turns as evaluated text does."""
    prompt, rest = _tokens(32, 4), _tokens(6, 5)
    rows = np.random.default_rng(6).standard_normal((12, 256)).astype(np.float32)
    picture = PictureRows(rows, 4)  # a grid of 4 x 3 rows from position 5: text after it at 5 + 4, not 5 + 12
    with Engine.load(mrope_model, n_ctx=64, threads=2, n_batch=16, n_seq=2) as engine:
        engine.eval(prompt, embeds=[(5, picture)], seq=0)
        blocks = [engine.export_kv(0, first, 16) for first in (0, 16)]
        evaluated = engine.eval(rest, all_logits=True, seq=0)
        for first, block in zip((0, 16), blocks, strict=True):
            engine.import_kv(1, first, block)
        imported = engine.eval(rest, all_logits=True, seq=1)
        # The same K and V rows with one-axis components (t = position, next = position + 1: the last 2 x 16
        # ints of each block) make the text after them turn as if at position 32: other logits.
        engine.keep(0, seq=1)
        for first, block in zip((0, 16), blocks, strict=True):
            flat = block.copy()
            at = np.arange(first, first + 16, dtype=np.int32)
            flat[-128:] = np.concatenate([at, at + 1]).view(np.uint8)
            engine.import_kv(1, first, flat)
        one_axis = engine.eval(rest, all_logits=True, seq=1)
    np.testing.assert_array_equal(imported, evaluated)
    assert np.abs(one_axis - evaluated).max() > 1e-3


def test_positions_move_between_contexts(model: pathlib.Path) -> None:
    """What a restarted server does: the bytes of one context's positions in a new context of the same model."""
    prompt = _tokens(24, 2)
    with Engine.load(model, n_ctx=64, threads=2, n_batch=16) as first:
        first.eval(prompt[:16])
        block = first.export_kv(0, 0, 16)
        expected = first.eval(prompt[16:])
        assert len(block) == 16 * first.kv_position_bytes
        identity = first.kv_identity
    with Engine.load(model, n_ctx=64, threads=2, n_batch=16) as second:
        assert second.kv_identity == identity
        second.import_kv(0, 0, block)
        np.testing.assert_array_equal(second.eval(prompt[16:]), expected)


def test_position_bytes_follow_the_kv_type(model: pathlib.Path) -> None:
    sizes = {}
    for kv in ("f32", "f16", "int8"):
        with Engine.load(model, n_ctx=16, threads=1, kv=kv) as engine:
            sizes[kv] = engine.kv_position_bytes
            # kv_bytes is every sequence's every position: one position is that over n_ctx
            assert engine.kv_bytes == sizes[kv] * 16
            kinds = {kv: engine.kv_identity}
            assert kinds[kv].endswith(f":{kv}:layout1")
    assert sizes["f32"] == 2 * sizes["f16"]


def test_import_checks_where_it_lands(model: pathlib.Path) -> None:
    with Engine.load(model, n_ctx=32, threads=1, n_seq=2) as engine:
        engine.eval(_tokens(8, 3))
        block = engine.export_kv(0, 0, 8)
        with pytest.raises(EngineError, match="continues at 0"):
            engine.import_kv(1, 4, block)  # not where sequence 1 continues
        with pytest.raises(EngineError, match="not whole positions"):
            engine.import_kv(1, 0, block[:-1])
        with pytest.raises(EngineError, match="holds 8"):
            engine.export_kv(0, 4, 8)  # past what it holds
        engine.import_kv(1, 0, block)
        with pytest.raises(EngineError, match="of 32"):
            engine.import_kv(1, 8, np.concatenate([block] * 4))  # past the context
        assert engine.seq_n_past(1) == 8


def test_a_hybrid_model_s_rows_are_its_attention_layers_and_its_state_goes_with_them(tmp_path: pathlib.Path) -> None:
    """A qwen35moe model (one attention layer in four): a position's bytes are its attention layer's rows only;
    positions imported leave the recurrent state invalid until the state saved there is loaded, and then the
    sequence continues bit for bit."""
    model = write_random_model(tmp_path / "hybrid.gguf", arch="qwen35moe", size="tiny", dtype="f32")
    hp = hparams_for("qwen35moe", "tiny")
    prompt, rest = _tokens(32, 8), _tokens(6, 9)
    with Engine.load(model, n_ctx=64, threads=2, n_batch=16, kv="f16", n_seq=2) as engine:
        attention_layers = hp.n_layer - sum(hp.recurrent_layers())
        rope_ints = 2 * 4  # each position's multi-axis RoPE components
        assert engine.kv_position_bytes == 2 * attention_layers * hp.n_head_kv * hp.head_dim * 2 + rope_ints
        engine.eval(prompt, seq=0)
        rows, state = engine.export_kv(0, 0, 32), engine.save_state(0)
        evaluated = engine.eval(rest, all_logits=True, seq=0)
        engine.import_kv(1, 0, rows)
        with pytest.raises(EngineError, match="recurrent state was cut back"):
            engine.eval(rest, seq=1)
        engine.load_state(1, state)
        imported = engine.eval(rest, all_logits=True, seq=1)
    np.testing.assert_array_equal(imported, evaluated)


def test_crc32c_is_castagnoli_s() -> None:
    """The disk tier's checksum: CRC-32C's check value (RFC 3720's "123456789"), continued across pieces, over
    lengths that are not whole words."""
    assert crc32c(b"123456789") == 0xE3069283
    data = np.random.default_rng(7).integers(0, 256, 1001, dtype=np.uint8)
    assert crc32c(data[500:], crc32c(data[:500])) == crc32c(data) == crc32c(data.tobytes())
    assert crc32c(b"") == 0
