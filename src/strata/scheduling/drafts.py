"""Speculative decoding's drafts: where a decoding job's guessed next tokens come from, and how many it guesses.

A draft is a few tokens the job's answer is likely to continue with. The batcher appends them to the job's token
in its step (`strata.scheduling.batcher`), the engine returns logits for every one of them, and the job keeps the
draft up to the first token its sampler would not have drawn, plus the token the sampler draws there: up to
`len(draft) + 1` tokens for one step, which on a CPU MoE costs little more than one token while the step reads
the routed experts' weights anyway.

Sources, behind `Drafter`:

- `PromptLookup`: the answer so far is matched against the prompt and itself (an n-gram index: the longest match
  of its last tokens, at least `min_ngram` of them and at most `max_ngram`, the latest occurrence among equally
  long ones), and the tokens that followed the match are the draft. This is prompt-lookup decoding (llama.cpp's
  `ngram` speculation, vLLM's n-gram proposer): free to compute, and right most of the time where the answer
  copies its input (an edit of a file it was given, a quote, a reformatting).
- `Prediction`: the client's own guess of the answer (OpenAI's Predicted Outputs, `prediction` on the chat
  route), tokenised: drafts continue it where the answer so far is its prefix, else after an n-gram match of the
  answer's last tokens in it; the prompt lookup takes over where it has no match.
- `Mtp`: the model's own MTP block (the `nextn` layer of Qwen3.5 files), which the engine runs beside the model
  (`Engine.mtp_draft`): from the hidden state of the answer's last evaluated token and the embedding of its next
  one, the block's greedy guess of the token after, chained on its own hidden state for several. It guesses free
  text too, where the lookup has nothing; the lookup takes over where it has no hidden state to start from.

All are deterministic: the draft's distribution is one token with probability 1, so the standard accept/reject
rule (accept draft token x with probability min(1, p(x) / q(x)), else draw from p with x removed and
renormalised) is the same as drawing the token from p as without speculation and keeping the draft while the draw
equals it. The batcher does exactly that, with the job's own sampler, so the output's distribution is the
model's own, a seeded request draws the same tokens with speculation on and off, and masks, penalties and
log-probabilities apply to every drafted position as to an ordinary one.

A separate small model of the same vocabulary is another source (`strata.scheduling.draft_model.DraftModel`):
drafted greedily on a context of its own, its q is one-hot too.

`Speculation` is one job's controller: it asks its drafter for as many tokens as pay (`length`) and learns from
the verification what pays.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from strata.config import SpeculativeConfig


class Drafter(Protocol):
    """A source of drafts for one job.

    Attributes:
        shadow_every: while drafts do not pay, `Speculation` guesses a token without sending it every this many
            steps: 1 for a source whose guess costs next to nothing; more for one that runs a model for it, whose
            interval then grows `Speculation.SHADOW_GROWTH` times with each wrong guess (up to
            `Speculation.MAX_SHADOW_EVERY`) and comes back with a right one.
    """

    shadow_every: int

    def propose(self, history: Sequence[int], n_prompt: int, n: int, seq: int = 0) -> list[int]:
        """Up to `n` tokens likely to follow `history` (the prompt, its first `n_prompt` tokens, then the answer
        so far) of the job on sequence `seq`; [] when it has no guess."""


class NgramIndex:
    """Where each `min_ngram`-token sequence of a growing token list occurs (the positions just after it), for
    the longest match of another list's tail, extended backwards up to `max_ngram` tokens."""

    CANDIDATES = 32  # latest occurrences of the short n-gram that a match is extended from
    # Positions indexed by one call at most (~2 ms, in the engine thread): a long prompt is indexed over a few
    # steps, matched meanwhile against its part indexed so far, and no step waits for all of it.
    CHUNK = 4096

    def __init__(self, min_ngram: int, max_ngram: int):
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self._after: dict[tuple[int, ...], list[int]] = {}
        self._indexed = 0  # the next position to index (the end of an n-gram)

    @property
    def indexed(self) -> int:
        return self._indexed

    def extend(self, tokens: Sequence[int]) -> None:
        """Index the positions of `tokens` (the list, grown since the last call) not indexed yet, `CHUNK` at
        most."""
        m = self.min_ngram
        start = max(self._indexed, m)
        stop = min(len(tokens) + 1, start + self.CHUNK)
        after = self._after
        if stop == start + 1:  # a decoding step's one token
            after.setdefault(tuple(tokens[start - m:start]), []).append(start)
        else:  # a prompt: its n-grams as tuples zip builds (a slice and a tuple a position cost 1.5 times as much)
            ngrams = zip(*(tokens[start - m + i:stop - m + i] for i in range(m)), strict=True)
            for end, ngram in enumerate(ngrams, start):
                after.setdefault(ngram, []).append(end)
        self._indexed = max(self._indexed, stop)

    def match(self, corpus: Sequence[int], tail: Sequence[int], before: int | None = None) -> tuple[int, int]:
        """(position after the match in `corpus`, its length) of the longest match of `tail`'s last tokens that
        some continuation follows (a position before `before`, default the corpus's end); (-1, 0) if none."""
        m = self.min_ngram
        if len(tail) < m:
            return -1, 0
        limit = len(corpus) if before is None else before
        ends = self._after.get(tuple(tail[-m:]), ())
        best, best_len = -1, 0
        checked = 0
        for end in reversed(ends):  # latest first: of equally long matches, the latest wins
            if end >= limit:
                continue
            length = m
            while (length < self.max_ngram and length < len(tail) and end - length - 1 >= 0
                   and corpus[end - length - 1] == tail[-length - 1]):
                length += 1
            if length > best_len:
                best, best_len = end, length
            checked += 1
            if checked >= self.CANDIDATES or best_len >= self.max_ngram:
                break
        return best, best_len


class PromptLookup:
    """Drafts copied from the prompt and the answer so far, after the longest match of the answer's tail."""

    shadow_every = 1

    def __init__(self, min_ngram: int = 2, max_ngram: int = 12):
        self.index = NgramIndex(min_ngram, max_ngram)
        self._last: tuple[int, int, int] | None = None  # (history's length, match's end, its length)

    def propose(self, history: Sequence[int], n_prompt: int, n: int, seq: int = 0) -> list[int]:
        end, _ = self.match(history)
        return list(history[end:end + n]) if end >= 0 else []

    def match(self, history: Sequence[int]) -> tuple[int, int]:
        """(where the continuation starts, the match's length) of the longest match of the tail of `history` (a
        job's, which only grows) earlier in it; (-1, 0) if none. Found once for each length of the history, once
        all of it is indexed."""
        if self._last is None or self._last[0] != len(history) or self.index.indexed <= len(history):
            self.index.extend(history)
            self._last = (len(history), *self.index.match(history, history, before=len(history)))
        return self._last[1], self._last[2]


class Prediction:
    """Drafts from the client's predicted answer (token ids), with `fallback` where the answer has left it."""

    def __init__(self, predicted: Sequence[int], fallback: Drafter, min_ngram: int = 2, max_ngram: int = 12):
        self.predicted = list(predicted)
        self.fallback = fallback
        self.shadow_every = fallback.shadow_every  # its guesses are the fallback's once the answer has left it
        self.index = NgramIndex(min_ngram, max_ngram)  # built as drafts are asked for, in the engine thread
        self._aligned = 0  # answer tokens so far equal to the prediction's first ones (-1: it left the prefix)
        self.from_prediction = 0  # tokens of the last proposal taken from the prediction

    def propose(self, history: Sequence[int], n_prompt: int, n: int, seq: int = 0) -> list[int]:
        draft = self.own(history, n_prompt, n)
        self.from_prediction = len(draft)
        return draft if draft else self.fallback.propose(history, n_prompt, n, seq)

    def own(self, history: Sequence[int], n_prompt: int, n: int) -> list[int]:
        """The prediction's own draft of `n` tokens at most for `history`; [] where `propose` asks the fallback."""
        answer = history[n_prompt:]
        while 0 <= self._aligned < len(answer):
            if self._aligned < len(self.predicted) and answer[self._aligned] == self.predicted[self._aligned]:
                self._aligned += 1
            else:
                self._aligned = -1
        if self._aligned >= 0:
            start = self._aligned
        else:
            self.index.extend(self.predicted)
            start, _ = self.index.match(self.predicted, answer)
        return self.predicted[start:start + n] if start >= 0 else []

    @property
    def followed(self) -> bool:
        """The answer so far is the prediction's prefix, or the last draft came from the prediction."""
        return self._aligned >= 0 or self.from_prediction > 0


class MtpEngine(Protocol):
    """An engine that runs its model's MTP block (`strata.engine_cffi.Engine` loaded with `mtp`)."""

    def mtp_draft(self, seqs: Sequence[int], pos: Sequence[int], tokens: Sequence[int], n_draft: int,
                  logits: bool = False) -> tuple[np.ndarray, np.ndarray | None]: ...


class Mtp:
    """Drafts of the model's MTP block, which the engine runs beside the model: greedy and chained, from the
    hidden state of the job's last evaluated token (held by the engine for the last positions each sequence
    evaluated, so also after a rollback) and its next token; `fallback` (the prompt lookup) where the block has
    no draft, and where the answer repeats a long run of the prompt or itself (`repeats`). A guess
    runs the block and the output product once (in a small model about half a plain step), after one batched
    pass that fills the block's rows for the tokens evaluated since the last (the engine fills them lazily: an
    eval without a draft does not run the block; with the server's window, the last `mtp_window` of them): a job
    whose drafts do not pay guesses every `shadow_every` steps at most, ever less often while it guesses wrong
    and where its guess costs more than `Speculation.GUESS_SHARE` of its decode time, and costs next to nothing
    between guesses. The batcher runs the
    block for all of a step's jobs in one call (`draft_together`) before they propose."""

    shadow_every = 8
    REPEAT = 6  # tokens of the answer's tail that, found earlier in the prompt or answer, make the lookup draft

    def __init__(self, engine: MtpEngine, fallback: Drafter):
        self.engine, self.fallback = engine, fallback
        self._ready: tuple[int, int, np.ndarray] | None = None  # `draft_together`'s: (position, token, drafts)

    def repeats(self, history: Sequence[int]) -> bool:
        """The answer's tail repeats `REPEAT` tokens or more of the prompt or the answer (an edit re-emitting the
        code it was given): the prompt lookup (the fallback) drafts there, for nothing, where the block would cost a
        pass a token."""
        return isinstance(self.fallback, PromptLookup) and self.fallback.match(history)[1] >= self.REPEAT

    def propose(self, history: Sequence[int], n_prompt: int, n: int, seq: int = 0) -> list[int]:
        ready, self._ready = self._ready, None
        if len(history) >= 2 and not self.repeats(history):
            pos, token = len(history) - 1, history[-1]
            if ready is not None and ready[:2] == (pos, token) and len(ready[2]) >= n:
                row = ready[2][:n]  # a chain's first n drafts are the drafts of n
            else:
                row = self.engine.mtp_draft([seq], [pos], [token], n)[0][0]
            draft = [int(t) for t in row if t >= 0]
            if draft:
                return draft
        return self.fallback.propose(history, n_prompt, n, seq)

    def take(self, history: Sequence[int], drafts: np.ndarray) -> None:
        """`drafts` (the block's for `history`, run with other jobs') are the next `propose`'s for `history`."""
        self._ready = (len(history) - 1, history[-1], drafts)

    def forget(self) -> None:
        """Drop drafts `propose` did not take: the block's held hidden states move on with the next eval."""
        self._ready = None


@dataclass(frozen=True)
class MtpAsk:
    """A job's call of the MTP block in a step: its drafter, sequence and history, and the drafts it asks for."""

    drafter: Mtp
    seq: int
    history: Sequence[int]
    n: int


def draft_together(asks: Sequence[MtpAsk], n_ctx: int) -> None:
    """Run the MTP block once for several jobs (once per engine) of a context of `n_ctx` positions: each job's
    chain as long as the longest asked, one pass over the block's weights and the output matrix per chained
    position for all of them; each drafter's next `propose` for its history takes its first `n` (the drafts it
    gets alone). A job whose chain that long would pass the context's end is left to its own call."""
    by_engine: dict[int, list[MtpAsk]] = {}
    for ask in asks:
        by_engine.setdefault(id(ask.drafter.engine), []).append(ask)
    for group in by_engine.values():
        n_draft = max(ask.n for ask in group)
        group = [ask for ask in group if len(ask.history) - 1 + n_draft <= n_ctx + 1]
        drafts, _ = group[0].drafter.engine.mtp_draft([ask.seq for ask in group],
                                                      [len(ask.history) - 1 for ask in group],
                                                      [ask.history[-1] for ask in group], n_draft)
        for ask, row in zip(group, drafts, strict=True):
            ask.drafter.take(ask.history, row)


@dataclass(frozen=True)
class VerifyCost:
    """What k draft tokens add to a step of decoding jobs, in seconds: `fixed` for a step with drafts at all
    (every row's logits), `per_token` for each draft token, and `per_expert` for each routed expert the draft
    tokens read that the step's own tokens (one a decoding job) do not.

    A step computes each expert its tokens route to once, for all of them, so on a CPU MoE a draft token costs
    mostly the experts it adds (`bench/verify_cost.py`, small Q8_0 qwen3moe: 0.024 ms an expert read against
    0.23 ms a token's own rows, a token adding up to 24 reads). The experts k draft tokens add are not counted
    per step; `routing` = (MoE layers, experts a layer, experts a token uses) gives their expectation for tokens
    routed independently, beside n tokens of the step's jobs: L * E * ((1 - K/E)^n - (1 - K/E)^(n + k)). It grows
    less with each draft token as the layers' experts are all read, and less in a crowded step, whose own tokens
    read most of them already; tokens that route alike show in a smaller fitted `per_expert`. Without `routing`
    (a dense model, or one of unknown shape) the cost is the line fixed + per_token * k.
    """

    fixed: float
    per_token: float
    per_expert: float = 0.0
    routing: tuple[int, int, int] | None = None

    def new_experts(self, k: int, n: int = 1) -> float:
        """Expert reads k draft tokens add to a step of n tokens, expected for independently routed tokens."""
        if self.routing is None:
            return 0.0
        n_layer, n_expert, n_used = self.routing
        miss = 1.0 - n_used / n_expert  # the chance that a token leaves a given expert of a layer unread
        return n_layer * n_expert * (miss ** n - miss ** (n + k))

    def seconds(self, k: int, n: int = 1) -> float:
        """What k draft tokens add to a step of n decoding jobs."""
        return self.fixed + self.per_token * k + self.per_expert * self.new_experts(k, n) if k > 0 else 0.0

    def table(self, n: int, k_max: int) -> tuple[float, ...]:
        """`seconds(k, n)` for k = 1..k_max, computed once for each (costs, n, k_max): every speculating job's
        draft length asks for it every step, and the costs change only where the batcher fits them again."""
        return _seconds_table(self, n, k_max)

    @classmethod
    def fit(cls, points: Sequence[tuple[int, int, float]], routing: tuple[int, int, int] | None = None) -> VerifyCost:
        """The least-squares cost through measured steps' (decoding jobs, draft tokens, seconds added), no term
        negative. With `routing`, three numbers of drafts or more separate a token's cost from its experts'; with
        fewer, the experts carry it all (most of it on a CPU MoE, and their curve does not overprice long drafts,
        so they get tried and measured)."""
        if routing is not None and cls(0.0, 0.0, 0.0, routing).new_experts(1) <= 0:
            routing = None  # every token reads every expert: drafts add none
        ks = [float(k) for _, k, _ in points]
        added = [a for _, _, a in points]
        shape = cls(0.0, 0.0, 0.0, routing)
        experts = [shape.new_experts(k, n) for n, k, _ in points]
        distinct = len(set(ks))
        columns = {"per_token": ks, "per_expert": experts} if routing is not None and distinct >= 3 else (
            {"per_expert": experts} if routing is not None else {"per_token": ks})
        if distinct < 2:
            name, x = next(iter(columns.items()))
            unit = float(statistics.median(a / v for a, v in zip(added, x, strict=True)))
            return cls(0.0, unit if name == "per_token" else 0.0, unit if name == "per_expert" else 0.0, routing)
        while True:
            fixed, slopes = _least_squares(list(columns.values()), added)
            terms = dict(zip(columns, slopes, strict=True))
            negative = [name for name, value in terms.items() if value < 0]
            if not negative or len(columns) == 1:
                break
            del columns[negative[0]]
        terms = {name: max(value, 0.0) for name, value in terms.items()}
        return cls(max(fixed, 0.0), terms.get("per_token", 0.0), terms.get("per_expert", 0.0), routing)


@functools.lru_cache(maxsize=64)
def _seconds_table(cost: VerifyCost, n: int, k_max: int) -> tuple[float, ...]:
    return tuple(cost.seconds(k, n) for k in range(1, k_max + 1))


def _least_squares(columns: list[list[float]], y: list[float]) -> tuple[float, list[float]]:
    """(intercept, slopes) of the least-squares line or plane through y over one or two columns, in plain floats:
    a fit of at most a window's few points runs every step a draft is measured, where numpy's call overhead cost as
    much as a small model's step. Centred normal equations; a second column that the first explains (their
    determinant vanishing) gets slope 0."""
    m = len(y)
    means = [sum(c) / m for c in columns]
    y_mean = sum(y) / m
    xs = [[v - mean for v in c] for c, mean in zip(columns, means, strict=True)]
    yc = [v - y_mean for v in y]

    def dot(a: list[float], b: list[float]) -> float:
        return sum(u * v for u, v in zip(a, b, strict=True))

    a11, b1 = dot(xs[0], xs[0]), dot(xs[0], yc)
    if len(xs) == 1 or a11 <= 0:
        slopes = [b1 / a11 if a11 > 0 else 0.0] + [0.0] * (len(xs) - 1)
    else:
        a12, a22, b2 = dot(xs[0], xs[1]), dot(xs[1], xs[1]), dot(xs[1], yc)
        det = a11 * a22 - a12 * a12
        if det <= 1e-12 * a11 * a22:
            slopes = [b1 / a11, 0.0]
        else:
            slopes = [(b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det]
    return y_mean - dot(means, slopes), slopes


class Speculation:
    """One job's speculative decoding: its drafter, how long its drafts are, and what they achieved.

    The draft length follows a cost model. A draft token at depth i (after i - 1 accepted ones) yields a token with
    probability a^i, a the job's acceptance rate per token, so k drafts give the job 1 + a + ... + a^k tokens; a
    step with k drafts costs what the batcher measured such steps to add (`VerifyCost`: the verification's own,
    each draft token's, and the experts they add), and every job of the step waits that long. The job takes the
    k that gives the step of `n` decoding jobs the most tokens per second: many while its drafts are right and
    verifying is cheap, fewer in a crowded batch (its extra tokens weigh less beside the other n - 1 jobs' while
    all of them wait for its drafts), none where they are mostly wrong. Then it keeps guessing one token a step
    without sending it (a shadow draft, checked against the token the step draws; every `shadow_every` steps for a
    source that runs a model to guess, `SHADOW_GROWTH` times as far apart after each wrong guess: where the model
    never guesses right its guesses cost next to nothing, and so where it guesses right but its drafts cost more
    than they save: a model source too slow for the model it drafts for): the acceptance rate stays measured, and
    drafting resumes when the text turns repetitive.

    A model source's guess also waits until it costs at most `GUESS_SHARE` of the job's decode time since the last
    one (the first: since the job's first step; its share of each step, which n decoding jobs take together), at
    the cost the batcher measured for a guess (`guess_s`: the job's share of the block's call, with the pairs it
    fills first; `PRIOR_GUESS_COST` of a step before it has): where the block is a large
    part of a small model's step, a short answer ends before its first guess, and a long one guesses ever less
    often while the block is wrong; in a deep model a guess costs a fraction of a step and comes within a few.

    A job sends no draft before its source has been right once: it starts with a shadow guess at its first step,
    and one that is wrong costs the source's guess, not a verification (and on a recurrent engine the state's save,
    reload and the token evaluated again) on free text where the source is never right. Until the batcher has
    measured what a draft token costs, drafts are one token long (a batcher without a step budget never measures
    it). A client's prediction is right from the start: it drafts at least `MIN_PREDICTED` tokens while the answer
    follows it and the acceptance rate stays at `PREDICTED_RATE` or above: the client said what the answer is,
    and step costs measured on a noisy clock must not talk the job out of an exact prediction.

    The acceptance rate is (accepted + 1) / (judged + 2) over draft tokens, with their counts decaying by `DECAY`
    at each step that judges one: it follows a change of the text within a few dozen tokens.

    Args:
        drafter: where the drafts come from.
        max_draft: the most tokens of a draft.
        adaptive: False: always `max_draft` (as many as the drafter has).
    """

    DECAY = 0.95
    # a draft token's cost, as a share of the plain step, before it is measured (again: `StepBudget.VERIFY_MEMORY`):
    # a source right less often than this drafts nothing to measure it, as on free text, where every measuring draft
    # of a recurrent model costs a step more when it is wrong
    PRIOR_DRAFT_COST = 0.5
    MIN_PREDICTED = 4
    PREDICTED_RATE = 0.5  # the prior's rate: a prediction drafts from its first step
    MAX_SHADOW_EVERY = 128
    SHADOW_GROWTH = 4  # a model source's guess interval, times this after each wrong guess
    GUESS_SHARE = 0.01  # the most of the decode time a model source's guesses take
    PRIOR_GUESS_COST = 0.5  # a model source's guess, as a share of the plain step, before the batcher measured one

    def __init__(self, drafter: Drafter, max_draft: int, adaptive: bool = True):
        self.drafter, self.max_draft, self.adaptive = drafter, max_draft, adaptive
        self._accepted = self._judged = 0.0  # decayed counts
        self._shadow: int | None = None  # the token guessed without being sent, to check against the draw
        self._quiet = drafter.shadow_every - 1  # steps without drafts since the last guess: the first step guesses
        self._shadow_every = drafter.shadow_every  # steps between guesses, now
        self._since = 0.0  # the job's decode seconds since the last guess (or its start): its share of the steps
        self._block_guess = False  # the shadow guess is the MTP block's (not a free one)
        self._free = (-1, False)  # `_free_guess`'s (history's length, answer)
        self._step_s: float | None = None  # the job's share of `choose`'s plain step, and what a guess costs (None:
        # not priced)
        self._guess_s = 0.0
        self._proven = not adaptive or isinstance(drafter, Prediction)  # the source has been right once
        self._declined = False  # the last length chosen was none although the source has been right: the costs
        # totals, for the status and the history
        self.drafted = self.accepted = self.steps = 0  # draft tokens sent, kept, and the steps that sent some
        self.length = max_draft if not adaptive else 0  # the draft length last chosen
        self.predicted_accepted = self.predicted_rejected = 0  # of the tokens drafted from a `Prediction`

    @property
    def rate(self) -> float:
        """The estimated acceptance rate of the next draft token."""
        return (self._accepted + 1.0) / (self._judged + 2.0)

    @property
    def proven(self) -> bool:
        """The source has been right once (or is not adaptive, or is the client's prediction): it may draft."""
        return self._proven

    @property
    def guessing(self) -> bool:
        """The last `draft` made a shadow guess, which `judge` checks against the token drawn."""
        return self._shadow is not None

    def choose(self, n_decoding: int, step_s: float | None, costs: VerifyCost | None,
               recurrent: bool = False, guess_s: float | None = None, block_s: float = 0.0) -> int:
        """The draft length that pays in a step of `n_decoding` jobs, at `step_s` seconds for their step without
        drafts, and `costs` for drafts (None: not measured yet); `guess_s`: what a model source's guess costs, as
        measured (None: not yet); `block_s`: what each token of the job's next draft costs before the step (the
        MTP block's pass and output product, where the block drafts it; 0 where the lookup or a prediction
        does). On a `recurrent` engine a rejected draft takes the
        tokens accepted before it back with it (the state is reloaded from before the draft), and the next step
        evaluates them again with the step's own token: after j accepted, j + 1 tokens more, which the cost of k
        drafts includes at the chance of each j."""
        if not self.adaptive:
            self.length = self.max_draft
            return self.length
        self._step_s = step_s / n_decoding if step_s else None
        if step_s:
            self._guess_s = guess_s if guess_s is not None else self.PRIOR_GUESS_COST * step_s
        self._declined = False
        if not self._proven:
            self.length = 0
            return 0
        measured = bool(step_s) and costs is not None
        step = step_s if step_s else 1.0
        cost = costs if step_s and costs is not None else VerifyCost(0.0, self.PRIOR_DRAFT_COST * step)
        a, expected, reach = self.rate, 1.0, 1.0  # reach: a ** (k - 1), the chance the k-th draft is judged
        best, best_rate = 0, n_decoding / step
        again = 0.0  # the expected seconds of evaluating again what a rejection of k drafts takes back
        for k, seconds in enumerate(cost.table(n_decoding, self.max_draft if measured else 1), 1):
            expected += reach * a  # the job's tokens from a step with k drafts
            if recurrent:  # the k-th draft rejected after k - 1 accepted: k tokens again
                again += reach * (1.0 - a) * (seconds - cost.fixed)
            reach *= a
            rate = (n_decoding + expected - 1.0) / (step + seconds + block_s * k + again)
            if rate > best_rate:
                best, best_rate = k, rate
        if isinstance(self.drafter, Prediction) and self.drafter.followed and self.rate >= self.PREDICTED_RATE:
            best = max(best, min(self.MIN_PREDICTED, self.max_draft))
        self.length = best
        self._declined = measured and best == 0
        return best

    def draft(self, history: Sequence[int], n_prompt: int, n: int, seq: int = 0) -> list[int]:
        """The draft to send for the job on sequence `seq` (`n` tokens at most: `choose`'s length within what the
        step has room for); with a length of 0, a shadow guess kept for `judge` instead."""
        self._shadow = None
        asked = self._asks(n, history, n_prompt)
        if n <= 0:
            if self.adaptive and self.length == 0:
                self._quiet = 0 if asked else self._quiet + 1
                self._since = 0.0 if asked else self._since + (self._step_s or 0.0)
            if asked:
                self._block_guess = not self._free_guess(history, n_prompt)
                guess = self.drafter.propose(history, n_prompt, asked, seq)
                self._shadow = guess[0] if guess else None
            return []
        return self.drafter.propose(history, n_prompt, n, seq)

    def _asks(self, n: int, history: Sequence[int], n_prompt: int) -> int:
        """The tokens `draft(history, n_prompt, n)` asks its drafter for: `n`, 1 for a shadow guess that is due
        (a free one at every step), else 0."""
        if n > 0:
            return n
        if not self.adaptive or self.length:
            return 0
        return int(self._free_guess(history, n_prompt) or (self._quiet + 1 >= self._shadow_every and self._affords()))

    def _free_guess(self, history: Sequence[int], n_prompt: int) -> bool:
        """Whether the guess for `history` (a job's, which only grows) costs next to nothing: the prediction's
        or the prompt lookup's, not the block's (where the answer repeats the prompt, `Mtp.repeats`). Found once
        for each length of the history: a step asks two or three times."""
        if self._free[0] != len(history):
            drafter = self.drafter
            if isinstance(drafter, Prediction) and drafter.own(history, n_prompt, 1):
                free = True
            else:
                drafter = drafter.fallback if isinstance(drafter, Prediction) else drafter
                free = drafter.shadow_every <= 1 or (isinstance(drafter, Mtp) and drafter.repeats(history))
            self._free = (len(history), free)
        return self._free[1]

    def from_block(self, history: Sequence[int], n_prompt: int) -> bool:
        """Whether the job's next draft or guess for `history` is the MTP block's (it runs the block first)."""
        drafter = self.drafter.fallback if isinstance(self.drafter, Prediction) else self.drafter
        return isinstance(drafter, Mtp) and not self._free_guess(history, n_prompt)

    def _affords(self) -> bool:
        """Whether a guess due by the step count is within `GUESS_SHARE` of the decode time since the last (one
        not priced: always)."""
        if self._step_s is None:
            return True
        return self._guess_s <= self.GUESS_SHARE * (self._since + self._step_s)

    def block_ask(self, history: Sequence[int], n_prompt: int, n: int, seq: int) -> MtpAsk | None:
        """The MTP block's call that `draft(history, n_prompt, n, seq)` makes; None where it makes none."""
        asked, drafter = self._asks(n, history, n_prompt), self.drafter
        if isinstance(drafter, Prediction):
            if asked and drafter.own(history, n_prompt, asked):
                return None
            drafter = drafter.fallback
        if not asked or not isinstance(drafter, Mtp) or len(history) < 2 or self._free_guess(history, n_prompt):
            return None
        return MtpAsk(drafter, seq, history, asked)

    def judge(self, draft: Sequence[int], kept: int, drawn: Sequence[int]) -> None:
        """The step's outcome: `kept` tokens of `draft` were accepted; `drawn` the tokens the step gave the job."""
        if draft:
            rejected = int(kept < len(draft))
            self._learn(kept, kept + rejected)
            self._proven = self._proven or kept > 0
            self.drafted += len(draft)
            self.accepted += kept
            self.steps += 1
            if isinstance(self.drafter, Prediction) and self.drafter.from_prediction:
                self.predicted_accepted += min(kept, self.drafter.from_prediction)
                self.predicted_rejected += max(self.drafter.from_prediction - kept, 0)
        elif self._shadow is not None and drawn:
            right = drawn[0] == self._shadow
            self._learn(int(right), 1)
            self._proven = self._proven or right
            if self._block_guess:  # a right guess that drafting does not pay for teaches little more
                self._shadow_every = self.drafter.shadow_every if right and not self._declined else min(
                    self.SHADOW_GROWTH * self._shadow_every, self.MAX_SHADOW_EVERY)
        self._shadow = None

    def _learn(self, accepted: int, judged: int) -> None:
        if judged:
            self._accepted = self._accepted * self.DECAY + accepted
            self._judged = self._judged * self.DECAY + judged


def speculation(config: SpeculativeConfig, predicted: Sequence[int] | None = None,
                draft_model: Drafter | None = None, mtp: MtpEngine | None = None) -> Speculation | None:
    """A job's speculation under `config`, drafting from `predicted` (the request's prediction, tokenised) where
    the source allows, from `draft_model` (the config's `draft_model`: a
    `strata.scheduling.draft_model.DraftModel`), or from the MTP block that `mtp` runs (an engine loaded with
    it; the source "auto" drafts with it where the request sent no prediction); None with speculation off."""
    if config.source == "off":
        return None
    if config.source == "draft_model":
        if draft_model is None:
            raise ValueError("speculative.source is draft_model and no draft model is loaded")
        return Speculation(draft_model, config.max_draft, config.adaptive)
    if config.source == "mtp" and mtp is None:
        raise ValueError("speculative.source is mtp and the model runs no MTP block")
    drafter: Drafter = PromptLookup(config.min_ngram, config.max_ngram)
    if mtp is not None and config.source in ("auto", "mtp"):
        drafter = Mtp(mtp, drafter)
    if predicted and config.source == "auto":
        drafter = Prediction(predicted, drafter, config.min_ngram, config.max_ngram)
    return Speculation(drafter, config.max_draft, config.adaptive)
