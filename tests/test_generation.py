"""The generation loop on a scripted engine (next token = last + 1), and through the real engine on a generated
model."""

from __future__ import annotations

import re

import numpy as np
import pytest

from strata.generation import decode_one, generate, prefill
from strata.prompt import render_chat
from strata.sampling import Sampler, SamplingParams

N_VOCAB = 16
GREEDY = SamplingParams(temperature=0.0)


class SuccessorEngine:
    """An engine whose most likely next token is always (last token + 1) mod N_VOCAB, the runner-up (last + 2);
    it records every call."""

    def __init__(self, n_ctx: int = 64) -> None:
        self.n_vocab, self.n_ctx = N_VOCAB, n_ctx
        self.cache: list[int] = []
        self.calls: list[tuple[list[int], list | None]] = []

    @property
    def n_past(self) -> int:
        return len(self.cache)

    def eval(self, tokens: list[int], embeds: list | None = None, all_logits: bool = False) -> np.ndarray:
        assert tokens and len(self.cache) + len(tokens) <= self.n_ctx
        self.calls.append((list(tokens), embeds))
        self.cache += tokens
        logits = np.zeros(N_VOCAB, np.float32)
        logits[(tokens[-1] + 1) % N_VOCAB] = 5.0
        logits[(tokens[-1] + 2) % N_VOCAB] = 4.0
        return logits

    def keep(self, n: int) -> None:
        del self.cache[n:]


def test_prefill_and_decode_one_append_to_the_cache() -> None:
    engine = SuccessorEngine()
    assert int(np.argmax(prefill(engine, [1, 2, 3]))) == 4
    assert int(np.argmax(decode_one(engine, 9))) == 10
    assert engine.cache == [1, 2, 3, 9]


def test_greedy_generation_stops_at_max_tokens() -> None:
    engine = SuccessorEngine()
    out = list(generate(engine, [1, 2], Sampler(GREEDY, N_VOCAB), max_tokens=4, stop_ids=set()))
    assert out == [3, 4, 5, 6]
    # one prefill, one decode per token but the last (its logits are never needed)
    assert [tokens for tokens, _ in engine.calls] == [[1, 2], [3], [4], [5]]
    assert engine.cache == [1, 2, 3, 4, 5]


def test_a_stop_id_ends_generation_unyielded() -> None:
    engine = SuccessorEngine()
    out = list(generate(engine, [1], Sampler(GREEDY, N_VOCAB), max_tokens=10, stop_ids={5, 12}))
    assert out == [2, 3, 4]
    assert engine.cache == [1, 2, 3, 4]


def test_generation_ends_with_the_context() -> None:
    engine = SuccessorEngine(n_ctx=5)
    out = list(generate(engine, [0, 1, 2], Sampler(GREEDY, N_VOCAB), max_tokens=10, stop_ids=set()))
    assert out == [3, 4]


def test_a_cached_prompt_prefix_is_not_evaluated_again() -> None:
    engine = SuccessorEngine()
    engine.cache = [7, 8, 9]
    list(generate(engine, [7, 8, 9, 10, 11], Sampler(GREEDY, N_VOCAB), max_tokens=1, stop_ids=set()))
    assert engine.calls[0][0] == [10, 11]


def test_a_fully_cached_prompt_evaluates_its_last_token() -> None:
    engine = SuccessorEngine()
    engine.cache = [7, 8, 9, 1, 1]  # the prompt, then tokens of an earlier answer
    out = list(generate(engine, [7, 8, 9], Sampler(GREEDY, N_VOCAB), max_tokens=1, stop_ids=set()))
    assert engine.calls[0][0] == [9]
    assert out == [10]


def test_image_rows_shift_with_the_cached_prefix() -> None:
    engine = SuccessorEngine()
    engine.cache = [1, 2, 3, 4]
    first, second = np.zeros((2, 3), np.float32), np.ones((3, 3), np.float32)
    # the first picture (positions 0-1) is cached; the second (3-5) straddles the cache's end: evaluated whole
    prompt = [1, 2, 3, 0, 0, 0, 6]
    list(generate(engine, prompt, Sampler(GREEDY, N_VOCAB), 1, set(), embeds=[(0, first), (3, second)]))
    tokens, embeds = engine.calls[0]
    assert tokens == [0, 0, 0, 6]
    assert len(embeds) == 1 and embeds[0][0] == 0 and embeds[0][1] is second


def test_penalties_see_the_prompt() -> None:
    engine = SuccessorEngine()
    sampler = Sampler(SamplingParams(temperature=0.0, repetition_penalty=2.0), N_VOCAB)
    # The favourite after 2 is 3, but 3 is in the prompt: penalised to 2.5, below the runner-up 4 (4.0).
    out = list(generate(engine, [3, 2], sampler, max_tokens=1, stop_ids=set()))
    assert out == [4]


def test_an_empty_prompt_is_refused() -> None:
    with pytest.raises(ValueError, match="the prompt is empty"):
        list(generate(SuccessorEngine(), [], Sampler(GREEDY, N_VOCAB), 1, set()))


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


def test_generate_command_prints_the_greedy_completion(tmp_path, capsys) -> None:
    from strata.cli import main
    from strata.engine_cffi import Engine
    from strata.modelgen import write_random_model
    from strata.tokenizer import Tokenizer

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
