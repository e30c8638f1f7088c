"""What constrained decoding costs: decode speed with and without a JSON-schema guide, the guide's own time per
token on the decode path, and the time to compile a schema (first time and from the cache).

    python bench/constrained.py [--model F.gguf] [--tokens 128] [--repeats 5] [--threads 2]

Without --model the small Q8_0 qwen3moe model with the 151,936-token Qwen vocabulary is generated in a temporary
directory. Three guides are compared with free decoding, in turns, `--repeats` times each, and medians are
reported (the machine is shared, so only figures from one run are compared):

- "before": the mask computed on the decode path before each token and written through a boolean copy over
  the whole vocabulary, the sampler's pipeline on the whole vocabulary (the guide before these changes);
- "on the path": the guide with `overlap` off: the mask computed after each token, written by index, the
  sampler drawing among the allowed ids when they are few;
- "overlapped": the server's guide: the same with the next mask computed in a pool thread while the engine
  computes the logits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from strata.text.constraints import AnswerFormat, Grammars, plan_constraint
from strata.text.families import family_of
from strata.engine_cffi import Engine
from strata.text.sampling import Sampler, SamplingParams
from strata.text.tokenizer import Tokenizer

# A long answer: enough constrained tokens to measure (strings are free text inside the grammar).
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 64, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "count": {"type": "integer", "minimum": 0, "maximum": 999},
                                     "kind": {"enum": ["tool", "fruit", "city"]}},
    "required": ["name", "count", "kind"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}


class _Before:
    """The JSON answer's mask as the guide made it before: the matcher's bitmask unpacked and copied over the
    logits before each token, the token consumed after; `apply` names no ids, so the sampler's pipeline runs on
    the whole vocabulary."""

    def __init__(self, matcher, n_vocab: int):
        import llguidance.numpy

        self.matcher, self.n_vocab = matcher, n_vocab
        self.bits = llguidance.numpy.allocate_token_bitmask(1, n_vocab)

    def apply(self, logits):
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask(self.matcher, self.bits, 0)
        banned = np.unpackbits(~self.bits.view(np.uint8), bitorder="little", count=self.n_vocab).view(bool)
        np.copyto(logits, -np.inf, where=banned)

    def advance(self, token):
        self.matcher.consume_token(token)


class _Timed:
    """A guide wrapper that adds up the time spent in the guide (mask and advance)."""

    def __init__(self, guide):
        self.guide, self.seconds, self.steps = guide, 0.0, 0

    def apply(self, logits):
        started = time.perf_counter()
        among = self.guide.apply(logits)
        self.seconds += time.perf_counter() - started
        self.steps += 1
        return among

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
    grammars = Grammars(tokenizer, family_of(tokenizer), engine.n_vocab)
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
    on_path = Grammars(tokenizer, family_of(tokenizer), engine.n_vocab, overlap=False)
    on_path.ll_tokenizer()
    kinds = {"before": lambda: _Before(grammars._matcher(plan(SCHEMA).answer, "bench"), engine.n_vocab),
             "on the path": lambda: on_path.guide(plan(SCHEMA)),
             "overlapped": lambda: grammars.guide(plan(SCHEMA))}
    free = []
    rates: dict[str, list[float]] = {kind: [] for kind in kinds}
    guide_ms: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(args.repeats):
        free.append(decode(engine, prompt, args.tokens, None)[0])
        for kind, make in kinds.items():
            timed = _Timed(make())
            rate, _ = decode(engine, prompt, args.tokens, timed)
            rates[kind].append(rate)
            guide_ms[kind].append(1000 * timed.seconds / timed.steps)
    f = statistics.median(free)
    print(f"model {Path(model).name}, vocabulary {tokenizer.n_vocab}, {args.threads} threads, "
          f"{args.tokens} tokens x {args.repeats}")
    print(f"llguidance tokenizer: {tokenizer_s:.2f} s (once per model)")
    print(f"schema compile: first {1000 * statistics.median(compile_first):.2f} ms, "
          f"cached {1000 * statistics.median(compile_cached):.3f} ms")
    print("| decode | tok/s | ms/token | vs free | guide ms/token on the decode path | guide share of a step |")
    print("|---|---|---|---|---|---|")
    print(f"| free | {f:.1f} | {1000 / f:.2f} | 1.000 | - | - |")
    for kind in kinds:
        c, g = statistics.median(rates[kind]), statistics.median(guide_ms[kind])
        print(f"| JSON schema, {kind} | {c:.1f} | {1000 / c:.2f} | {c / f:.3f} | {g:.3f} | "
              f"{100 * g / (1000 / f):.1f}% |")
    engine.close()


if __name__ == "__main__":
    main()
