"""A model split into several files (llama.cpp's `gguf-split` layout, written by the `gguf` package's writer) reads
as one from its first part: its metadata, its tensors' bytes, and the engine's logits bit-identical to the whole
file's; a part named instead of the first, a part missing or a stray file are one clear error each."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf_rewrite import rewrite

from strata.gguf_file import GGUFError, GGUFFile, split_part_path
from strata.model_file import ModelFileError, check_model_file


@pytest.fixture(scope="module")
def split(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_model` in parts of 8 tensors each; the first part's path."""
    return rewrite(tiny_model, tmp_path_factory.mktemp("split") / "tiny.gguf", split_max_tensors=8)


def test_the_parts_read_as_the_whole_file(tiny_model: Path, split: Path) -> None:
    with GGUFFile(tiny_model) as whole, GGUFFile(split) as parts:
        count = int(parts.metadata["split.count"])
        assert count >= 3 and parts.paths == [split_part_path(str(split), no, count) for no in range(1, count + 1)]
        assert {key: value for key, value in parts.metadata.items() if not key.startswith("split.")}.keys() == \
            whole.metadata.keys()
        assert [t.name for t in parts.tensors] == [t.name for t in whole.tensors]
        assert {t.part for t in parts.tensors} == set(range(count))
        for mine, theirs in zip(parts.tensors, whole.tensors, strict=True):
            np.testing.assert_array_equal(parts.data(mine), whole.data(theirs))


def test_the_engine_gives_the_whole_files_logits(tiny_model: Path, split: Path) -> None:
    from strata.engine_cffi import Engine

    tokens = [1, 5, 9, 42, 7]
    with Engine.load(tiny_model, n_ctx=64) as whole, Engine.load(split, n_ctx=64) as parts:
        np.testing.assert_array_equal(parts.eval(tokens, all_logits=True), whole.eval(tokens, all_logits=True))
    assert check_model_file(split) == "qwen3moe"


def test_a_wrong_or_missing_part_is_one_clear_error(split: Path, tmp_path: Path) -> None:
    with GGUFFile(split) as file:
        count, second = len(file.paths), Path(file.paths[1])
    with pytest.raises(ModelFileError, match=rf"part 2 of {count} of a split model: name its first part "
                                             rf"\(.*tiny-00001-of-0000{count}\.gguf\)"):
        check_model_file(second)
    alone = tmp_path / split.name
    shutil.copy(split, alone)  # the first part without the others
    with pytest.raises(GGUFError, match=rf"part 2 of {count} of the split model is missing \(.*-00002-of-"):
        GGUFFile(alone)
    for no in range(3, count + 1):
        part = Path(split_part_path(str(split), no, count))
        shutil.copy(part, tmp_path / part.name)
    shutil.copy(split, tmp_path / Path(split_part_path(str(split), 2, count)).name)  # a stray file in its place
    with pytest.raises(GGUFError, match=r"not part 2 of .* \(its split.no and split.count say otherwise\)"):
        GGUFFile(alone)
