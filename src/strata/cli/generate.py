"""`strata generate`: stream a completion of one prompt to stdout, then its speed to stderr."""

from __future__ import annotations

import argparse
import sys
import time

from strata.text.sampling import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = SamplingParams()
    parser.add_argument("--model", default=None, help="GGUF model file (default: the shipped demo model)")
    parser.add_argument("--hf", metavar="REPO[:QUANT]", default=None,
                        help="download the model from Hugging Face into its cache (instead of --model)")
    parser.add_argument("--prompt", required=True, help="the prompt text (special-token text becomes its token)")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message through the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    parser.add_argument("--temperature", type=float, default=defaults.temperature,
                        help=f"0 is greedy (default {defaults.temperature:g})")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh one)")
    parser.add_argument("--threads", type=int, default=None, help="engine threads (default: all cores)")
    parser.add_argument("--context", type=int, default=4096, help="context length in tokens (default 4096)")
    parser.add_argument("--record-routing", metavar="FILE", default=None,
                        help="write each MoE layer's chosen experts per token of every step to FILE (a routing trace)")


def run(args: argparse.Namespace) -> int:
    from strata.engine_cffi import Engine, EngineError
    from strata.model_file import check_model_file
    from strata.models import DEMO_MODEL
    from strata.scheduling.batcher import generate
    from strata.text.prompt import PromptError, render_chat
    from strata.text.sampling import Sampler
    from strata.text.tokenizer import Tokenizer

    try:
        model = _hub_model(args.hf) if args.hf else args.model or str(DEMO_MODEL)
        params = SamplingParams(temperature=args.temperature, seed=args.seed)
        check_model_file(model)  # one line for a wrong path, as `strata serve` prints it (a ValueError)
        tokenizer = Tokenizer.from_gguf(model)
        text = args.prompt
        if args.chat:
            if tokenizer.chat_template is None:
                raise PromptError("the model has no chat template (tokenizer.chat_template)")
            text = render_chat(tokenizer.chat_template, [{"role": "user", "content": args.prompt}])
        prompt_ids = tokenizer.encode_prompt(text)
        engine = Engine.load(model, n_ctx=args.context, threads=args.threads, record_routing=args.record_routing)
    except (ValueError, OSError, EngineError) as exc:
        print(f"strata generate: error: {exc}", file=sys.stderr)
        return 1
    try:
        sampler = Sampler(params, engine.n_vocab)
        tokens = generate(engine, prompt_ids, sampler, args.max_tokens, tokenizer.eos_ids)
        _stream(tokens, tokenizer, len(prompt_ids))
    except EngineError as exc:
        print(f"\nstrata generate: {exc}", file=sys.stderr)
        return 1
    finally:
        engine.close()
    return 0


def _hub_model(name: str) -> str:
    """The path of the model `--hf` names, downloaded with progress lines on stderr (or found in the cache)."""
    from functools import partial

    import trio

    from strata.config import Config, VisionConfig
    from strata.models.hub import PREFIX
    from strata.models.resolve import resolve_config

    config = Config(model=PREFIX + name.removeprefix(PREFIX), vision=VisionConfig(hf_mmproj="none"))
    resolved = trio.run(partial(resolve_config, config, lambda line: print(line, file=sys.stderr, flush=True)))
    return resolved.model or ""


def _stream(tokens, tokenizer, n_prompt: int) -> None:
    """Print the text of `tokens` as it arrives, then one line of timings on stderr."""
    decoder = tokenizer.stream_decoder()
    started = time.perf_counter()
    first = None
    n_out = 0
    for token in tokens:
        if first is None:
            first = time.perf_counter()
        n_out += 1
        print(decoder.push(token), end="", flush=True)
    print(decoder.flush(), flush=True)
    print(_timings(n_prompt, n_out, started, first, time.perf_counter()), file=sys.stderr)


def _timings(n_prompt: int, n_out: int, started: float, first: float | None, ended: float) -> str:
    """The speed line. The prompt time runs to the first token; each later token costs one decode step."""
    prompt_s = (first or ended) - started
    decode_s = ended - (first or ended)
    line = f"prompt: {n_prompt} tokens in {prompt_s * 1e3:.0f} ms ({n_prompt / max(prompt_s, 1e-9):.1f} tok/s)"
    if n_out > 1:
        line += f", decode: {n_out - 1} tokens in {decode_s * 1e3:.0f} ms ({(n_out - 1) / decode_s:.1f} tok/s)"
    return line
