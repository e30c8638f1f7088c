"""Choosing the next token from the engine's logits.

The pipeline, in order (the order Hugging Face and vLLM use, so that settings mean what clients expect):

1. penalties over the last `penalty_last_n` previous tokens: the repetition penalty the llama.cpp way (a positive
   logit is divided by it, a negative one multiplied), then OpenAI's
   `logit -= count * frequency_penalty + (count > 0) * presence_penalty`;
2. temperature 0 (or top_k 1) means greedy: the arg-max of the penalised logits, nothing else applies;
3. otherwise logits are divided by the temperature and turned into probabilities;
4. top-k keeps the k most likely tokens, top-p the smallest most-likely set whose probability reaches top_p, min-p
   the tokens at least `min_p` times as likely as the most likely one;
5. one token is drawn from what is left, renormalised.

Defaults are OpenAI's (temperature 1, top_p 1, no penalties) plus the neutral values of the extensions
(top_k 0 and min_p 0 switch those filters off, repetition_penalty 1 does nothing), so a request that sets nothing
samples from the model's own distribution. The penalty window, 64 tokens, is llama.cpp's default.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from strata.engine_cffi._engine import ffi, lib

# top-p on the whole vocabulary first looks at this many of the most likely tokens, and grows the window only if
# their mass falls short of top_p: a full sort of 151,936 logits costs ~10 ms, a partition ~1 ms.
_TOP_P_FIRST_WINDOW = 1024

# A temperature above 0 but below this draws the arg-max, as 0 does: the logits divided by it overflow float32
# (the engine's draw takes the temperature as a C float, in which 1e-300 is 0), and the limit of the distribution
# as the temperature goes to 0 is the arg-max anyway (at 1e-5, a logit 1e-3 below the largest weighs e^-100).
GREEDY_BELOW = 1e-5
# top_k goes to the engine's draw as a C int; a larger k keeps every token, as 0 does.
_TOP_K_MAX = 2**31 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. Every field has the neutral or OpenAI default; `validate()` checks the ranges.

    Attributes:
        temperature: divides the logits; 0 means greedy (always the most likely token), and so does any
            temperature under `GREEDY_BELOW`.
        top_k: keep only the k most likely tokens; 0 means off, and so does a k of the vocabulary's size or more.
            At most 2^31 - 1.
        top_p: nucleus sampling, in (0, 1]; 1 means off.
        min_p: drop tokens less likely than `min_p` times the most likely one, in [0, 1]; 0 means off.
        repetition_penalty: > 0; 1 means off. Divides positive logits of recent tokens, multiplies negative ones.
        frequency_penalty: in [-2, 2]; subtracted once per occurrence of a token in the recent window.
        presence_penalty: in [-2, 2]; subtracted once from every token present in the recent window.
        penalty_last_n: how many previous tokens the penalties look at; -1 means all of them, 0 none.
        seed: seeds the random generator; None draws a fresh seed from the OS.
        logit_bias: (token id, bias in [-100, 100]) pairs added to those tokens' logits before everything else
            (OpenAI's `logit_bias`; -100 bans a token in practice, 100 all but forces it).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field whose value is out of range."""
        _check_number("temperature", self.temperature, lo=0.0)
        _check_int("top_k", self.top_k, lo=0, hi=_TOP_K_MAX)
        _check_number("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_number("min_p", self.min_p, lo=0.0, hi=1.0)
        _check_number("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        _check_number("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_number("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_int("penalty_last_n", self.penalty_last_n, lo=-1)
        if self.seed is not None:
            _check_int("seed", self.seed)
        for token, bias in self.logit_bias:
            _check_int("logit_bias token", token, lo=0)
            _check_number(f"logit_bias[{token}]", bias, lo=-100.0, hi=100.0)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def penalised(self) -> bool:
        return self.penalty_last_n != 0 and (
            self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
        )


class SamplingError(ValueError):
    """A sampling setting out of its range; `field` names it (as the APIs name their fields)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _check_number(name: str, value: object, lo: float | None = None, hi: float | None = None,
                  lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SamplingError(name, f"{name} must be a finite number, got {value!r}")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        bound = f"greater than {lo:g}" if lo_open else f"at least {lo:g}"
        raise SamplingError(name, f"{name} must be {bound}, got {value!r}")
    if hi is not None and value > hi:
        raise SamplingError(name, f"{name} must be at most {hi:g}, got {value!r}")


def _check_int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingError(name, f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise SamplingError(name, f"{name} must be at least {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise SamplingError(name, f"{name} must be at most {hi}, got {value!r}")


class TokenMask(Protocol):
    """What constrains the next token (`strata.text.constraints.Guide`): it masks the logits before the pipeline and
    follows the token drawn. `apply` may return the allowed ids (when they are few): the pipeline then works on
    those alone instead of the whole vocabulary."""

    def apply(self, logits: np.ndarray) -> np.ndarray | None: ...
    def advance(self, token: int) -> None: ...


class Sampler:
    """Picks tokens with one `SamplingParams` and its own random generator (one sampler per generation).

    Args:
        params: the sampling settings (already validated by their constructor).
        n_vocab: the length of every logits vector passed in.
        mask: applied to the logits (in place) before each draw and told the token drawn, or None.
    """

    def __init__(self, params: SamplingParams, n_vocab: int, mask: TokenMask | None = None,
                 logprobs: int | None = None) -> None:
        if n_vocab <= 0:
            raise ValueError(f"n_vocab must be positive, got {n_vocab}")
        self.params = params
        self.n_vocab = n_vocab
        self.mask = mask
        self.logprobs = logprobs
        # With `logprobs`: per drawn token, (its log-probability, the `logprobs` most likely (id, log-probability)),
        # appended before `sample` returns (the engine thread appends, the request's task reads).
        self.records: list[tuple[float, list[tuple[int, float]]]] = []
        if any(token >= n_vocab for token, _ in params.logit_bias):
            raise ValueError(f"logit_bias names a token id beyond the vocabulary ({n_vocab} tokens)")
        self._bias_ids = np.array([token for token, _ in params.logit_bias], dtype=np.int64)
        self._bias_values = np.array([bias for _, bias in params.logit_bias], dtype=np.float32)
        self._work: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def _alone(self) -> bool:
        """A draw reads the scores alone: no mask to apply, bias to add or log-probabilities to record."""
        return self.mask is None and not self._bias_ids.size and self.logprobs is None

    @functools.cached_property
    def _rng(self) -> np.random.Generator:
        # Built at the first random draw: a fresh generator reads the OS's entropy (about 60 us), which a greedy
        # request, the common case of agents, never needs.
        return np.random.default_rng(None if self.params.seed is None else self.params.seed % 2**64)

    def sample(self, logits: np.ndarray, previous_ids: Sequence[int] = ()) -> int:
        """Return the next token id for `logits` (n_vocab,), given the tokens so far (prompt and output).
        With a logit bias or a mask, `logits` is changed in place."""
        if self._alone:
            return self._draw(logits, previous_ids)
        if np.shape(logits) != (self.n_vocab,):
            raise ValueError(f"logits must have shape ({self.n_vocab},), got {np.shape(logits)}")
        if self._bias_ids.size:
            logits[self._bias_ids] += self._bias_values
        among = self.mask.apply(logits) if self.mask is not None else None
        token = self._draw(logits, previous_ids, among)
        if self.mask is not None:
            self.mask.advance(token)
        if self.logprobs is not None:
            self.records.append(log_probabilities(logits, token, self.logprobs))
        return token

    def draws_at_once(self, rows: np.ndarray) -> list[int] | None:
        """The tokens `sample` draws from `rows` (n, n_vocab), one after another, where no draw depends on the ones
        before it: greedy, with no penalty, mask, logit bias or log-probabilities, each row's arg-max (a speculative
        step's rows, drawn in one call); None where `sample` must draw each in turn."""
        if not self.params.greedy or self.params.penalised or not self._alone:
            return None
        if rows.ndim != 2 or rows.shape[1] != self.n_vocab:
            raise ValueError(f"rows must have shape (n, {self.n_vocab}), got {rows.shape}")
        return np.argmax(rows, axis=1).tolist()

    def draw_inputs(self, logits: np.ndarray, previous_ids: Sequence[int] = ()) -> tuple[np.ndarray, float] | None:
        """What `sample` draws from for `logits` (the scores after penalties, and u; 0 for a greedy draw, which
        takes none), for a caller that draws several rows at once (`Engine.sample_rows`); None where `sample` must
        draw itself (a mask, a logit bias, log-probabilities). Like `sample`, it takes u from this sampler's
        generator."""
        if not self._alone:
            return None
        return self.penalise(logits, previous_ids), 0.0 if self.params.greedy else self._rng.random()

    def draw_with(self, scores: np.ndarray, u: float) -> int:
        """The index that `scores` (after penalties) and u give, drawn here."""
        if self.params.greedy:  # the decode loop's common case: the arg-max, nothing to build
            return int(np.argmax(scores))
        return draw(scores, self.params, u, self._scratch(len(scores)))

    def _draw(self, logits: np.ndarray, previous_ids: Sequence[int], among: np.ndarray | None = None) -> int:
        """A token drawn from `logits`; with `among` (ids), from those tokens only (the others are masked)."""
        scores = self.penalise(logits, previous_ids)  # `logits` itself unless a penalty applies
        if among is not None:
            scores = scores[among]
        index = self.draw_with(scores, 0.0 if self.params.greedy else self._rng.random())
        return index if among is None else int(among[index])

    def _scratch(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """`draw`'s work arrays for n logits, kept from draw to draw (151,936 logits: 1.2 MB)."""
        if self._work is None or len(self._work[0]) < n:
            self._work = (np.empty(n, np.float32), np.empty(n, np.int32))
        return self._work

    def penalise(self, logits: np.ndarray, previous_ids: Sequence[int]) -> np.ndarray:
        """The logits after the penalties (a copy when any applies; `logits` itself is never changed)."""
        logits = np.asarray(logits)
        if logits.shape != (self.n_vocab,):
            raise ValueError(f"logits must have shape ({self.n_vocab},), got {logits.shape}")
        p = self.params
        if not p.penalised:
            return logits
        window = _recent(previous_ids, p.penalty_last_n)
        if len(window) == 0:
            return logits
        ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
        out = logits.astype(np.float32, copy=True)
        values: np.ndarray = out[ids]
        if p.repetition_penalty != 1.0:
            values = np.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        values = values - counts * p.frequency_penalty - p.presence_penalty
        out[ids] = values
        return out

    def distribution(self, logits: np.ndarray, previous_ids: Sequence[int] = (), among: np.ndarray | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
        """The candidates `sample` draws from: token ids and their probabilities (summing to 1); with `among`
        (ascending ids: what a mask allows), from those tokens only.

        At temperature 0 (or top_k 1) that is the arg-max alone with probability 1. With top-k or top-p the ids
        come most likely first; otherwise in vocabulary order.
        """
        ids, weights = self._candidates(logits, previous_ids, among)
        return ids, weights / weights.sum(dtype=np.float64)

    def _candidates(self, logits: np.ndarray, previous_ids: Sequence[int], among: np.ndarray | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
        """Like `distribution`, with weights relative to the most likely token instead of probabilities; with
        `among`, over those ids only."""
        scores = self.penalise(logits, previous_ids)
        if among is None:
            return self._filter(scores)
        ids, weights = self._filter(scores[among])
        return among[ids], weights

    def _filter(self, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Temperature, top-k, top-p and min-p over `scores`: the positions kept and their weights."""
        p = self.params
        if p.greedy:
            return np.array([int(np.argmax(scores))]), np.ones(1)
        # float32 over the whole vocabulary (exp is the cost here); float64 once the candidates are few
        scaled = np.asarray(scores, dtype=np.float32) / np.float32(p.temperature)  # (n_vocab,)
        if 0 < p.top_k < len(scaled):
            ids = _sorted_top(scaled, p.top_k)
            weights = np.exp(scaled[ids].astype(np.float64) - scaled[ids[0]])  # relative to the most likely
            total = weights.sum()
        else:
            relative = np.exp(scaled - scaled.max())  # (n_vocab,), 1 for the most likely token
            total = relative.sum(dtype=np.float64)
            if p.top_p < 1.0:
                ids = _nucleus_window(scaled, relative, total, p.top_p)
                weights = relative[ids].astype(np.float64)
            else:
                ids, weights = np.arange(len(scaled)), relative
        if p.top_p < 1.0:
            keep = _nucleus_size(weights, total, p.top_p)
            ids, weights = ids[:keep], weights[:keep]
        if p.min_p > 0.0:
            # weights are relative to the most likely token, so the threshold is min_p itself
            mask = weights >= p.min_p
            ids, weights = ids[mask], weights[mask]
        return ids, weights


def draw(scores: np.ndarray, params: SamplingParams, u: float,
         work: tuple[np.ndarray, np.ndarray] | None = None) -> int:
    """The index of the token that `u` in [0, 1) draws from `scores` (logits after penalties and masks) under the
    temperature, top-k, top-p and min-p of `params` (not greedy): the candidates `Sampler.distribution` gives,
    walked in id order until their running probability passes `u`. In C (`strata_sample`), without the GIL: numpy
    took 1.4 ms a token over 151,936 logits at the default settings, and 15 ms for top-p 0.95 of a flat
    distribution. Weights under e^-87 of the most likely token's count as 0.

    work: a float32 and an int32 array of at least len(scores), reused between calls (else allocated)."""
    scores = np.ascontiguousarray(scores, dtype=np.float32)
    n = len(scores)
    if n == 0 or params.greedy:
        raise ValueError("draw needs logits and a temperature above 0 (greedy draws are the arg-max)")
    floats, ints = work if work is not None else (np.empty(n, np.float32), np.empty(n, np.int32))
    if len(floats) < n or len(ints) < n or floats.dtype != np.float32 or ints.dtype != np.int32:
        raise ValueError(f"draw needs float32 and int32 work arrays of {n} values")
    settings = ffi.new("strata_sampling *", {"temperature": params.temperature, "top_k": params.top_k,
                                             "top_p": params.top_p, "min_p": params.min_p})
    index = lib.strata_sample(ffi.from_buffer("float[]", scores), n, settings, u,
                              ffi.from_buffer("float[]", floats), ffi.from_buffer("int[]", ints))
    if index < 0:
        raise MemoryError("no memory for the top-k candidates")
    return int(index)


def log_probabilities(logits: np.ndarray, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of `token` and the `top` most likely tokens under softmax(logits): the model's own
    distribution after the logit bias and the answer's mask, before penalties and temperature (what OpenAI
    reports)."""
    peak = float(np.max(logits))
    log_total = peak + float(np.log(np.sum(np.exp(logits - peak), dtype=np.float64)))
    best: list[tuple[int, float]] = []
    if top > 0:
        ids = _sorted_top(logits, min(top, len(logits)))
        best = [(int(i), float(logits[i]) - log_total) for i in ids if np.isfinite(logits[i])]
    return float(logits[token]) - log_total, best


def _nucleus_window(scaled: np.ndarray, relative: np.ndarray, total: float, top_p: float) -> np.ndarray:
    """Ids of the most likely tokens, highest first (equal ones in id order), at least enough of them to hold
    `top_p` of the mass.

    Grows a partitioned window instead of sorting the whole vocabulary; only the window that suffices is sorted.
    """
    window = _TOP_P_FIRST_WINDOW
    while window < len(scaled):
        lowest = scaled[np.argpartition(-scaled, window - 1)[window - 1]]
        ids = np.flatnonzero(scaled >= lowest)  # the window, and every token equal to its lowest
        if relative[ids].sum(dtype=np.float64) >= top_p * total:
            return ids[np.argsort(-scaled[ids], kind="stable")]
        window *= 8
    return np.argsort(-scaled, kind="stable")


def _recent(previous_ids: Sequence[int], last_n: int) -> Sequence[int]:
    if last_n == 0:
        return ()
    if last_n < 0:
        return previous_ids
    return previous_ids[-last_n:]


def _sorted_top(scores: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k highest scores, highest first (equal ones in id order)."""
    lowest = scores[np.argpartition(-scores, k - 1)[k - 1]]
    ids = np.flatnonzero(scores >= lowest)
    return ids[np.argsort(-scores[ids], kind="stable")][:k]


def _nucleus_size(weights: np.ndarray, total: float, top_p: float) -> int:
    """How many of the descending `weights` it takes to hold `top_p` of `total`; at least one.

    This is the set Hugging Face's TopPLogitsWarper keeps: a token stays if the tokens more likely than it hold
    less than `top_p` of the mass.
    """
    cumulative = np.cumsum(weights) / total
    return min(int(np.searchsorted(cumulative, top_p, side="left")) + 1, len(weights))
