"""What constrained decoding costs: decode speed with and without a JSON-schema guide, the guide's own time per
token beside the decode step, and the time to compile a schema (first time and from the cache).

    python bench/constrained.py [--model F.gguf] [--tokens 128] [--repeats 5] [--threads 2]

Without --model the small Q8_0 qwen3moe model with the 151,936-token Qwen vocabulary is generated in a temporary
directory. Free and constrained runs alternate, `--repeats` times each, and medians are reported: the machine is
shared, so only figures from one run are compared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from strata.constraints import AnswerFormat, Grammars, plan_constraint
from strata.engine_cffi import Engine
from strata.sampling import Sampler, SamplingParams
from strata.tokenizer import Tokenizer

# A long answer: enough constrained tokens to measure (strings are free text inside the grammar).
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 64, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "count": {"type": "integer", "minimum": 0, "maximum": 999},
                                     "kind": {"enum": ["tool", "fruit", "city"]}},
    "required": ["name", "count", "kind"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}


class _Timed:
    """A guide wrapper that adds up the time spent in the guide (mask and advance)."""

    def __init__(self, guide):
        self.guide, self.seconds, self.steps = guide, 0.0, 0

    def apply(self, logits):
        started = time.perf_counter()
        self.guide.apply(logits)
        self.seconds += time.perf_counter() - started
        self.steps += 1

    def advance(self, token):
        started = time.perf_counter()
        self.guide.advance(token)
        self.seconds += time.perf_counter() - started


def decode(engine: Engine, prompt: list[int], n_tokens: int, mask) -> tuple[float, int]:
    """(decode tok/s, tokens) for up to n_tokens sampled at temperature 1 after `prompt`."""
    engine.keep(0)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0), engine.n_vocab, mask=mask)
    logits = engine.eval(prompt)
    ids = list(prompt)
    started = time.perf_counter()
    n = 0
    while n < n_tokens:
        token = sampler.sample(logits, ids)
        ids.append(token)
        n += 1
        logits = engine.eval([token])
    return n / (time.perf_counter() - started), n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from strata.modelgen import write_random_model

            model = str(write_random_model(Path(tmp) / "small.gguf", arch="qwen3moe", size="small", dtype="q8_0",
                                           vocab="qwen", seed=0))
        run(model, args)


def run(model: str, args: argparse.Namespace) -> None:
    tokenizer = Tokenizer.from_gguf(model)
    engine = Engine.load(model, n_ctx=1024, threads=args.threads)
    grammars = Grammars(tokenizer, engine.n_vocab)
    started = time.perf_counter()
    grammars.ll_tokenizer()
    tokenizer_s = time.perf_counter() - started

    def plan(schema):
        return plan_constraint(answer_format=AnswerFormat("json_schema", json.dumps(schema)), tools=[],
                               tool_choice=None, parallel_tool_calls=True, thinking=False, in_reasoning=False,
                               tokens=grammars.tokens)

    compile_first, compile_cached = [], []
    for i in range(args.repeats):
        schema = {**SCHEMA, "title": f"variant {i}"}  # a new text: a cache miss
        started = time.perf_counter()
        grammars.guide(plan(schema))
        compile_first.append(time.perf_counter() - started)
        started = time.perf_counter()
        grammars.guide(plan(schema))
        compile_cached.append(time.perf_counter() - started)

    prompt = tokenizer.encode("<|im_start|>user\nList things.<|im_end|>\n<|im_start|>assistant\n", special=True)
    free, constrained, guide_ms, step_ms = [], [], [], []
    for _ in range(args.repeats):
        rate, _ = decode(engine, prompt, args.tokens, None)
        free.append(rate)
        timed = _Timed(grammars.guide(plan(SCHEMA)))
        rate, _ = decode(engine, prompt, args.tokens, timed)
        constrained.append(rate)
        guide_ms.append(1000 * timed.seconds / timed.steps)
        step_ms.append(1000 / rate)
    f, c = statistics.median(free), statistics.median(constrained)
    g = statistics.median(guide_ms)
    print(f"model {Path(model).name}, vocabulary {tokenizer.n_vocab}, {args.threads} threads, "
          f"{args.tokens} tokens x {args.repeats}")
    print(f"llguidance tokenizer: {tokenizer_s:.2f} s (once per model)")
    print(f"schema compile: first {1000 * statistics.median(compile_first):.2f} ms, "
          f"cached {1000 * statistics.median(compile_cached):.3f} ms")
    print("| decode | tok/s | ms/token | guide ms/token | guide share of a step |")
    print("|---|---|---|---|---|")
    print(f"| free | {f:.1f} | {1000 / f:.2f} | - | - |")
    print(f"| JSON schema | {c:.1f} | {1000 / c:.2f} | {g:.3f} | {100 * g / (1000 / f):.1f}% |")
    print(f"constrained / free: {c / f:.3f}; guide per token p90 over runs {np.percentile(guide_ms, 90):.3f} ms")
    engine.close()


if __name__ == "__main__":
    main()
