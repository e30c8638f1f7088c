"""The tests' engines: scripted models with the `EngineLike` calls, and a wrapper that records an engine's calls.

mypy checks this module (pyproject's `files`): each engine here is passed where an `EngineLike` is expected, so
one whose calls drift from the protocol fails the type check, not a test far away.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from strata.engine_cffi import BatchItem, Embeds, EngineAborted, EngineError
from strata.scheduling.engine_like import EngineLike
from strata.text.sampling import SamplingParams, draw


class FakeEngine:
    """What the fakes share: their draws in Python, as the C engine draws them, and the process's CPU time as
    the engine's own."""

    arch = backend = "scripted"
    threads = 1
    n_batch = 256
    cpu_seconds = staticmethod(time.process_time)
    recurrent = False  # a transformer: every prefix of a sequence is reusable
    state_bytes = 0

    def save_state(self, seq: int = 0) -> bytes:
        return b""

    def load_state(self, seq: int, data: bytes) -> None:
        pass

    def checkpoint_state(self, seq: int = 0) -> None:
        pass

    def restore_state(self, seq: int = 0) -> None:
        pass

    def expert_counts(self) -> dict[str, int] | None:
        return None

    def sample_rows(self, rows: Sequence[np.ndarray], settings: Sequence[SamplingParams], u: Sequence[float]
                    ) -> list[int]:
        return [int(np.argmax(row)) if params.greedy else draw(row, params, x)
                for row, params, x in zip(rows, settings, u, strict=True)]

    def close(self) -> None:
        pass

    # A position's "rows" are its token id: what the disk tier saves and reads back.
    kv_identity = "fake"
    kv_position_bytes = 8

    def _cache(self, seq: int) -> list[int]:
        raise NotImplementedError

    def export_kv(self, seq: int, first: int, n: int) -> np.ndarray:
        cache = self._cache(seq)
        assert first + n <= len(cache)
        return np.asarray(cache[first:first + n], np.int64).view(np.uint8)

    def import_kv(self, seq: int, first: int, data: Any) -> None:
        cache = self._cache(seq)
        if first != len(cache):
            raise EngineError(f"import at {first}: sequence {seq} continues at {len(cache)}")
        cache += np.frombuffer(data, np.int64).tolist()


# --- a chat model that writes a script


class ScriptedEngine(FakeEngine):
    """The `Engine` API with a "model" that writes `script` (token ids) after each assistant prompt, then stops.

    Timing and aborts behave like the C engine's: a prompt token costs `prompt_s` and a decode step `decode_s`
    (each token of a step that verifies a draft too: a neutral cost, that neither speeds nor slows an answer) seconds
    of blocking work (a batch costs the sum of its items'); each sequence's abort flag is checked between
    tokens — `LAYERS` times per token —, drops that sequence from the call in flight (or the next one that has its
    tokens) with `EngineAborted`, is lowered by doing so, and the positions not reached are dropped.

    Args:
        tokenizer: the tokenizer whose ids the script uses (for the vocabulary size and end-of-turn id).
        script: the ids the model writes after `<|im_start|>assistant\\n`; the end-of-turn id follows.
        n_seq: sequences (slots).
    """

    LAYERS = 4  # abort checks per token

    def __init__(self, tokenizer: Any, script: Sequence[int] = (), *, n_ctx: int = 4096, prompt_s: float = 0.0,
                 decode_s: float = 0.0, n_embd: int = 48, n_seq: int = 1):
        self.n_embd = self.picture_width = n_embd  # the vision tests' encoders write rows this wide
        self.n_vocab = tokenizer.n_vocab
        self.n_ctx, self.n_seq = n_ctx, n_seq
        self.script = list(script)
        self.prompt_s, self.decode_s = prompt_s, decode_s
        self.kvs: list[list[int]] = [[] for _ in range(n_seq)]
        self.calls: list[list[int]] = []  # the tokens of every item of every eval call, in order
        self.embeds: list[list[Any]] = []  # the embeds of every item: (index, rows) pairs
        self.call_times: list[float] = []  # time.perf_counter() at the start of each item
        self.aborts = 0  # items stopped by an abort flag
        self.running = threading.Event()  # set while an eval call runs
        self._abort: set[int] = set()
        self._lock = threading.Lock()
        self._turn_open = tokenizer.encode("<|im_start|>assistant\n", special=True)
        self._no_thinking = tokenizer.encode("<think>\n\n</think>\n\n", special=True)
        self._end = tokenizer.token_to_id("<|im_end|>")

    @property
    def kv(self) -> list[int]:
        return self.kvs[0]

    def _cache(self, seq: int) -> list[int]:
        return self.kvs[seq]

    @property
    def n_past(self) -> int:
        return len(self.kvs[0])

    def seq_n_past(self, seq: int) -> int:
        return len(self.kvs[seq])

    def eval_batch(self, items: Sequence[BatchItem], notify_fd: int = -1) -> list[np.ndarray]:
        if notify_fd >= 0:  # as the engine does as a call starts
            os.eventfd_write(notify_fd, 1)
        results: list[np.ndarray | None] = []
        dropped: set[int] = set()
        self.running.set()
        try:
            for item in items:
                self.call_times.append(time.perf_counter())
                self.calls.append(list(item.tokens))
                self.embeds.append(list(item.embeds or []))
                kv = self.kvs[item.seq]
                if len(kv) + len(item.tokens) > self.n_ctx:
                    raise EngineError("context full")
                # a decode step's token, or a draft token it verifies (every row's logits), costs a decode step
                step = self.decode_s if len(item.tokens) == 1 or item.logits == "all" else self.prompt_s
                results.append(self._run(item, kv, step, dropped))
        finally:
            self.running.clear()
        if dropped:
            raise EngineAborted("aborted", frozenset(dropped), results)
        return cast(list[np.ndarray], results)  # no None without a dropped sequence

    def _run(self, item: BatchItem, kv: list[int], step: float, dropped: set[int]) -> np.ndarray | None:
        nexts = []  # the script's token after each position of the item
        for token in item.tokens:
            for _ in range(self.LAYERS):
                with self._lock:
                    stop = item.seq in self._abort
                    self._abort.discard(item.seq)
                if stop:
                    self.aborts += 1
                    dropped.add(item.seq)
                    return None
                if step:
                    time.sleep(step / self.LAYERS)
            kv.append(token)
            if item.logits == "all":
                nexts.append(self._next_token(kv))
        if item.logits == "last":
            nexts.append(self._next_token(kv))
        # A margin no temperature below ~10 can overturn: the script is followed at any sampling setting.
        logits = np.full((len(nexts), self.n_vocab), -100.0, dtype=np.float32)
        logits[np.arange(len(nexts)), nexts] = 100.0
        return logits

    def eval(self, tokens: Sequence[int], embeds: Any = None, all_logits: bool = False) -> np.ndarray:
        (logits,) = self.eval_batch([BatchItem(0, tokens, embeds)])
        return logits[0]

    def _next_token(self, kv: list[int]) -> int:
        """The script's token after what follows the last assistant prompt (and its empty thinking block, when
        the template disabled thinking) in the cache."""
        n = len(self._turn_open)
        for start in range(len(kv) - n, -1, -1):
            if kv[start:start + n] == self._turn_open:
                start += n
                if kv[start:start + len(self._no_thinking)] == self._no_thinking:
                    start += len(self._no_thinking)
                written = len(kv) - start
                return self.script[written] if 0 <= written < len(self.script) else self._end
        return self._end

    def keep(self, n: int, seq: int = 0) -> None:
        del self.kvs[seq][n:]

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self.kvs[dst] = self.kvs[src][:n]

    def abort(self, seq: int = 0) -> None:
        with self._lock:
            self._abort.add(seq)

    def clear_abort(self, seq: int = 0) -> None:
        with self._lock:
            self._abort.discard(seq)


# --- the successor model of the batcher's tests

N_VOCAB = 16


class SuccessorEngine(FakeEngine):
    """An engine of `n_seq` sequences whose most likely next token is always (last token + 1) mod N_VOCAB, the
    runner-up (last + 2); it records every call as a list of (seq, tokens, embeds)."""

    def __init__(self, n_ctx: int = 64, n_seq: int = 1, n_batch: int = 256) -> None:
        self.n_vocab, self.n_ctx, self.n_seq, self.n_batch = N_VOCAB, n_ctx, n_seq, n_batch
        self.picture_width = 2  # the width of the rows the tests' prompts carry
        self.caches: list[list[int]] = [[] for _ in range(n_seq)]
        self.calls: list[list[tuple[int, list[int], Embeds | None]]] = []
        self.copies: list[tuple[int, int, int]] = []
        self.flags: set[int] = set()

    def seq_n_past(self, seq: int) -> int:
        return len(self.caches[seq])

    def _cache(self, seq: int) -> list[int]:
        return self.caches[seq]

    def eval_batch(self, items: Sequence[BatchItem], notify_fd: int = -1) -> list[np.ndarray]:
        if notify_fd >= 0:  # as the engine does as a call starts
            os.eventfd_write(notify_fd, 1)
        self.calls.append([(item.seq, list(item.tokens), item.embeds) for item in items])
        results: list[np.ndarray | None] = []
        dropped = frozenset(item.seq for item in items if item.seq in self.flags)
        for item in items:
            assert item.tokens and self.seq_n_past(item.seq) + len(item.tokens) <= self.n_ctx
            if item.seq in dropped:
                results.append(None)
                continue
            cache = self.caches[item.seq]
            cache += item.tokens
            first = len(cache) - len(item.tokens)
            logits = np.stack([self.row(cache[:first + i + 1]) for i in range(len(item.tokens))])
            results.append({"all": logits, "last": logits[-1:], "none": logits[:0]}[item.logits])
        self.flags -= dropped
        if dropped:
            raise EngineAborted("aborted", dropped, results)
        return cast(list[np.ndarray], results)  # no None without a dropped sequence

    def row(self, cache: list[int]) -> np.ndarray:
        """The logits after the positions `cache` (N_VOCAB,)."""
        logits = np.zeros(N_VOCAB, np.float32)
        logits[(cache[-1] + 1) % N_VOCAB] = 5.0
        logits[(cache[-1] + 2) % N_VOCAB] = 4.0
        return logits

    def keep(self, n: int, seq: int = 0) -> None:
        del self.caches[seq][n:]

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self.copies.append((src, dst, n))
        self.caches[dst] = self.caches[src][:n]

    def abort(self, seq: int = 0) -> None:
        self.flags.add(seq)

    def clear_abort(self, seq: int = 0) -> None:
        self.flags.discard(seq)


class MarkovEngine(SuccessorEngine):
    """A SuccessorEngine whose logits after a position are random (seeded) and depend on its last two tokens:
    text that repeats itself in places, for speculative decoding. `sharp` scales them (a large value: a few
    likely tokens)."""

    def __init__(self, seed: int = 0, sharp: float = 1.0, **kw: Any) -> None:
        super().__init__(**kw)
        self.table = np.random.default_rng(seed).normal(0.0, sharp, (N_VOCAB, N_VOCAB, N_VOCAB)).astype(np.float32)

    def row(self, cache: list[int]) -> np.ndarray:
        return self.table[cache[-2] if len(cache) > 1 else 0, cache[-1]].copy()


class RecurrentEngine(SuccessorEngine):
    """A SuccessorEngine with a recurrent state per sequence, held to the C engine's rules: the state is every
    token the sequence has taken; `keep` to fewer positions, `copy_prefix` of fewer than the source holds, and
    `import_kv` of some positions leave it invalid until `load_state`; an eval of a sequence whose state does not
    sum up exactly its cache fails. `loads` records every (seq, n_past) a state was loaded at."""

    recurrent = True
    state_bytes = 1000

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.states: list[list[int] | None] = [[] for _ in range(self.n_seq)]
        self.loads: list[tuple[int, int]] = []
        self.checkpoints: dict[int, list[int]] = {}
        self.restores: list[tuple[int, int]] = []  # every (seq, n_past) a checkpoint was restored at

    def eval_batch(self, items: Sequence[BatchItem], notify_fd: int = -1) -> list[np.ndarray]:
        for item in items:
            if self.states[item.seq] != self.caches[item.seq]:
                raise EngineError(f"sequence {item.seq}'s recurrent state does not match its cache")
        dropped = set(self.flags)
        try:
            return super().eval_batch(items, notify_fd=notify_fd)
        finally:  # a dropped sequence's state stopped half-way through the layers
            for item in items:
                self.states[item.seq] = None if item.seq in dropped else list(self.caches[item.seq])

    def keep(self, n: int, seq: int = 0) -> None:
        if n < len(self.caches[seq]):
            self.states[seq] = [] if n == 0 else None
        super().keep(n, seq)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self.states[dst] = list(self.caches[src]) if n == len(self.caches[src]) else None
        super().copy_prefix(src, dst, n)

    def import_kv(self, seq: int, first: int, data: Any) -> None:
        super().import_kv(seq, first, data)
        if len(memoryview(data)):  # rows without their state
            self.states[seq] = None

    def save_state(self, seq: int = 0) -> bytes:
        state = self.states[seq]
        assert state is not None
        return bytes(state)

    def load_state(self, seq: int, data: bytes) -> None:
        assert len(data) == len(self.caches[seq]), "a state loaded at another position"
        self.loads.append((seq, len(data)))
        self.states[seq] = list(data)

    def checkpoint_state(self, seq: int = 0) -> None:
        state = self.states[seq]
        assert state is not None
        self.checkpoints[seq] = list(state)

    def restore_state(self, seq: int = 0) -> None:
        state = self.checkpoints.pop(seq)
        assert len(state) == len(self.caches[seq]), "a checkpoint restored at another position"
        self.restores.append((seq, len(state)))
        self.states[seq] = state


class TimedEngine(SuccessorEngine):
    """A SuccessorEngine on a clock of its own: a call takes `decode` seconds plus `per_token(position)` for each
    token of the sequences in `prompting`."""

    def __init__(self, decode: float, per_token: Callable[[int], float], prompting: set[int], **kw: Any) -> None:
        super().__init__(**kw)
        self.now, self.decode, self.per_token, self.prompting = 0.0, decode, per_token, prompting
        self.times: list[float] = []  # the clock after each call

    def clock(self) -> float:
        return self.now

    def eval_batch(self, items: Sequence[BatchItem], notify_fd: int = -1) -> list[np.ndarray]:
        self.now += self.decode + sum(self.per_token(self.seq_n_past(item.seq) + i)
                                      for item in items if item.seq in self.prompting
                                      for i in range(len(item.tokens)))
        self.times.append(self.now)
        return super().eval_batch(items, notify_fd=notify_fd)


# --- recording


class RecordingEngine:
    """Another engine, with the sequences of each eval call (`batches`) and the tokens and embeds of each item
    (`calls`) kept."""

    def __init__(self, engine: EngineLike):
        self._engine = engine
        self.batches: list[list[int]] = []
        self.calls: list[tuple[list[int], list[Any]]] = []

    @property
    def n_vocab(self) -> int:
        return self._engine.n_vocab

    @property
    def picture_width(self) -> int:
        return self._engine.picture_width

    @property
    def n_ctx(self) -> int:
        return self._engine.n_ctx

    @property
    def n_seq(self) -> int:
        return self._engine.n_seq

    @property
    def n_batch(self) -> int:
        return self._engine.n_batch

    @property
    def arch(self) -> str:
        return self._engine.arch

    @property
    def backend(self) -> str:
        return self._engine.backend

    @property
    def threads(self) -> int:
        return self._engine.threads

    def eval_batch(self, items: Sequence[BatchItem], notify_fd: int = -1) -> list[np.ndarray]:
        self.batches.append([item.seq for item in items])
        self.calls += [(list(item.tokens), list(item.embeds or [])) for item in items]
        return self._engine.eval_batch(items, notify_fd=notify_fd)

    @property
    def recurrent(self) -> bool:
        return self._engine.recurrent

    @property
    def state_bytes(self) -> int:
        return self._engine.state_bytes

    def save_state(self, seq: int = 0) -> bytes:
        return self._engine.save_state(seq)

    def load_state(self, seq: int, data: bytes) -> None:
        self._engine.load_state(seq, data)

    def checkpoint_state(self, seq: int = 0) -> None:
        self._engine.checkpoint_state(seq)

    def restore_state(self, seq: int = 0) -> None:
        self._engine.restore_state(seq)

    def seq_n_past(self, seq: int) -> int:
        return self._engine.seq_n_past(seq)

    def keep(self, n: int, seq: int = 0) -> None:
        self._engine.keep(n, seq)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self._engine.copy_prefix(src, dst, n)

    def abort(self, seq: int = 0) -> None:
        self._engine.abort(seq)

    def clear_abort(self, seq: int = 0) -> None:
        self._engine.clear_abort(seq)

    def sample_rows(self, rows: Sequence[np.ndarray], settings: Sequence[SamplingParams], u: Sequence[float]
                    ) -> list[int]:
        return self._engine.sample_rows(rows, settings, u)


    def cpu_seconds(self) -> float:
        return self._engine.cpu_seconds()

    def expert_counts(self) -> dict[str, int] | None:
        return self._engine.expert_counts()

    @property
    def kv_identity(self) -> str:
        return self._engine.kv_identity

    @property
    def kv_position_bytes(self) -> int:
        return self._engine.kv_position_bytes

    def export_kv(self, seq: int, first: int, n: int) -> np.ndarray:
        return self._engine.export_kv(seq, first, n)

    def import_kv(self, seq: int, first: int, data: Any) -> None:
        self._engine.import_kv(seq, first, data)

    def close(self) -> None:
        self._engine.close()


class FirstTokenWatch(RecordingEngine):
    """Also records, at each eval call, whether the consumer had been given its first token (`given`)."""

    def __init__(self, engine: EngineLike):
        super().__init__(engine)
        self.given = False
        self.seen: list[bool] = []

    def eval_batch(self, items: Sequence[BatchItem], notify_fd: int = -1) -> list[np.ndarray]:
        self.seen.append(self.given)
        return super().eval_batch(items, notify_fd=notify_fd)


class FailingEngine(ScriptedEngine):
    """A scripted engine whose every eval call raises `error`."""

    def __init__(self, tokenizer: Any, error: Exception, **options: Any):
        super().__init__(tokenizer, **options)
        self.error = error

    def eval_batch(self, items: Sequence[BatchItem], notify_fd: int = -1) -> list[np.ndarray]:
        raise self.error


# The type check: each engine here implements `EngineLike`.
_ENGINES: tuple[type[EngineLike], ...] = (ScriptedEngine, SuccessorEngine, MarkovEngine, TimedEngine, RecordingEngine,
                                          FirstTokenWatch, FailingEngine)
