"""The generation loop: jobs generating on the sequences (slots) of one engine context, advanced together.

`Batcher.step()` is one engine call: one token of every decoding job, plus prompt chunks of joining jobs within a
per-step budget, so a long prompt never holds up the streams already running. The budget is a cap of tokens,
and while a prompt longer than the cap joins, one of time (`StepBudget`: a step with prompt chunks takes at most
`slowdown` times the decoding jobs' own step, from costs measured as it runs). The server's engine thread and
`strata generate` (through `generate`) both loop over it. No I/O and no detokenising: callers render the ids.

Each slot keeps what its cache holds after its job ends (the prefix cache): a new job goes to the idle slot whose
cache shares the longest prefix with its prompt (token ids, and (picture digest, row) for picture rows), the
least recently used one when none does; a longer prefix held by a busy slot is copied over (`copy_prefix`).
A hybrid model's slot (a recurrent engine) resumes only where it has its recurrent state: at the end of what it
holds, or at a snapshot (`strata.scheduling.snapshots`) taken where a later request is likely to branch off.
With a disk tier (`strata.kv_disk.KvTier`), the stored blocks that extend that prefix are read on the tier's
reader thread and imported as they come, while the other jobs step on; a job leaving its slot saves the slot's
blocks (and a hybrid model's slot its recurrent states: at its end and at its snapshots, each a state record that
a job resumes from after reading the blocks before it).

A decoding job with a `Speculation` (`strata.scheduling.drafts`) also sends a draft in its step, and keeps the
part of it that its own draws confirm (`_verify`), so one step may give it several tokens; the positions of the
rest are cut back (`_roll_back`).

The engine is an `EngineLike` (`strata.engine_cffi.Engine`, or a test's scripted engine).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol

import numpy as np

from strata.engine_cffi import BatchItem, EngineAborted, EngineError
from strata.kv_disk.reader import Load
from strata.kv_disk.tier import KvTier
from strata.pictures.expand import embeds_from
from strata.scheduling.drafts import MtpAsk, Speculation, VerifyCost, draft_together
from strata.scheduling.engine_like import EngineLike
from strata.scheduling.snapshots import Snapshots, snapshot_points
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


class CacheObserver(Protocol):
    """Told where a slot's cached keys change (`strata.kv_events.KvBlocks` publishes them for routers)."""

    def on_blocks(self, seq: int, keys: Sequence[Hashable], n: int, kept: int) -> None:
        """Slot `seq` now holds `keys[:n]` in a form a job can resume from (a recurrent engine's slot: up to its
        live state or its last snapshot); its first `kept` positions are unchanged since the last call."""


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
        turn_starts: the prompt positions where its messages start: a recurrent engine's slot snapshots its state
            at some of them (`strata.scheduling.snapshots.snapshot_points`).
        speculation: drafts its decoding steps verify (`strata.scheduling.drafts`), or None.
    """

    def __init__(self, ids: Sequence[int], sampler: Sampler, max_tokens: int | None, stop_ids: Collection[int], *,
                 keys: Sequence[Hashable] | None = None, spans: Sequence[tuple[int, Any]] = (), tag: str = "",
                 progress: Any = None, prompt_logprobs: int | None = None, turn_starts: Sequence[int] = (),
                 speculation: Speculation | None = None):
        if not ids:
            raise ValueError("the prompt is empty")
        self.history = list(ids)  # the prompt, then every sampled token
        self.n_prompt = len(ids)
        self.keys: list[Hashable] = list(keys) if keys is not None else list(ids)
        # keys that name the same rows in another process too (not the stand-ins for pictures without digests)
        self.portable_keys = keys is not None or not spans
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
        self.reused = 0  # prompt positions found in the slot's cache, or read from the disk tier
        self.disk_tokens = 0  # of those, the ones read from the disk tier
        self.loading: Load | None = None  # the disk tier's blocks being read for it: it waits for them
        self.block_names: list[bytes] = []  # the disk tier's names of its prompt's whole blocks (when it has one)
        self.started = time.perf_counter()
        self.prompt_done = 0.0  # perf_counter() when the prompt was through, and at the last token
        self.last_token = 0.0
        self.stopping = False  # Batcher.cancel was called
        self.prompt_logprobs = prompt_logprobs
        self.prompt_records: list[tuple[float, list[tuple[int, float]]]] = []  # prompt tokens 1.., as Sampler.records
        self.turn_starts = turn_starts
        self.snapshot_at: list[int] = []  # the prompt positions its slot snapshots (a recurrent engine's)
        self.speculation = speculation

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
        self.live = True  # a recurrent engine's state is that of the end of `keys` (a dropped call breaks it)
        self.portable = False  # its keys name the same rows in another process (its last job's `portable_keys`)


@dataclass
class _Planned:
    """A speculating job's part of a step: where its sequence was (`n_past`), what the step appends to it (`fed`:
    its pending tokens, then `draft`), whether a recurrent engine checkpointed its state at `n_past`, and the job's
    token count before; `kept`: the draft tokens accepted."""

    n_past: int
    fed: list[int]
    draft: list[int]
    checkpoint: bool
    tokens: int
    kept: int = 0


class _RecentMedian:
    """The median of the last `size` values added, taken again only after one came (every step asks)."""

    def __init__(self, size: int):
        self._values: deque[float] = deque(maxlen=size)
        self._median: float | None = None
        self._stale = False

    def add(self, value: float) -> None:
        self._values.append(value)
        self._stale = True

    def median(self) -> float | None:
        if self._stale:
            self._median, self._stale = statistics.median(self._values), False
        return self._median


class _Prices(NamedTuple):
    """A step's measured costs, for its jobs' draft lengths (`Speculation.choose`): the decode-only step of
    `n_decoding` jobs, what drafts add to it, a guess of the MTP block, and a token of the block's draft (a tuple:
    made every step)."""

    n_decoding: int
    step: float | None
    drafts: VerifyCost | None
    guess: float | None
    block: float


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
    VERIFY_REFRESH = 32  # steps with drafts between two decode-only ones (their reference)
    # Steps a draft's measured cost counts for: costs too high (a step that lost its caches to another process)
    # stop every draft, so no step would measure them again; forgotten, they leave jobs to draft a token and
    # measure anew.
    VERIFY_MEMORY = 64
    # verifications (and decode-only steps after a few) between two fits of their cost in a full window
    # (`draft_costs`)
    REFIT_EVERY = 3

    def __init__(self, slowdown: float, clock: Callable[[], float] = time.process_time, refresh: int | None = 32,
                 routing: tuple[int, int, int] | None = None):
        if slowdown < 1:
            raise ValueError(f"slowdown must be at least 1, not {slowdown}")
        self.slowdown, self.clock, self.refresh = slowdown, clock, refresh
        self.routing = routing  # (MoE layers, experts a layer, experts a token uses): what drafts' experts cost
        self._decode: dict[int, _RecentMedian] = {}  # decoding jobs -> seconds of their last decode-only steps
        self._mixed_steps: deque[tuple[int, int, float]] = deque(maxlen=self.WINDOW)  # (n, prompt, seconds)
        self._last_chunk = 0
        self._mixed = 0  # mixed steps since the last decode-only one
        self._verify_steps: deque[tuple[int, int, float, int]] = deque(maxlen=self.WINDOW)  # (n, drafts, s, step)
        # the MTP block's calls: seconds a guess (of steps that ran it for guesses only), and seconds a chained
        # position (of steps with drafts)
        self._guess, self._block_token = _RecentMedian(self.WINDOW), _RecentMedian(self.WINDOW)
        self._steps = 0  # steps recorded
        self._verifies = 0  # steps with drafts since the last decode-only one
        self._verify_count = 0  # steps with drafts recorded
        self._remeasured = 0  # decode-only steps after fewer than VERIFY_REFRESH steps with drafts
        # draft_costs' answer and what it was fitted on: whether any verification counts, the reference's
        # version, and the count of verifications and decode-only steps after drafts it follows
        self._costs: tuple[tuple[bool, int, int], VerifyCost | None] | None = None
        self._reference = 0  # bumped where a decode-only step re-measures the reference after VERIFY_REFRESH
        # steps with drafts, or first measures it

    def decode_seconds(self, n: int) -> float | None:
        """A decode-only step of `n` jobs, as measured (None before the first)."""
        times = self._decode.get(n)
        return times.median() if times else None

    def per_token_seconds(self) -> float | None:
        """What a prompt token adds to a step with decoding jobs: computed against the decode-only steps as
        they are now, so that a re-measured one corrects the prompt's cost too."""
        added = [max(seconds - step, 0.0) / prompt for n, prompt, seconds in self._mixed_steps
                 if (step := self.decode_seconds(n)) is not None]
        return statistics.median(added) if added else None

    def draft_costs(self) -> VerifyCost | None:
        """What drafts add to a step of decoding jobs (speculative decoding), measured against the decode-only
        step as it is now: `VerifyCost.fit` through the recent steps' added seconds against their draft tokens,
        with the model's routing shape where it has experts, over those of the last `VERIFY_MEMORY` steps; None
        without any. Fitted again where the reference is re-measured after `VERIFY_REFRESH` verifications (or
        first measured) and where the last verification leaves the memory (None); else at each verification and
        each decode-only step after drafts while the window of verifications fills, then at every `REFIT_EVERY`
        of them: every decoding job's draft length asks for it every step, and a fit costs a fifth of a tiny
        model's step (10-20 µs of Python), while one step's timing, one more measurement of the reference and the
        verifications leaving the memory one by one move it by noise."""
        steps, recent = self._verify_steps, self._steps - self.VERIFY_MEMORY
        changes = self._verify_count + self._remeasured
        key = (bool(steps) and steps[-1][3] > recent, self._reference,
               changes if len(steps) < self.WINDOW else changes // self.REFIT_EVERY)
        if self._costs is None or self._costs[0] != key:
            points = [(n, drafts, max(seconds - step, 0.0)) for n, drafts, seconds, at in steps
                      if at > recent and (step := self.decode_seconds(n)) is not None]
            self._costs = (key, VerifyCost.fit(points, self.routing) if points else None)
        return self._costs[1]

    def guess_seconds(self) -> float | None:
        """What one job's guess costs: its share of the MTP block's call (the pass, and the pairs it fills
        first), the median of the recent steps that ran the block for guesses only; None before one."""
        return self._guess.median()

    def block_token_seconds(self) -> float | None:
        """What each token of a draft of the MTP block costs before its step: the block's call over the length
        of its chain (a pass and the output product a position, and the pairs it fills first), the median of
        the recent steps with drafts whose block ran; None before one."""
        return self._block_token.median()

    def wants_plain_step(self, n: int) -> bool:
        """Whether the next step of `n` decoding jobs should carry no drafts: their decode-only step, the
        reference of every cost, is not measured yet, or not since `VERIFY_REFRESH` steps with drafts."""
        return self.decode_seconds(n) is None or self._verifies >= self.VERIFY_REFRESH

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

    def record(self, n: int, prompt: int, seconds: float, drafts: int = 0, block: float = 0.0,
               chained: int = 0, guesses: int = 0) -> None:
        """A step with `n` decoding jobs, `prompt` prompt tokens and `drafts` draft tokens took `seconds` (in a
        step with a prompt chunk, the draft tokens count as prompt tokens), `block` of them in the MTP block's
        call before it: `chained` positions of chained drafts, or shadow guesses of `guesses` jobs. The block's
        seconds are priced apart (`block_token_seconds`, `guess_seconds`), not as the verification's."""
        if n <= 0:
            return
        if block:
            if drafts:
                self._block_token.add(block / max(chained, 1))
            else:
                self._guess.add(block / max(guesses, 1))
            seconds -= block
            if not drafts:
                # Invariant: a step whose block ran for guesses only is not a plain step, block or not: its
                # first guess ran the pairs of a window first, and a plain step timed with them made drafts that
                # do not pay look free (the reference every draft's cost is measured against).
                return
        self._steps += 1
        if drafts and not prompt:
            self._verify_steps.append((n, drafts, seconds, self._steps))
            self._verify_count += 1
            self._verifies += 1
            return
        if not prompt:
            if self._verifies >= self.VERIFY_REFRESH or n not in self._decode:
                self._reference += 1  # the reference re-measured as it asked (or first measured)
            elif self._verifies:
                self._remeasured += 1  # a decode-only step after a few drafts: one more measurement of it
            self._decode.setdefault(n, _RecentMedian(self.DECODE_WINDOW)).add(seconds)
            self._mixed = self._verifies = 0
            return
        self._last_chunk = prompt
        self._mixed += 1
        self._mixed_steps.append((n, prompt + drafts, seconds))


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
        snapshot_bytes: a recurrent engine's snapshots take at most this many bytes (default: four per slot).
        tier: the disk tier under the slots' caches, or None.
    """

    WAIT_SECONDS = 0.005  # the most a step with nothing to compute waits for a job's blocks before looking again

    def __init__(self, engine: EngineLike, step_tokens: int = 64, n_batch: int | None = None,
                 slowdown: float | None = 1.6, clock: Callable[[], float] | None = None,
                 snapshot_bytes: int | None = None, tier: KvTier | None = None):
        self.engine = engine
        self.tier = tier
        self.n_batch = n_batch if n_batch is not None else engine.n_batch
        self.slots = [_Slot(seq) for seq in range(engine.n_seq)]
        self.jobs: list[Job] = []  # in arrival order: earlier prompts get the step budget first
        self.step_tokens = max(1, step_tokens)
        clock = clock or engine.cpu_seconds
        # an engine of a mixture of experts says how it routes (`Engine.expert_routing`); a scripted one need not
        routing = getattr(engine, "expert_routing", None)
        self.budget = None if slowdown is None else StepBudget(slowdown, clock, routing=routing)
        # an eventfd every engine call adds 1 to as it starts (-1: none): see `strata.scheduling.engine_loop.Relay`
        self.notify_fd = -1
        self.last_batch = 0  # tokens in the last step
        self._clock = itertools.count(1)
        self._lock = threading.Lock()  # cancel() against the step's bookkeeping
        self._in_call: set[int] = set()  # sequences of the engine call in flight
        self._drafts: dict[Job, _Planned] = {}  # the speculating jobs of the step being run
        self._block_call = (0.0, 0, 0)  # the step's MTP block call: seconds, chained positions, jobs guessing only
        self.snapshots: Snapshots | None = None
        self.observer: CacheObserver | None = None  # told where the slots' cached keys change
        if engine.recurrent:
            state = engine.state_bytes
            self.snapshots = Snapshots(4 * engine.n_seq * state if snapshot_bytes is None else snapshot_bytes, state)

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
            return self._resumable(slot, min(common_prefix(slot.keys, job.keys), n_keep))

        continuing = [slot for slot in idle if 2 * shared(slot) >= len(slot.keys) > 0]
        if continuing:
            slot = max(continuing, key=lambda s: (shared(s), -s.used))
        else:
            slot = min(idle, key=lambda s: (len(s.keys) > 0, s.used))
        reused = shared(slot)
        held = slot.keys
        donor = max(self.slots, key=shared)
        try:
            if shared(donor) > reused:
                reused = shared(donor)
                self._copy(donor, slot, reused)
            elif reused < self.engine.seq_n_past(slot.seq) or not slot.live:
                self._cut(slot, reused)
        except BaseException:  # the slot starts over rather than hold a cache its keys do not describe
            self._clear(slot)
            raise
        slot.keys = job.keys[:reused]
        slot.job, slot.used, slot.portable = job, next(self._clock), job.portable_keys
        job.seq, job.reused = slot.seq, reused
        if self.snapshots is not None:
            job.snapshot_at = snapshot_points(job.turn_starts, job.n_prompt, reused)
        if self.tier is not None and job.portable_keys:
            self._read_stored(job, slot, n_keep)
        self._announce(slot, common_prefix(held, slot.keys))
        room = self.engine.n_ctx - job.n_prompt  # every token has a place in the cache
        job.budget = room if job.max_tokens is None else min(job.max_tokens, room)
        self.jobs.append(job)
        if job.progress is not None:
            job.progress.slot = slot.seq
            job.progress.prompt_progress(job.reused, cached=job.reused)

    def _read_stored(self, job: Job, slot: _Slot, n_keep: int) -> None:
        """Start reading the stored blocks that extend the job's cached prefix: the consecutive ones from the
        block where that prefix ends (the slot is cut back to that block's start, at most a block's positions).
        A recurrent engine's slot reads them up to the longest position with a stored state record, then the
        record (`KvTier.resumable`)."""
        tier = self.tier
        assert tier is not None
        block = tier.block_tokens
        first = job.reused // block
        if self.snapshots is None and (first + 1) * block > n_keep:  # no whole block past the cached prefix
            return
        job.block_names = names = tier.names(job.keys[:n_keep])
        if self.snapshots is None:
            load = names[first:first + tier.stored(names, first)]
        else:
            end = tier.resumable(job.keys, names, first, job.reused, n_keep)
            load = names[first:end // block] + [tier.state_name(job.keys, end, names)] if end else []
        if not load:
            return
        self.engine.keep(first * block, seq=slot.seq)
        if self.snapshots is not None:
            self.snapshots.truncate(slot.seq, first * block)
            slot.live = False  # until the record's state is loaded
        del slot.keys[first * block:]
        job.reused = first * block
        job.loading = tier.read(load)

    def _import_read(self) -> None:
        """Import the blocks read for the jobs waiting for them (a memcpy each, on this thread)."""
        for job in self.jobs:
            load = job.loading
            if load is None:
                continue
            slot = self.slots[job.seq]
            for first, payload, state in load.take():
                before = self.engine.seq_n_past(job.seq)
                try:
                    self.engine.import_kv(job.seq, first, payload)
                    if state:
                        self.engine.load_state(job.seq, bytes(state))
                        slot.live = True
                except EngineError:  # a block not where the sequence continues, a state of another size: computed
                    load.cancel()
                    break
                added = self.engine.seq_n_past(job.seq) - before
                job.reused += added
                job.disk_tokens += added
            if load.finished or load.cancelled:
                job.loading = None
                if self.snapshots is not None and not slot.live:  # the state record never came
                    self._resume_held(job, slot)
            n_past = self.engine.seq_n_past(job.seq)
            held = len(slot.keys)
            _track(slot.keys, job, n_past)
            self._announce(slot, held)
            if job.progress is not None:
                job.progress.prompt_progress(n_past, cached=n_past)

    def _resume_held(self, job: Job, slot: _Slot) -> None:
        """Cut the job's slot back to its last snapshot (or to nothing): the blocks read past it have no state."""
        assert self.snapshots is not None
        self._cut(slot, self.snapshots.best(slot.seq, self.engine.seq_n_past(slot.seq)))
        job.reused, job.disk_tokens = self.engine.seq_n_past(slot.seq), 0
        job.snapshot_at = snapshot_points(job.turn_starts, job.n_prompt, job.reused)

    def _announce(self, slot: _Slot, kept: int) -> None:
        """Tell the observer what the slot holds now (its first `kept` positions unchanged)."""
        if self.observer is not None:
            n = len(slot.keys) if self.snapshots is None or slot.live else self.snapshots.best(slot.seq, len(slot.keys))
            self.observer.on_blocks(slot.seq, slot.keys, n, kept)

    def _resumable(self, slot: _Slot, n: int) -> int:
        """The longest prefix of at most `n` of the slot's positions that a job can resume from: all `n` but on a
        recurrent engine, whose slot resumes where it has its state (the end of what it holds, or a snapshot)."""
        if self.snapshots is None:
            return n
        if slot.live and len(slot.keys) <= n:
            return len(slot.keys)
        return self.snapshots.best(slot.seq, n)

    def _copy(self, donor: _Slot, slot: _Slot, n: int) -> None:
        """Make the slot hold the donor's first `n` positions (and, on a recurrent engine, its state there)."""
        self.engine.copy_prefix(donor.seq, slot.seq, n)
        if self.snapshots is not None:
            self.snapshots.clear(slot.seq)
            if not (donor.live and n == len(donor.keys)):  # copy_prefix copied the state at the donor's end
                self.engine.load_state(slot.seq, self.snapshots.take(donor.seq, n))
            slot.live = True

    def _clear(self, slot: _Slot) -> None:
        """Empty the slot (its cache, its snapshots), as far as the engine lets it."""
        slot.keys, slot.live = [], True
        if self.snapshots is not None:
            self.snapshots.clear(slot.seq)
        with contextlib.suppress(Exception):
            self.engine.keep(0, seq=slot.seq)
        self._announce(slot, 0)

    def _cut(self, slot: _Slot, n: int) -> None:
        """Cut the slot back to its first `n` positions (on a recurrent engine, to its snapshot there)."""
        self.engine.keep(n, seq=slot.seq)
        if self.snapshots is not None:
            self.snapshots.truncate(slot.seq, n)
            if n:
                self.engine.load_state(slot.seq, self.snapshots.take(slot.seq, n))
            slot.live = True

    def cancel(self, job: Job) -> None:
        """Stop `job` (any thread): an engine call in flight drops its sequence within one layer; the job leaves
        its slot at the next step (finish "cancel"), and the other jobs go on."""
        with self._lock:
            job.stopping = True
            if job.seq in self._in_call and job.finish is None:
                self.engine.abort(job.seq)
        if self.tier is not None:
            self.tier.wake()  # a step waiting for blocks looks at once

    def step(self) -> list[Job]:
        """One engine call for every job that has work; returns the jobs that got tokens or finished. Jobs
        cancelled between two steps leave their slots without a call: the step returns them at once."""
        changed = [job for job in self.jobs if job.stopping]
        for job in changed:
            self._leave(job, "cancel")
        if changed:  # their slots are free: say so now, not after another engine call
            return changed
        if self.tier is not None:
            self._import_read()
        budget = self.budget
        started = budget.clock() if budget is not None else 0.0
        items, work, n_decoding = self._plan()
        if not items:
            if self.tier is not None and any(job.loading is not None for job in self.jobs):
                self.tier.wait(self.WAIT_SECONDS)  # nothing to compute until a block comes
            return changed
        decode_tokens = sum(len(item.tokens) for item, job in zip(items, work, strict=True) if job.decoding)
        with self._lock:
            self._in_call = {job.seq for job in work}
        complete = True
        rows: Sequence[np.ndarray | None]  # None: a sequence the call dropped
        try:
            rows = self.engine.eval_batch(items, notify_fd=self.notify_fd)
        except EngineAborted as error:  # some sequences were dropped: the others' work is complete
            rows, complete = error.results, False
        except Exception as error:  # noqa: BLE001 - the call's jobs end with it; the slots serve on
            self._drafts.clear()
            for job in work:
                job.error = error
                self._leave(job, "error")
            return changed + work
        finally:
            with self._lock:
                self._in_call = set()
        changed = self._advance(work, rows, time.perf_counter())
        if budget is not None and complete:  # a step cut short by an abort measures nothing
            block, chained, guesses = self._block_call
            budget.record(n_decoding, self.last_batch - decode_tokens, budget.clock() - started,
                          drafts=decode_tokens - n_decoding, block=block, chained=chained, guesses=guesses)
        return changed

    def _advance(self, work: list[Job], rows: Sequence[np.ndarray | None], now: float) -> list[Job]:
        """The call's jobs after it: their slots' keys, prompt progress and scores, then each job's next token
        (drawn together where several are), or its end (cancelled, or its sampler failed). Returns the jobs that
        got a token or finished; a job still in its prompt is not among them."""
        changed: list[Job] = []
        draws: list[tuple[Job, np.ndarray, float]] = []  # (job, scores, u) to draw together
        for job, logits in zip(work, rows, strict=True):
            slot = self.slots[job.seq]
            planned = self._drafts.get(job)
            if planned is not None and planned.draft:
                if logits is not None and not job.stopping:
                    self._verify(job, planned, logits, now)
                self._roll_back(job, planned)
                held = len(slot.keys)
                _track(slot.keys, job, self.engine.seq_n_past(job.seq))
                self._announce(slot, min(held, len(slot.keys)))
                if job.stopping and job.finish is None:
                    self._leave(job, "cancel")
                changed.append(job)
                continue
            n_past = self.engine.seq_n_past(job.seq)
            held = len(slot.keys)
            _track(slot.keys, job, n_past)
            if self.snapshots is not None and logits is not None and n_past in job.snapshot_at and not job.decoding:
                self.snapshots.put(job.seq, n_past, self.engine.save_state(job.seq))
            self._announce(slot, min(held, n_past))
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
        for job, planned in self._drafts.items():
            if job.speculation is not None:
                job.speculation.judge(planned.draft, planned.kept, job.tokens[planned.tokens:])
        self._drafts.clear()
        return changed

    def _verify(self, job: Job, planned: _Planned, logits: np.ndarray, now: float) -> None:
        """Draw the job's tokens from the rows of its last token and its draft, in order, with its own sampler,
        while each draw equals the draft token it checks: the draft is accepted up to its first miss, and the
        token drawn there (or after the whole draft) is the step's last. Each draw is the one the job makes
        without speculation, so a stop id, the token budget and a failing sampler end the job where they would
        have, and its mask (a guide) only ever follows accepted tokens."""
        rows = logits[-(len(planned.draft) + 1):]
        try:  # a draft is planned within the job's token budget: it has room for one token at least
            drawn = job.sampler.draws_at_once(rows)  # greedy and nothing carried from draw to draw: all at once
            for i, row in enumerate(rows):
                token = drawn[i] if drawn is not None else job.sampler.sample(row, job.history)
                self._take(job, token, now)
                if job.finish is not None or i == len(planned.draft) or token != planned.draft[i]:
                    break
                planned.kept += 1
        except Exception as error:  # noqa: BLE001 - a sampler or token mask that failed ends its job only
            job.error = error
            self._leave(job, "error")

    def _roll_back(self, job: Job, planned: _Planned) -> None:
        """Cut the job's sequence back to the positions that hold its history (the rejected draft's are gone); a
        recurrent engine's back to where the draft started, with the state checkpointed there: the accepted tokens
        are evaluated again with the job's next step."""
        fed = planned.fed
        n_past = self.engine.seq_n_past(job.seq)
        valid = planned.n_past + common_prefix(fed, job.history[planned.n_past:planned.n_past + len(fed)])
        if n_past <= valid:
            return
        if not planned.checkpoint:
            self.engine.keep(valid, seq=job.seq)
        elif not job.stopping:  # a cancelled job's slot is marked not live as it leaves
            self.engine.keep(planned.n_past, seq=job.seq)
            self.engine.restore_state(job.seq)

    def _plan(self) -> tuple[list[BatchItem], list[Job], int]:
        """This step's items: each decoding job's last token (and its draft: `_draft`), then prompt chunks in
        arrival order within the budget (whole n_batch chunks while nobody decodes); and the number of decoding
        jobs."""
        items, work = [], []
        decoding = [job for job in self.jobs if job.decoding]
        room = self.step_tokens - len(decoding)  # for drafts, then prompt chunks
        plain = self.budget is not None and self.budget.wants_plain_step(len(decoding))
        prices = self._prices(len(decoding)) if any(job.speculation for job in decoding) else None
        steps = []
        for job in decoding:
            n_past = self.engine.seq_n_past(job.seq)
            tokens = job.history[n_past:]  # its last token (and, on a recurrent engine, accepted ones again)
            length = self._draft_length(job, n_past, tokens, prices)  # chosen also in a plain step
            steps.append((job, n_past, tokens, 0 if plain else length))
        asks, block = self._run_blocks(steps, room)
        drafted = False
        for job, n_past, tokens, length in steps:
            draft = self._draft(job, n_past, tokens, min(length, room))
            room -= len(draft)
            drafted = drafted or bool(draft)
            items.append(BatchItem(job.seq, tokens + draft, None, "all" if draft else "last"))
            work.append(job)
        for ask in asks:
            ask.drafter.forget()
        self._block_call = (block, max((ask.n for ask in asks), default=0), 0 if drafted else len(asks))
        budget = room if decoding else self.n_batch
        # A short prompt (a side request, a parallel one) joins within the token cap at once; only a prompt
        # longer than that, which would hold the streams for many steps, is cut by time.
        if decoding and self.budget is not None and any(
                not job.decoding and job.loading is None and job.n_prompt - job.reused > budget for job in self.jobs):
            budget = self.budget.prompt_tokens(len(decoding), budget)
        for job in self.jobs:
            if job.decoding or job.loading is not None or budget <= 0:
                continue
            start = self.engine.seq_n_past(job.seq)
            scored = job.prompt_logprobs is not None
            # A scored prompt's chunks return every row's logits: at most _SCORED_ROWS at a time.
            end = min(job.n_prompt, start + (min(budget, _SCORED_ROWS) if scored else budget))
            end = min([end, *(p for p in job.snapshot_at if p > start)])  # a chunk ends where a snapshot is due
            embeds = embeds_from(job.spans, start, end)
            items.append(BatchItem(job.seq, job.history[start:end], embeds or None,
                                   "all" if scored else "last" if end == job.n_prompt else "none"))
            work.append(job)
            budget -= end - start
        self.last_batch = sum(len(item.tokens) for item in items)
        return items, work, len(decoding)

    def _prices(self, n_decoding: int) -> _Prices:
        """What a step of `n_decoding` jobs, their drafts and the MTP block's calls cost, as measured."""
        budget = self.budget
        if budget is None:
            return _Prices(n_decoding, None, None, None, 0.0)
        guess = budget.guess_seconds()
        # a draft of the MTP block pays for its chain before the step (a guess's price until one was measured)
        return _Prices(n_decoding, budget.decode_seconds(n_decoding), budget.draft_costs(), guess,
                       budget.block_token_seconds() or guess or 0.0)

    def _draft_length(self, job: Job, n_past: int, tokens: list[int], prices: _Prices | None) -> int:
        """The most draft tokens the job's step may carry before the step's room: the length its speculation
        chooses at the step's `prices`, within its context and its token budget."""
        speculation = job.speculation
        if speculation is None or prices is None:
            return 0
        # (a source not proven right drafts nothing whatever the block costs: its check is skipped)
        length = speculation.choose(prices.n_decoding, prices.step, prices.drafts, recurrent=self.snapshots is not None,
                                    guess_s=prices.guess, block_s=prices.block if prices.block and speculation.proven
                                    and speculation.from_block(job.history, job.n_prompt) else 0.0)
        if self.snapshots is not None and len(tokens) > 1:
            # Invariant: tokens a recurrent engine's rollback took back are evaluated again without a draft, so this
            # step keeps them: a draft rejected with them would take them back again, every step, while the step
            # grew by a token each time.
            return 0
        return min(length, self.engine.n_ctx - n_past - len(tokens), job.budget - len(job.tokens) - 1)

    def _run_blocks(self, steps: list[tuple[Job, int, list[int], int]], room: int) -> tuple[list[MtpAsk], float]:
        """Run the MTP block once for the drafts and shadow guesses the step's jobs (job, n_past, tokens, draft
        length) will ask of it, each for as many tokens as it may draft with all of the step's `room`
        (`draft_together`); returns the asks, whose drafts the jobs not drafting after all leave, and the
        seconds of the call (by the step budget's clock)."""
        asks = [ask for job, _, _, length in steps if job.speculation is not None and (
            ask := job.speculation.block_ask(job.history, job.n_prompt, max(min(length, room), 0), job.seq))]
        if not asks:
            return asks, 0.0
        clock = self.budget.clock if self.budget is not None else time.process_time
        started = clock()
        draft_together(asks, self.engine.n_ctx)
        return asks, clock() - started

    def _draft(self, job: Job, n_past: int, tokens: list[int], room: int) -> list[int]:
        """The draft the job's step verifies (at most `room` tokens: `_draft_length` within the step's room),
        planned for `_advance` with what a rollback needs (a recurrent engine's state before it)."""
        speculation = job.speculation
        if speculation is None:
            return []
        draft = speculation.draft(job.history, job.n_prompt, max(room, 0), job.seq)[:max(room, 0)]
        if not draft and not speculation.guessing:
            return draft  # nothing to verify, roll back or judge
        checkpoint = bool(draft) and self.snapshots is not None
        if checkpoint:
            self.engine.checkpoint_state(job.seq)
        self._drafts[job] = _Planned(n_past, tokens + draft, draft, checkpoint, len(job.tokens))
        return draft

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
        """Free the job's slot; the slot keeps what its cache holds, and the disk tier gets its whole blocks."""
        slot = self.slots[job.seq]
        if job.loading is not None:
            job.loading.cancel()
            job.loading = None
        if self.tier is not None and job.portable_keys and finish != "error":
            # a cancelled call may have left a recurrent state half-way: only its snapshots are saved then
            self._save(slot, job.block_names, slot.live and finish != "cancel")
        slot.job, slot.used = None, next(self._clock)
        if finish in ("cancel", "error"):  # a call cut short may have left a recurrent state half-way
            slot.live = self.snapshots is None
            self._announce(slot, len(slot.keys))
        self.jobs.remove(job)
        with self._lock:
            # A flag raised as the job's last call was returning would stop the slot's next job.
            self.engine.clear_abort(job.seq)
            job.finish = finish

    def _save(self, slot: _Slot, known: list[bytes], live: bool, wait: bool = False) -> None:
        """Queue the slot's whole blocks that the disk tier lacks (`known`: names of its first blocks, when
        computed already); on a recurrent engine, then its state records: at its end when `live` (its state is
        that of its end), and at its snapshots, the latest first."""
        tier = self.tier
        assert tier is not None
        seq = slot.seq
        n_past = self.engine.seq_n_past(seq)
        del slot.keys[n_past:]  # a call cut short may have left keys past what the cache holds
        names = tier.names(slot.keys, known[:n_past // tier.block_tokens])
        tier.save(self.engine, seq, names, wait)
        snapshots = self.snapshots
        if snapshots is not None:
            held = len(slot.keys)
            live = live and held == n_past  # short of n_past after a draft not rolled back yet: no keys to name it
            states = [(n_past, functools.partial(self.engine.save_state, seq))] if live else []
            states += [(p, functools.partial(snapshots.take, seq, p)) for p in reversed(snapshots.positions(seq))
                       if p <= held and not (live and p == n_past)]
            tier.save_states(self.engine, seq, slot.keys, names, states, wait)

    def save_all(self) -> None:
        """Save every idle slot's blocks, waiting for the writer's room: a clean shutdown, with no step running."""
        if self.tier is None:
            return
        for slot in self.slots:
            if slot.job is None and slot.portable and slot.keys and self.engine.seq_n_past(slot.seq) == len(slot.keys):
                self._save(slot, [], slot.live, wait=True)


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
