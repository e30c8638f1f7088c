"""What the HTTP layer costs: time to first token and decode tokens/s through the server against the same work
done by calling the engine directly.

Both sides run greedy decoding of the same prompts (a fresh prompt each run, so no KV prefix is reused) for a
fixed number of tokens. Direct: what `strata generate` does, the chat template, the tokenizer and
`strata.scheduling.batcher.generate` (the generation loop the server runs too) on an engine of the server's shape, with
the streaming detokeniser; its batcher is kept from run to run, as the server's is. HTTP: a
streamed `/v1/chat/completions` request to a server in this process (hypercorn, trio worker), read by a client in
a process of its own over a plain socket, as a real client would be (one in this process would compete with the
server for the GIL); the first token is the first content chunk, throughput counts the chunks after it. Direct
and HTTP runs alternate, so that a busy machine slows both alike, and each figure is the median over the runs.
CPU per token is this process's (the server's, without the client), and on the HTTP side by thread
(`threadcpu`: the event loop, the engine's threads, the rest). The client keeps its connection from one request
to the next, as the OpenAI and Anthropic SDKs do; a third run of each round opens a new connection, whose first
token is shown too. Goal: under 2 ms more to the first token and under 5% less throughput.

    python bench/serve.py [--model F.gguf ...] [--threads 1 2] [--tokens 64] [--runs 7]

Without --model: `bench/out/qwen3moe-small-q8_0.gguf` when it exists (Qwen's vocabulary), and a generated tiny
qwen3moe with the same vocabulary (its
short decode steps show the per-token cost of the server most).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from strata.config import config_from_dict
from strata.scheduling.batcher import Batcher, generate
from strata.text.prompt import render_chat
from strata.text.sampling import Sampler, SamplingParams
from strata.service import open_service

import threadcpu
from served import served
from stamps import Stamps

SMALL_MODEL = Path(__file__).parent / "out" / "qwen3moe-small-q8_0.gguf"


def messages(run: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"Run {run}: write a long story about a lighthouse keeper."}]


def direct(engine: Any, batcher: Any, tokenizer: Any, run: int, n_tokens: int) -> tuple[float, float, float, int]:
    """(seconds to the first token, decode tokens/s, process CPU seconds per token, tokens) calling the engine
    directly, as `strata generate` does: render, tokenise, then `strata.scheduling.batcher.generate` (the generation loop
    the server runs too) on a batcher kept from run to run, so that its slots keep their prefixes as the
    server's do; each token is detokenised as it comes."""
    cpu = time.process_time()
    start = time.perf_counter()
    ids = tokenizer.encode_prompt(render_chat(tokenizer.chat_template, messages(run)))
    sampler = Sampler(SamplingParams(temperature=0), engine.n_vocab)
    decoder = tokenizer.stream_decoder()
    first, n = start, 0
    for token in generate(engine, ids, sampler, n_tokens, tokenizer.eos_ids, batcher=batcher):
        decoder.push(token)
        n += 1
        if n == 1:
            first = time.perf_counter()
    rate = (n - 1) / (time.perf_counter() - first) if n > 1 else 0.0
    return first - start, rate, (time.process_time() - cpu) / max(n, 1), n


# --- the client process


def stream_once(host: str, port: int, run: int, n_tokens: int, sock: socket.socket | None = None
                ) -> dict[str, float]:
    """One streamed request over a plain socket: seconds to the first content chunk, chunks/s after it, chunks.

    `sock`: a connection kept from an earlier request (as the OpenAI and Anthropic SDKs keep theirs), else a new
    one is opened and closed."""
    body = json.dumps({"messages": messages(run), "max_tokens": n_tokens, "temperature": 0, "stream": True}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    start = time.perf_counter()
    first, chunks, buffer, done = 0.0, 0, b"", False
    connection = sock or socket.create_connection((host, port))
    try:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection.sendall(head + body)
        while not done:
            data = connection.recv(65536)
            if not data:
                if not chunks:  # a kept connection the server closed while it was idle
                    raise ConnectionResetError("the server closed the connection")
                break
            *events, buffer = (buffer + data).split(b"\n\n")
            for event in events:
                done = done or b"data: [DONE]" in event
                # Every token is one chunk: count content and reasoning deltas (a random model may write tags).
                if (b'"delta":{"content":"' in event and b'"delta":{"content":""' not in event
                        or b'"delta":{"reasoning_content":"' in event):
                    chunks += 1
                    if chunks == 1:
                        first = time.perf_counter()
        last = time.perf_counter()
        while not buffer.endswith(b"0\r\n\r\n"):  # the body's last chunk: the connection is ready for the next
            data = connection.recv(65536)
            if not data:
                break
            buffer += data
    finally:
        if sock is None:
            connection.close()
    return {"ttft": first - start, "rate": (chunks - 1) / max(last - first, 1e-9), "chunks": chunks,
            "sent": start, "first": first}


def client_main(host: str, port: int) -> None:
    """Serve `stream_once` over stdin/stdout: one JSON line in (run, tokens, keep), one JSON line out; with
    `keep`, the request goes over the connection kept for such requests."""
    kept = socket.create_connection((host, port))
    for line in sys.stdin:
        order = json.loads(line)
        try:
            result = stream_once(host, port, order["run"], order["tokens"], kept if order["keep"] else None)
        except OSError:  # hypercorn closes a connection idle for keep_alive_timeout (5 s): a slow direct run
            kept.close()
            kept = socket.create_connection((host, port))
            result = stream_once(host, port, order["run"], order["tokens"], kept if order["keep"] else None)
        print(json.dumps(result), flush=True)
    kept.close()


class Client:
    """The client process, driven from a worker thread (its reads block)."""

    def __init__(self, host: str, port: int):
        self._process = subprocess.Popen([sys.executable, __file__, "--client", f"{host}:{port}"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def request(self, run: int, n_tokens: int, keep: bool) -> dict[str, float]:
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(json.dumps({"run": run, "tokens": n_tokens, "keep": keep}) + "\n")
        self._process.stdin.flush()
        return json.loads(self._process.stdout.readline())

    def close(self) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()
        self._process.wait(timeout=10)


async def over_http(client: Client, run: int, n_tokens: int, keep: bool = True,
                    names: threadcpu.Names | None = None) -> tuple[float, float, float, int, dict[str, float]]:
    """(seconds to the first content chunk, chunks/s after it, server CPU seconds per chunk, chunks, the server's
    CPU seconds per chunk by thread role (`threadcpu`)); `keep`: over the client's kept connection, else a new
    one."""
    cpu, threads = time.process_time(), threadcpu.snapshot()
    result = await trio.to_thread.run_sync(client.request, run, n_tokens, keep)
    chunks = max(int(result["chunks"]), 1)
    roles = {role: seconds / chunks for role, seconds in threadcpu.spent(threads, threadcpu.snapshot(), names).items()}
    return result["ttft"], result["rate"], (time.process_time() - cpu) / chunks, chunks, roles


# --- the comparison


async def compare(model: Path, threads: int | None, n_tokens: int, runs: int, warm: bool = False
                  ) -> dict[str, float]:
    from strata.engine_cffi import Engine
    from strata.text.tokenizer import Tokenizer

    config = config_from_dict({"model": str(model), "context": 4096, "threads": threads,
                               "host": "127.0.0.1", "port": 0})
    # The direct side's engine has the server's shape: as many sequences, the same batch.
    engine = Engine.load(model, n_ctx=config.context, threads=threads, n_seq=config.slots, n_batch=config.batch)
    batcher = Batcher(engine, config.step_tokens, config.batch, config.step_slowdown)
    tokenizer = Tokenizer.from_gguf(model)
    direct_runs, http_runs, fresh_runs = [], [], []
    roles: list[dict[str, float]] = []
    async with open_service(config, log=lambda line: None) as service:
        async with served(service) as (host, port):
            client, names = Client(host, port), threadcpu.Names()
            try:
                direct(engine, batcher, tokenizer, -1, 8)  # warm up both
                await over_http(client, -1, 8)
                for run in range(10, 10 + runs):  # two-digit runs: every prompt has as many tokens
                    if warm:  # untimed, so that the timed request does not follow the other side's engine
                        direct(engine, batcher, tokenizer, run + 50, 4)
                    direct_runs.append(direct(engine, batcher, tokenizer, run, n_tokens)[:3])
                    if warm:
                        await over_http(client, run + 50, 4)
                    with names:
                        ttft, rate, cpu, chunks, by_role = await over_http(client, run, n_tokens, names=names)
                    http_runs.append((ttft, rate, cpu))
                    roles.append(by_role)
                    fresh_runs.append((await over_http(client, run + runs, n_tokens, keep=False))[:3])
                    # A model that ends its answer early gives fewer chunks: it still times the same path.
                    if chunks < n_tokens // 2:
                        print(f"note: run {run} streamed only {chunks} tokens")
            finally:
                client.close()
    engine.close()
    medians = {}
    for side, rows in (("direct", direct_runs), ("http", http_runs), ("fresh", fresh_runs)):
        for i, name in enumerate(("ttft_ms", "tokens_per_s", "cpu_ms")):
            scale = 1.0 if name == "tokens_per_s" else 1e3
            medians[f"{side}_{name}"] = statistics.median(row[i] for row in rows) * scale
    for role in threadcpu.ROLES:
        medians[f"http_{role}_ms"] = statistics.median(row[role] for row in roles) * 1e3
    return medians


def report(model: Path, threads: int | None, n_tokens: int, runs: int, m: dict[str, float]) -> None:
    print(f"model {model.name}, threads {threads or 'all'}, {n_tokens} tokens, median of {runs}")
    print(f"{'':<22} {'direct':>10} {'HTTP':>10} {'HTTP cost':>12}")
    ttft = m["http_ttft_ms"] - m["direct_ttft_ms"]
    print(f"{'first token (ms)':<22} {m['direct_ttft_ms']:10.2f} {m['http_ttft_ms']:10.2f} {ttft:+10.2f} ms")
    fresh = m["fresh_ttft_ms"] - m["direct_ttft_ms"]
    print(f"{'  on a new connection':<22} {'':>10} {m['fresh_ttft_ms']:10.2f} {fresh:+10.2f} ms")
    rate = (m["http_tokens_per_s"] / m["direct_tokens_per_s"] - 1) * 100
    print(f"{'decode (tokens/s)':<22} {m['direct_tokens_per_s']:10.1f} {m['http_tokens_per_s']:10.1f} "
          f"{rate:+10.1f} %")
    cpu = m["http_cpu_ms"] - m["direct_cpu_ms"]
    print(f"{'CPU per token (ms)':<22} {m['direct_cpu_ms']:10.2f} {m['http_cpu_ms']:10.2f} {cpu:+10.2f} ms")
    print(f"{'  HTTP, by thread (ms)':<22} " + ", ".join(f"{role} {m[f'http_{role}_ms']:.3f}"
                                                       for role in threadcpu.ROLES), flush=True)


async def stamped(model: Path, threads: int | None, runs: int) -> None:
    """Time stamps along requests of 4 tokens over a kept connection (`stamps.Stamps`): medians, in ms from the
    client's send."""
    config = config_from_dict({"model": str(model), "context": 4096, "threads": threads,
                               "host": "127.0.0.1", "port": 0})
    rows = []
    async with open_service(config, log=lambda line: None) as service, served(service) as (host, port):
        client = Client(host, port)
        try:
            await over_http(client, -1, 8)
            marks = Stamps().install(service)
            try:
                for run in range(10, 10 + runs):
                    marks.reset()
                    result = await trio.to_thread.run_sync(client.request, run, 4, True)
                    rows.append(marks.row(result["sent"], result["first"]))
            finally:
                marks.uninstall()
        finally:
            client.close()
    print(f"model {model.name}, threads {threads or 'all'}: time stamps of a request, ms after the client's send "
          f"(median of {runs}; step: from the mark before)")
    last = 0.0
    for mark in rows[0]:
        at = statistics.median(row[mark] for row in rows if mark in row)
        print(f"  {mark:<22} {at:8.3f} {at - last:+8.3f}")
        last = at


async def main(args: argparse.Namespace) -> None:
    for model in args.model:
        for threads in args.threads:
            if args.stamps:
                await stamped(model, threads, args.runs)
                continue
            medians = await compare(model, threads, args.tokens, args.runs, args.warm)
            report(model, threads, args.tokens, args.runs, medians)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, action="append", help="GGUF model (repeatable)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--warm", action="store_true",
                        help="an untimed request on each side before its timed one (after the other side's)")
    parser.add_argument("--stamps", action="store_true",
                        help="instead: time stamps along a request, from arrival to the first write")
    parser.add_argument("--client", metavar="HOST:PORT", help=argparse.SUPPRESS)  # the client process
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.client:
        client_host, _, client_port = arguments.client.rpartition(":")
        client_main(client_host, int(client_port))
        sys.exit(0)
    with tempfile.TemporaryDirectory() as directory:
        if arguments.model is None:
            from strata.modelgen import write_random_model

            arguments.model = [SMALL_MODEL] if SMALL_MODEL.exists() else []
            arguments.model.append(write_random_model(Path(directory) / "tiny.gguf", arch="qwen3moe", size="tiny",
                                                      dtype="f16", vocab="qwen", seed=0))
        trio.run(main, arguments)
