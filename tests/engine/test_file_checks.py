"""Files the engine does not run are refused in one line that names what is missing, before anything else is read."""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pytest
from gguf import GGUFWriter

from strata.engine_cffi import Engine, EngineError


def _write(path: pathlib.Path, arch: str, **keys: Any) -> pathlib.Path:
    """A header-only model: `general.architecture`, the given `{arch}.*` keys and a small token_embd."""
    writer = GGUFWriter(str(path), arch)
    for name, value in keys.items():
        key = f"{arch}.{name.replace('__', '.')}"
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((16, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


_LLAMA = {"context_length": 256, "embedding_length": 64, "block_count": 1, "feed_forward_length": 128,
          "attention__head_count": 2, "attention__head_count_kv": 1}


def test_an_lfm2_text_file_names_its_architecture(tmp_path: pathlib.Path) -> None:
    # LFM2 stores head_count_kv per layer (0 for its convolution layers): reading it as ours would fail obscurely
    path = _write(tmp_path / "lfm2.gguf", "lfm2", block_count=4, embedding_length=64,
                  attention__head_count_kv=[0, 0, 2, 0])
    expected = (r"^unsupported architecture 'lfm2' \(this engine runs qwen3moe, qwen3, llama, qwen3vl, qwen3vlmoe, "
                r"qwen35, qwen35moe\)$")
    with pytest.raises(EngineError, match=expected):
        Engine.load(path)


@pytest.mark.parametrize("arch", ["qwen2vl", "qwen25vl", "gemma3", "lfm2moe"])
def test_other_architectures_are_named(tmp_path: pathlib.Path, arch: str) -> None:
    with pytest.raises(EngineError, match=f"^unsupported architecture '{arch}'"):
        Engine.load(_write(tmp_path / "m.gguf", arch, **_LLAMA))


@pytest.mark.parametrize("kind", ["yarn", "linear", "longrope"])
def test_rope_scaling_the_engine_does_not_apply_is_refused(tmp_path: pathlib.Path, kind: str) -> None:
    path = _write(tmp_path / "m.gguf", "llama", **_LLAMA, rope__scaling__type=kind, rope__scaling__factor=4.0)
    with pytest.raises(EngineError, match=f"unsupported rope.scaling.type '{kind}'"):
        Engine.load(path)


def test_partial_rope_is_refused(tmp_path: pathlib.Path) -> None:
    path = _write(tmp_path / "m.gguf", "llama", **_LLAMA, rope__dimension_count=16)
    with pytest.raises(EngineError, match="rope.dimension_count 16 differs from the head size 32"):
        Engine.load(path)


@pytest.mark.parametrize(("arch", "keys", "message"), [
    ("qwen3", {"rope__dimension_sections": [8, 4, 4, 0]}, "rope.dimension_sections on qwen3, whose RoPE has one axis"),
    ("qwen3vl", {"rope__dimension_sections": [8, 8, 8, 0]}, r"expected three sections of at most n_rot / 2 = 16"),
    ("qwen3vl", {"rope__dimension_sections": [8, 4, 4, 0, 0]}, "rope.dimension_sections has 5 values"),
    ("qwen3vl", {"n_deepstack_layers": 3}, "n_deepstack_layers 3 on qwen3vl with 1 layers"),
    ("qwen3", {"n_deepstack_layers": 1}, "n_deepstack_layers 1 on qwen3"),
])
def test_multi_axis_rope_and_deepstack_keys_are_checked(tmp_path: pathlib.Path, arch: str, keys: dict,
                                                         message: str) -> None:
    # before any tensor is read: these header-only files have none but token_embd
    with pytest.raises(EngineError, match=message):
        Engine.load(_write(tmp_path / "m.gguf", arch, **_LLAMA, **keys))
