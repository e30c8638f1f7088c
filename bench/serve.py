"""What the HTTP layer costs: time to first token and decode tokens/s through the server against the same work
done by calling the engine directly.

Both sides run greedy decoding of the same prompts (a fresh prompt each run, so no KV prefix is reused) for a
fixed number of tokens. Direct: tokenizer, `engine.eval` and argmax in a loop. HTTP: a streamed
`/v1/chat/completions` request to a server in this process (hypercorn, trio worker), read from a plain socket;
the first token is the first content chunk, throughput counts the chunks after it. Goal: under 2 ms more to the
first token and under 5% less throughput.

    python bench/serve.py [--model F.gguf] [--tokens 64] [--runs 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import hypercorn
import hypercorn.trio
import numpy as np
import trio

from strata.api import create_app
from strata.config import config_from_dict
from strata.prompt import render_chat
from strata.service import open_service


def messages(run: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"Run {run}: write a long story about a lighthouse keeper."}]


def direct(engine: Any, tokenizer: Any, run: int, n_tokens: int) -> tuple[float, float, float]:
    """(seconds to the first token, decode tokens/s, process CPU seconds per token) calling the engine directly."""
    cpu = time.process_time()
    start = time.perf_counter()
    ids = tokenizer.encode(render_chat(tokenizer.chat_template, messages(run)), special=True)
    engine.keep(0)
    logits = engine.eval(ids)
    token = int(np.argmax(logits))
    first = time.perf_counter()
    decoder = tokenizer.stream_decoder()
    decoder.push(token)
    for _ in range(n_tokens - 1):
        logits = engine.eval([token])
        token = int(np.argmax(logits))
        decoder.push(token)
    return first - start, (n_tokens - 1) / (time.perf_counter() - first), (time.process_time() - cpu) / n_tokens


async def over_http(host: str, port: int, run: int, n_tokens: int) -> tuple[float, float, float, int]:
    """(seconds to the first content chunk, chunks/s after it, process CPU seconds per chunk, chunks) for one
    streamed request; the CPU time counts every thread of this process, the client's included."""
    cpu = time.process_time()
    body = json.dumps({"messages": messages(run), "max_tokens": n_tokens, "temperature": 0, "stream": True}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    start = time.perf_counter()
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        await stream.send_all(head + body)
        first, chunks, buffer = None, 0, b""
        while b"data: [DONE]" not in buffer:
            data = await stream.receive_some()
            if not data:
                break
            buffer += data
            # Every token is one chunk: count content and reasoning deltas (the random model may write tags).
            n = buffer.count(b'"delta":{"content":"') + buffer.count(b'"delta":{"reasoning_content":"')
            n -= buffer.count(b'"delta":{"content":""')
            if n and first is None:
                first = time.perf_counter()
            chunks = n
    last = time.perf_counter()
    return first - start, (chunks - 1) / (last - first), (time.process_time() - cpu) / chunks, chunks


async def main(args: argparse.Namespace) -> None:
    from strata.engine_cffi import Engine
    from strata.tokenizer import Tokenizer

    engine = Engine.load(args.model, n_ctx=4096, threads=args.threads)
    tokenizer = Tokenizer.from_gguf(args.model)
    config = config_from_dict({"model": str(args.model), "context": 4096, "threads": args.threads,
                               "host": "127.0.0.1", "port": 0})
    direct_runs, http_runs = [], []
    async with open_service(config, log=lambda line: None) as service:
        hyper = hypercorn.Config()
        hyper.bind, hyper.accesslog, hyper.errorlog = ["127.0.0.1:0"], None, None
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(partial(hypercorn.trio.serve, create_app(service=service), hyper))
            host, port = binds[0].removeprefix("http://").split(":")
            direct(engine, tokenizer, -1, 4)  # warm up both
            await over_http(host, int(port), -1, 4)
            # Alternate the two, so that a busy machine slows both alike.
            for run in range(args.runs):
                direct_runs.append(direct(engine, tokenizer, run, args.tokens))
                ttft, rate, cpu, chunks = await over_http(host, int(port), run, args.tokens)
                http_runs.append((ttft, rate, cpu))
                # A model that ends its answer early gives fewer chunks: it still times the same path.
                if chunks < args.tokens // 2:
                    print(f"note: run {run} streamed only {chunks} tokens")
            nursery.cancel_scope.cancel()
    engine.close()

    ttft_direct, rate_direct, cpu_direct = (statistics.median(run[i] for run in direct_runs) for i in range(3))
    ttft_http, rate_http, cpu_http = (statistics.median(run[i] for run in http_runs) for i in range(3))
    ttft_direct, ttft_http = ttft_direct * 1e3, ttft_http * 1e3
    print(f"model {args.model.name}, threads {args.threads or 'all'}, {args.tokens} tokens, median of {args.runs}")
    print(f"{'':<22} {'direct':>10} {'HTTP':>10} {'HTTP cost':>12}")
    print(f"{'first token (ms)':<22} {ttft_direct:10.2f} {ttft_http:10.2f} {ttft_http - ttft_direct:+10.2f} ms")
    print(f"{'decode (tokens/s)':<22} {rate_direct:10.1f} {rate_http:10.1f} "
          f"{(rate_http / rate_direct - 1) * 100:+10.1f} %")
    print(f"{'CPU per token (ms)':<22} {cpu_direct * 1e3:10.2f} {cpu_http * 1e3:10.2f} "
          f"{(cpu_http - cpu_direct) * 1e3:+10.2f} ms")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="GGUF model (default: a generated small qwen3moe)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    with tempfile.TemporaryDirectory() as directory:
        if arguments.model is None:
            from strata.modelgen import write_random_model

            arguments.model = write_random_model(Path(directory) / "small.gguf", arch="qwen3moe", size="small",
                                                 dtype="f16", vocab="bytes", seed=0)
        trio.run(main, arguments)
