"""Speculative decoding: what a draft token costs the engine, and what drafts buy, side by side in one run.

    python bench/speculative.py [--threads 2] [--repeat 3] [--parts steps,engine,http,mtp]

- steps: the engine alone, the small Q8_0 qwen3moe (`strata make-model --arch qwen3moe --size small --dtype q8_0`):
  the seconds of one step of one sequence that carries its token and k draft tokens, k = 0..16, the median of
  many; the ratio to k = 0 is what a draft token costs. Random tokens route to many experts; one token repeated
  routes alike (few experts beyond one token's): the two bound what the experts a draft adds cost.
- engine: the batcher on the same model, speculation off, lookup (always max_draft tokens) and adaptive, on
  (a) an edit whose answer the client predicted (the prediction is the model's own greedy answer: every draft is
  right, the best case of an edit), (b) free sampled text at temperature 1 (drafts from prompt lookup mostly
  wrong), (c) four such streams at once: decode tokens/s, with the answers at temperature 0 compared.
- http: the demo model (`src/strata/models/demo.gguf`) through the HTTP API, a 300-line source file to re-emit
  with a rename (also with the file as the request's `prediction`), at temperature 0, and a free chat sampled with
  a seed: decode tokens/s from the history rows (output tokens after the first over the decode seconds), each
  configuration in a server of its own. The shipped demo model was not trained to edit (the `qwen35moe` demo
  learns short pieces of code, not a file of 300 lines): its answer is not the file.
- demo: the demo model's own edit skill (a held-out "rename X to Y in this code" on a short generated function,
  as the `qwen35moe` demo is trained), through one batcher per mode (as a server's, whose measured step costs
  carry from request to request), greedy, one request at a time: speculation off on an
  engine without the MTP block, the block's drafts (always 3 tokens, and adaptive; where the file has the block:
  `--demo-model` names the `qwen35moe` demo), prompt lookup (always max_draft tokens, and adaptive); decode
  tokens/s over all the requests, the drafts' acceptance rate, the answers compared; and the same on its other
  text tasks (short answers: sums, capitals, spelling, greetings, tool calls).
- overhead: the demo model on one engine with its MTP block, in process, each decode step of the batcher timed
  outside the engine's calls (the scheduler's Python, speculation's included) and inside them, per mode (off,
  the default, lookup adaptive): its 16 held-out edits and 16 other text tasks (greedy) and a sampled free chat;
  the medians of `--repeat` rounds.
- demo-http: the demo's own requests (16 edits, 16 other short ones) one after another through a server with
  speculation off and one with the default ("auto"), taking turns: the seconds of each trace's requests, whole
  (prompts, answers and the HTTP stack; the fastest of three rounds after one to warm up, the median over
  `--repeat`), with the answers compared.
- rollback: a generated Q8_0 qwen35moe of the small width with Qwen3.5-35B-A3B's Gated DeltaNet shape (40
  layers, 30 DeltaNet, 32 value heads of 128: a recurrent state of ~64 MiB a sequence, that model's): a step of one
  token and 3 drafts with no state kept, with the state saved before it and loaded after its rollback (bytes
  through Python), and with the engine's checkpoint restored (`checkpoint_state`, `restore_state`), the median of
  `10 * --repeat`.
- mtp: the batcher on the small Q8_0 qwen35moe with its MTP block (`strata make-model --arch qwen35moe --size
  small --dtype q8_0`), greedy, one stream and four: speculation off on an engine without the block, off on one
  that runs it (what keeping its rows filled costs: lazily, in batches), the block's drafts (always 3 tokens)
  and adaptive, each from the first decode step on; decode tokens/s, the acceptance rate and the block's fills
  (passes over its weights, and the pairs they filled), with the answers compared (four
  streams' prompts are chunked by measured time, and a hybrid's prompt rounds by its chunks: reported only). Its
  weights are random: the block is not trained to guess the trunk, so its drafts are about never right here, and
  this measures what they cost. `--layers N` takes the small shape with N layers (every 4th full attention).
  Then a one-token decode step without the block and with it, nothing drafted (runs of 128 steps: what keeping
  the block's rows filled costs decode), a 2,000-token prompt's time without the block and with it (what the fill
  costs a prompt), and the block's
  draft calls alone: 1 and 3 drafts for one sequence, for four in a call each, and for four in one call (the
  batcher's, one a step), and 1 draft after 1 to 64 one-token evals (the call first fills their pairs in one
  pass: what the lazy fill costs a guess), the median of many.

The engines that run the block keep the server's `speculative.mtp_window` (`--mtp-window N`; 0: the block's
whole history, every pair filled).

Rates are wall-clock and per CPU second of the engine's threads (which the load of other processes on a shared
machine does not stretch); the table shows medians of `--repeat` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
sys.path.insert(0, str(ROOT / "src"))

from strata.config import SpeculativeConfig, config_from_dict  # noqa: E402
from strata.engine_cffi import BatchItem, Engine  # noqa: E402
from strata.scheduling.batcher import Batcher, Job  # noqa: E402
from strata.scheduling.drafts import Speculation, speculation  # noqa: E402
from strata.text.sampling import Sampler, SamplingParams  # noqa: E402

MODES = {"off": SpeculativeConfig(source="off"), "lookup": SpeculativeConfig(source="auto", adaptive=False),
         "adaptive": SpeculativeConfig(source="auto")}
GREEDY = SamplingParams(temperature=0.0)


def small_model(arch: str = "qwen3moe", layers: int | None = None) -> pathlib.Path:
    """The small Q8_0 model of `arch`, with `layers` layers in place of the table's where given."""
    from strata.modelgen import write_random_model

    path = OUT / f"{arch}-small{f'-{layers}l' if layers else ''}-q8_0.gguf"
    if not path.exists():
        OUT.mkdir(parents=True, exist_ok=True)
        write_random_model(path, arch=arch, size="small", dtype="q8_0", vocab="qwen", seed=0,
                           **({"n_layer": layers} if layers else {}))
    return path


# --- steps: the engine's cost of a draft token


def step_costs(engine: Engine, ks: list[int], rounds: int, same: bool = False) -> dict[int, tuple[float, float]]:
    """Median seconds of a step of one sequence at ~300 positions carrying 1 + k tokens (all rows' logits for
    k > 0, as a verification asks), the ks taking turns: wall time, and the engine threads' CPU time. `same`:
    the 1 + k tokens are one token repeated, whose rows route alike (the first layer's exactly: one embedding),
    so the step reads few experts beyond one token's; else random tokens, which read many."""
    rng = np.random.default_rng(0)
    context = [int(t) for t in rng.integers(0, engine.n_vocab, 300)]
    engine.keep(0)
    engine.eval_batch([BatchItem(0, context, None, "none")])
    times: dict[int, list[tuple[float, float]]] = {k: [] for k in ks}
    for _ in range(rounds):
        for k in ks:
            tokens = [int(t) for t in rng.integers(0, engine.n_vocab, 1 if same else 1 + k)]
            tokens *= (1 + k) // len(tokens)
            started, cpu = time.perf_counter(), engine.cpu_seconds()
            engine.eval_batch([BatchItem(0, tokens, None, "all" if k else "last")])
            times[k].append((time.perf_counter() - started, engine.cpu_seconds() - cpu))
            engine.keep(len(context))
    return {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}


# --- engine: the batcher with each mode


def run_jobs(engine: Engine, jobs: list[Job], later: list[Speculation | None] | None = None,
             batcher: Batcher | None = None) -> tuple[tuple[float, float], list[Job]]:
    """Decode tokens per second of the jobs together (tokens after each one's first, from the end of the last
    prompt), of wall time and of the engine threads' CPU time (which other processes' load does not stretch).
    `later`: each job's speculation from the end of the prompts on (their chunks then the same in every mode).
    `batcher`: one that ran earlier requests (a server's, whose measured step costs carry over); default a new
    one."""
    batcher = batcher or Batcher(engine)
    for job in jobs:
        batcher.add(job)
    while any(not job.decoding for job in jobs):
        batcher.step()
    for job, spec in zip(jobs, later or [], strict=False):
        job.speculation = spec
    started, cpu = time.perf_counter(), engine.cpu_seconds()
    first = sum(len(job.tokens) for job in jobs)
    while batcher.jobs:
        batcher.step()
    seconds, cpu = time.perf_counter() - started, engine.cpu_seconds() - cpu
    for seq in range(engine.n_seq):
        engine.keep(0, seq)
    decoded = sum(len(job.tokens) for job in jobs) - first
    return (decoded / seconds, decoded / cpu), jobs


def engine_traces(engine: Engine, repeat: int, tokens: int) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(0, engine.n_vocab, 200)]
    prompts4 = [[int(t) for t in rng.integers(0, engine.n_vocab, 200)] for _ in range(4)]
    predicted = run_jobs(engine, [Job(prompt, Sampler(GREEDY, engine.n_vocab), tokens, set())])[1][0].tokens
    results: dict[str, dict[str, list[tuple[float, float]]]] = {}
    answers: dict[str, list[int]] = {}

    def record(trace: str, mode: str, value: tuple[float, float]) -> None:
        results.setdefault(trace, {}).setdefault(mode, []).append(value)

    for _ in range(repeat):
        for mode, config in MODES.items():
            rate, (job,) = run_jobs(engine, [Job(prompt, Sampler(GREEDY, engine.n_vocab), tokens, set(),
                                                 speculation=speculation(config, predicted))])
            record("edit, predicted (greedy)", mode, rate)
            answers[mode] = job.tokens
            free = SamplingParams(temperature=1.0, seed=11)
            rate, _ = run_jobs(engine, [Job(prompt, Sampler(free, engine.n_vocab), tokens, set(),
                                            speculation=speculation(config))])
            record("free text, sampled", mode, rate)
            rate, _ = run_jobs(engine, [Job(p, Sampler(SamplingParams(temperature=1.0, seed=i), engine.n_vocab),
                                            tokens, set(), speculation=speculation(config))
                                        for i, p in enumerate(prompts4)])
            record("4 streams, sampled", mode, rate)
    assert answers["off"] == answers["lookup"] == answers["adaptive"], "greedy answers differ"
    return medians(results)


def medians(results: dict[str, dict[str, list[tuple[float, float]]]]) -> dict[str, dict[str, tuple[float, float]]]:
    return {trace: {mode: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
                    for mode, v in modes.items()} for trace, modes in results.items()}


# --- mtp: the model's MTP block

# the engines' (`--mtp-window`): the server's by default (none in a tree before it, whose strata
# bench/speculative_policy.py may run this module against)
MTP_WINDOW = getattr(SpeculativeConfig(), "mtp_window", 0)
MTP_MODES = {"off": SpeculativeConfig(source="off"), "off, block run": SpeculativeConfig(source="off"),
             "mtp": SpeculativeConfig(source="mtp", adaptive=False, max_draft=3),
             "mtp adaptive": SpeculativeConfig(source="mtp")}


def mtp_traces(path: pathlib.Path, threads: int, repeat: int, tokens: int
               ) -> tuple[dict[str, dict[str, tuple[float, float]]], dict[str, float], dict[str, list[int]]]:
    """Each mode's decode rates on one greedy stream and on four, the drafts' acceptance rate, and the block's
    fills over each mode's runs, prompts included: [passes, pairs]."""
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, 151000, 200)] for _ in range(4)]
    results: dict[str, dict[str, list[tuple[float, float]]]] = {}
    answers: dict[str, list[list[int]]] = {}
    drafted: dict[str, list[int]] = {}
    fills: dict[str, list[int]] = {}
    with Engine.load(path, n_ctx=1024, threads=threads, n_seq=4) as plain, \
            Engine.load(path, n_ctx=1024, threads=threads, n_seq=4, mtp=True, mtp_window=MTP_WINDOW) as block:
        for _ in range(repeat):
            for mode, config in MTP_MODES.items():
                engine = plain if mode == "off" else block
                for trace, batch in (("one stream, greedy", prompts[:1]), ("4 streams, greedy", prompts)):
                    # Speculation from the first decode step on: a hybrid's prompt chunked otherwise (room taken by
                    # drafts) rounds otherwise, which a near tie can turn into another greedy answer
                    specs = [speculation(config, mtp=engine if engine.mtp else None) for _ in batch]
                    before = engine.mtp_fills()
                    rate, jobs = run_jobs(engine, [Job(p, Sampler(GREEDY, engine.n_vocab), tokens, set())
                                                   for p in batch], later=specs)
                    counts = fills.setdefault(mode, [0, 0])
                    for i, (start, end) in enumerate(zip(before, engine.mtp_fills(), strict=True)):
                        counts[i] += end - start
                    results.setdefault(trace, {}).setdefault(mode, []).append(rate)
                    answers.setdefault(f"{trace} {mode}", [job.tokens for job in jobs])
                    counts = drafted.setdefault(mode, [0, 0])
                    for spec in specs:
                        counts[0] += spec.accepted if spec else 0
                        counts[1] += spec.drafted if spec else 0
    # One stream's prompt is one chunk in every mode; four streams' prompts are chunked by measured time, which a
    # hybrid's Gated DeltaNet rounds by (its chunked form), so their answers may part where two logits nearly tie
    assert len({str(answers[f"one stream, greedy {mode}"]) for mode in MTP_MODES}) == 1, "the answers differ"
    for mode in MTP_MODES:
        same = answers[f"4 streams, greedy {mode}"] == answers["4 streams, greedy off"]
        print(f"  4 streams, {mode}: answers {'the same as' if same else 'other than'} off's", flush=True)
    acceptance = {mode: accepted / n for mode, (accepted, n) in drafted.items() if n}
    return medians(results), acceptance, fills


def mtp_prompt_costs(path: pathlib.Path, threads: int, repeat: int, n_prompt: int = 2000
                     ) -> dict[str, tuple[float, float]]:
    """Median seconds, wall and CPU, of one `n_prompt`-token prompt on an engine without the block and on one that
    runs it (which fills the block's rows for every token), the two taking turns."""
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 151000, n_prompt)]
    times: dict[str, list[tuple[float, float]]] = {"off": [], "block run": []}
    with Engine.load(path, n_ctx=n_prompt + 64, threads=threads) as plain, \
            Engine.load(path, n_ctx=n_prompt + 64, threads=threads, mtp=True, mtp_window=MTP_WINDOW) as block:
        for _ in range(repeat):
            for name, engine in (("off", plain), ("block run", block)):
                started, cpu = time.perf_counter(), engine.cpu_seconds()
                engine.eval_batch([BatchItem(0, prompt, None, "last")])
                times[name].append((time.perf_counter() - started, engine.cpu_seconds() - cpu))
                engine.keep(0)
    return {name: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
            for name, v in times.items()}


def mtp_step_costs(path: pathlib.Path, threads: int, rounds: int, steps: int = 128
                   ) -> dict[str, tuple[float, float]]:
    """Median seconds, wall and CPU, of a one-token decode step of one sequence after a 200-token prompt, on an
    engine without the block and on one that runs it, no draft ever asked: runs of `steps` steps (each run as long
    as the held history, so a lazy fill fills once a run, as decode does every 128 steps), the two engines
    taking turns."""
    prompt = [int(t) for t in np.random.default_rng(6).integers(0, 151000, 200)]
    times: dict[str, list[tuple[float, float]]] = {"off": [], "block run": []}
    with Engine.load(path, n_ctx=512, threads=threads) as plain, \
            Engine.load(path, n_ctx=512, threads=threads, mtp=True, mtp_window=MTP_WINDOW) as block:
        engines = {"off": plain, "block run": block}
        states = {}
        for name, engine in engines.items():
            engine.eval(prompt)
            states[name] = engine.save_state(0)
        tokens = [int(t) for t in np.random.default_rng(7).integers(0, 151000, steps)]
        for _ in range(rounds):
            for name, engine in engines.items():
                started, cpu = time.perf_counter(), engine.cpu_seconds()
                for token in tokens:
                    engine.eval([token])
                times[name].append(((time.perf_counter() - started) / steps, (engine.cpu_seconds() - cpu) / steps))
                engine.keep(len(prompt))
                engine.load_state(0, states[name])
    return {name: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
            for name, v in times.items()}


def mtp_call_costs(path: pathlib.Path, threads: int, rounds: int) -> dict[tuple[int, str], tuple[float, float]]:
    """The block's draft calls after four 200-token prompts: (drafts, how) -> median seconds, wall and CPU, for one
    sequence, four in a call each, and four in one call; then one draft of one sequence after k more tokens
    evaluated one an eval (the call first fills the k pairs they completed, in one pass)."""
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, 151000, 200)] for _ in range(4)]
    costs: dict[tuple[int, str], tuple[float, float]] = {}
    with Engine.load(path, n_ctx=1024, threads=threads, n_seq=4, mtp=True, mtp_window=MTP_WINDOW) as engine:
        engine.eval_batch([BatchItem(seq, prompt, None, "last") for seq, prompt in enumerate(prompts)])
        calls = {"one sequence": [[0]], "4 sequences, a call each": [[0], [1], [2], [3]],
                 "4 sequences, one call": [[0, 1, 2, 3]]}
        for n_draft in (1, 3):
            for how, groups in calls.items():
                walls, cpus = [], []
                for _ in range(rounds):
                    wall, cpu = time.perf_counter(), engine.cpu_seconds()
                    for seqs in groups:
                        engine.mtp_draft(seqs, [200] * len(seqs), [5] * len(seqs), n_draft)
                    walls.append(time.perf_counter() - wall)
                    cpus.append(engine.cpu_seconds() - cpu)
                costs[n_draft, how] = statistics.median(walls), statistics.median(cpus)
        state = engine.save_state(0)  # a hybrid's sequence goes back to 200 positions through it
        for k in (1, 8, 32, 64):
            walls, cpus = [], []
            for _ in range(max(rounds // 4, 3)):
                for token in rng.integers(0, 151000, k):
                    engine.eval([int(token)])
                wall, cpu = time.perf_counter(), engine.cpu_seconds()
                engine.mtp_draft([0], [200 + k], [5], 1)
                walls.append(time.perf_counter() - wall)
                cpus.append(engine.cpu_seconds() - cpu)
                engine.keep(200)
                engine.load_state(0, state)
            costs[1, f"one sequence, after {k} evals"] = statistics.median(walls), statistics.median(cpus)
    return costs


# --- rollback: a hybrid's recurrent state kept for a draft's rollback

# Qwen3.5-35B-A3B's Gated DeltaNet shape (40 layers, 3 of 4 DeltaNet: 16 key and 32 value heads of 128), on the
# small model's width and experts: a state of that model's size per sequence
DELTANET_35B = dict(n_layer=40, ssm_state_size=128, ssm_group_count=16, ssm_time_step_rank=32, ssm_inner_size=4096)


def rollback_costs(threads: int, rounds: int) -> tuple[int, dict[str, tuple[float, float]]]:
    """The state's bytes, and the median seconds (wall, the engine threads' CPU) of a step of one token and 3
    drafts at ~200 positions: with no state kept (the drafts accepted, decode going on), with the state saved before
    and loaded after a rollback (`save_state`, `load_state`), and with a checkpoint restored (`checkpoint_state`,
    `restore_state`)."""
    from strata.modelgen import write_random_model

    path = OUT / "qwen35moe-small-deltanet35b-q8_0.gguf"
    if not path.exists():
        OUT.mkdir(parents=True, exist_ok=True)
        write_random_model(path, arch="qwen35moe", size="small", dtype="q8_0", vocab="qwen", seed=0, **DELTANET_35B)
    rng = np.random.default_rng(4)
    times: dict[str, list[tuple[float, float]]] = {}
    with Engine.load(path, n_ctx=512, threads=threads) as engine:
        engine.eval([int(t) for t in rng.integers(0, 151000, 200)])
        n = engine.n_past

        def step() -> None:
            engine.eval_batch([BatchItem(0, [int(t) for t in rng.integers(0, 151000, 4)], None, "all")])

        def saved() -> None:
            state = engine.save_state(0)
            step()
            engine.keep(n)
            engine.load_state(0, state)

        def checkpointed() -> None:
            engine.checkpoint_state(0)
            step()
            engine.keep(n)
            engine.restore_state(0)

        base = engine.save_state(0)
        for _ in range(rounds):
            for mode, run in (("no state kept", step), ("saved and loaded", saved), ("checkpoint", checkpointed)):
                started, cpu = time.perf_counter(), engine.cpu_seconds()
                run()
                times.setdefault(mode, []).append((time.perf_counter() - started, engine.cpu_seconds() - cpu))
                engine.keep(n)
                engine.load_state(0, base)
        state_bytes = engine.state_bytes
    return state_bytes, {mode: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
                         for mode, v in times.items()}


# --- demo: the demo model's own edit skill

DEMO_MODES = {"off": SpeculativeConfig(source="off"),
              "mtp": SpeculativeConfig(source="mtp", adaptive=False, max_draft=3),
              "mtp adaptive": SpeculativeConfig(source="mtp"),
              "lookup": SpeculativeConfig(source="lookup", adaptive=False),
              "lookup adaptive": SpeculativeConfig(source="lookup")}


def demo_prompts(model: pathlib.Path, tasks: tuple[str, ...], n: int) -> list[list[int]]:
    """n held-out requests of the demo's tasks, thinking off, as the server renders them: token ids."""
    import random

    from strata.modelgen.demo import data
    from strata.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(model)
    assert tok.chat_template is not None
    rng = random.Random(2_000_003)  # a seed training never draws from
    out = []
    while len(out) < n:
        example = data.make_example(rng.choice(tasks), rng)
        if example.scene is None and example.thinking is False:
            out.append(tok.encode(data.render(example, tok.chat_template)[0]))
    return out


def demo_traces(model: pathlib.Path, threads: int, repeat: int, n: int = 16
                ) -> tuple[dict[str, dict[str, tuple[float, float]]], dict[str, dict[str, float]]]:
    """Each mode's decode rates over n edits and n other text requests, one at a time, and the acceptance rates
    (the MTP modes where the file has the block)."""
    from strata.text.tokenizer import Tokenizer

    traces = {"edit (trained form)": demo_prompts(model, ("edit",), n),
              "other text tasks": demo_prompts(model, ("arithmetic", "capital", "spelling", "greeting",
                                                       "weather_call", "add_answer"), n)}
    results: dict[str, dict[str, list[tuple[float, float]]]] = {}
    answers: dict[str, dict[str, list[list[int]]]] = {}
    drafted: dict[str, dict[str, list[int]]] = {}
    with Engine.load(model, n_ctx=1024, threads=threads) as plain, \
            Engine.load(model, n_ctx=1024, threads=threads, mtp=plain.has_mtp,
                        mtp_window=MTP_WINDOW) as block:
        stop = set(Tokenizer.from_gguf(model).eos_ids)
        modes = {mode: config for mode, config in DEMO_MODES.items() if block.mtp or config.source != "mtp"}
        for _ in range(repeat):
            for mode, config in modes.items():
                engine = plain if mode == "off" else block
                batcher = Batcher(engine)  # a server's: what it measured on one request holds for the next
                for trace, prompts in traces.items():
                    decoded = seconds = cpu = 0.0
                    outs = []
                    counts = drafted.setdefault(trace, {}).setdefault(mode, [0, 0])
                    for prompt in prompts:
                        spec = speculation(config, mtp=engine if engine.mtp else None)
                        job = Job(prompt, Sampler(GREEDY, engine.n_vocab), 256, stop)
                        (rate, per_cpu), (done,) = run_jobs(engine, [job], later=[spec], batcher=batcher)
                        n_decoded = len(done.tokens) - 1
                        decoded += n_decoded
                        seconds, cpu = seconds + n_decoded / rate, cpu + n_decoded / per_cpu
                        outs.append(done.tokens)
                        counts[0] += spec.accepted if spec else 0
                        counts[1] += spec.drafted if spec else 0
                    results.setdefault(trace, {}).setdefault(mode, []).append((decoded / seconds, decoded / cpu))
                    answers.setdefault(trace, {})[mode] = outs
    for trace, by_mode in answers.items():
        assert all(outs == by_mode["off"] for outs in by_mode.values()), f"{trace}: the greedy answers differ"
    acceptance = {trace: {mode: a / d for mode, (a, d) in modes.items() if d} for trace, modes in drafted.items()}
    return medians(results), acceptance


OVERHEAD_MODES = {"off": SpeculativeConfig(source="off"), "auto": SpeculativeConfig(),
                  "lookup adaptive": SpeculativeConfig(source="lookup")}


def overhead_traces(threads: int, repeat: int) -> dict[str, dict[str, tuple[float, float, float]]]:
    """Per decode step of the demo model, the stepping thread's microseconds outside the engine's calls (the
    scheduler's and speculation's Python) and inside them, and the tokens a step gives, of each mode on one engine
    with the MTP block: the demo's 16 held-out edits and 16 other text tasks (greedy) and a sampled free chat (4
    answers of 256 tokens, end of turn banned); medians of `repeat` rounds, the modes taking turns."""
    from strata.models import DEMO_MODEL
    from strata.text.prompt import render_chat
    from strata.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(DEMO_MODEL)
    assert tok.chat_template is not None
    stop = set(tok.eos_ids)
    chat = tok.encode(render_chat(tok.chat_template, [{"role": "user", "content": "Tell me about your day, and what "
                                                       "you like to do on a long weekend."}], enable_thinking=False))
    sampled = SamplingParams(temperature=1.0, seed=5, logit_bias=tuple((t, -100.0) for t in stop))
    traces = {"edit (trained form)": (demo_prompts(DEMO_MODEL, ("edit",), 16), GREEDY),
              "other text tasks": (demo_prompts(DEMO_MODEL, ("arithmetic", "capital", "spelling", "greeting",
                                                             "weather_call", "add_answer"), 16), GREEDY),
              "free chat, sampled": ([chat] * 4, sampled)}
    results: dict[str, dict[str, list[tuple[float, float, float]]]] = {}
    with Engine.load(DEMO_MODEL, n_ctx=1024, threads=threads, mtp=True, mtp_window=MTP_WINDOW) as engine:
        inside = [0.0]
        evaluate = engine.eval_batch

        def timed(items: list[BatchItem], notify_fd: int = -1) -> list[np.ndarray]:
            started = time.perf_counter()
            try:
                return evaluate(items, notify_fd=notify_fd)
            finally:
                inside[0] += time.perf_counter() - started

        engine.eval_batch = timed  # type: ignore[method-assign]
        for _ in range(repeat):
            for mode, config in OVERHEAD_MODES.items():
                batcher = Batcher(engine)
                for trace, (prompts, params) in traces.items():
                    steps = tokens = 0
                    outside = within = 0.0
                    for prompt in prompts:
                        job = Job(prompt, Sampler(params, engine.n_vocab), 256, stop)
                        batcher.add(job)
                        while not job.decoding:
                            batcher.step()
                        job.speculation = speculation(config, mtp=engine)
                        first = len(job.tokens)
                        while batcher.jobs:
                            inside[0] = 0.0
                            started = time.perf_counter()
                            batcher.step()
                            outside += time.perf_counter() - started - inside[0]
                            within += inside[0]
                            steps += 1
                        tokens += len(job.tokens) - first
                        for seq in range(engine.n_seq):
                            engine.keep(0, seq)
                    results.setdefault(trace, {}).setdefault(mode, []).append(
                        (outside / steps * 1e6, within / steps * 1e6, tokens / steps))
    return {trace: {mode: tuple(statistics.median(run[i] for run in runs) for i in range(3))  # type: ignore[misc]
                    for mode, runs in modes.items()} for trace, modes in results.items()}


def overhead_table(results: dict[str, dict[str, tuple[float, float, float]]]) -> str:
    lines = ["| demo model, per decode step: µs outside the engine (inside), tokens | " + " | ".join(OVERHEAD_MODES)
             + " |", "|---|" + "---|" * len(OVERHEAD_MODES)]
    for trace, modes in results.items():
        lines.append(f"| {trace} | " + " | ".join(f"{out:.1f} ({inside:.1f}), {tokens:.2f}"
                                                  for out, inside, tokens in modes.values()) + " |")
    return "\n".join(lines)


# --- http: the demo model through the API


def source_file(lines: int) -> str:
    """A Python module of about `lines` lines that uses the name `total` throughout."""
    out = ['"""Accounts and their ledgers."""', "", "from dataclasses import dataclass", ""]
    i = 0
    while len(out) < lines:
        out += [f"def ledger_{i}(entries, rate_{i}):", "    total = 0",
                "    for entry in entries:", f"        total += entry.amount * rate_{i}",
                f"    if total > {100 * (i + 1)}:", f"        total -= {i + 3}", "    return total", "", ""]
        i += 1
    return "\n".join(out[:lines]) + "\n"


async def http_trace(model: pathlib.Path, mode: str, edit: str, chat: list[dict[str, Any]], max_tokens: int,
                     threads: int, repeat: int) -> dict[str, Any]:
    """Each trace in a server with `mode`'s speculation: once to warm up (its prompt stays cached: the measured
    requests evaluate only its last token), then `repeat` times measured."""
    import httpx
    from served import served

    from strata.service import open_service

    config = config_from_dict({"model": str(model), "threads": threads, "context": 4096, "slots": 1,
                               "vision": {"exe": ["true"], "lazy_load": True},  # no encoder starts
                               "speculative": {"source": MODES[mode].source, "adaptive": MODES[mode].adaptive,
                                               "mtp_window": MTP_WINDOW}})
    out: dict[str, Any] = {}
    async with open_service(config, log=lambda line: None) as service, served(service) as (host, port), \
            httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=600) as client:
        assert service.engine is not None
        # The demo model answers a request it was not trained on in a few words: with its end-of-turn ids banned
        # it writes `max_tokens` tokens, which is what a rate needs.
        endless = {"logit_bias": {str(token): -100 for token in service.tokenizer.eos_ids}}
        for name, body in (
                ("edit", {"messages": [{"role": "user", "content": edit}], "temperature": 0,
                          "max_tokens": max_tokens, "reasoning_effort": "none"}),
                ("edit, predicted", {"messages": [{"role": "user", "content": edit}], "temperature": 0,
                                     "max_tokens": max_tokens, "reasoning_effort": "none",
                                     "prediction": {"type": "content", "content": edit.split("```")[1]}}),
                ("free chat, sampled", {"messages": chat, "temperature": 1.0, "seed": 5, "max_tokens": max_tokens,
                                        "reasoning_effort": "none"})):
            runs = []
            for i in range(repeat + 1):
                cpu = service.engine.cpu_seconds()
                reply = (await client.post("/v1/chat/completions", json=body | endless)).json()
                cpu = service.engine.cpu_seconds() - cpu
                row = service.history.last
                assert row is not None
                if i:
                    runs.append(((row.tokens_per_second or 0.0), (row.output_tokens - 1) / cpu))
            out[name] = {"text": reply["choices"][0]["message"]["content"], "runs": runs,
                         "acceptance": row.acceptance_rate, "reused": row.reused_tokens, "prompt": row.prompt_tokens}
    return out


def http_traces(model: pathlib.Path, repeat: int, threads: int,
                max_tokens: int) -> dict[str, dict[str, tuple[float, float]]]:
    import trio

    text = source_file(300)
    edit = f"Rename the variable total to amount in this code:\n```{text}```"
    chat = [{"role": "user", "content": "Tell me about your day, and what you like to do on a long weekend."}]
    rates: dict[str, dict[str, list[tuple[float, float]]]] = {}
    texts: dict[str, dict[str, str]] = {}
    for _ in range(repeat):  # the modes' servers take turns: a change of load falls on all of them
        for mode in MODES:
            result = trio.run(http_trace, model, mode, edit, chat, max_tokens, threads, 2)
            for name, value in result.items():
                rates.setdefault(name, {}).setdefault(mode, []).extend(value["runs"])
                texts.setdefault(name, {})[mode] = value["text"]
                acceptance = value["acceptance"]
                print(f"  http {name:20s} {mode:8s} prompt {value['prompt']} (cached {value['reused']}), tok/s "
                      f"{[round(w) for w, _ in value['runs']]}, per CPU s {[round(c) for _, c in value['runs']]}, "
                      f"acceptance {acceptance if acceptance is None else round(acceptance, 2)}", flush=True)
    for name, by_mode in texts.items():
        assert len(set(by_mode.values())) == 1, f"{name}: the answers differ between modes"
    return medians(rates)


# --- demo-http: the demo model's own tasks through the API, whole requests


def demo_requests(tasks: tuple[str, ...], n: int) -> list[dict[str, Any]]:
    """n held-out chat requests of the demo's tasks (pictures and thinking left out), as a client sends them."""
    import random

    from strata.modelgen.demo import data

    rng = random.Random(2_000_003)  # as demo_prompts: the same requests
    out: list[dict[str, Any]] = []
    while len(out) < n:
        example = data.make_example(rng.choice(tasks), rng)
        if example.scene is None and example.thinking is False:
            messages = [m for m in example.messages if m["role"] != "assistant" or m is not example.messages[-1]]
            out.append({"messages": messages} | ({"tools": example.tools} if example.tools else {}))
    return out


async def demo_http_trace(source: str, traces: dict[str, list[dict[str, Any]]], threads: int, rounds: int
                          ) -> dict[str, tuple[float, list[str]]]:
    """Each trace's requests one after another through a server whose speculation is `source`: the fastest
    round's seconds (after one to warm up) and the answers."""
    import httpx
    from served import served

    from strata.models import DEMO_MODEL
    from strata.service import open_service

    config = config_from_dict({"model": str(DEMO_MODEL), "threads": threads, "context": 4096, "slots": 1,
                               "vision": {"exe": ["true"], "lazy_load": True},
                               "speculative": {"source": source, "mtp_window": MTP_WINDOW}})
    out = {}
    async with open_service(config, log=lambda line: None) as service, served(service) as (host, port), \
            httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=600) as client:
        for name, requests in traces.items():
            best, answers = float("inf"), []
            for i in range(rounds + 1):
                started, answers = time.perf_counter(), []
                for body in requests:
                    reply = (await client.post("/v1/chat/completions", json=body | {
                        "temperature": 0, "max_tokens": 256, "reasoning_effort": "none"})).json()
                    message = reply["choices"][0]["message"]
                    calls = [call["function"] for call in message.get("tool_calls") or []]  # ids are random
                    answers.append(json.dumps([message["content"], calls], sort_keys=True))
                if i:
                    best = min(best, time.perf_counter() - started)
            out[name] = (best, answers)
    return out


def demo_http(threads: int, repeat: int) -> dict[str, dict[str, float]]:
    """Seconds of each trace's 16 requests, speculation off against the default ("auto"), servers taking turns."""
    import trio

    traces = {"edit (trained form)": demo_requests(("edit",), 16),
              "other text tasks": demo_requests(("arithmetic", "capital", "spelling", "greeting", "weather_call",
                                                  "add_answer"), 16)}
    seconds: dict[str, dict[str, list[float]]] = {}
    answers: dict[str, set[str]] = {}
    for _ in range(repeat):
        for source in ("off", "auto"):
            for name, (best, texts) in trio.run(demo_http_trace, source, traces, threads, 3).items():
                seconds.setdefault(name, {}).setdefault(source, []).append(best)
                answers.setdefault(name, set()).add("\n".join(texts))
    assert all(len(texts) == 1 for texts in answers.values()), "the answers differ between off and auto"
    return {name: {source: statistics.median(v) for source, v in by.items()} for name, by in seconds.items()}


def table(title: str, results: dict[str, dict[str, tuple[float, float]]],
          others: tuple[str, ...] = ("lookup", "adaptive")) -> str:
    """Decode tokens/s (wall) and tokens per engine CPU second, each other mode's ratio to off."""
    lines = [f"| {title} | off: tok/s, per CPU s | {' | '.join(others)} |", "|---|---|" + "---|" * len(others)]
    for trace, modes in results.items():
        off = modes["off"]
        cells = [f"{off[0]:.0f}, {off[1]:.0f}"]
        for mode in others:
            wall, cpu = modes[mode]
            cells.append(f"{wall:.0f} ({wall / off[0]:.2f}x), {cpu:.0f} ({cpu / off[1]:.2f}x)")
        lines.append(f"| {trace} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256, help="tokens each answer generates")
    parser.add_argument("--parts", default="steps,engine,http",
                        help="of steps, engine, http, mtp, demo, demo-http, rollback, overhead")
    parser.add_argument("--mtp-window", type=int, default=MTP_WINDOW,
                        help="the MTP block's window (`speculative.mtp_window`; 0: the whole history)")
    parser.add_argument("--demo-model", type=pathlib.Path,
                        help="demo, http: another demo model file than the shipped one")
    parser.add_argument("--layers", type=int, help="mtp: the qwen35moe's layers in place of the small one's 8 (every "
                        "4th full attention, as Qwen3.5)")
    args = parser.parse_args()
    globals()["MTP_WINDOW"] = args.mtp_window
    parts = args.parts.split(",")
    print(f"load average {os.getloadavg()[0]:.2f}, {args.threads} engine threads", flush=True)
    if "steps" in parts or "engine" in parts:
        with Engine.load(small_model(), n_ctx=1024, threads=args.threads, n_seq=4) as engine:
            if "steps" in parts:
                ks = [0, 1, 2, 4, 8, 16]
                costs = step_costs(engine, ks, rounds=10 * args.repeat)
                alike = step_costs(engine, ks, rounds=10 * args.repeat, same=True)
                print("| draft tokens | step ms | x the plain step | CPU ms | x | one token repeated: CPU ms | x |"
                      "\n|---|---|---|---|---|---|---|")
                for k in ks:
                    (wall, cpu), (wall0, cpu0), same, same0 = costs[k], costs[0], alike[k][1], alike[0][1]
                    print(f"| {k} | {wall * 1e3:.2f} | {wall / wall0:.2f} | {cpu * 1e3:.2f} | {cpu / cpu0:.2f} | "
                          f"{same * 1e3:.2f} | {same / same0:.2f} |", flush=True)
            if "engine" in parts:
                print(table("small Q8_0 qwen3moe, batcher", engine_traces(engine, args.repeat, args.tokens)),
                      flush=True)
    if "mtp" in parts:
        path = small_model("qwen35moe", args.layers)
        name = f"small Q8_0 qwen35moe{f', {args.layers} layers,' if args.layers else ''} with its MTP block"
        rates, acceptance, fills = mtp_traces(path, args.threads, args.repeat, args.tokens)
        print(table(f"{name}, batcher", rates, tuple(MTP_MODES)[1:]), flush=True)
        print("acceptance: " + ", ".join(f"{mode} {rate:.3f}" for mode, rate in acceptance.items()), flush=True)
        print("the block's fills (passes, pairs; prompts included): " + ", ".join(
            f"{mode} {passes}, {pairs}" for mode, (passes, pairs) in fills.items() if pairs), flush=True)
        steps = mtp_step_costs(path, args.threads, 3 * args.repeat)
        (wall0, cpu0), (wall, cpu) = steps["off"], steps["block run"]
        print(f"| a decode step, nothing drafted | off: ms, CPU ms | block run |\n|---|---|---|\n| {name} | "
              f"{wall0 * 1e3:.2f}, {cpu0 * 1e3:.2f} | {wall * 1e3:.2f} ({wall / wall0:.3f}x), {cpu * 1e3:.2f} "
              f"({cpu / cpu0:.3f}x) |", flush=True)
        prompt = mtp_prompt_costs(path, args.threads, args.repeat)
        (wall0, cpu0), (wall, cpu) = prompt["off"], prompt["block run"]
        print(f"| 2,000-token prompt | off: s, CPU s | block run |\n|---|---|---|\n| {name} | {wall0:.2f}, "
              f"{cpu0:.2f} | {wall:.2f} ({wall / wall0:.3f}x), {cpu:.2f} ({cpu / cpu0:.3f}x) |", flush=True)
        print("| the block's drafts | ms | CPU ms |\n|---|---|---|")
        for (n_draft, how), (wall, cpu) in mtp_call_costs(path, args.threads, 20 * args.repeat).items():
            print(f"| {n_draft}, {how} | {wall * 1e3:.2f} | {cpu * 1e3:.2f} |", flush=True)
    from strata.models import DEMO_MODEL

    demo_model = args.demo_model or DEMO_MODEL
    if "demo" in parts:
        rates, acceptance = demo_traces(demo_model, args.threads, args.repeat)
        print(table("demo model's own tasks, batcher", rates, tuple(rates["other text tasks"])[1:]), flush=True)
        for trace, modes in acceptance.items():
            print(f"acceptance, {trace}: " + ", ".join(f"{mode} {rate:.3f}" for mode, rate in modes.items()),
                  flush=True)
    if "overhead" in parts:
        print(overhead_table(overhead_traces(args.threads, args.repeat)), flush=True)
    if "http" in parts:
        print(table("demo model, HTTP API", http_traces(demo_model, args.repeat, args.threads, args.tokens)),
              flush=True)
    if "rollback" in parts:
        size, costs = rollback_costs(args.threads, 10 * args.repeat)
        base_wall, base_cpu = costs["no state kept"]
        print(f"| a step of 1 + 3 tokens, state of {size / 2**20:.1f} MiB | ms | CPU ms |\n|---|---|---|")
        for mode, (wall, cpu) in costs.items():
            print(f"| {mode} | {wall * 1e3:.2f} ({wall / base_wall:.2f}x) | {cpu * 1e3:.2f} ({cpu / base_cpu:.2f}x) |")
    if "demo-http" in parts:
        print("| the demo's 16 requests over HTTP, whole | off: ms | auto (the default): ms |\n|---|---|---|")
        for name, by in demo_http(args.threads, args.repeat).items():
            print(f"| {name} | {by['off'] * 1e3:.1f} | {by['auto'] * 1e3:.1f} ({by['off'] / by['auto']:.2f}x) |")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
