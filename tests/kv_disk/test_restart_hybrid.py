"""A restart of a hybrid model (`qwen35moe`: Gated DeltaNet and attention layers) through the real engine: the
disk tier's blocks and state records put a new engine where the first one was, and its logits are those of the
first engine going on from memory, bit for bit."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from fakes import RecordingEngine

from strata.engine_cffi import BatchItem, Engine
from strata.kv_disk import KvTier
from strata.modelgen import write_random_model
from strata.scheduling.batcher import Batcher, Job
from strata.text.sampling import Sampler, SamplingParams

BLOCK = 16
TURN_STARTS = [0, 40, 64]  # the prompt's messages: snapshots at 40, 64 (a block's end) and the prompt's end


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("models") / "hybrid.gguf", arch="qwen35moe", size="tiny",
                              dtype="f32", vocab="bytes", seed=0)


class _Logits(RecordingEngine):
    """The engine, with the last row of logits of each sequence of each call kept (`rows`)."""

    def __init__(self, engine: Engine):
        super().__init__(engine)
        self.rows: list[np.ndarray] = []

    def eval_batch(self, items: Sequence[BatchItem], notify_fd: int = -1) -> list[np.ndarray]:
        results = super().eval_batch(items, notify_fd)
        self.rows += [rows[-1].copy() for rows in results if len(rows)]
        return results


def _prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def _run(batcher: Batcher, prompt: list[int], turn_starts: Sequence[int] = TURN_STARTS) -> Job:
    job = Job(prompt, Sampler(SamplingParams(temperature=0), batcher.engine.n_vocab), 6, set(),
              turn_starts=turn_starts)
    batcher.add(job)
    while job.finish is None:
        batcher.step()
    assert job.finish == "length"
    return job


def _turns(model: Path, directory: Path | None, prompts: list[list[int]]) -> tuple[list[Job], list[np.ndarray]]:
    """Each prompt in turn, with the answer before it appended to it, on one engine: the jobs, the logits."""
    with Engine.load(model, n_ctx=512, threads=2, n_batch=32, kv="f16") as real:
        engine = _Logits(real)
        tier = None if directory is None else KvTier(str(directory), real.kv_identity, 10**8,
                                                     real.kv_position_bytes, BLOCK)
        batcher = Batcher(engine, tier=tier)
        jobs: list[Job] = []
        for prompt in prompts:
            history = jobs[-1].history if jobs else []
            jobs.append(_run(batcher, history + prompt))
        if tier is not None:
            tier.close()
    return jobs, engine.rows


def test_a_restart_resumes_from_the_stored_state_and_answers_the_same(hybrid_model: Path, tmp_path: Path) -> None:
    first, second = _prompt(100, 0), _prompt(20, 1)
    jobs, rows = _turns(hybrid_model, None, [first, second])  # the second turn from the live state in memory
    cold, _ = _turns(hybrid_model, tmp_path, [first])
    assert cold[0].disk_tokens == 0 and cold[0].tokens == jobs[0].tokens
    assert len(list(tmp_path.glob("*.kvb"))) == 105 // BLOCK + 4  # the blocks; states at 40, 64, 100, 105
    again, again_rows = _turns(hybrid_model, tmp_path, [jobs[0].history + second])
    assert again[0].disk_tokens == again[0].reused == 105  # 6 blocks, then the state record with 9 positions
    assert again[0].tokens == jobs[1].tokens
    assert np.array_equal(again_rows[0], rows[len(rows) - len(again_rows)])  # the first answer token's logits


def test_the_same_prompt_again_resumes_from_its_last_snapshot(hybrid_model: Path, tmp_path: Path) -> None:
    prompt = _prompt(100, 2)
    cold, rows = _turns(hybrid_model, tmp_path, [prompt])
    again, again_rows = _turns(hybrid_model, tmp_path, [prompt])
    # the state at 100 is past what a job may reuse (its last token is evaluated): the one at 64, a record without
    # rows after 4 blocks
    assert again[0].reused == again[0].disk_tokens == 64
    assert again[0].tokens == cold[0].tokens
    assert np.array_equal(again_rows, rows[len(rows) - len(again_rows):])
