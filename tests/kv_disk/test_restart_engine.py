"""A restart through the real engine: a new Engine and Batcher on the same directory read the conversation's
blocks back, and the answer is the one the first computed (greedy: the same logits bit for bit)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from strata.engine_cffi import Engine
from strata.kv_disk import KvTier
from strata.modelgen import write_random_model
from strata.scheduling.batcher import Batcher, Job
from strata.text.sampling import Sampler, SamplingParams


def _answer(model: Path, directory: Path, prompt: list[int], kv: str) -> tuple[list[int], Job]:
    with Engine.load(model, n_ctx=256, threads=2, n_batch=32, kv=kv) as engine:
        tier = KvTier(str(directory), engine.kv_identity, 10**8, engine.kv_position_bytes, 16)
        batcher = Batcher(engine, tier=tier)
        job = Job(prompt, Sampler(SamplingParams(temperature=0), engine.n_vocab), 6, set())
        batcher.add(job)
        while job.finish is None:
            batcher.step()
        tier.close()
    return job.tokens, job


def test_a_restart_reads_the_prompt_back_and_answers_the_same(tiny_model: Path, tmp_path: Path) -> None:
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 256, 100)]
    for kv in ("f16", "int8"):
        directory = tmp_path / kv
        first, cold = _answer(tiny_model, directory, prompt, kv)
        assert cold.disk_tokens == 0
        again, warm = _answer(tiny_model, directory, prompt, kv)
        assert warm.disk_tokens == warm.reused == 96  # 6 blocks of 16; the last 4 prompt tokens computed
        assert again == first


def test_another_kv_type_finds_nothing(tiny_model: Path, tmp_path: Path) -> None:
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 256, 50)]
    _answer(tiny_model, tmp_path, prompt, "f16")
    _, job = _answer(tiny_model, tmp_path, prompt, "f32")  # another KV type: the f16 blocks are removed
    assert job.disk_tokens == 0
    _, job = _answer(tiny_model, tmp_path, prompt, "f32")
    assert job.disk_tokens == 48


def test_another_model_file_finds_nothing_and_its_files_go(tiny_model: Path, tmp_path: Path) -> None:
    """A model of the same shape and settings but other weights has another identity: the first model's blocks
    are removed when the second opens the directory, never imported."""
    other = write_random_model(tmp_path / "other.gguf", arch="qwen3moe", size="tiny", dtype="f32", vocab="bytes",
                               seed=1)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, 256, 50)]
    directory = tmp_path / "kv"
    _answer(tiny_model, directory, prompt, "f16")
    first = set(directory.glob("*.kvb"))
    assert len(first) == 3
    _, job = _answer(other, directory, prompt, "f16")
    assert job.disk_tokens == 0
    assert not first & set(directory.glob("*.kvb"))  # removed: the files there now are the other model's
