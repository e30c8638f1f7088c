"""Speculative decoding in the batcher: drafts verified in the job's step give the answer the job gives without
them (token for token at temperature 0 and with a seed, in distribution otherwise), and the cache and the
recurrent state never keep a rejected token."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
from fakes import N_VOCAB, MarkovEngine, RecordingEngine, RecurrentEngine, SuccessorEngine

from strata.config import ConfigError, SpeculativeConfig, config_from_dict
from strata.engine_cffi import BatchItem
from strata.scheduling.batcher import Batcher, Job, StepBudget
from strata.scheduling.drafts import (
    Mtp,
    MtpEngine,
    NgramIndex,
    Prediction,
    PromptLookup,
    Speculation,
    VerifyCost,
    draft_together,
    speculation,
)
from strata.text.sampling import Sampler, SamplingParams

GREEDY = SamplingParams(temperature=0.0)
FIXED = SpeculativeConfig(source="lookup", adaptive=False, max_draft=4)
ADAPTIVE = SpeculativeConfig(source="auto")
PROMPT = [int(t) for t in np.random.default_rng(1).integers(0, N_VOCAB, 40)]


def answer(engine: SuccessorEngine, prompt: Sequence[int], spec: Speculation | None, max_tokens: int | None = 60,
           params: SamplingParams = GREEDY, stop_ids: frozenset[int] = frozenset(), logprobs: int | None = None,
           slowdown: float | None = 1.6) -> tuple[Job, int]:
    """The job's answer alone on a fresh batcher, and the steps it took; the cache holds its history throughout.
    (`slowdown` None: no step budget, so no step without drafts to measure the plain step first.) Steps are timed
    by a clock of the engine's calls (10 ms each, and 0.5 ms a token), so that adaptive drafts are chosen alike
    from run to run."""
    batcher = Batcher(engine, slowdown=slowdown, clock=lambda: sum(
        0.010 + 0.0005 * sum(len(tokens) for _, tokens, _ in call) for call in engine.calls))
    job = Job(prompt, Sampler(params, engine.n_vocab, logprobs=logprobs), max_tokens, stop_ids, speculation=spec)
    batcher.add(job)
    steps = 0
    while job.finish is None:
        batcher.step()
        steps += 1
        cache = engine.caches[job.seq]
        assert cache == job.history[:len(cache)]
    return job, steps


@pytest.mark.parametrize("sharp", [1.0, 3.0])
@pytest.mark.parametrize("config", [FIXED, ADAPTIVE])
def test_greedy_answers_are_identical_with_and_without_drafts(sharp: float, config: SpeculativeConfig) -> None:
    plain, plain_steps = answer(MarkovEngine(seed=2, sharp=sharp, n_ctx=200), PROMPT, None)
    spec = speculation(config)
    fast, fast_steps = answer(MarkovEngine(seed=2, sharp=sharp, n_ctx=200), PROMPT, spec)
    assert fast.tokens == plain.tokens and fast.finish == plain.finish == "length"
    assert spec is not None and spec.accepted > 0
    assert spec.drafted > spec.accepted or spec.adaptive  # some wrong (adaptive drafts only once a guess is right)
    assert fast_steps < plain_steps


def test_a_right_draft_gives_all_its_tokens_and_one_more_in_one_step() -> None:
    engine = SuccessorEngine(n_ctx=100)
    spec = speculation(FIXED)
    job, _ = answer(engine, [*range(16), 0, 1, 2], spec, max_tokens=20)
    assert job.tokens == [(3 + i) % 16 for i in range(20)]
    decode_items = [call[0][1] for call in engine.calls[1:]]
    assert decode_items[0] == [3]  # the first decode step: no measured step yet, no draft
    assert decode_items[1] == [4, 5, 6, 7, 8]  # the answer's last token and four drafted after "3 4"
    assert decode_items[2] == [9, 10, 11, 12, 13]
    assert spec is not None and spec.accepted == spec.drafted


@pytest.mark.parametrize("seed", [3, 4])
def test_seeded_sampling_draws_the_same_tokens_with_and_without_drafts(seed: int) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=seed)
    plain, _ = answer(MarkovEngine(seed=5, sharp=3.0, n_ctx=200), PROMPT, None, params=params, logprobs=2)
    fast, _ = answer(MarkovEngine(seed=5, sharp=3.0, n_ctx=200), PROMPT, speculation(FIXED), params=params,
                     logprobs=2)
    assert fast.tokens == plain.tokens
    assert fast.sampler.records == plain.sampler.records  # log-probabilities of every token, drafted or not


def test_sampled_answers_keep_the_models_distribution() -> None:
    """Unseeded draws: the token at each of the first positions over 400 answers with drafts against 400 without,
    a chi-square two-sample test per position at the 0.1% level."""
    n, length = 400, 8
    counts: list[list[Counter[int]]] = [[Counter() for _ in range(length)] for _ in range(2)]
    accepted = 0
    # the model's greedy text repeats "9 3 5 12": lookup drafts it, and a draw at temperature 1 often follows it
    prompt = [0, *answer(MarkovEngine(seed=1, sharp=2.0), [0], None, 30)[0].tokens]
    for which in range(2):
        for i in range(n):
            spec = speculation(FIXED) if which else None
            job, _ = answer(MarkovEngine(seed=1, sharp=2.0, n_ctx=60), prompt, spec, max_tokens=length,
                            params=SamplingParams(temperature=1.0, seed=10_000 * which + i), slowdown=None)
            accepted += spec.accepted if spec is not None else 0
            for position, token in enumerate(job.tokens):
                counts[which][position][token] += 1
    assert accepted > n  # the drafts were used
    for position in range(length):
        a, b = counts[0][position], counts[1][position]
        tokens = sorted(set(a) | set(b))
        table = np.array([[a[t] for t in tokens], [b[t] for t in tokens]], dtype=float)
        expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
        chi2 = float(((table - expected) ** 2 / expected).sum())
        dof = len(tokens) - 1
        # Wilson-Hilferty: the 99.9th percentile of chi-square with dof degrees of freedom
        limit = dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3
        assert chi2 < limit, (position, chi2, limit)


def test_stop_ids_and_the_token_budget_end_the_answer_where_they_would_without_drafts() -> None:
    prompt = [*range(16), 0, 1, 2]
    for stop_ids, max_tokens in ((frozenset({9}), 30), (frozenset(), 7), (frozenset({5}), 2)):
        plain, _ = answer(SuccessorEngine(n_ctx=100), prompt, None, max_tokens, stop_ids=stop_ids)
        engine = SuccessorEngine(n_ctx=100)
        fast, _ = answer(engine, prompt, speculation(FIXED), max_tokens, stop_ids=stop_ids)
        assert (fast.tokens, fast.finish) == (plain.tokens, plain.finish)
        assert engine.caches[0] == fast.history[:len(engine.caches[0])]
        assert len(engine.caches[0]) >= len(fast.history) - 1


def test_drafts_stay_within_the_context() -> None:
    engine = SuccessorEngine(n_ctx=30)  # which fails a call past its context
    job, _ = answer(engine, [*range(16), 0, 1, 2], speculation(FIXED), max_tokens=None)
    assert len(job.tokens) == 30 - 19 and job.finish == "length"


def test_a_recurrent_engine_restores_its_state_before_a_rejected_draft() -> None:
    """The successor model's answer starts "5" after "... 9 3 4": lookup drafts "9 3 4 5" after "4 5", the model
    says 6: the state is restored from before the step and its 5 evaluated again with the next one (the fake fails
    any step whose state does not sum up its cache)."""
    prompt = [*range(6), 9, 3, 4]
    plain, _ = answer(RecurrentEngine(n_ctx=100), prompt, None, 30)
    engine = RecurrentEngine(n_ctx=100)
    spec = speculation(FIXED)
    fast, _ = answer(engine, prompt, spec, 30, slowdown=None)
    assert fast.tokens == plain.tokens
    assert engine.restores and not engine.loads  # a rollback restored the checkpoint
    assert spec is not None and 0 < spec.accepted < spec.drafted
    assert [call[0][1] for call in engine.calls[1:3]] == [[5, 9, 3, 4, 5], [5, 6]]


class Wrong:
    """Drafts that are always wrong: `token`s."""

    shadow_every = 1

    def __init__(self, token: int):
        self.token = token

    def propose(self, history: Sequence[int], n_prompt: int, n: int, seq: int = 0) -> list[int]:
        return [self.token] * n


def test_a_recurrent_engine_keeps_the_tokens_a_rollback_took_back_in_the_next_step() -> None:
    """Every draft wrong: each rejected step's state is restored, and the next step evaluates the tokens it took
    back without a draft, which keeps them; no step carries more than a token and a draft."""
    prompt = [*range(6), 9, 3, 4]
    plain, _ = answer(RecurrentEngine(n_ctx=100), prompt, None, 30)
    engine = RecurrentEngine(n_ctx=100)
    spec = Speculation(Wrong(0), 3, adaptive=False)
    fast, _ = answer(engine, prompt, spec, 30, slowdown=None)
    assert fast.tokens == plain.tokens and spec.accepted < spec.drafted
    assert max(len(call[0][1]) for call in engine.calls[1:]) == 4  # taken back for ever, they grew a token a step


class Forbid:
    """A token mask that bans `banned` and records the tokens it follows."""

    def __init__(self, banned: int):
        self.banned, self.followed = banned, []  # type: ignore[var-annotated]

    def apply(self, logits: np.ndarray) -> np.ndarray | None:
        logits[self.banned] = -np.inf
        return None

    def advance(self, token: int) -> None:
        self.followed.append(token)


def test_a_draft_token_the_mask_forbids_ends_the_draft_and_the_mask_follows_only_accepted_tokens() -> None:
    prompt = [*range(16), 0, 1, 2]  # drafts run through 7, which the mask bans: the model's runner-up, 8, comes
    outputs = []
    for spec in (None, speculation(FIXED)):
        engine = SuccessorEngine(n_ctx=100)
        batcher = Batcher(engine)
        mask = Forbid(7)
        job = Job(prompt, Sampler(GREEDY, N_VOCAB, mask=mask), 20, set(), speculation=spec)
        batcher.add(job)
        while job.finish is None:
            batcher.step()
        assert mask.followed == job.tokens
        outputs.append(job.tokens)
    assert outputs[0] == outputs[1] and 7 not in outputs[0]


def test_a_hang_up_during_verification_frees_the_slot_in_that_step() -> None:
    engine = SuccessorEngine(n_ctx=100)
    batcher = Batcher(engine)
    job = Job([*range(16), 0, 1, 2], Sampler(GREEDY, N_VOCAB), 50, set(), speculation=speculation(FIXED))
    batcher.add(job)
    while len(job.tokens) < 6:
        batcher.step()
    original = engine.eval_batch

    def hang_up(items: Sequence[BatchItem], notify_fd: int = -1) -> list[np.ndarray]:
        assert len(items[0].tokens) > 1  # a verification
        batcher.cancel(job)  # the request hangs up as the call runs: its abort flag drops it
        return original(items, notify_fd)

    engine.eval_batch = hang_up  # type: ignore[method-assign]
    assert batcher.step() == [job]
    assert job.finish == "cancel" and batcher.free_slots == 1 and not batcher.jobs
    assert engine.caches[0] == job.history[:len(engine.caches[0])]


def test_mixed_speculating_and_plain_jobs_each_get_the_answer_they_get_alone() -> None:
    prompts = [PROMPT, [*range(16), 0, 1, 2], PROMPT[:20] + PROMPT[:10]]
    params = [GREEDY, SamplingParams(temperature=0.9, seed=4), SamplingParams(temperature=0.7, seed=8)]
    configs: list[SpeculativeConfig | None] = [FIXED, None, ADAPTIVE]

    def jobs() -> list[Job]:
        return [Job(prompt, Sampler(p, N_VOCAB), 40, set(), speculation=speculation(c) if c else None)
                for prompt, p, c in zip(prompts, params, configs, strict=True)]

    engine = MarkovEngine(seed=9, sharp=3.0, n_ctx=200, n_seq=3)
    batcher = Batcher(engine)
    together = jobs()
    for job in together:
        batcher.add(job)
    while batcher.jobs:
        batcher.step()
    for job, prompt, p in zip(together, prompts, params, strict=True):
        alone, _ = answer(MarkovEngine(seed=9, sharp=3.0, n_ctx=200), prompt, None, 40, params=p)
        assert job.tokens == alone.tokens
    assert any(len(item[1]) > 1 for call in engine.calls[2:] for item in call)  # drafts were verified


# --- drafts and their lengths


def test_prompt_lookup_drafts_after_the_longest_match() -> None:
    lookup = PromptLookup(min_ngram=2, max_ngram=8)
    history = [1, 2, 3, 9, 9, 5, 1, 2, 3, 7, 8, 0, 2, 3]
    assert lookup.propose(history, 10, 3) == [7, 8, 0]  # "2 3": latest occurrence with a continuation
    history += [9]  # "2 3 9": the longer match, earlier
    assert lookup.propose(history, 10, 2) == [9, 5]
    assert lookup.propose([1, 2], 2, 4) == []


def test_a_prediction_drafts_its_continuation_then_after_a_match_then_the_lookup() -> None:
    drafts = Prediction([10, 11, 12, 13, 14, 15], PromptLookup())
    prompt = [1, 2, 3, 4]
    assert drafts.propose(prompt, 4, 3) == [10, 11, 12]
    assert drafts.propose([*prompt, 10, 11], 4, 3) == [12, 13, 14]
    assert drafts.propose([*prompt, 10, 11, 5, 12, 13], 4, 3) == [14, 15]  # after the match "12 13"
    assert drafts.propose([*prompt, 10, 11, 5, 1, 2], 4, 3) == [3, 4, 10]  # no match in it: the prompt's
    assert drafts.from_prediction == 0


def test_the_draft_length_follows_acceptance_cost_and_the_batch() -> None:
    spec = Speculation(PromptLookup(), max_draft=8)
    assert spec.choose(1, step_s=None, costs=None) == 0  # no draft before the source was right once
    history = [5, 6, 7, 8, 5, 6, 7]
    assert spec.draft(history[:-1], 0, 0) == [] and spec.choose(1, step_s=None, costs=None) == 0
    spec.judge([], 0, [7])  # its shadow guess was right
    assert spec.choose(1, step_s=None, costs=None) == 1  # unmeasured: one token, which measures the cost
    for _ in range(40):
        spec.judge([1, 2, 3, 4], 3, [1, 2, 3, 7])  # three in four accepted
    assert spec.rate == pytest.approx(0.75, abs=0.01)
    cheap = VerifyCost(0.0, 0.0005)

    def tokens_per_second(k: int, n: int, costs: VerifyCost) -> float:  # the step's, as choose weighs it
        gained = sum(spec.rate ** i for i in range(1, k + 1))
        return (n + gained) / (0.010 + costs.seconds(k))

    long = spec.choose(1, step_s=0.010, costs=cheap)
    assert long == max(range(9), key=lambda k: tokens_per_second(k, 1, cheap)) and long >= 4
    assert spec.choose(4, step_s=0.010, costs=cheap) < long  # a crowded batch
    assert spec.choose(1, step_s=0.010, costs=VerifyCost(0.0, 0.002)) < long  # dear draft tokens
    assert spec.choose(1, step_s=0.010, costs=VerifyCost(0.006, 0.0)) == 8  # a dear verification, then drafts for free
    assert spec.choose(4, step_s=0.010, costs=VerifyCost(0.02, 0.0)) == 0  # a verification dearer than it gains
    for _ in range(100):
        spec.judge([1, 2, 3], 0, [7])
    usual = VerifyCost(0.001, 0.0005)  # a verification's own cost beside its tokens'
    assert spec.rate < 0.1 and spec.choose(1, step_s=0.010, costs=usual) == 0  # off where drafts are wrong
    for _ in range(80):  # off: a shadow guess each step, judged against the drawn token
        assert spec.draft(history, 0, 0) == []
        spec.judge([], 0, [8])
    assert spec.choose(1, step_s=0.010, costs=usual) > 0  # back on: the text repeats


def test_the_experts_drafts_add_grow_less_with_each_token() -> None:
    shape = VerifyCost(0.0, 0.0, 1.0, routing=(6, 16, 4))  # the small qwen3moe: 6 layers, top-4 of 16
    added = [shape.new_experts(k) for k in range(9)]
    assert added[0] == 0.0 and added[1] == pytest.approx(6 * 16 * (0.75 - 0.75 ** 2))  # 18 of a token's 24
    steps = np.diff(added)
    assert (steps > 0).all() and (np.diff(steps) < 0).all() and added[-1] < 6 * (16 - 4)
    assert shape.new_experts(4, n=4) < shape.new_experts(4)  # four jobs' tokens read most experts already
    assert VerifyCost(0.001, 0.0005).new_experts(8) == 0.0  # no routing: the line


def test_the_verification_cost_is_fitted_with_its_experts() -> None:
    routing = (6, 16, 4)
    truth = VerifyCost(0.0003, 0.00023, 0.000024, routing)  # about bench/verify_cost.py's small qwen3moe
    points = [(n, k, truth.seconds(k, n)) for k in (1, 2, 3, 4, 8) for n in (1, 2, 4)]
    fitted = VerifyCost.fit(points, routing)
    assert (fitted.fixed, fitted.per_token, fitted.per_expert) == pytest.approx((0.0003, 0.00023, 0.000024))
    line = VerifyCost.fit(points)  # without routing: a line, which cannot follow the experts' curve
    assert line.per_expert == 0.0
    assert line.seconds(5) < truth.seconds(5) - 0.0003 and line.seconds(5, n=4) > truth.seconds(5, n=4) + 0.0003
    two = VerifyCost.fit([(1, k, truth.seconds(k)) for k in (1, 2)], routing)  # too few to part tokens from experts
    assert two.per_token == 0.0 and two.per_expert > 0
    one = VerifyCost.fit([(1, 2, 0.003)], routing)
    assert one.seconds(2) == pytest.approx(0.003) and one.fixed == one.per_token == 0.0
    every = VerifyCost.fit([(1, 2, 0.003)], (1, 2, 2))  # both experts read by every token: a line
    assert every.routing is None and every.per_token == pytest.approx(0.0015)


def test_long_drafts_are_priced_by_the_experts_they_add() -> None:
    # measured at one and two draft tokens, a line prices eight at eight times the first's slope; the experts'
    # curve, which the true cost follows, knows that the eighth adds few experts: the length that pays is longer
    routing = (6, 16, 4)
    truth = VerifyCost(0.0, 0.0, 0.00035, routing)
    spec = Speculation(PromptLookup(), max_draft=8)
    for _ in range(60):
        spec.judge([1, 2, 3, 4], 3, [1, 2, 3, 7])
    measured = [(1, k, truth.seconds(k)) for k in (1, 2)]
    line, experts = VerifyCost.fit(measured), VerifyCost.fit(measured, routing)
    best = max(range(9), key=lambda k: (1 + sum(spec.rate ** i for i in range(1, k + 1))) / (0.010 + truth.seconds(k)))
    assert spec.choose(1, step_s=0.010, costs=experts) == best
    assert spec.choose(1, step_s=0.010, costs=line) < best


def test_adaptive_speculation_stops_drafting_free_text() -> None:
    """Sampled text of a flat model: prompt lookup is mostly wrong; the adaptive job sends far fewer drafts."""
    params = SamplingParams(temperature=1.0, seed=1)
    fixed = speculation(FIXED)
    adaptive = speculation(ADAPTIVE)
    answer(MarkovEngine(seed=1, sharp=0.3, n_ctx=400), PROMPT, fixed, 300, params=params)
    answer(MarkovEngine(seed=1, sharp=0.3, n_ctx=400), PROMPT, adaptive, 300, params=params)
    assert fixed is not None and adaptive is not None
    assert fixed.accepted < fixed.drafted / 4
    assert adaptive.drafted < fixed.drafted / 3


def test_the_step_budget_measures_what_drafts_cost_against_the_plain_step() -> None:
    budget = StepBudget(1.6, clock=lambda: 0.0)
    assert budget.wants_plain_step(2)
    budget.record(2, 0, 0.010)
    assert not budget.wants_plain_step(2) and budget.draft_costs() is None
    budget.record(2, 0, 0.014, drafts=8)
    assert budget.draft_costs() == VerifyCost(0.0, pytest.approx(0.0005))  # one number of drafts: per token
    for drafts in (1, 2, 4, 8) * 8:
        budget.record(2, 0, 0.010 + 0.002 + 0.0005 * drafts, drafts=drafts)
    assert budget.draft_costs() == VerifyCost(pytest.approx(0.002), pytest.approx(0.0005))  # its own, a token's
    assert budget.decode_seconds(2) == pytest.approx(0.010)  # steps with drafts are not decode-only
    assert budget.wants_plain_step(2)  # after VERIFY_REFRESH steps with drafts: re-measure the reference
    budget.record(2, 0, 0.011)  # the reference re-measured (median 10.5 ms): the costs against it
    assert budget.draft_costs() == VerifyCost(pytest.approx(0.0015), pytest.approx(0.0005))


def test_a_full_window_of_verifications_is_fitted_again_every_few() -> None:
    """A fit costs a fifth of a tiny model's step and every step asks for it: while the window of verifications is
    filling each one is fitted at once, and then every `REFIT_EVERY` verifications."""
    budget = StepBudget(1.6, clock=lambda: 0.0)
    budget.record(1, 0, 0.010)
    fits = []
    for drafts in range(1, StepBudget.WINDOW + 1):  # the window fills: a new fit each time
        budget.record(1, 0, 0.010 + 0.001 * drafts, drafts=drafts)
        fits.append(budget.draft_costs())
    assert len({id(costs) for costs in fits}) == StepBudget.WINDOW
    assert fits[-1] == VerifyCost(pytest.approx(0.0), pytest.approx(0.001))
    kept = 0
    while True:  # the window full: the last fit serves until REFIT_EVERY verifications more have come
        budget.record(1, 0, 0.010 + 0.003 * 4, drafts=4)  # drafts now three times as dear
        costs = budget.draft_costs()
        if costs is not fits[-1]:
            break
        kept += 1
    assert 0 < kept < StepBudget.REFIT_EVERY
    assert costs is not None and costs.seconds(4) > fits[-1].seconds(4)


def test_measured_draft_costs_are_forgotten_after_some_steps() -> None:
    """One verification timed while another process took the caches prices drafts out; since no job then drafts,
    nothing would measure them again. After `VERIFY_MEMORY` steps the costs are unmeasured again, and a job whose
    guesses are right drafts a token to measure them."""
    budget = StepBudget(1.6, clock=lambda: 0.0)
    budget.record(1, 0, 0.010)
    budget.record(1, 0, 0.150, drafts=8)  # an outlier: 14 plain steps for 8 drafts
    spec = Speculation(PromptLookup(), 8)
    spec.judge([3, 4], 2, [3, 4, 5])  # its drafts right
    assert spec.choose(1, budget.decode_seconds(1), budget.draft_costs()) == 0
    for _ in range(StepBudget.VERIFY_MEMORY - 1):
        budget.record(1, 0, 0.010)
    assert budget.draft_costs() is not None
    budget.record(1, 0, 0.010)
    assert budget.draft_costs() is None
    assert spec.choose(1, budget.decode_seconds(1), budget.draft_costs()) == 1


def test_on_a_recurrent_engine_a_draft_pays_for_the_tokens_a_rejection_takes_back() -> None:
    """A rejected draft on a recurrent engine takes the tokens accepted before it back, and the next step evaluates
    them again: at 30% acceptance a token a fifth of a step pays on a cache that cuts back (1.3 tokens for 1.2
    steps) and not on a recurrent state (1.3 for 1.2 + 0.7 x 0.2)."""
    spec = Speculation(PromptLookup(), 1)
    for right in [True, False, False, True, False, False, False] * 10:  # 2 drafts right in 7
        spec.judge([1], int(right), [1])
    assert 0.25 < spec.rate < 0.35
    costs = VerifyCost(0.0, 0.2)
    assert spec.choose(1, 1.0, costs) == 1
    assert spec.choose(1, 1.0, costs, recurrent=True) == 0


def test_speculative_config_names_a_bad_value() -> None:
    with pytest.raises(ConfigError, match='"speculative.source"'):
        config_from_dict({"speculative": {"source": "eagle"}})
    with pytest.raises(ConfigError, match='"speculative.max_draft"'):
        config_from_dict({"speculative": {"max_draft": 0}})
    with pytest.raises(ConfigError, match='"speculative.max_ngram"'):
        config_from_dict({"speculative": {"min_ngram": 4, "max_ngram": 3}})
    with pytest.raises(ConfigError, match='"speculative.draft_model" is needed with source "draft_model"'):
        config_from_dict({"speculative": {"source": "draft_model"}})
    with pytest.raises(ConfigError, match='"speculative.draft_model"'):
        config_from_dict({"speculative": {"draft_model": "d.gguf"}})
    with pytest.raises(ValueError, match="no draft model is loaded"):
        speculation(SpeculativeConfig(source="draft_model", draft_model="d.gguf"))
    assert speculation(SpeculativeConfig(source="off")) is None
    assert isinstance(speculation(ADAPTIVE, [1, 2]).drafter, Prediction)  # type: ignore[union-attr]
    assert isinstance(speculation(FIXED, [1, 2]).drafter, PromptLookup)  # type: ignore[union-attr]


def test_greedy_answers_through_the_engine_are_identical_with_drafts(tmp_path) -> None:
    """The C engine on a generated MoE: a step that verifies a draft computes its rows in one batch, and the
    answer is the one decoded token by token; with the answer itself as the prediction, every draft is right."""
    from strata.engine_cffi import Engine
    from strata.modelgen import write_random_model

    path = write_random_model(tmp_path / "m.gguf", arch="qwen3moe", size="tiny", dtype="q8_0")
    rng = np.random.default_rng(0)
    with Engine.load(path, n_ctx=256, threads=1) as engine:
        base = [int(t) for t in rng.integers(0, engine.n_vocab, 30)]
        prompt = base + base[:10]

        def run(spec: Speculation | None) -> tuple[list[int], int]:
            batcher = Batcher(engine)
            job = Job(prompt, Sampler(GREEDY, engine.n_vocab), 48, set(), speculation=spec)
            batcher.add(job)
            steps = 0
            while job.finish is None:
                batcher.step()
                steps += 1
            engine.keep(0)
            return job.tokens, steps

        plain, plain_steps = run(None)
        assert run(speculation(FIXED))[0] == plain
        predicted, steps = run(speculation(SpeculativeConfig(adaptive=False), plain))  # 8 drafts a step
        assert predicted == plain and steps < plain_steps / 3


def test_a_guided_answer_is_the_same_with_drafts_the_guide_forbids(tokenizer) -> None:
    """A JSON schema's guide (llguidance) over a scripted model that writes a colour the schema does not allow:
    prompt lookup drafts the forbidden colour from the prompt, the guide ends the draft there, and the answer (and
    the guide's own record of it) is the one decoded without drafts."""
    from fakes import ScriptedEngine

    from strata.text.constraints import AnswerFormat, Grammars, plan_constraint
    from strata.text.families import QWEN3

    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}, "count": {"type": "integer"}},
              "required": ["colour", "count"], "additionalProperties": False}
    script = '{"colour": "purple", "count": 12345}'
    grammars = Grammars(tokenizer, QWEN3, tokenizer.n_vocab)
    the_plan = plan_constraint(answer_format=AnswerFormat("json_schema", json.dumps(schema)), tools=[],
                               tool_choice=None, parallel_tool_calls=True, thinking=False, in_reasoning=False,
                               tokens=grammars.tokens)
    prompt = tokenizer.encode(f"<|im_start|>user\nSay {script} twice: {script}<|im_end|>\n<|im_start|>assistant\n",
                              special=True)
    answers = []
    for spec in (None, speculation(FIXED)):
        engine = ScriptedEngine(tokenizer, tokenizer.encode(script, special=True))
        batcher = Batcher(engine, slowdown=None)
        guide = grammars.guide(the_plan)
        job = Job(prompt, Sampler(GREEDY, tokenizer.n_vocab, mask=guide), 40, set(tokenizer.eos_ids),
                  speculation=spec)
        batcher.add(job)
        while job.finish is None:
            batcher.step()
        assert guide.answer_ids == [*job.tokens, guide.answer_ids[-1]]  # and the end of turn
        assert job.finish == "stop" and guide.answer_error() is None
        answers.append(job.tokens)
        if spec is not None:
            assert 0 < spec.accepted < spec.drafted
    assert answers[0] == answers[1]
    assert json.loads(tokenizer.decode(answers[0]))["colour"] in ("red", "green")


def test_a_draft_model_drafts_greedily_and_the_answer_stays_the_models(tmp_path) -> None:
    """The C engine on a generated MoE with two draft models of its vocabulary: itself (every draft right) and
    one of other weights (drafts mostly wrong); a 300-token prompt catches up 256 tokens a step."""
    from strata.engine_cffi import Engine
    from strata.modelgen import write_random_model
    from strata.scheduling.draft_model import DraftModel

    main = write_random_model(tmp_path / "m.gguf", arch="qwen3moe", size="tiny", dtype="q8_0", seed=1)
    other = write_random_model(tmp_path / "d.gguf", arch="qwen3moe", size="tiny", dtype="q8_0", seed=2)
    config = SpeculativeConfig(source="draft_model", draft_model="x", adaptive=False, max_draft=4)
    with Engine.load(main, n_ctx=512, threads=1) as engine:
        prompt = [int(t) for t in np.random.default_rng(0).integers(0, engine.n_vocab, 300)]

        def run(spec: Speculation | None) -> tuple[list[int], int]:
            batcher = Batcher(engine, slowdown=None)
            job = Job(prompt, Sampler(GREEDY, engine.n_vocab), 40, set(), speculation=spec)
            batcher.add(job)
            steps = 0
            while job.finish is None:
                batcher.step()
                steps += 1
            engine.keep(0)
            return job.tokens, steps

        plain, plain_steps = run(None)
        for path, right in ((main, True), (other, False)):
            with Engine.load(path, n_ctx=512, threads=1) as draft_engine:
                recorded = RecordingEngine(draft_engine)
                drafts = DraftModel(recorded)
                spec = speculation(config, draft_model=drafts)
                assert spec is not None
                tokens, steps = run(spec)
                assert tokens == plain
                if right:
                    assert spec.accepted == spec.drafted > 0 and steps < plain_steps / 2
                else:
                    assert spec.accepted < spec.drafted
                # the first two decode steps: the prompt and its first answer tokens, 256 at a time (then drafts)
                assert [len(tokens) for tokens, _ in recorded.calls[:3]] == [256, 302 - 256, 1]


def test_a_long_prompt_is_indexed_a_chunk_a_step_and_matched_meanwhile() -> None:
    lookup = PromptLookup()
    n = 2 * NgramIndex.CHUNK + 100
    history = [*range(n), 5, 6]  # "5 6" follows at 7; the prompt's tail is indexed last
    assert lookup.propose(history, n, 2) == [7, 8] and lookup.index.indexed == NgramIndex.CHUNK + 2
    lookup.propose(history, n, 2)
    lookup.propose(history, n, 2)
    assert lookup.index.indexed == len(history) + 1


def test_a_recurrent_slot_stopped_inside_a_draft_serves_the_next_job_from_its_state() -> None:
    """A stop id inside an accepted draft ends the job there: its recurrent slot is back at the state before the
    step (the fake fails any step whose state does not sum up its cache), and the next turn resumes from it."""
    engine = RecurrentEngine(n_ctx=100)
    batcher = Batcher(engine, slowdown=None)
    first = Job([*range(16), 0, 1, 2], Sampler(GREEDY, N_VOCAB), 40, {9}, speculation=speculation(FIXED))
    batcher.add(first)
    while first.finish is None:
        batcher.step()
    assert first.tokens == [3, 4, 5, 6, 7, 8] and first.finish == "stop"
    assert batcher.slots[0].live and engine.seq_n_past(0) < len(first.history)
    follow_up = Job([*first.history, 9, 12], Sampler(GREEDY, N_VOCAB), 5, set(), speculation=speculation(FIXED))
    batcher.add(follow_up)
    assert follow_up.reused == engine.seq_n_past(0) > 16  # resumed from the slot's state, not from scratch
    while follow_up.finish is None:
        batcher.step()
    assert follow_up.tokens == [13, 14, 15, 0, 1]


class FixedMtp:
    """An engine's MTP block that always drafts `drafts` (then nothing: -1s), counting the drafts it gave."""

    def __init__(self, drafts: list[int]):
        self.drafts, self.given = drafts, 0

    def mtp_draft(self, seqs: Sequence[int], pos: Sequence[int], tokens: Sequence[int], n_draft: int,
                  logits: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        row = (self.drafts + [-1] * n_draft)[:n_draft]
        self.given += sum(t >= 0 for t in row)
        return np.array([row] * len(seqs), np.int32), None


class CountingMtp:
    """A real engine's MTP block, counting its calls and the drafts it gave."""

    def __init__(self, engine: MtpEngine):
        self.engine, self.given, self.calls = engine, 0, 0

    def mtp_draft(self, seqs: Sequence[int], pos: Sequence[int], tokens: Sequence[int], n_draft: int,
                  logits: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        drafts, rows = self.engine.mtp_draft(seqs, pos, tokens, n_draft, logits)
        self.given += int((drafts >= 0).sum())
        self.calls += 1
        return drafts, rows


def test_the_sources_with_an_mtp_block() -> None:
    mtp = FixedMtp([7, 8])
    auto = speculation(ADAPTIVE, mtp=mtp)
    assert auto is not None and isinstance(auto.drafter, Mtp)
    assert auto.drafter.propose([1, 2, 3], 2, 4) == [7, 8]
    predicted = speculation(ADAPTIVE, [1, 2], mtp=mtp)  # a request's prediction first, the block after it
    assert predicted is not None and isinstance(predicted.drafter, Prediction)
    assert isinstance(predicted.drafter.fallback, Mtp)
    assert isinstance(speculation(FIXED, mtp=mtp).drafter, PromptLookup)  # type: ignore[union-attr]
    only = speculation(SpeculativeConfig(source="mtp"), [1, 2], mtp=mtp)
    assert only is not None and isinstance(only.drafter, Mtp)
    # no hidden state held for the job: the prompt lookup drafts
    assert Mtp(FixedMtp([]), PromptLookup()).propose([1, 2, 3, 1, 2], 5, 2) == [3, 1]
    with pytest.raises(ValueError, match="runs no MTP block"):
        speculation(SpeculativeConfig(source="mtp"))


def test_where_the_answer_repeats_a_long_run_the_lookup_drafts_instead_of_the_block() -> None:
    """An edit re-emits the code it was given: where the answer's tail repeats `Mtp.REPEAT` tokens or more of the
    prompt, the prompt lookup drafts (for nothing) and the block is not run; elsewhere the block drafts."""
    block = FixedMtp([70, 71, 72])
    spec = Speculation(Mtp(block, PromptLookup()), 3, adaptive=False)
    prompt = [*range(20), 50]
    copying = [*prompt, *range(Mtp.REPEAT)]  # the answer so far: the prompt's first REPEAT tokens again
    assert spec.block_ask(copying, len(prompt), 3, 0) is None
    assert spec.draft(copying, len(prompt), 3) == [Mtp.REPEAT, Mtp.REPEAT + 1, Mtp.REPEAT + 2]
    assert block.given == 0
    short = [*prompt, *range(Mtp.REPEAT - 1)]  # a shorter repeat: the block's guess
    assert spec.block_ask(short, len(prompt), 3, 0) is not None
    assert spec.draft(short, len(prompt), 3) == [70, 71, 72] and block.given == 3


def test_the_mtp_block_guesses_ever_less_often_while_wrong() -> None:
    """Where drafts do not pay, a job guesses a token without sending it: each step from the prompt lookup (it costs
    nothing), from the MTP block (a guess runs it and the output product) at the first step, then `SHADOW_GROWTH`
    times as far apart after each wrong guess (`shadow_every` steps after the first, at most `MAX_SHADOW_EVERY`),
    and every `shadow_every` steps again after a right one."""
    costs = VerifyCost(1.0, 1.0)  # no draft length pays
    block = FixedMtp([7])
    spec = Speculation(Mtp(block, PromptLookup()), 4)
    every, growth, most = Mtp.shadow_every, Speculation.SHADOW_GROWTH, Speculation.MAX_SHADOW_EVERY
    gaps_wrong = [growth * every, min(growth ** 2 * every, most)]
    steps, guessed_at = 1 + sum(gaps_wrong) + 2 * every, []
    for step in range(steps):  # a guess at 1% of a step: the step count alone spaces them
        assert spec.choose(1, 1.0, costs, guess_s=0.01) == 0 and spec.draft([1, 2, 3, 1, 2], 3, 0) == []
        if block.given > len(guessed_at):
            guessed_at.append(step)
        right = len(guessed_at) == 3 and guessed_at[-1] == step  # the third guess is right
        spec.judge([], 0, [7 if right else 9])
    gaps = [b - a for a, b in zip([-1, *guessed_at], guessed_at, strict=False)]
    assert gaps == [1, *gaps_wrong, every]


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("guess_s", [None, 0.3, 6.0])
def test_a_dear_guess_waits_until_it_costs_a_small_share_of_the_decode_time(guess_s: float | None, n: int) -> None:
    """Where the block's guess is a large part of a step (the fill of its window of pairs in a small model), a
    job's first guess waits until it costs at most `GUESS_SHARE` of its decode time so far (its share of steps of
    n decoding jobs), and each later one of its decode time since the last: a short answer never pays for one.
    Before the batcher measured a guess, it costs `PRIOR_GUESS_COST` of a step; the prompt lookup's guesses are
    free, at every step."""
    costs = VerifyCost(1.0, 1.0)  # no draft length pays
    block = FixedMtp([7])
    spec = Speculation(Mtp(block, PromptLookup()), 4)
    share, cost = Speculation.GUESS_SHARE, Speculation.PRIOR_GUESS_COST if guess_s is None else guess_s
    steps, guessed_at = 1000, []
    for step in range(steps):
        assert spec.choose(n, 1.0, costs, guess_s=guess_s) == 0 and spec.draft([1, 2, 3, 1, 2], 3, 0) == []
        if block.given > len(guessed_at):
            guessed_at.append(step)
        spec.judge([], 0, [9])  # wrong
    gaps = [b - a for a, b in zip([-1, *guessed_at], guessed_at, strict=False)]
    affordable = math.ceil(cost * n / share - 1e-9)  # steps whose share of the decode time a guess is that of
    waits = [affordable] + [max(min(Mtp.shadow_every * Speculation.SHADOW_GROWTH ** i, Speculation.MAX_SHADOW_EVERY),
                                affordable) for i in range(1, len(gaps) + 1)]
    assert gaps == waits[:-1] and sum(waits) > steps - 1
    lookup = Speculation(PromptLookup(), 4)
    for _ in range(5):
        lookup.choose(n, 1.0, costs, guess_s=guess_s)
        lookup.draft([1, 2, 3, 1, 2], 3, 0)
        assert lookup._shadow is not None  # a guess at every step
        lookup.judge([], 0, [9])


def test_where_the_answer_repeats_the_prompt_the_guess_is_the_lookups_at_every_step() -> None:
    """The guess where the answer repeats a run of the prompt is the lookup's, which costs nothing: made at every
    step however dear the block's guess, and right, it proves the source (the lookup then drafts); the block is
    not run, and a wrong one does not move the block's next guess away."""
    block = FixedMtp([7])
    spec = Speculation(Mtp(block, PromptLookup()), 4)
    prompt = [*range(40), 99]
    history = [*prompt, *range(Mtp.REPEAT)]  # the answer so far: the prompt's first REPEAT tokens again
    for i in range(2):
        assert spec.choose(1, 1.0, None, guess_s=50.0) == 0  # a block guess dearer than any decode time
        assert spec.block_ask(history, len(prompt), 0, 0) is None and spec.draft(history, len(prompt), 0) == []
        spec.judge([], 0, [1000 if i == 0 else Mtp.REPEAT + i])  # wrong, then the lookup's guesses are right
        history.append(Mtp.REPEAT + i)
    assert block.given == 0 and spec._shadow_every == Mtp.shadow_every
    assert spec.choose(1, 1.0, None, guess_s=50.0) == 1  # proven: a draft of one token measures the costs
    assert spec.draft(history, len(prompt), 1) == [Mtp.REPEAT + 2] and block.given == 0


def test_a_right_block_whose_drafts_do_not_pay_guesses_ever_less_often() -> None:
    """A block that guesses right but whose drafts cost more than they save (a model too small for its block to
    pay): once the costs decline a source that has been right, each right guess moves the next as far away as a
    wrong one would, so the block's passes stop costing the job."""
    costs = VerifyCost(1.0, 1.0)  # no draft length pays
    block = FixedMtp([7])
    spec = Speculation(Mtp(block, PromptLookup()), 4)
    every, growth, most = Mtp.shadow_every, Speculation.SHADOW_GROWTH, Speculation.MAX_SHADOW_EVERY
    guessed_at: list[int] = []
    for step in range(1 + every + growth * every + most + 1):
        assert spec.choose(1, 1.0, costs, guess_s=0.01) == 0 and spec.draft([1, 2, 3, 1, 2], 3, 0) == []
        if block.given > len(guessed_at):
            guessed_at.append(step)
        spec.judge([], 0, [7])  # every guess right
    gaps = [b - a for a, b in zip([-1, *guessed_at], guessed_at, strict=False)]
    # the first right guess proves the source (no costs weighed yet); from then on the costs decline it
    assert gaps == [1, every, growth * every, min(growth ** 2 * every, most)]
    assert spec.rate > 0.7 and spec.drafted == 0


class GuessClockEngine(SuccessorEngine):
    """A successor engine with an MTP block that always guesses the successor; each guess's pass counts."""

    def __init__(self, n_ctx: int):
        super().__init__(n_ctx=n_ctx)
        self.guesses = 0

    def mtp_draft(self, seqs: Sequence[int], pos: Sequence[int], tokens: Sequence[int], n_draft: int,
                  logits: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        self.guesses += 1
        return np.array([[(t + 1 + i) % 16 for i in range(n_draft)] for t in tokens], np.int32), None


def test_a_step_that_only_ran_the_block_for_guesses_does_not_set_the_plain_step() -> None:
    """The plain step every draft's cost is measured against is timed on steps without the MTP block: a step
    whose block ran for a shadow guess (here 40 ms, four plain steps) measures the guess only. Counted as a plain
    step, it made drafts that do not pay look free."""
    engine = GuessClockEngine(n_ctx=200)
    batcher = Batcher(engine, clock=lambda: 0.040 * engine.guesses + sum(
        0.010 + 0.0005 * sum(len(tokens) for _, tokens, _ in call) for call in engine.calls))
    spec = Speculation(Mtp(engine, PromptLookup()), 4)
    job = Job([*range(16), 0, 1, 2], Sampler(GREEDY, engine.n_vocab), 24, set(), speculation=spec)
    batcher.add(job)
    while job.finish is None:
        batcher.step()
    assert engine.guesses > 0 and spec.drafted > 0
    assert batcher.budget is not None and batcher.budget.decode_seconds(1) == pytest.approx(0.0105)
    assert batcher.budget.guess_seconds() == pytest.approx(0.040)


def test_the_step_budget_prices_the_mtp_blocks_calls_apart_from_the_verification() -> None:
    """The MTP block's call before a step is timed alone: a guess's price from steps that ran it for guesses
    only (which are not plain steps), a chained draft position's from steps with drafts, whose verification is
    priced without it."""
    budget = StepBudget(1.6)
    assert budget.guess_seconds() is None and budget.block_token_seconds() is None
    budget.record(2, 0, 0.010)
    budget.record(2, 0, 0.016, block=0.006, guesses=2)  # two jobs' guesses in one pass of the block
    budget.record(2, 5, 0.050, block=0.004, guesses=1)  # beside a prompt chunk: the block's call is its own
    assert budget.guess_seconds() == pytest.approx(0.0035)
    assert budget.decode_seconds(2) == pytest.approx(0.010) and budget.per_token_seconds() is None
    budget.record(2, 0, 0.030, drafts=4, block=0.008, chained=4)  # a chain of 4 positions, then its verification
    assert budget.block_token_seconds() == pytest.approx(0.002)
    costs = budget.draft_costs()
    assert costs is not None and costs.seconds(4, 2) == pytest.approx(0.012)  # 30 - 8 ms against the plain 10


def test_a_followed_prediction_drafts_its_minimum_where_the_costs_say_none() -> None:
    costs = VerifyCost(1.0, 1.0)  # a step with one draft costs three plain steps: no draft length pays
    predicted = speculation(ADAPTIVE, list(range(1, 20)))
    lookup = speculation(ADAPTIVE)
    assert predicted is not None and lookup is not None
    assert predicted.choose(1, 1.0, costs) == Speculation.MIN_PREDICTED
    assert lookup.choose(1, 1.0, costs) == 0
    history = [5, 6]
    assert predicted.draft(history, 2, 4) == [1, 2, 3, 4]
    predicted.judge([1, 2, 3, 4], 4, [1, 2, 3, 4, 5])
    assert predicted.choose(1, 1.0, costs) == Speculation.MIN_PREDICTED
    for _ in range(8):  # its drafts rejected: the acceptance rate falls, and the costs decide again
        predicted.judge([5, 6, 7, 8], 0, [9])
    assert predicted.rate < Speculation.PREDICTED_RATE and predicted.choose(1, 1.0, costs) == 0


@pytest.mark.parametrize("backend", ["cpu", "host"])
def test_mtp_drafts_through_the_engine_give_each_job_its_greedy_answer(tmp_path, backend: str) -> None:
    """The C engine, or the device backend on the host device (the block run through the device interface), on a
    generated qwen35moe with its MTP block (random weights: its drafts mostly wrong): the block's drafts, verified
    in the jobs' steps and rolled back through the recurrent state's snapshots, give the answer decoded token by
    token, beside a job without drafts; every draft is the block's. Then the answer's first tokens as a prediction
    before the block: accepted drafts too."""
    from strata.engine_cffi import Engine
    from strata.engine_cffi.device import Device
    from strata.engine_cffi.device_engine import DeviceEngine
    from strata.modelgen import write_random_model

    path = write_random_model(tmp_path / "m.gguf", arch="qwen35moe", size="tiny", dtype="q8_0")
    config = SpeculativeConfig(source="mtp", adaptive=False, max_draft=3)
    shape = dict(n_ctx=256, threads=1, n_seq=2, mtp=True)
    with (Engine.load(path, **shape) if backend == "cpu"  # type: ignore[arg-type]
          else DeviceEngine.open(path, Device("host"), **shape)) as engine:  # type: ignore[arg-type]
        assert engine.recurrent and engine.mtp
        rng = np.random.default_rng(0)
        prompts = [[int(t) for t in rng.integers(0, engine.n_vocab, n)] for n in (30, 20)]

        def run(specs: list[Speculation | None]) -> list[list[int]]:
            batcher = Batcher(engine, slowdown=None)
            jobs = [Job(prompt, Sampler(GREEDY, engine.n_vocab), 24, set(), speculation=spec)
                    for prompt, spec in zip(prompts, specs, strict=True)]
            for job in jobs:
                batcher.add(job)
            while any(job.finish is None for job in jobs):
                batcher.step()
            for seq in range(engine.n_seq):
                engine.keep(0, seq)
            return [job.tokens for job in jobs]

        plain = run([None, None])
        block = CountingMtp(engine)
        spec = speculation(config, mtp=block)
        assert run([spec, None]) == plain
        assert spec is not None and spec.drafted == block.given > 0
        # the answer's first tokens as a prediction, then the block: accepted drafts move its hidden states on
        given = block.given
        spec = speculation(SpeculativeConfig(source="auto", adaptive=False, max_draft=3), plain[0][:12], mtp=block)
        assert run([spec, None]) == plain
        assert spec is not None and spec.accepted > 0 and block.given > given


def test_a_job_whose_mtp_guesses_are_wrong_runs_the_block_only_where_it_guesses(tmp_path) -> None:
    """The C engine fills the MTP block's rows lazily: a job whose drafts do not pay (the block's weights are
    random) soon drafts nothing and guesses ever less often, and the block fills its rows once per call, for
    every token evaluated since, instead of at every step; the answer is the one decoded without the block."""
    from strata.engine_cffi import Engine
    from strata.modelgen import write_random_model

    path = write_random_model(tmp_path / "m.gguf", arch="qwen35moe", size="tiny", dtype="q8_0")
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, 200, 30)]
    answers = []
    for mtp in (False, True):
        with Engine.load(path, n_ctx=256, threads=1, mtp=mtp) as engine:
            block = CountingMtp(engine)
            batcher = Batcher(engine, slowdown=None)
            job = Job(prompt, Sampler(GREEDY, engine.n_vocab), 90, set(),
                      speculation=speculation(SpeculativeConfig(source="mtp"), mtp=block) if mtp else None)
            batcher.add(job)
            steps = 0
            while job.finish is None:
                batcher.step()
                steps += 1
            answers.append(job.tokens)
            passes, pairs = engine.mtp_fills()
    assert answers[0] == answers[1] and len(answers[0]) == 90
    assert 0 < block.calls <= steps // 4  # it backed off
    assert passes == block.calls and pairs <= len(prompt) + steps  # one pass a call, none in the other steps


class BatchCheckingMtp:
    """A real engine's MTP block that checks each call's drafts against each sequence's drafts alone (the whole
    chain, and its first token asked for alone), and records the sequences of each call."""

    def __init__(self, engine: MtpEngine):
        self.engine, self.calls = engine, []

    def mtp_draft(self, seqs: Sequence[int], pos: Sequence[int], tokens: Sequence[int], n_draft: int,
                  logits: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        drafts, rows = self.engine.mtp_draft(seqs, pos, tokens, n_draft, logits)
        for i, seq in enumerate(seqs):
            alone, _ = self.engine.mtp_draft([seq], [pos[i]], [tokens[i]], n_draft)
            first, _ = self.engine.mtp_draft([seq], [pos[i]], [tokens[i]], 1)
            assert (alone[0] == drafts[i]).all() and first[0][0] == drafts[i][0]
        self.calls.append(list(seqs))
        return drafts, rows


def test_a_step_drafts_for_all_its_mtp_jobs_in_one_call(tmp_path) -> None:
    """Four streams with the MTP block's drafts of 1 to 3 tokens (a step's call chains as far as the longest):
    one call of the block a step, for every job, each job's drafts bit-identical to its drafts alone; the answers
    those of decoding without drafts."""
    from strata.engine_cffi import Engine
    from strata.modelgen import write_random_model

    path = write_random_model(tmp_path / "m.gguf", arch="qwen35moe", size="tiny", dtype="q8_0")
    with Engine.load(path, n_ctx=256, threads=1, n_seq=4, mtp=True) as engine:
        rng = np.random.default_rng(1)
        prompts = [[int(t) for t in rng.integers(0, engine.n_vocab, n)] for n in (30, 20, 16, 12)]

        def run(specs: list[Speculation | None]) -> tuple[list[list[int]], int]:
            batcher = Batcher(engine, slowdown=None)
            jobs = [Job(prompt, Sampler(GREEDY, engine.n_vocab), 16, set(), speculation=spec)
                    for prompt, spec in zip(prompts, specs, strict=True)]
            for job in jobs:
                batcher.add(job)
            calls = []  # the block's calls in each step
            while any(job.finish is None for job in jobs):
                before = len(block.calls)
                batcher.step()
                calls.append(len(block.calls) - before)
            for seq in range(engine.n_seq):
                engine.keep(0, seq)
            return [job.tokens for job in jobs], calls

        block = BatchCheckingMtp(engine)
        plain, _ = run([None] * 4)
        specs = [speculation(SpeculativeConfig(source="mtp", adaptive=False, max_draft=n), mtp=block)
                 for n in (1, 2, 3, 3)]
        answers, calls = run(specs)
    assert answers == plain
    assert max(calls) == 1 and max(len(seqs) for seqs in block.calls) == 4
    assert all(spec is not None and spec.drafted > 0 for spec in specs)


def test_a_jobs_ask_of_the_mtp_block_is_the_call_its_draft_makes() -> None:
    """`block_ask` names the block's call of the job's next `draft` (which the batcher runs with other jobs'):
    a shadow guess only on the steps it is due, none where a followed prediction drafts, and the drafts the call
    gave are the draft's."""
    costs = VerifyCost(1.0, 1.0)  # no draft length pays: shadow guesses only
    block = FixedMtp([7])
    spec = Speculation(Mtp(block, PromptLookup()), 4)
    history = [1, 2, 3, 1, 2]
    for _ in range(3 * Mtp.shadow_every):
        assert spec.choose(1, 1.0, costs) == 0
        ask, given = spec.block_ask(history, 3, 0, 0), block.given
        spec.draft(history, 3, 0)
        assert (ask is not None) == (block.given > given)
        spec.judge([], 0, [9])
    predicted = speculation(ADAPTIVE, [5, 6, 7], mtp=block)
    assert predicted is not None and predicted.block_ask([1, 2, 5], 2, 2, 0) is None
    assert predicted.draft([1, 2, 5], 2, 2) == [6, 7]
    ask = predicted.block_ask([1, 2, 5, 8], 2, 2, 0)  # the answer left the prediction: the block drafts
    assert ask is not None and ask.n == 2
    draft_together([ask], 100)
    given = block.given
    assert predicted.draft([1, 2, 5, 8], 2, 2) == [7] and block.given == given  # taken from the joint call


class WrongModel(Wrong):
    """Drafts that are always wrong, from a model (its guesses are dear): counts the tokens it was asked for."""

    shadow_every = Mtp.shadow_every

    def __init__(self, token: int):
        super().__init__(token)
        self.asked: list[int] = []

    def propose(self, history: Sequence[int], n_prompt: int, n: int, seq: int = 0) -> list[int]:
        self.asked.append(n)
        return super().propose(history, n_prompt, n, seq)


def test_adaptive_sends_no_draft_before_its_source_was_right() -> None:
    """Free text where the source never guesses right: the adaptive job sends no draft at all (on a recurrent
    engine a wrong one costs the state's save, its reload and the token evaluated again), only shadow guesses of one
    token, from its first step on and ever further apart; the answer is the plain one."""
    prompt = [*range(6), 9, 3, 4]
    plain, _ = answer(RecurrentEngine(n_ctx=200), prompt, None, 100)
    engine, wrong = RecurrentEngine(n_ctx=200), WrongModel(0)
    spec = Speculation(wrong, 4)
    fast, _ = answer(engine, prompt, spec, 100)
    assert fast.tokens == plain.tokens
    assert spec.drafted == 0 and not engine.restores and max(len(call[0][1]) for call in engine.calls[1:]) == 1
    guesses, at, gap = 0, 0, WrongModel.shadow_every
    while at < 100 - 1:  # the decode steps of the tokens after the prompt's
        guesses += 1
        gap = min(Speculation.SHADOW_GROWTH * gap, Speculation.MAX_SHADOW_EVERY)
        at += gap
    assert guesses > 1 and wrong.asked == [1] * guesses
