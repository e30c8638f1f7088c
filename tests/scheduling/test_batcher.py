"""The generation loop on a scripted engine (next token = last + 1), and through the real engine on a generated
model."""

from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest
from fakes import N_VOCAB, RecurrentSuccessorEngine, SuccessorEngine, TimedEngine

from strata.scheduling.batcher import Batcher, Job, generate
from strata.text.prompt import render_chat
from strata.text.sampling import Sampler, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def job(ids: list[int], max_tokens: int | None = 1, stop_ids: set[int] | None = None, **kw) -> Job:
    return Job(ids, Sampler(GREEDY, N_VOCAB), max_tokens, stop_ids or set(), **kw)


def run(batcher: Batcher, *jobs: Job) -> None:
    """Add the jobs that have no slot yet, then step until every one of them has finished."""
    for j in jobs:
        if j.seq < 0:
            batcher.add(j)
    while any(j.finish is None for j in jobs):
        batcher.step()


def test_greedy_generation_stops_at_max_tokens() -> None:
    engine = SuccessorEngine()
    out = list(generate(engine, [1, 2], Sampler(GREEDY, N_VOCAB), max_tokens=4, stop_ids=set()))
    assert out == [3, 4, 5, 6]
    # one prefill, one decode per token but the last (its logits are never needed)
    assert engine.calls == [[(0, [1, 2], None)], [(0, [3], None)], [(0, [4], None)], [(0, [5], None)]]
    assert engine.caches[0] == [1, 2, 3, 4, 5]


def test_a_stop_id_ends_generation_unyielded() -> None:
    engine = SuccessorEngine()
    out = list(generate(engine, [1], Sampler(GREEDY, N_VOCAB), max_tokens=10, stop_ids={5, 12}))
    assert out == [2, 3, 4]
    assert engine.caches[0] == [1, 2, 3, 4]


def test_generation_ends_with_the_context() -> None:
    engine = SuccessorEngine(n_ctx=5)
    out = list(generate(engine, [0, 1, 2], Sampler(GREEDY, N_VOCAB), max_tokens=10, stop_ids=set()))
    assert out == [3, 4]


def test_a_job_owns_its_token_budget_within_its_context() -> None:
    engine = SuccessorEngine(n_ctx=8)
    batcher = Batcher(engine, n_batch=8)
    capped, free = job([0, 1, 2], max_tokens=3), job([0, 1, 2], max_tokens=None)
    run(batcher, capped)
    run(batcher, free)
    assert (capped.budget, capped.tokens, capped.finish) == (3, [3, 4, 5], "length")
    assert (free.budget, free.tokens, free.finish) == (5, [3, 4, 5, 6, 7], "length")  # as many as the context holds


def test_a_cached_prompt_prefix_is_not_evaluated_again() -> None:
    engine = SuccessorEngine()
    batcher = Batcher(engine)
    run(batcher, job([7, 8, 9]))
    engine.calls.clear()
    run(batcher, second := job([7, 8, 9, 10, 11]))
    assert engine.calls[0] == [(0, [10, 11], None)] and second.reused == 3


def test_a_fully_cached_prompt_evaluates_its_last_token() -> None:
    engine = SuccessorEngine()
    batcher = Batcher(engine)
    run(batcher, job([7, 8, 9, 1], max_tokens=3))  # the prompt, then tokens of an earlier answer
    engine.calls.clear()
    run(batcher, again := job([7, 8, 9]))
    assert engine.calls[0] == [(0, [9], None)]
    assert again.tokens == [10] and again.reused == 2


def test_picture_rows_are_matched_by_digest_and_cut_at_the_cached_prefix() -> None:
    engine = SuccessorEngine()
    batcher = Batcher(engine)
    rows = np.ones((3, 2), np.float32)
    keys = [1, 2, ("pic", 0), ("pic", 1), ("pic", 2), 6]
    run(batcher, job([1, 2, 0, 0, 0, 6], keys=keys, spans=[(2, rows)]))
    engine.calls.clear()
    # the same picture, then another text: every row of the picture is reused
    run(batcher, j := job([1, 2, 0, 0, 0, 7], keys=keys[:5] + [7], spans=[(2, rows)]))
    assert engine.calls[0] == [(0, [7], None)] and j.reused == 5
    engine.calls.clear()
    # the picture's first row matches a cached one, the others do not: the rest of it is evaluated, its rows cut
    other = [1, 2, ("pic", 0), ("new", 1), ("new", 2), 7]
    run(batcher, job([1, 2, 0, 0, 0, 7], keys=other, spans=[(2, rows)]))
    ((_, tokens, embeds),) = engine.calls[0]
    assert tokens == [0, 0, 7] and embeds[0][0] == 0 and embeds[0][1].shape == (2, 2)


def test_a_slot_knows_what_each_cached_position_holds() -> None:
    # through a prompt in chunks, picture rows, decoding and a cancel mid-prompt
    engine = SuccessorEngine(n_batch=2)
    batcher = Batcher(engine, n_batch=2)
    keys = [1, 2, ("pic", 0), ("pic", 1), 5]
    run(batcher, first := job([1, 2, 0, 0, 5], max_tokens=4, keys=keys, spans=[(2, np.ones((2, 2), np.float32))]))
    slot = batcher.slots[0]
    assert slot.keys == keys + first.tokens[:-1] and len(slot.keys) == engine.seq_n_past(0)  # the last: not fed
    batcher.add(second := job([1, 2, 9, 10, 11, 12, 13]))
    batcher.step()  # [9, 10] after the reused [1, 2]
    batcher.cancel(second)
    batcher.step()
    assert second.finish == "cancel" and slot.keys == [1, 2, 9, 10] == engine.caches[0]


def test_each_engine_call_is_notified_on_the_batchers_eventfd() -> None:
    # The batcher hands its eventfd to every call; the engine writes it as the call starts (this fake as the real
    # one does: tests/engine).
    engine = SuccessorEngine()
    batcher = Batcher(engine)
    fd = os.eventfd(0, os.EFD_NONBLOCK)
    try:
        run(batcher, j := job([1, 2, 3], max_tokens=2))
        with pytest.raises(BlockingIOError):  # notify_fd -1: nothing written
            os.eventfd_read(fd)
        batcher.notify_fd = fd
        run(batcher, job([7], max_tokens=3))
        assert os.eventfd_read(fd) == len(engine.calls) - 2  # the first job's two calls were not notified
    finally:
        os.close(fd)
    assert j.tokens == [4, 5]


def test_penalties_see_the_prompt() -> None:
    engine = SuccessorEngine()
    sampler = Sampler(SamplingParams(temperature=0.0, repetition_penalty=2.0), N_VOCAB)
    # The favourite after 2 is 3, but 3 is in the prompt: penalised to 2.5, below the runner-up 4 (4.0).
    out = list(generate(engine, [3, 2], sampler, max_tokens=1, stop_ids=set()))
    assert out == [4]


def test_an_empty_prompt_is_refused() -> None:
    with pytest.raises(ValueError, match="the prompt is empty"):
        list(generate(SuccessorEngine(), [], Sampler(GREEDY, N_VOCAB), 1, set()))


# --- several jobs


def test_jobs_share_each_step_and_a_joining_prompt_comes_in_chunks() -> None:
    engine = SuccessorEngine(n_seq=3, n_ctx=256)
    batcher = Batcher(engine, step_tokens=8, slowdown=None)  # a budget of tokens only
    a = job([1, 2], max_tokens=20)
    batcher.add(a)
    batcher.step()  # a's prompt; a is decoding from now on
    b = job(list(range(20)), max_tokens=2)
    batcher.add(b)
    for _ in range(3):
        batcher.step()
    # each step: a's decode token first, then 7 of b's prompt (the budget of 8 tokens a step)
    assert [[(seq, len(tokens)) for seq, tokens, _ in call] for call in engine.calls[1:]] == \
        [[(0, 1), (1, 7)], [(0, 1), (1, 7)], [(0, 1), (1, 6)]]
    assert len(a.tokens) == 4 and b.tokens == [4]  # b's first token came with its last chunk (19 + 1 mod 16)
    run(batcher, a, b)
    assert a.tokens == [(3 + i) % N_VOCAB for i in range(20)] and b.tokens == [4, 5]


def run_until_answered(batcher: Batcher, engine: TimedEngine, long: Job) -> tuple[list[int], np.ndarray]:
    """Steps until the joining job `long` is answered: its prompt tokens in each of those steps, and the steps'
    seconds."""
    first = len(engine.calls)
    while long.finish is None:
        batcher.step()
    chunks = [sum(len(t) for seq, t, _ in call if seq == long.seq) for call in engine.calls[first:]]
    return chunks, np.diff(engine.times[first - 1:])


def test_a_joining_prompt_is_cut_so_that_a_step_takes_at_most_slowdown_times_the_decode_step() -> None:
    # a prompt token costs a twentieth of the decode step at first, twice that at position 500 (attention)
    engine = TimedEngine(0.02, lambda pos: 0.001 * (1 + pos / 500), prompting={3}, n_seq=4, n_ctx=1024)
    batcher = Batcher(engine, step_tokens=64, slowdown=2.0, clock=engine.clock)
    streams = [job([1 + i], max_tokens=400) for i in range(3)]
    run_steps = lambda n: [batcher.step() for _ in range(n)]  # noqa: E731
    for stream in streams:
        batcher.add(stream)
    run_steps(5)  # their one-token prompts, then decode-only steps: the decode step is measured
    assert batcher.budget.decode_seconds(3) == pytest.approx(0.02)
    batcher.add(long := job(list(range(16)) * 40, max_tokens=1))
    chunks, steps = run_until_answered(batcher, engine, long)
    assert all(len(call) >= 3 for call in engine.calls[-len(chunks):])  # the streams had a token in every step
    # small first, at most doubling, then what fits: 0.02 s over the average cost so far (1.03 ms)
    assert chunks[:4] == [4, 8, 16, 19]
    assert max(steps) <= 2.0 * 0.02 * 1.1  # the chunk follows the growing cost (10%: the average lags it)
    assert sum(steps > 2 * 0.02 * 0.85) > 0.8 * len(steps)  # and uses the time it has
    # every step carries some of the prompt but each 33rd, which re-measures the decode step
    assert sum(chunks) == 640 and [i for i, chunk in enumerate(chunks) if chunk < 1] == [32]


def test_steps_are_timed_by_the_engines_own_cpu_clock_where_it_has_one() -> None:
    """`Engine.cpu_seconds` counts the engine's threads only: the budget takes it over the process's CPU time,
    which counts the event loop and a tokenising worker too."""
    engine = TimedEngine(0.02, lambda pos: 0.0, prompting=set(), n_seq=2, n_ctx=256)
    engine.cpu_seconds = engine.clock
    batcher = Batcher(engine, step_tokens=64)
    batcher.add(job([1], max_tokens=10))
    for _ in range(4):
        batcher.step()
    assert batcher.budget.decode_seconds(1) == pytest.approx(0.02)  # the engine's clock, not the process's
    assert Batcher(SuccessorEngine(n_seq=2)).budget.clock is time.process_time


def test_a_decode_step_timed_during_a_burst_stops_setting_the_chunks_once_re_measured() -> None:
    engine = TimedEngine(0.04, lambda pos: 0.001, prompting={3}, n_seq=4, n_ctx=16384)
    batcher = Batcher(engine, step_tokens=64, slowdown=2.0, clock=engine.clock)
    streams = [job([1 + i], max_tokens=4000) for i in range(3)]
    for stream in streams:
        batcher.add(stream)
    for _ in range(8):  # the decode-only steps are timed at twice their cost (another process had a core)
        batcher.step()
    engine.decode = 0.02  # the burst is over as the prompt joins
    batcher.add(long := job(list(range(16)) * 800, max_tokens=1))
    chunks, steps = run_until_answered(batcher, engine, long)
    refreshes = [i for i, chunk in enumerate(chunks) if chunk == 0]
    assert refreshes[:4] == [32, 65, 98, 131]
    assert max(steps[:32]) > 2.5 * 0.02  # the stale reference: steps of three times the decode step
    assert max(steps[refreshes[2]:]) <= 2.0 * 0.02 * 1.05  # after three refreshes, the median is the real step
    assert batcher.budget.decode_seconds(3) == pytest.approx(0.02)


def test_a_prompt_within_the_token_cap_joins_in_one_step() -> None:
    engine = TimedEngine(0.02, lambda pos: 0.01, prompting={1}, n_seq=2, n_ctx=256)
    batcher = Batcher(engine, step_tokens=32, slowdown=2.0, clock=engine.clock)
    batcher.add(a := job([1], max_tokens=50))
    for _ in range(3):
        batcher.step()
    batcher.add(b := job(list(range(31))))  # 31 = the cap less a's token: not cut, though 10x a's step
    batcher.step()
    assert [(seq, len(t)) for seq, t, _ in engine.calls[-1]] == [(a.seq, 1), (b.seq, 31)] and b.tokens


def test_a_new_number_of_decoding_jobs_gets_a_decode_only_step_first() -> None:
    engine = TimedEngine(0.01, lambda pos: 0.001, prompting={2}, n_seq=3, n_ctx=256)
    batcher = Batcher(engine, step_tokens=64, slowdown=3.0, clock=engine.clock)
    batcher.add(a := job([1], max_tokens=50))
    batcher.add(b := job(list(range(16)) * 4, max_tokens=50))
    batcher.step()  # nobody decodes: whole prompts
    assert [len(t) for _, t, _ in engine.calls[0]] == [1, 64]
    batcher.add(c := job(list(range(16)) * 8))
    batcher.step()  # a and b decode now, never measured as two: c waits a step
    assert [seq for seq, _, _ in engine.calls[1]] == [a.seq, b.seq]
    batcher.step()
    assert [(seq, len(t)) for seq, t, _ in engine.calls[2]] == [(a.seq, 1), (b.seq, 1), (c.seq, 4)]


def test_with_nobody_decoding_a_prompt_takes_whole_engine_chunks() -> None:
    engine = SuccessorEngine(n_ctx=256, n_batch=32)
    batcher = Batcher(engine, step_tokens=8)
    run(batcher, job(list(range(16)) * 5))
    assert [len(call[0][1]) for call in engine.calls] == [32, 32, 16]


def test_a_new_job_takes_the_idle_slot_with_the_longest_prefix_else_the_least_recently_used() -> None:
    engine = SuccessorEngine(n_seq=3)
    batcher = Batcher(engine)
    run(batcher, job([1, 1, 1, 1]))  # slot 0
    batcher.add(busy := job([5, 5], max_tokens=50))  # slot 1, empty: before any used one
    run(batcher, job([3, 3, 3]))  # slot 2
    assert busy.seq == 1 and engine.caches[2][:3] == [3, 3, 3]
    run(batcher, c := job([1, 1, 1, 2]))
    assert c.seq == 0 and c.reused == 3
    run(batcher, d := job([9, 9]))  # no prefix anywhere: the least recently used idle slot (2) is evicted
    assert d.seq == 2 and d.reused == 0 and engine.caches[2][:2] == [9, 9]
    batcher.cancel(busy)
    batcher.step()
    assert busy.finish == "cancel" and batcher.free_slots == 3


def test_a_prefix_held_by_a_busy_slot_is_copied() -> None:
    engine = SuccessorEngine(n_seq=2)
    batcher = Batcher(engine)
    batcher.add(main := job([4, 4, 4, 4, 4, 1], max_tokens=30))
    batcher.step()
    run(batcher, side := job([4, 4, 4, 4, 4, 2]))
    assert engine.copies == [(main.seq, side.seq, 5)] and side.reused == 5
    assert main.finish is None


def test_on_a_recurrent_engine_only_a_whole_cache_is_reused() -> None:
    """A recurrent model's state cannot be cut back (the fake refuses an eval of a cut sequence, as the engine
    does): a prompt that continues a slot's whole cache reuses it, another slot's whole cache is copied with its
    state, and a shorter shared prefix is not reused: the slot starts empty."""
    engine = RecurrentSuccessorEngine(n_seq=2)
    batcher = Batcher(engine)
    run(batcher, first := job([4, 4, 4, 4], max_tokens=2))  # slot 0 holds 4, 4, 4, 4, 5 (its answer's first token)
    held = list(engine.caches[first.seq])
    run(batcher, turn := job([*held, 7, 7]))  # the next turn continues all of it
    assert turn.seq == first.seq and turn.reused == len(held)
    held = list(engine.caches[first.seq])
    batcher.add(busy := job([*held[:6], 9, 9], max_tokens=30))  # 6 of the 7 held: a transformer would reuse them
    assert busy.reused == 0 and engine.seq_n_past(busy.seq) == 0
    batcher.step()
    prompt = list(engine.caches[busy.seq])
    run(batcher, side := job([*prompt, 2]))  # the busy slot's whole cache, copied with its state
    assert engine.copies == [(busy.seq, side.seq, len(prompt))] and side.reused == len(prompt)
    assert busy.finish is None and not engine.invalid


def test_cancel_frees_the_slot_at_the_next_step_and_the_others_go_on() -> None:
    engine = SuccessorEngine(n_seq=2, n_ctx=256)
    batcher = Batcher(engine, step_tokens=4, slowdown=None)
    batcher.add(a := job([1], max_tokens=10))
    batcher.add(b := job(list(range(40)), max_tokens=3))
    batcher.step()
    batcher.step()
    batcher.cancel(b)  # between steps: it never reaches the engine again
    n_calls = len(engine.calls)
    assert b in batcher.step() and b.finish == "cancel" and batcher.free_slots == 1
    assert all(seq == a.seq for call in engine.calls[n_calls:] for seq, _, _ in call)
    run(batcher, a)
    assert a.tokens == [(2 + i) % N_VOCAB for i in range(10)]


def test_a_job_cancelled_between_steps_leaves_without_an_engine_call() -> None:
    engine = SuccessorEngine(n_seq=2)
    batcher = Batcher(engine)
    batcher.add(a := job([1], max_tokens=5))
    batcher.add(b := job([7], max_tokens=5))
    batcher.step()
    batcher.cancel(b)
    n_calls = len(engine.calls)
    assert batcher.step() == [b] and b.finish == "cancel" and len(engine.calls) == n_calls  # told at once
    run(batcher, a)
    assert a.tokens == [2, 3, 4, 5, 6]


def test_an_abort_in_flight_drops_only_that_job() -> None:
    engine = SuccessorEngine(n_seq=2)
    batcher = Batcher(engine)
    batcher.add(a := job([1], max_tokens=5))
    batcher.add(b := job([7], max_tokens=5))
    evaluate = engine.eval_batch

    def cancelled_in_flight(items, notify_fd=-1):
        batcher.cancel(b)  # from another thread while the call runs: the engine's flag for b goes up
        assert engine.flags == {b.seq}
        engine.eval_batch = evaluate
        return evaluate(items, notify_fd=notify_fd)

    engine.eval_batch = cancelled_in_flight
    assert set(batcher.step()) == {a, b}
    assert a.tokens == [2] and b.finish == "cancel" and not engine.flags and b.tokens == []
    run(batcher, a)
    assert a.tokens == [2, 3, 4, 5, 6]


def test_greedy_generation_through_the_engine_matches_recomputation(tmp_path) -> None:
    """The incremental loop (prefill once, then one token at a time) against evaluating the whole sequence anew
    for every step."""
    from strata.engine_cffi import Engine
    from strata.modelgen import write_random_model

    path = write_random_model(tmp_path / "tiny.gguf", arch="qwen3", size="tiny", dtype="f32", seed=5)
    prompt = [40, 41, 42, 43, 44]
    with Engine.load(path, n_ctx=64, threads=1) as engine:
        sampler = Sampler(GREEDY, engine.n_vocab)
        out = list(generate(engine, prompt, sampler, max_tokens=12, stop_ids=set()))
        assert len(out) == 12
        for step, token in enumerate(out):
            engine.keep(0)
            logits = engine.eval(prompt + out[:step])
            best = int(np.argmax(logits))
            # a different choice is only acceptable on a near-tie (f32 sums in another order)
            assert best == token or logits[best] - logits[token] < 1e-4, step
        engine.keep(0)
        stop_at = out[6]
        first_stop = out.index(stop_at)
        truncated = list(generate(engine, prompt, sampler, max_tokens=12, stop_ids={stop_at}))
        assert truncated == out[:first_stop]


def test_sampled_answers_in_a_batch_equal_the_answers_alone(tmp_path) -> None:
    # Seeded draws and a greedy one: a step of four jobs draws on the engine's threads (Engine.sample_rows), a job
    # alone on the batcher's thread; each job's tokens are the same either way.
    from strata.engine_cffi import Engine
    from strata.modelgen import write_random_model

    path = write_random_model(tmp_path / "m.gguf", arch="qwen3moe", size="tiny", dtype="q8_0")
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.7, top_p=0.9, seed=2),
              SamplingParams(temperature=0.6, top_k=20, seed=3), SamplingParams(temperature=0.0)]
    prompts = [[5, 6, 7], [9, 10, 11, 12], [20, 21], [30, 31, 32]]

    def new_jobs(engine: Engine) -> list[Job]:
        return [Job(prompt, Sampler(p, engine.n_vocab), 10, set()) for prompt, p in zip(prompts, params, strict=True)]

    with Engine.load(path, n_ctx=64, threads=2, n_seq=4) as engine:
        together = new_jobs(engine)
        run(Batcher(engine), *together)
        alone = new_jobs(engine)
        for j in alone:
            run(Batcher(engine), j)
    assert [j.tokens for j in together] == [j.tokens for j in alone]
    assert len({tuple(j.tokens) for j in together}) == 4


def test_generate_command_prints_the_greedy_completion(tmp_path, capsys) -> None:
    from strata.cli import main
    from strata.engine_cffi import Engine
    from strata.modelgen import write_random_model
    from strata.text.tokenizer import Tokenizer

    path = write_random_model(tmp_path / "tiny.gguf", arch="qwen3moe", size="tiny", dtype="f32", seed=2)
    tokenizer = Tokenizer.from_gguf(path)
    prompt_ids = tokenizer.encode(render_chat(tokenizer.chat_template, [{"role": "user", "content": "Hi"}]))
    with Engine.load(path, n_ctx=256, threads=1) as engine:
        ids = list(generate(engine, prompt_ids, Sampler(GREEDY, engine.n_vocab), 8, tokenizer.eos_ids))

    argv = ["generate", "--model", str(path), "--prompt", "Hi", "--chat", "--max-tokens", "8",
            "--temperature", "0", "--threads", "1", "--context", "256"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out == tokenizer.decode(ids) + "\n"
    assert re.fullmatch(rf"prompt: {len(prompt_ids)} tokens in \d+ ms \([\d.]+ tok/s\)"
                        rf"(, decode: {len(ids) - 1} tokens in \d+ ms \([\d.]+ tok/s\))?\n", err)


def test_generate_command_reports_bad_arguments(tmp_path, capsys) -> None:
    from strata.cli import main

    assert main(["generate", "--model", str(tmp_path / "missing.gguf"), "--prompt", "x"]) == 1
    assert main(["generate", "--model", "m.gguf", "--prompt", "x", "--temperature", "-1"]) == 1
    err = capsys.readouterr().err
    assert "missing.gguf" in err and "temperature must be at least 0" in err
