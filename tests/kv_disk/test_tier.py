"""The disk tier under the batcher's slots, on the tests' successor engine (whose exported "rows" are its token
ids): a restarted batcher reads a conversation back instead of computing it; a hang-up while its blocks are read
frees the slot at once; a block that cannot be read is computed instead. A hybrid model's slot (the recurrent
fake engine) saves its states beside its blocks and resumes from them."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
from fakes import N_VOCAB, RecurrentEngine, SuccessorEngine

from strata.config import SpeculativeConfig
from strata.kv_disk import KvTier
from strata.kv_disk.store import BlockStore
from strata.scheduling.batcher import Batcher, Job
from strata.scheduling.drafts import speculation
from strata.text.sampling import Sampler, SamplingParams

BLOCK = 8


def _tier(path: Path, engine: SuccessorEngine, lines: list[str] | None = None) -> KvTier:
    log = lines.append if lines is not None else print
    return KvTier(str(path), engine.kv_identity, 10**6, engine.kv_position_bytes, BLOCK, log)


def _job(ids: list[int], max_tokens: int = 3, **kw: object) -> Job:
    return Job(ids, Sampler(SamplingParams(temperature=0), N_VOCAB), max_tokens, set(), **kw)  # type: ignore[arg-type]


def _run(batcher: Batcher, job: Job) -> None:
    batcher.add(job)
    deadline = time.monotonic() + 10
    while job.finish is None:
        assert time.monotonic() < deadline
        batcher.step()


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, N_VOCAB, n)]


def _first_turn(path: Path, prompt: list[int], engine_type: type[SuccessorEngine] = SuccessorEngine,
                **kw: object) -> Job:
    engine = engine_type(n_ctx=128)
    tier = _tier(path, engine)
    job = _job(prompt, **kw)
    _run(Batcher(engine, tier=tier), job)
    tier.close()  # a clean shutdown: the queue is written
    return job


def test_a_restarted_batcher_reads_the_conversation_back(tmp_path: Path) -> None:
    prompt = _prompt(40)
    first = _first_turn(tmp_path, prompt)
    assert len(list(tmp_path.glob("*.kvb"))) == 42 // BLOCK  # the prompt and 2 evaluated answer tokens: 5 blocks
    engine = SuccessorEngine(n_ctx=128)
    tier = _tier(tmp_path, engine)
    turn = prompt + first.tokens + _prompt(10, seed=1)  # the next turn of the conversation
    job = _job(turn)
    _run(Batcher(engine, tier=tier), job)
    assert job.disk_tokens == job.reused == 40  # 5 blocks read; the rest of the prompt computed
    assert engine.caches[0][:40] == turn[:40]
    assert engine.calls[0][0][1] == turn[40:]  # the first call starts where the blocks end
    assert tier.status()["read_blocks"] == 5
    tier.close()


def test_the_ram_prefix_comes_first_and_the_disk_extends_it(tmp_path: Path) -> None:
    prompt = _prompt(40)
    _first_turn(tmp_path, prompt)
    engine = SuccessorEngine(n_ctx=128)
    tier = _tier(tmp_path, engine)
    batcher = Batcher(engine, tier=tier)
    _run(batcher, _job(prompt[:20], max_tokens=1))  # the slot now holds 20 positions computed here
    job = _job(prompt + [1, 2, 3])
    _run(batcher, job)
    assert job.reused == 40 and job.disk_tokens == 40 - 16  # cut back to the block at 16, then blocks 2..4 read
    assert engine.caches[0][:40] == prompt
    tier.close()


@pytest.mark.parametrize("engine_type", [SuccessorEngine, RecurrentEngine])
def test_a_hang_up_while_blocks_are_read_frees_the_slot(tmp_path: Path, engine_type: type[SuccessorEngine]) -> None:
    prompt = _prompt(40)
    _first_turn(tmp_path, prompt, engine_type)
    engine = engine_type(n_ctx=128)
    tier = _tier(tmp_path, engine)
    gate = threading.Event()
    read = tier.store.get

    def stuck_get(name: bytes) -> tuple[int, memoryview, memoryview]:
        gate.wait(10)  # a disk that does not answer
        return read(name)

    tier.store.get = stuck_get  # type: ignore[method-assign]
    batcher = Batcher(engine, tier=tier)
    job = _job(prompt + [1])
    batcher.add(job)
    assert batcher.step() == [] and job.loading is not None and not engine.calls  # waiting: nothing computed
    threading.Timer(0.01, batcher.cancel, [job]).start()
    started = time.monotonic()
    while job.finish is None:
        batcher.step()
    assert job.finish == "cancel" and batcher.free_slots == 1
    assert time.monotonic() - started < 0.1
    gate.set()
    _run(batcher, _job(prompt + [2]))  # the slot serves on (a recurrent one from where it has a state)
    tier.close()


def test_a_corrupt_block_is_computed_instead(tmp_path: Path) -> None:
    prompt = _prompt(40)
    _first_turn(tmp_path, prompt)
    engine = SuccessorEngine(n_ctx=128)
    lines: list[str] = []
    tier = _tier(tmp_path, engine, lines)
    third = tmp_path / (tier.names(prompt)[2].hex() + ".kvb")
    data = bytearray(third.read_bytes())
    data[-1] ^= 1
    third.write_bytes(bytes(data))
    job = _job(prompt + [1])
    _run(Batcher(engine, tier=tier), job)
    assert job.disk_tokens == 16 and engine.caches[0][:41] == prompt + [1]  # blocks 0, 1 read; the rest computed
    assert len(lines) == 1 and "could not be read" in lines[0] and tier.store.removed == 1
    tier.close()  # the job's blocks, the recomputed one too, are saved as it leaves
    store = BlockStore(tmp_path, engine.kv_identity, 10**6)
    assert bytes(store.get(tier.names(prompt)[2])[1]) == bytes(engine.export_kv(0, 16, BLOCK))
    store.close()


def test_rows_without_portable_keys_are_not_saved(tmp_path: Path) -> None:
    engine = SuccessorEngine(n_ctx=128)
    engine.picture_width = 2
    tier = _tier(tmp_path, engine)
    rows = np.zeros((4, 2), np.float32)  # picture rows without a digest: their keys name this process's array
    _run(Batcher(engine, tier=tier), _job(_prompt(30), spans=[(2, rows)]))
    tier.close()
    assert not list(tmp_path.glob("*.kvb"))


def _files_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.kvb"))


def test_a_restarted_hybrid_batcher_resumes_from_a_state_record(tmp_path: Path) -> None:
    prompt = _prompt(40)
    first = _first_turn(tmp_path, prompt, RecurrentEngine, turn_starts=[0, 20])
    engine = RecurrentEngine(n_ctx=128)
    tier = _tier(tmp_path, engine)
    # 5 blocks; the states at the slot's end (42: the prompt and 2 evaluated answer tokens) and its snapshots
    assert tier.status()["blocks"] == 5 and tier.status()["state_records"] == 3
    assert tier.store.state_ends(0, 100) == [42, 40, 20]
    assert tier.status()["bytes"] == _files_bytes(tmp_path)  # the records count in the byte budget
    turn = prompt + first.tokens + _prompt(10, seed=1)
    job = _job(turn)
    _run(Batcher(engine, tier=tier), job)
    assert job.disk_tokens == job.reused == 42  # 5 blocks, then the record: 2 positions and the state at 42
    assert engine.loads == [(0, 42)] and engine.calls[0][0][1] == turn[42:]
    assert job.tokens == [(turn[-1] + 1 + i) % N_VOCAB for i in range(3)]
    tier.close()


def test_a_corrupt_state_record_is_computed_instead(tmp_path: Path) -> None:
    prompt = _prompt(40)
    first = _first_turn(tmp_path, prompt, RecurrentEngine)
    engine = RecurrentEngine(n_ctx=128)
    lines: list[str] = []
    tier = _tier(tmp_path, engine, lines)
    turn = prompt + first.tokens + [1]
    record = tmp_path / (tier.state_name(turn, 42, tier.names(turn)).hex() + ".kvb")
    data = bytearray(record.read_bytes())
    data[-1] ^= 1  # a byte of the state
    record.write_bytes(bytes(data))
    job = _job(turn)
    _run(Batcher(engine, tier=tier), job)
    assert job.reused == job.disk_tokens == 0 and not engine.loads  # the blocks read have no state: computed
    assert engine.caches[0][:len(turn)] == turn and job.tokens == [(turn[-1] + 1 + i) % N_VOCAB for i in range(3)]
    assert len(lines) == 1 and "could not be read" in lines[0] and tier.store.removed == 1
    assert not record.exists()
    tier.close()


def test_the_live_state_goes_first_and_a_full_queue_drops_the_rest(tmp_path: Path) -> None:
    """A queue with room for the blocks and one state record takes the one at the slot's end, the most likely to
    be continued."""
    engine = RecurrentEngine(n_ctx=128)
    block_bytes = BLOCK * engine.kv_position_bytes
    tier = KvTier(str(tmp_path), engine.kv_identity, 10**6, engine.kv_position_bytes, BLOCK,
                  queue_bytes=5 * block_bytes + 2 * engine.kv_position_bytes + engine.state_bytes)
    gate = threading.Event()
    put = tier.store.put

    def held_put(*args: object, **kw: object) -> None:
        gate.wait(10)  # a slow disk: the queue fills
        put(*args, **kw)  # type: ignore[arg-type]

    tier.store.put = held_put  # type: ignore[method-assign]
    _run(Batcher(engine, tier=tier), _job(_prompt(40), turn_starts=[0, 20]))
    assert tier.writer.dropped == 2  # the snapshots at 40 and 20
    gate.set()
    tier.close()
    assert tier.store.state_ends(0, 100) == [42]


def test_a_slot_stopped_inside_a_draft_stores_states_only_where_its_keys_reach(tmp_path: Path) -> None:
    """A stop id inside an accepted draft ends the job before its sequence is rolled back: the state there is past
    the keys the slot names, so it is not stored; the snapshot at the prompt's end is."""
    engine = RecurrentEngine(n_ctx=100)
    tier = _tier(tmp_path, engine)
    job = _job([*range(16), 0, 1, 2], max_tokens=40, speculation=speculation(SpeculativeConfig(
        source="lookup", adaptive=False, max_draft=4)))
    job.stop_ids = {9}
    _run(Batcher(engine, slowdown=None, tier=tier), job)
    assert job.finish == "stop" and engine.restores  # rolled back to the state before its last step
    tier.close()
    assert tier.store.state_ends(0, 100) == [19]
