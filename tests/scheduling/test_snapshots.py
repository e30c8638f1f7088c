"""Prefix reuse on a recurrent (hybrid) engine: snapshots of the state where requests branch off, and the batcher
resuming only where a slot has its state. The fake engine fails any eval whose state does not sum up exactly the
sequence's cache, so a wrong resume cannot pass unseen."""

from __future__ import annotations

import pytest
from fakes import N_VOCAB, RecurrentEngine

from strata.scheduling.batcher import Batcher, Job
from strata.scheduling.snapshots import Snapshots, snapshot_points
from strata.text.sampling import Sampler, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def job(ids: list[int], max_tokens: int = 1, turn_starts: tuple[int, ...] = ()) -> Job:
    return Job(ids, Sampler(GREEDY, N_VOCAB), max_tokens, set(), turn_starts=turn_starts)


def run(batcher: Batcher, *jobs: Job) -> None:
    for j in jobs:
        batcher.add(j)
    while any(j.finish is None for j in jobs):
        batcher.step()
    assert all(j.error is None for j in jobs), [j.error for j in jobs]


# --- the store


def test_snapshots_evict_the_least_recently_used_beyond_the_budget() -> None:
    snaps = Snapshots(budget=3 * 100, state_bytes=100)
    for p in (5, 9, 12):
        snaps.put(0, p, bytes([p]))
    snaps.take(0, 5)  # 5 is now the most recently used: 9 goes first
    snaps.put(1, 4, b"x")
    assert (snaps.positions(0), snaps.positions(1)) == ([5, 12], [4])
    assert (len(snaps), snaps.held_bytes, snaps.evicted) == (3, 300, 1)
    assert snaps.best(0, 11) == 5 and snaps.best(0, 12) == 12 and snaps.best(0, 4) == 0


def test_truncating_a_slot_drops_only_its_snapshots_past_the_cut() -> None:
    snaps = Snapshots(budget=10_000, state_bytes=100)
    for seq, p in ((0, 3), (0, 8), (1, 8)):
        snaps.put(seq, p, b"s")
    snaps.truncate(0, 7)
    assert (snaps.positions(0), snaps.positions(1)) == ([3], [8])
    snaps.clear(1)
    assert snaps.positions(1) == []
    with pytest.raises(KeyError):
        snaps.take(1, 8)


def test_a_budget_smaller_than_one_state_keeps_none() -> None:
    snaps = Snapshots(budget=99, state_bytes=100)
    snaps.put(0, 3, b"s")
    assert len(snaps) == 0 and snaps.capacity == 0


def test_snapshot_points_are_the_first_and_last_turns_and_the_prompt_end_past_the_reuse() -> None:
    assert snapshot_points([0, 10, 20, 30, 40], n_prompt=50, reused=0) == [10, 30, 40, 50]
    assert snapshot_points([0, 10, 20, 30, 40], n_prompt=50, reused=35) == [40, 50]
    assert snapshot_points([], n_prompt=7, reused=0) == [7]


# --- the batcher on a recurrent engine

SYSTEM = [1, 2, 3, 4, 5, 6]  # a "system prompt": the first turn starts after it
TURN = (6,)


def test_the_next_turn_resumes_from_the_live_state_without_a_load() -> None:
    engine = RecurrentEngine(n_seq=2)
    batcher = Batcher(engine)
    first = job(SYSTEM + [7, 8], max_tokens=3, turn_starts=TURN)
    run(batcher, first)
    follow = job(first.history + [2, 3], turn_starts=TURN)
    run(batcher, follow)
    # the cache holds the whole history but its last token, which was drawn and never fed back
    assert follow.seq == first.seq and follow.reused == len(first.history) - 1
    assert engine.loads == []


def test_a_turn_whose_answer_was_re_rendered_resumes_from_the_prompt_end_snapshot() -> None:
    engine = RecurrentEngine(n_seq=2)
    batcher = Batcher(engine)
    first = job(SYSTEM + [7, 8], max_tokens=3, turn_starts=TURN)
    run(batcher, first)
    # the template renders the answer otherwise: only the prompt is shared
    follow = job(SYSTEM + [7, 8] + [0, 0, 4], turn_starts=TURN)
    run(batcher, follow)
    assert follow.reused == first.n_prompt == 8
    assert engine.loads == [(first.seq, 8)]


def test_a_side_request_with_the_same_system_prompt_copies_from_the_first_turn_snapshot() -> None:
    engine = RecurrentEngine(n_seq=2)
    batcher = Batcher(engine)
    main = job(SYSTEM + [7, 8, 9, 10, 11, 12, 13], max_tokens=2, turn_starts=TURN)
    run(batcher, main)
    side = job(SYSTEM + [12, 13], turn_starts=TURN)  # shares less than half of main's: another slot
    run(batcher, side)
    assert side.seq != main.seq and side.reused == len(SYSTEM)
    assert engine.copies == [(main.seq, side.seq, len(SYSTEM))]
    assert engine.loads == [(side.seq, len(SYSTEM))]


def test_the_prompt_is_cut_into_chunks_at_its_snapshot_points() -> None:
    engine = RecurrentEngine()
    batcher = Batcher(engine)
    run(batcher, job(SYSTEM + [7, 8, 9], turn_starts=(6, 8)))
    assert [len(call[0][1]) for call in engine.calls] == [6, 2, 1]
    assert batcher.snapshots is not None and batcher.snapshots.positions(0) == [6, 8, 9]


def test_a_slot_without_a_state_at_the_shared_prefix_starts_from_the_longest_snapshot_below() -> None:
    engine = RecurrentEngine()
    batcher = Batcher(engine)
    run(batcher, job(SYSTEM + [7, 8, 9, 10], turn_starts=(6,)))
    branch = job(SYSTEM + [7, 8, 0, 0], turn_starts=(6,))  # shares 8 positions; snapshots at 6 and 10
    run(batcher, branch)
    assert branch.reused == 6 and engine.loads == [(0, 6)]


def test_without_room_for_snapshots_a_branch_recomputes_from_scratch() -> None:
    engine = RecurrentEngine()
    batcher = Batcher(engine, snapshot_bytes=0)
    run(batcher, job(SYSTEM + [7, 8], turn_starts=TURN))
    branch = job(SYSTEM + [0], turn_starts=TURN)
    run(batcher, branch)
    assert branch.reused == 0 and engine.loads == []
    assert engine.caches[0] == SYSTEM + [0]


def test_a_job_dropped_mid_call_leaves_its_slot_resuming_from_a_snapshot() -> None:
    class HangUpInCall(RecurrentEngine):
        """Cancels `victim` from inside the call that reaches position `at`, as a hang-up racing the step does."""

        victim: Job | None = None

        def eval_batch(self, items, notify_fd=-1):
            if self.victim is not None and self.seq_n_past(self.victim.seq) >= 6:
                batcher.cancel(self.victim)
            return super().eval_batch(items, notify_fd=notify_fd)

    engine = HangUpInCall()
    batcher = Batcher(engine, n_batch=4)
    dropped = engine.victim = job(SYSTEM + [7, 8, 9, 10, 11, 12], turn_starts=TURN)
    batcher.add(dropped)
    while dropped.finish is None:
        batcher.step()
    assert dropped.finish == "cancel" and engine.states[dropped.seq] is None
    engine.victim = None
    again = job(SYSTEM + [7, 8, 9, 10, 11, 12], turn_starts=TURN)
    run(batcher, again)
    assert again.reused == len(SYSTEM) and engine.loads == [(0, len(SYSTEM))]


def test_a_soak_of_branches_and_hang_ups_keeps_the_snapshots_within_budget_and_true() -> None:
    import random

    rng = random.Random(30)
    engine = RecurrentEngine(n_ctx=96, n_seq=3)
    batcher = Batcher(engine, step_tokens=8, snapshot_bytes=5 * RecurrentEngine.state_bytes)
    systems = [[rng.randrange(1, N_VOCAB) for _ in range(12)] for _ in range(2)]
    running: list[Job] = []
    for _ in range(300):
        while batcher.free_slots and rng.random() < 0.6:
            prompt = rng.choice(systems) + [rng.randrange(1, N_VOCAB) for _ in range(rng.randrange(1, 20))]
            starts = (12, 12 + rng.randrange(1, 6))
            running.append(Job(prompt, Sampler(GREEDY, N_VOCAB), rng.randrange(1, 10), set(), turn_starts=starts))
            batcher.add(running[-1])
        if running and rng.random() < 0.15:
            batcher.cancel(rng.choice(running))
        batcher.step()  # the fake fails any eval from a state that does not sum up its cache
        assert all(j.error is None for j in running), [j.error for j in running]
        running = [j for j in running if j.finish is None]
        snaps = batcher.snapshots
        assert snaps is not None and snaps.held_bytes <= snaps.budget
        for slot in batcher.slots:  # a snapshot is of a position the slot still holds, and equals its prefix
            for p in snaps.positions(slot.seq):
                assert p <= len(slot.keys) and list(snaps.take(slot.seq, p)) == engine.caches[slot.seq][:p]
    assert engine.loads and snaps.evicted > 0  # resumed from snapshots, and ran out of room for some
