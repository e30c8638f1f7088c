"""The sampler against Hugging Face's logits warpers (the reference for what each setting means) and numpy."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from strata.text.sampling import Sampler, SamplingParams, draw

N_VOCAB = 151_936


def random_logits(scale: float, n: int = N_VOCAB, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def reference_distribution(logits: np.ndarray, params: SamplingParams) -> dict[int, float]:
    """Token id -> probability after Hugging Face's warpers, applied in its generate() order."""
    warpers = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0.0:
        warpers.append(MinPLogitsWarper(params.min_p))
    scores = torch.from_numpy(logits.astype(np.float64))[None, :]
    ids = torch.zeros((1, 1), dtype=torch.long)
    for warper in warpers:
        scores = warper(ids, scores)
    probs = torch.softmax(scores, dim=-1)[0].numpy()
    kept = np.flatnonzero(probs > 0)
    return {int(i): float(probs[i]) for i in kept}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.1, "temperature must be at least 0"),
        ("temperature", float("nan"), "temperature must be a finite number"),
        ("top_k", -1, "top_k must be at least 0"),
        ("top_k", 2.5, "top_k must be an integer"),
        ("top_k", 2**31, "top_k must be at most 2147483647"),  # the engine's draw takes it as a C int
        ("top_p", 0.0, "top_p must be greater than 0"),
        ("top_p", 1.5, "top_p must be at most 1"),
        ("min_p", -0.5, "min_p must be at least 0"),
        ("repetition_penalty", 0.0, "repetition_penalty must be greater than 0"),
        ("frequency_penalty", 2.5, "frequency_penalty must be at most 2"),
        ("presence_penalty", -3, "presence_penalty must be at least -2"),
        ("penalty_last_n", -2, "penalty_last_n must be at least -1"),
        ("seed", "7", "seed must be an integer"),
        ("seed", True, "seed must be an integer"),
    ],
)
def test_invalid_params_name_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_logits_of_the_wrong_length_are_refused() -> None:
    with pytest.raises(ValueError, match=r"logits must have shape \(10,\)"):
        Sampler(SamplingParams(), 10).sample(np.zeros(11, np.float32))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(top_k=1, seed=3),
                                    SamplingParams(temperature=1e-300), SamplingParams(temperature=9e-6, seed=3)])
def test_greedy_is_argmax(params: SamplingParams) -> None:
    sampler = Sampler(params, N_VOCAB)
    for seed in range(5):
        logits = random_logits(3.0, seed=seed)
        assert sampler.sample(logits, [1, 2, 3]) == int(np.argmax(logits))


def test_a_draw_handed_out_takes_what_sample_would_have_drawn() -> None:
    # draw_inputs and draw_with (the batcher's draws of several rows at once) give sample's tokens, seed for seed
    # (a greedy draw takes no u); a draw that sample must make itself (a mask, a bias, log-probabilities) is not
    # handed out.
    params = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3, seed=7)
    whole, split = Sampler(params, N_VOCAB), Sampler(params, N_VOCAB)
    history = [1, 2, 3]
    for seed in range(6):
        logits = random_logits(3.0, seed=seed)
        inputs = split.draw_inputs(logits, history)
        assert inputs is not None
        token = split.draw_with(*inputs)
        assert token == whole.sample(logits, history)
        history.append(token)
    logits = random_logits(3.0)
    greedy = Sampler(SamplingParams(temperature=0.0, repetition_penalty=1e6), N_VOCAB)
    scores, u = greedy.draw_inputs(logits, [int(np.argmax(logits))]) or (None, None)
    assert u == 0.0 and greedy.draw_with(scores, u) == greedy.sample(logits, [int(np.argmax(logits))])
    assert Sampler(SamplingParams(logit_bias=((5, 1.0),)), N_VOCAB).draw_inputs(logits) is None
    assert Sampler(SamplingParams(), N_VOCAB, logprobs=1).draw_inputs(logits) is None


def test_rows_drawn_at_once_are_what_sample_draws_row_by_row() -> None:
    # a speculative step's rows: greedy with nothing carried from draw to draw, each row's arg-max in one call; a
    # draw that depends on the ones before it (a penalty over the history, a mask, a bias, log-probabilities,
    # sampling's generator) is left to sample
    rows = np.stack([random_logits(3.0, seed=seed) for seed in range(5)])
    greedy = Sampler(SamplingParams(temperature=0.0), N_VOCAB)
    assert greedy.draws_at_once(rows) == [greedy.sample(row, [1, 2]) for row in rows]
    assert Sampler(SamplingParams(top_k=1, temperature=0.9), N_VOCAB).draws_at_once(rows) == np.argmax(
        rows, axis=1).tolist()
    for other in (Sampler(SamplingParams(temperature=0.7, seed=1), N_VOCAB),
                  Sampler(SamplingParams(temperature=0.0, frequency_penalty=0.5), N_VOCAB),
                  Sampler(SamplingParams(temperature=0.0, logit_bias=((5, 1.0),)), N_VOCAB),
                  Sampler(SamplingParams(temperature=0.0), N_VOCAB, logprobs=1)):
        assert other.draws_at_once(rows) is None
    with pytest.raises(ValueError, match="rows must have shape"):
        greedy.draws_at_once(rows[:, :-1])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(top_k=40),
        SamplingParams(top_p=0.9),  # peaked logits: the nucleus fits the first partition window
        SamplingParams(top_p=0.999, temperature=1.3),  # the window has to grow
        SamplingParams(min_p=0.05),
        SamplingParams(temperature=0.6, top_k=20, top_p=0.95, min_p=0.01),
        SamplingParams(temperature=1.5, top_p=0.5, min_p=0.2),
    ],
)
@pytest.mark.parametrize("scale", [1.0, 6.0])
def test_distribution_matches_hugging_face(params: SamplingParams, scale: float) -> None:
    logits = random_logits(scale)
    ids, probs = Sampler(params, N_VOCAB).distribution(logits)
    expected = reference_distribution(logits, params)
    assert sorted(ids.tolist()) == sorted(expected)
    # the sampler takes exp in float32 over the whole vocabulary: relative error ~|logit| * 6e-8
    np.testing.assert_allclose(probs, [expected[int(i)] for i in ids], rtol=1e-5, atol=1e-12)


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = np.array([0.05, 0.4, 0.1, 0.3, 0.15])  # sorted: 0.4, 0.3, 0.15 (0.85), 0.1, 0.05
    logits = np.log(probs).astype(np.float32)
    ids, kept = Sampler(SamplingParams(top_p=0.8), 5).distribution(logits)
    assert sorted(ids.tolist()) == [1, 3, 4]
    np.testing.assert_allclose(kept, probs[ids] / 0.85, rtol=1e-6)


def test_min_p_keeps_tokens_at_least_that_fraction_of_the_top() -> None:
    probs = np.array([0.5, 0.2, 0.26, 0.04])
    ids, _ = Sampler(SamplingParams(min_p=0.5), 4).distribution(np.log(probs).astype(np.float32))
    assert sorted(ids.tolist()) == [0, 2]  # 0.26 >= 0.25, 0.2 < 0.25


def test_repetition_penalty_matches_hugging_face() -> None:
    logits = random_logits(2.0, n=1000)
    history = [3, 3, 17, 999, 500, 17, 42]
    ours = Sampler(SamplingParams(repetition_penalty=1.3, penalty_last_n=-1), 1000).penalise(logits, history)
    reference = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([history]), torch.from_numpy(logits)[None, :])
    np.testing.assert_allclose(ours, reference[0].numpy(), rtol=1e-6)


def test_frequency_and_presence_penalties_follow_openai() -> None:
    logits = random_logits(2.0, n=100)
    history = [5, 9, 5, 5, 70, 9, 1]
    ours = Sampler(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), 100).penalise(logits, history)
    expected = logits.astype(np.float64).copy()
    for token in set(history):
        expected[token] -= history.count(token) * 0.5 + 0.25
    np.testing.assert_allclose(ours, expected, rtol=1e-6)


def test_penalties_look_only_at_the_last_n_tokens() -> None:
    logits = np.ones(10, np.float32)
    penalised = Sampler(SamplingParams(presence_penalty=1.0, penalty_last_n=2), 10).penalise(logits, [1, 2, 3, 4])
    assert penalised.tolist() == [1, 1, 1, 0, 0, 1, 1, 1, 1, 1]
    assert logits.tolist() == [1.0] * 10  # the caller's array is left alone


def test_same_seed_same_sequence() -> None:
    logits = random_logits(4.0)
    first = Sampler(SamplingParams(seed=1234, top_p=0.95), N_VOCAB)
    second = Sampler(SamplingParams(seed=1234, top_p=0.95), N_VOCAB)
    other = Sampler(SamplingParams(seed=4321, top_p=0.95), N_VOCAB)
    a = [first.sample(logits) for _ in range(30)]
    assert a == [second.sample(logits) for _ in range(30)]
    assert a != [other.sample(logits) for _ in range(30)]


def test_draws_follow_the_distribution() -> None:
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], np.float32)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=99)
    # Independent expectation: softmax at T=0.8, then the most likely tokens until 0.9 of the mass.
    p = np.exp(logits / 0.8) / np.exp(logits / 0.8).sum()
    order = np.argsort(-p)
    n_keep = int(np.argmax(np.cumsum(p[order]) >= 0.9)) + 1
    expected = np.zeros(6)
    expected[order[:n_keep]] = p[order[:n_keep]] / p[order[:n_keep]].sum()
    sampler = Sampler(params, 6)
    n = 40_000
    counts = np.bincount([sampler.sample(logits) for _ in range(n)], minlength=6)
    assert np.all(counts[expected == 0] == 0)
    # 5 standard deviations of a binomial proportion
    np.testing.assert_array_less(np.abs(counts / n - expected), 5 * np.sqrt(expected * (1 - expected) / n) + 1e-9)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.05),
])
def test_drawing_among_a_masks_ids_is_the_masked_distribution(params: SamplingParams) -> None:
    """A mask that names its allowed ids lets the sampler work on those alone: the distribution is Hugging Face's
    on the whole vocabulary with every other logit at -inf."""
    logits = random_logits(3.0, seed=5)
    allowed = np.sort(np.random.default_rng(6).choice(N_VOCAB, 200, replace=False))
    masked = np.full(N_VOCAB, -np.inf, np.float32)
    masked[allowed] = logits[allowed]
    ids, probs = Sampler(params, N_VOCAB).distribution(masked, among=allowed)
    expected = reference_distribution(masked, params)
    assert set(ids.tolist()) == set(expected)
    for i, p in zip(ids.tolist(), probs, strict=True):
        assert p == pytest.approx(expected[i], rel=1e-5, abs=1e-12)


def test_a_greedy_draw_among_ids_is_their_arg_max() -> None:
    logits = random_logits(3.0, seed=7)
    allowed = np.array([3, 77, 151_000])

    class Mask:
        def apply(self, values: np.ndarray) -> np.ndarray:
            return allowed

        def advance(self, token: int) -> None:
            pass

    expected = int(allowed[np.argmax(logits[allowed])])
    assert Sampler(SamplingParams(temperature=0), N_VOCAB, mask=Mask()).sample(logits.copy()) == expected
    assert int(np.argmax(logits)) != expected  # the mask changed the answer


# --- the draw (strata_sample, in C) against the numpy pipeline's candidates


def reference_pick(ids: np.ndarray, probs: np.ndarray, u: float) -> tuple[int, float]:
    """The token `u` draws from the candidates walked in id order, and u's distance to the nearest boundary of the
    running probabilities (where float rounding may decide either way)."""
    order = np.argsort(ids)
    cumulative = np.cumsum(probs[order])
    at = min(int(np.searchsorted(cumulative, u, side="right")), len(ids) - 1)
    return int(ids[order][at]), float(np.min(np.abs(cumulative - u)))


def trained_like(n: int, seed: int) -> np.ndarray:
    """Most of the mass on a few tokens, as a trained model puts it: 30 tokens 8-20 above a normal background."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal(n) * 2
    logits[rng.choice(n, 30, replace=False)] += rng.uniform(8, 20, 30)
    return logits.astype(np.float32)


def with_ties_and_masks(n: int, seed: int) -> np.ndarray:
    """Logits in steps of 0.25, so that many are equal (ties at every cut), and a tenth of them -inf."""
    rng = np.random.default_rng(seed)
    logits = np.round(rng.standard_normal(n) * 8) / 4
    logits[rng.random(n) < 0.1] = -np.inf
    return logits.astype(np.float32)


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.6, top_p=0.95),
    SamplingParams(top_p=0.3),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.8, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=0.6, top_k=20, top_p=0.95),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.05),
    SamplingParams(top_k=1999),
])
@pytest.mark.parametrize("logits", [random_logits(3.0, n=2000, seed=11), random_logits(1.0, n=2000, seed=12),
                                    trained_like(2000, 14), with_ties_and_masks(2000, 13)],
                         ids=["peaked", "flat", "trained-like", "ties and masks"])
def test_a_draw_picks_the_token_the_candidates_give_u(params: SamplingParams, logits: np.ndarray) -> None:
    """For u across [0, 1): the token of the numpy pipeline's candidates (`distribution`) whose running
    probability, in id order, first passes u. Near a boundary (within 1e-5: the two take e^x in float32 by
    different means) either neighbour may come."""
    ids, probs = Sampler(params, len(logits)).distribution(logits)
    checked = 0
    for u in np.linspace(0.0, 1.0, 401, endpoint=False) + 0.0012345:
        expected, margin = reference_pick(ids, probs, u)
        if margin < 1e-5:
            continue
        assert draw(logits, params, float(u)) == expected, f"u={u}"
        checked += 1
    assert checked > 300


@pytest.mark.parametrize("params", [SamplingParams(top_p=0.9), SamplingParams(temperature=0.5, min_p=0.2),
                                    SamplingParams(top_k=50, top_p=0.7)])
def test_draws_over_the_whole_vocabulary_stay_among_the_candidates(params: SamplingParams) -> None:
    logits = random_logits(3.0, seed=21)
    ids, probs = Sampler(params, N_VOCAB).distribution(logits)
    sampler = Sampler(dataclasses.replace(params, seed=5), N_VOCAB)
    drawn = np.array([sampler.sample(logits) for _ in range(3000)])
    assert set(drawn.tolist()) <= set(ids.tolist())
    # the most likely candidate comes about as often as it should (5 standard deviations)
    top = int(ids[np.argmax(probs)])
    p = float(probs.max())
    assert abs(np.mean(drawn == top) - p) < 5 * np.sqrt(p * (1 - p) / 3000)


def test_a_draw_never_picks_a_masked_token() -> None:
    logits = np.full(N_VOCAB, -np.inf, np.float32)
    logits[[7, 151_000]] = [0.0, -100.0]  # e^-100: below the float32 weights the draw keeps
    assert {draw(logits, SamplingParams(), u) for u in (0.0, 0.5, 0.999999)} == {7}


def test_a_draw_refuses_greedy_settings_and_no_logits() -> None:
    with pytest.raises(ValueError, match="temperature above 0"):
        draw(np.zeros(4, np.float32), SamplingParams(temperature=0.0), 0.5)
    with pytest.raises(ValueError, match="logits"):
        draw(np.zeros(0, np.float32), SamplingParams(), 0.5)


@pytest.mark.parametrize("top_k", [N_VOCAB, 2**31 - 1])
def test_a_top_k_beyond_the_vocabulary_keeps_every_token(top_k: int) -> None:
    logits = np.random.default_rng(5).normal(size=N_VOCAB).astype(np.float32)
    every = Sampler(SamplingParams(top_k=0, seed=11), N_VOCAB)
    beyond = Sampler(SamplingParams(top_k=top_k, seed=11), N_VOCAB)
    assert [beyond.sample(logits.copy()) for _ in range(20)] == [every.sample(logits.copy()) for _ in range(20)]
    work = (np.empty(N_VOCAB, np.float32), np.empty(N_VOCAB, np.int32))
    assert draw(logits, SamplingParams(top_k=top_k), 0.5, work) == draw(logits, SamplingParams(), 0.5, work)
