"""The generation loop: jobs generating on the sequences (slots) of one engine context, advanced together.

`Batcher.step()` is one engine call: one token of every decoding job, plus prompt chunks of joining jobs within a
per-step budget, so a long prompt never holds up the streams already running. The budget is a cap of tokens,
and while a prompt longer than the cap joins, one of time (`StepBudget`: a step with prompt chunks takes at most
`slowdown` times the decoding jobs' own step, from costs measured as it runs). The server's engine thread and
`strata generate` (through `generate`) both loop over it. No I/O and no detokenising: callers render the ids.

Each slot keeps what its cache holds after its job ends (the prefix cache): a new job goes to the idle slot whose
cache shares the longest prefix with its prompt (token ids, and (picture digest, row) for picture rows), the
least recently used one when none does; a longer prefix held by a busy slot is copied over (`copy_prefix`).

The engine is an `EngineLike` (`strata.engine_cffi.Engine`, or a test's scripted engine).
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Hashable, Iterator, Sequence
from typing import Any, Literal

import numpy as np

from strata.engine_cffi import BatchItem, EngineAborted
from strata.pictures.expand import embeds_from
from strata.scheduling.engine_like import EngineLike
from strata.text.sampling import Sampler, log_probabilities

# (index in the prompt, float32 rows (n_rows, n_embd)): rows that replace the embeddings of prompt placeholders.
Embeds = Sequence[tuple[int, np.ndarray]]
_SCORED_ROWS = 64  # 64 rows of logits of a 151,936-token vocabulary: 39 MB
# How a job left its slot: a stop id, its token budget, `Batcher.cancel`, an error of its engine call or its draw.
JobFinish = Literal["stop", "length", "cancel", "error"]


def salted(keys: Sequence[Hashable], salt: str | None) -> Sequence[Hashable]:
    """A prompt's keys such that only prompts with the same salt share a prefix with it: the salt joins its first
    position's key (as vLLM's `cache_salt` joins the hash of a prompt's first block), so a different salt, or none,
    matches no position at all. Without a salt, the keys themselves."""
    if salt is None or not keys:
        return keys
    return [("salt", salt, keys[0]), *keys[1:]]


def common_prefix(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class Job:
    """One generation: a prompt, then up to `max_tokens` sampled tokens.

    The job owns its token budget: the batcher ends it with finish "length" at `budget` tokens, `max_tokens` within
    the room its context has left (every token has a place in the cache), so a caller reads `finish` and counts
    nothing itself.

    Written by the batcher's thread only, except `tokens`/`finish`, which others read (list appends and attribute
    writes are atomic), and `Batcher.cancel`.

    Args:
        ids: the prompt, at least one token.
        max_tokens: the most tokens to sample; None: as many as the context holds.
        keys: what each prompt position holds, for prefix reuse (default: the ids; (digest, row) for pictures).
        spans: pictures: (first position, float32 rows) replacing the embeddings of the placeholders there.
        tag: the caller's name for the job (the request id), shown in the slots' status.
        progress: told the job's slot (`slot`) and its prompt's positions in the cache as they grow
            (`prompt_progress(done, cached=None)`: `strata.activity.RequestProgress`), or None.
        prompt_logprobs: score the prompt: each prompt token after the first gets its log-probability and this
            many alternatives in `prompt_records` (the whole prompt is evaluated then: no cached prefix).
    """

    def __init__(self, ids: Sequence[int], sampler: Sampler, max_tokens: int | None, stop_ids: Collection[int], *,
                 keys: Sequence[Hashable] | None = None, spans: Sequence[tuple[int, Any]] = (), tag: str = "",
                 progress: Any = None, prompt_logprobs: int | None = None):
        if not ids:
            raise ValueError("the prompt is empty")
        self.history = list(ids)  # the prompt, then every sampled token
        self.n_prompt = len(ids)
        self.keys: list[Hashable] = list(keys) if keys is not None else list(ids)
        if keys is None:  # picture rows without digests: keys that only these very rows match
            for first, rows in spans:
                self.keys[first:first + len(rows)] = [(id(rows), r) for r in range(len(rows))]
        self.spans = list(spans)
        self.sampler, self.max_tokens, self.stop_ids, self.tag = sampler, max_tokens, stop_ids, tag
        self.progress = progress
        self.tokens: list[int] = []  # sampled and yielded, in order (a stop id is not)
        self.finish: JobFinish | None = None  # once the job has left its slot
        self.budget = 0  # the tokens it may sample: max_tokens within its context's room (set by Batcher.add)
        self.error: BaseException | None = None
        self.seq = -1  # its slot while it has one
        self.reused = 0  # prompt positions found in the slot's cache
        self.started = time.perf_counter()
        self.prompt_done = 0.0  # perf_counter() when the prompt was through, and at the last token
        self.last_token = 0.0
        self.stopping = False  # Batcher.cancel was called
        self.prompt_logprobs = prompt_logprobs
        self.prompt_records: list[tuple[float, list[tuple[int, float]]]] = []  # prompt tokens 1.., as Sampler.records

    def score_prompt(self, n_past: int, rows: np.ndarray) -> None:
        """Record the prompt tokens that the logits `rows` of the positions up to `n_past` predict."""
        first = n_past - len(rows)
        for j, row in enumerate(rows):
            at = first + j + 1
            if at >= self.n_prompt:
                break
            self.prompt_records.append(log_probabilities(row, self.history[at], self.prompt_logprobs or 0))

    @property
    def decoding(self) -> bool:
        return self.prompt_done > 0


class _Slot:
    def __init__(self, seq: int):
        self.seq = seq
        self.keys: list[Hashable] = []  # what each position of the sequence's cache holds
        self.job: Job | None = None
        self.used = 0  # LRU clock value of the last use


class StepBudget:
    """How many prompt tokens a step may carry beside one token of each of `n` decoding jobs, so that it takes
    at most `slowdown` times their decode-only step: a joining prompt slows the running streams by that factor
    at most, and gets the rest of the time.

    Two costs are measured as steps run: the seconds of a decode-only step, per number of decoding jobs, and the
    seconds a prompt token adds to a step with decoding jobs (the step's time less their decode-only step's, per
    prompt token). Each is the median of its last measurements (`DECODE_WINDOW`, `WINDOW`): a step that lost
    its core to another process is an outlier, not a new cost, while a prompt's cost growing with its position
    (attention) and a lasting change of load are followed within a few steps. The prompt cost is learnt from
    such mixed steps only, since a token in a small chunk costs more than one in a whole engine chunk (an MoE
    reads its experts either way), and is computed against the decode-only step as it is now. The first step
    with a new number of decoding jobs carries no prompt (it measures their step); the first chunk after that
    is small, and a chunk at most doubles from one step to the next, so that a wrong estimate costs one short
    step, not one long one. While a long prompt joins, each `refresh` steps with a chunk are followed by a
    decode-only one: the step the budget multiplies is re-measured (one timed during a burst of load would
    otherwise set every chunk of the prompt). Every other step carries at least one prompt token: a prompt
    always progresses.

    Steps are timed by `clock` in CPU time: another process taking a core for a while stretches a step's wall
    time but not its work, so it neither inflates the reference step nor shrinks the chunks after it. The
    `Batcher` gives it the engine's own threads' CPU time (`Engine.cpu_seconds`: the evaluating thread and the
    pool's workers); without one it is the process's. (One thread's CPU time is not enough: the
    engine thread takes over the products' rows of a partner that lost its core, and its own CPU time doubles
    with the wall time. The process's counts its other threads too: the event loop writing the tokens out, a
    worker tokenising the joining prompt, whose CPU in the decode step that measures the reference set every
    chunk after it too large.)
    """

    FIRST_CHUNK = 4
    WINDOW = 9
    DECODE_WINDOW = 5  # decode-only steps are rare while a prompt joins: the reference follows a change in 3

    def __init__(self, slowdown: float, clock: Callable[[], float] = time.process_time, refresh: int | None = 32):
        if slowdown < 1:
            raise ValueError(f"slowdown must be at least 1, not {slowdown}")
        self.slowdown, self.clock, self.refresh = slowdown, clock, refresh
        self._decode: dict[int, deque[float]] = {}  # decoding jobs -> seconds of their last decode-only steps
        self._mixed_steps: deque[tuple[int, int, float]] = deque(maxlen=self.WINDOW)  # (n, prompt, seconds)
        self._last_chunk = 0
        self._mixed = 0  # mixed steps since the last decode-only one

    def decode_seconds(self, n: int) -> float | None:
        """A decode-only step of `n` jobs, as measured (None before the first)."""
        times = self._decode.get(n)
        return statistics.median(times) if times else None

    def per_token_seconds(self) -> float | None:
        """What a prompt token adds to a step with decoding jobs: computed against the decode-only steps as
        they are now, so that a re-measured one corrects the prompt's cost too."""
        added = [max(seconds - step, 0.0) / prompt for n, prompt, seconds in self._mixed_steps
                 if (step := self.decode_seconds(n)) is not None]
        return statistics.median(added) if added else None

    def prompt_tokens(self, n: int, cap: int) -> int:
        """The prompt tokens a step with `n` (> 0) decoding jobs may carry, at most `cap`."""
        step = self.decode_seconds(n)
        if step is None or cap <= 0 or (self.refresh is not None and self._mixed >= self.refresh):
            return 0
        per_token = self.per_token_seconds()
        if per_token is None:
            chunk = self.FIRST_CHUNK
        else:
            chunk = int((self.slowdown - 1) * step / max(per_token, 1e-9))
            chunk = min(chunk, 2 * max(self._last_chunk, self.FIRST_CHUNK // 2))
        return max(1, min(chunk, cap))

    def record(self, n: int, prompt: int, seconds: float) -> None:
        """A step with `n` decoding jobs and `prompt` prompt tokens took `seconds`."""
        if n <= 0:
            return
        if not prompt:
            self._decode.setdefault(n, deque(maxlen=self.DECODE_WINDOW)).append(seconds)
            self._mixed = 0
            return
        self._last_chunk = prompt
        self._mixed += 1
        self._mixed_steps.append((n, prompt, seconds))


class Batcher:
    """The jobs of one engine context and the step that advances all of them.

    Args:
        engine: a context of `engine.n_seq` sequences.
        step_tokens: the most tokens one step takes while some job is decoding (decode tokens included); a
            joining prompt that fits goes in one step.
        n_batch: the most tokens of a step with nobody decoding (default: the engine's `n_batch`).
        slowdown: while jobs decode and a prompt longer than `step_tokens` joins, a step with prompt chunks takes
            at most this many times their decode-only step (`StepBudget`); None: `step_tokens` is the only bound.
        clock: seconds, for timing steps (default: the engine's threads' CPU time, `engine.cpu_seconds`).
    """

    def __init__(self, engine: EngineLike, step_tokens: int = 64, n_batch: int | None = None,
                 slowdown: float | None = 1.6, clock: Callable[[], float] | None = None):
        self.engine = engine
        self.n_batch = n_batch if n_batch is not None else engine.n_batch
        self.slots = [_Slot(seq) for seq in range(engine.n_seq)]
        self.jobs: list[Job] = []  # in arrival order: earlier prompts get the step budget first
        self.step_tokens = max(1, step_tokens)
        clock = clock or engine.cpu_seconds
        self.budget = None if slowdown is None else StepBudget(slowdown, clock)
        # an eventfd every engine call adds 1 to as it starts (-1: none): see `strata.scheduling.engine_loop.Relay`
        self.notify_fd = -1
        self.last_batch = 0  # tokens in the last step
        self._clock = itertools.count(1)
        self._lock = threading.Lock()  # cancel() against the step's bookkeeping
        self._in_call: set[int] = set()  # sequences of the engine call in flight

    @property
    def free_slots(self) -> int:
        return sum(slot.job is None for slot in self.slots)

    def add(self, job: Job) -> None:
        """Give `job` a slot and the longest cached prefix of its prompt.

        The slot is the idle one that continues its cache best, if that keeps at least half of what it holds (a
        conversation's next turn); otherwise the least recently used idle one (empty ones first), so that a side
        request never evicts a conversation to reuse a few tokens of chat template. A longer prefix held by any
        other slot, busy or idle, is then copied over (a shared system prompt is computed once).

        Raises:
            RuntimeError: every slot is taken (callers admit at most `n_seq` jobs).
        """
        idle = [slot for slot in self.slots if slot.job is None]
        if not idle:
            raise RuntimeError("every slot is taken")
        n_keep = job.n_prompt - 1  # at least the last prompt token is evaluated: its logits start the answer
        if job.prompt_logprobs is not None:
            n_keep = 0  # a scored prompt is evaluated whole

        def shared(slot: _Slot) -> int:
            return min(common_prefix(slot.keys, job.keys), n_keep)

        continuing = [slot for slot in idle if 2 * shared(slot) >= len(slot.keys) > 0]
        if continuing:
            slot = max(continuing, key=lambda s: (shared(s), -s.used))
        else:
            slot = min(idle, key=lambda s: (len(s.keys) > 0, s.used))
        reused = shared(slot)
        donor = max(self.slots, key=shared)
        if self.engine.recurrent:
            reused = self._reuse_whole_cache(slot, shared)
        elif shared(donor) > reused:
            reused = shared(donor)
            self.engine.copy_prefix(donor.seq, slot.seq, reused)
        elif reused < self.engine.seq_n_past(slot.seq):
            self.engine.keep(reused, seq=slot.seq)
        slot.keys = job.keys[:reused]
        slot.job, slot.used = job, next(self._clock)
        job.seq, job.reused = slot.seq, reused
        room = self.engine.n_ctx - job.n_prompt  # every token has a place in the cache
        job.budget = room if job.max_tokens is None else min(job.max_tokens, room)
        self.jobs.append(job)
        if job.progress is not None:
            job.progress.slot = slot.seq
            job.progress.prompt_progress(reused, cached=reused)

    def _reuse_whole_cache(self, slot: _Slot, shared: Callable[[_Slot], int]) -> int:
        """A recurrent model's state cannot be cut back to a shorter prefix: reuse a cache only where the prompt
        continues all of it (the slot's own, or the longest such one of another slot, copied with its state);
        otherwise the slot starts empty. The positions reused."""
        whole = [s for s in self.slots if 0 < self.engine.seq_n_past(s.seq) == shared(s)]
        if not whole:
            self.engine.keep(0, seq=slot.seq)
            return 0
        best = max(whole, key=lambda s: (shared(s), s is slot))
        if best is not slot:
            self.engine.copy_prefix(best.seq, slot.seq, shared(best))
        return shared(best)

    def cancel(self, job: Job) -> None:
        """Stop `job` (any thread): an engine call in flight drops its sequence within one layer; the job leaves
        its slot at the next step (finish "cancel"), and the other jobs go on."""
        with self._lock:
            job.stopping = True
            if job.seq in self._in_call and job.finish is None:
                self.engine.abort(job.seq)

    def step(self) -> list[Job]:
        """One engine call for every job that has work; returns the jobs that got tokens or finished. Jobs
        cancelled between two steps leave their slots without a call: the step returns them at once."""
        changed = [job for job in self.jobs if job.stopping]
        for job in changed:
            self._leave(job, "cancel")
        if changed:  # their slots are free: say so now, not after another engine call
            return changed
        budget = self.budget
        started = budget.clock() if budget is not None else 0.0
        items, work, n_decoding = self._plan()
        if not items:
            return changed
        with self._lock:
            self._in_call = {job.seq for job in work}
        complete = True
        rows: Sequence[np.ndarray | None]  # None: a sequence the call dropped
        try:
            rows = self.engine.eval_batch(items, notify_fd=self.notify_fd)
        except EngineAborted as error:  # some sequences were dropped: the others' work is complete
            rows, complete = error.results, False
        except Exception as error:  # noqa: BLE001 - the call's jobs end with it; the slots serve on
            for job in work:
                job.error = error
                self._leave(job, "error")
            return changed + work
        finally:
            with self._lock:
                self._in_call = set()
        changed = self._advance(work, rows, time.perf_counter())
        if budget is not None and complete:  # a step cut short by an abort measures nothing
            budget.record(n_decoding, self.last_batch - n_decoding, budget.clock() - started)
        return changed

    def _advance(self, work: list[Job], rows: Sequence[np.ndarray | None], now: float) -> list[Job]:
        """The call's jobs after it: their slots' keys, prompt progress and scores, then each job's next token
        (drawn together where several are), or its end (cancelled, or its sampler failed). Returns the jobs that
        got a token or finished; a job still in its prompt is not among them."""
        changed: list[Job] = []
        draws: list[tuple[Job, np.ndarray, float]] = []  # (job, scores, u) to draw together
        for job, logits in zip(work, rows, strict=True):
            slot = self.slots[job.seq]
            n_past = self.engine.seq_n_past(job.seq)
            _track(slot.keys, job, n_past)
            if job.progress is not None and not job.decoding:
                job.progress.prompt_progress(min(n_past, job.n_prompt))
            if job.prompt_logprobs is not None and logits is not None and not job.decoding and not job.stopping:
                job.score_prompt(n_past, logits)
            if job.stopping:
                self._leave(job, "cancel")
            elif logits is not None and len(logits) and n_past == len(job.history):
                job.prompt_done = job.prompt_done or now
                self._sample(job, logits[-1], now, draws)
            else:
                continue
            changed.append(job)
        if draws:
            self._draw_together(draws, now)
        return changed

    def _plan(self) -> tuple[list[BatchItem], list[Job], int]:
        """This step's items: each decoding job's last token, then prompt chunks in arrival order within the
        budget (whole n_batch chunks while nobody decodes); and the number of decoding jobs."""
        items, work = [], []
        decoding = [job for job in self.jobs if job.decoding]
        for job in decoding:
            items.append(BatchItem(job.seq, job.history[-1:]))
            work.append(job)
        budget = self.step_tokens - len(decoding) if decoding else self.n_batch
        # A short prompt (a side request, a parallel one) joins within the token cap at once; only a prompt
        # longer than that, which would hold the streams for many steps, is cut by time.
        if decoding and self.budget is not None and any(
                not job.decoding and job.n_prompt - job.reused > budget for job in self.jobs):
            budget = self.budget.prompt_tokens(len(decoding), budget)
        for job in self.jobs:
            if job.decoding or budget <= 0:
                continue
            start = self.engine.seq_n_past(job.seq)
            scored = job.prompt_logprobs is not None
            # A scored prompt's chunks return every row's logits: at most _SCORED_ROWS at a time.
            end = min(job.n_prompt, start + (min(budget, _SCORED_ROWS) if scored else budget))
            embeds = embeds_from(job.spans, start, end)
            items.append(BatchItem(job.seq, job.history[start:end], embeds or None,
                                   "all" if scored else "last" if end == job.n_prompt else "none"))
            work.append(job)
            budget -= end - start
        self.last_batch = sum(len(item.tokens) for item in items)
        return items, work, len(decoding)

    def _sample(self, job: Job, logits: np.ndarray, now: float, draws: list[tuple[Job, np.ndarray, float]]) -> None:
        """Draw the job's next token, or leave its draw in `draws` for `_draw_together`."""
        try:
            if job.budget <= 0:
                self._leave(job, "length")
                return
            inputs = job.sampler.draw_inputs(logits, job.history)
            if inputs is not None:
                draws.append((job, *inputs))
                return
            self._take(job, job.sampler.sample(logits, job.history), now)
        except Exception as error:  # noqa: BLE001 - a sampler or token mask that failed ends its job only
            job.error = error
            self._leave(job, "error")

    def _draw_together(self, draws: list[tuple[Job, np.ndarray, float]], now: float) -> None:
        """The step's draws in one engine call: each reads the whole vocabulary (~80 us at 151,936 logits at
        temperature 1, ~35 us for the arg-max of a row just made), and the engine's threads, idle between steps,
        take them in parallel. One draw is done here: handing it to the threads (whose idle spin may have ended)
        cost more than it saved."""
        try:
            if len(draws) == 1:
                job, scores, u = draws[0]
                tokens = [job.sampler.draw_with(scores, u)]
            else:
                tokens = self.engine.sample_rows([scores for _, scores, _ in draws],
                                                 [job.sampler.params for job, _, _ in draws], [u for _, _, u in draws])
        except Exception as error:  # noqa: BLE001 - the draws' jobs end with it; the slots serve on
            for job, _, _ in draws:
                job.error = error
                self._leave(job, "error")
            return
        for (job, _, _), token in zip(draws, tokens, strict=True):
            self._take(job, token, now)

    def _take(self, job: Job, token: int, now: float) -> None:
        """The job's drawn token: the end at a stop id, else its next token (and the end at its budget)."""
        if token in job.stop_ids:
            self._leave(job, "stop")
            return
        job.history.append(token)
        job.tokens.append(token)
        job.last_token = now
        if len(job.tokens) >= job.budget:
            self._leave(job, "length")

    def _leave(self, job: Job, finish: JobFinish) -> None:
        """Free the job's slot; the slot keeps what its cache holds."""
        slot = self.slots[job.seq]
        slot.job, slot.used = None, next(self._clock)
        self.jobs.remove(job)
        with self._lock:
            # A flag raised as the job's last call was returning would stop the slot's next job.
            self.engine.clear_abort(job.seq)
            job.finish = finish


def _track(keys: list[Hashable], job: Job, n_past: int) -> None:
    """Make a slot's `keys` those of the first `n_past` positions of `job` (its prompt's keys, then its sampled
    tokens), in place: a step adds a token or a chunk, and rebuilding the whole list at every step cost 0.44 ms a
    job at 20,000 positions, on the engine thread, holding the GIL."""
    have = len(keys)
    if have > n_past:
        del keys[n_past:]
    elif have < n_past:
        keys += job.keys[have:min(n_past, job.n_prompt)]
        keys += job.history[max(have, job.n_prompt):n_past]


def generate(engine: EngineLike, prompt_ids: Sequence[int], sampler: Sampler, max_tokens: int,
             stop_ids: Collection[int], embeds: Embeds | None = None, batcher: Batcher | None = None) -> Iterator[int]:
    """Yield up to `max_tokens` generated token ids; a token in `stop_ids` ends the generation and is not yielded.

    Generation also ends where the context does, so every yielded token has a place in the cache. Penalties see
    the prompt and the output. Pass the same `batcher` to later calls to reuse the prefix they share.

    Raises:
        ValueError: the prompt is empty.
        EngineError: from the engine.
    """
    job = Job(prompt_ids, sampler, max_tokens, stop_ids, spans=list(embeds or ()))
    batcher = batcher or Batcher(engine)
    batcher.add(job)
    given = 0
    try:
        while job.finish is None:
            batcher.step()
            while given < len(job.tokens):
                given += 1
                yield job.tokens[given - 1]
        if job.error is not None:
            raise job.error
    finally:
        if job.finish is None:
            batcher.cancel(job)
            batcher.step()
