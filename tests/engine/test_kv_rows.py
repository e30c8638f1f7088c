"""A sequence's cached positions as bytes (`Engine.export_kv` / `import_kv`): positions imported into another
sequence, or another context of the same model, continue exactly as the evaluated ones do."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from strata.engine_cffi import Engine, EngineError
from strata.modelgen import write_random_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_random_model(tmp_path_factory.mktemp("kv_rows") / "moe.gguf", arch="qwen3moe", size="tiny",
                              dtype="q8_0")


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
