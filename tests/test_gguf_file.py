"""`strata.gguf_file` against the `gguf` package's own reader, and on broken files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from strata.gguf_file import GGUFError, GGUFFile


@pytest.fixture(scope="module")
def q4k_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from strata.modelgen import write_random_model

    # Q4_K, Q6_K, Q8_0 and F32 tensors side by side exercise every block-size rule.
    return write_random_model(tmp_path_factory.mktemp("gguf") / "m.gguf", arch="qwen3moe", dtype="q4_k")


def test_metadata_and_tensors_equal_gguf_reader(q4k_model: Path) -> None:
    reference = GGUFReader(q4k_model)
    with GGUFFile(q4k_model) as file:
        expected_keys = {k for k in reference.fields if not k.startswith("GGUF.")}
        assert set(file.metadata) == expected_keys
        for key in expected_keys:
            want, got = reference.fields[key].contents(), file.metadata[key]
            if isinstance(got, np.ndarray):
                np.testing.assert_array_equal(got, np.asarray(want))
            else:
                assert got == want, key
        assert [t.name for t in file.tensors] == [t.name for t in reference.tensors]
        for ours, theirs in zip(file.tensors, reference.tensors, strict=True):
            assert ours.shape == tuple(int(n) for n in theirs.shape)
            assert ours.type == int(theirs.tensor_type)
            assert ours.n_bytes == theirs.n_bytes
            view = file.data(ours)
            np.testing.assert_array_equal(view, np.asarray(theirs.data).reshape(-1).view(np.uint8))
            assert not view.flags.writeable


def test_suffix_lookup(q4k_model: Path) -> None:
    with GGUFFile(q4k_model) as file:
        assert file.tensor("token_embd") is file.tensor("token_embd.weight") is not None
        assert file.tensor("no_such_tensor") is None


@pytest.mark.parametrize("cut", [3, 20, 200, -100])
def test_truncated_files_raise_gguf_error(q4k_model: Path, tmp_path: Path, cut: int) -> None:
    data = q4k_model.read_bytes()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(data[:cut] if cut > 0 else data[:len(data) + cut])
    with pytest.raises(GGUFError, match="broken.gguf"):
        GGUFFile(broken)


def test_not_gguf(tmp_path: Path) -> None:
    other = tmp_path / "notes.txt"
    other.write_text("hello, this is not a model file at all")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(other)
