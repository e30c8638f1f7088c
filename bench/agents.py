"""Agent traffic through HTTP: parallel streams, and a long conversation with side requests between its turns.

- **Parallel streams.** N clients (1, 2, 4, 8) stream greedy answers of `--tokens` tokens at once, each its own
  prompt; the figure is the aggregate generated tokens/s (all streams' chunks over the wall time from the first
  request to the last chunk) and its ratio to one stream. Beside it, when llama-cpp-python is installed,
  llama.cpp's own batched decode of the same file: one `llama_decode` per step with a `llama_batch` holding one
  token of each of N sequences (prompts first, one per sequence), the same token counts, its tokens/s over the
  decode steps, and the ratio Strata / llama.cpp for each N.
- **A long prompt joins.** Three streams run, then a request with a ~3,000-token prompt arrives: the streams'
  inter-token gaps while it is processed (p99) against their steady step (median gap before it came).
- **Agent trace.** A ~3,000-token system prompt, 8 main turns (each the whole conversation so far plus a new
  user message), and after each a side request with another system prompt (a title). Reuse is the main turns'
  `cached_tokens` over their prompt tokens (turns 2-8); the trace time is compared with the same main turns
  without side requests, and with one slot (every side request evicts the conversation).

The server runs in this process (hypercorn, trio worker, `slots` = 8); the client runs in a process of its own
(a client here would compete with the server for the GIL), with one thread per stream.

    python bench/agents.py [--model bench/out/qwen3moe-small-q8_0.gguf] [--threads 2] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from strata.config import config_from_dict
from strata.service import open_service

from served import served

SMALL_MODEL = Path(__file__).parent / "out" / "qwen3moe-small-q8_0.gguf"
STREAMS = (1, 2, 4, 8)
WORDS = ("agent", "tool", "file", "patch", "test", "build", "review", "commit", "branch", "error", "trace", "plan")


def filler(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * i) % len(WORDS)] for i in range(n_words))


# --- the client process


def stream_one(url: str, body: dict[str, Any], out: dict[str, Any]) -> None:
    """One streamed chat request: the time of each content chunk."""
    times: list[float] = []
    start = time.perf_counter()
    with httpx.Client(timeout=600) as client, client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content"' in line and json.loads(line[6:])["choices"][0][
                    "delta"].get("content"):
                times.append(time.perf_counter())
    end = time.perf_counter()
    out.update(start=start, first=times[0] if times else end, end=end, chunks=len(times), times=times)


def stream_body(text: str, tokens: int) -> dict[str, Any]:
    return {"model": "m", "stream": True, "max_tokens": tokens, "temperature": 0,
            "messages": [{"role": "user", "content": text}]}


def parallel(url: str, n: int, tokens: int, run: int) -> dict[str, Any]:
    results: list[dict[str, Any]] = [{} for _ in range(n)]
    bodies = [stream_body(f"run {run} stream {i}: " + filler(20, run * 10 + i), tokens) for i in range(n)]
    threads = [threading.Thread(target=stream_one, args=(url, body, result)) for body, result in zip(bodies, results)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    start, end = min(r["start"] for r in results), max(r["end"] for r in results)
    chunks = sum(r["chunks"] for r in results)
    return {"tokens_per_s": chunks / (end - start), "chunks": chunks,
            "ttft_ms": [1e3 * (r["first"] - r["start"]) for r in results]}


def join(url: str, tokens: int) -> dict[str, Any]:
    """Three streams run; a request with a ~3,000-token prompt joins once they stream. Their inter-token gaps
    while it is processed (p99) against their gaps before it joined (median)."""
    results: list[dict[str, Any]] = [{} for _ in range(3)]
    threads = [threading.Thread(target=stream_one, args=(url, stream_body(f"join stream {i}: " + filler(20, i),
                                                                           tokens), result))
               for i, result in enumerate(results)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # their short prompts are through: they are streaming
    joined = time.perf_counter()
    long = {}
    stream_one(url, stream_body("Read this. " + filler(2800, 5), 1), long)
    for thread in threads:
        thread.join()
    before, during = [], []
    for r in results:
        for a, b in zip(r["times"], r["times"][1:]):
            (before if b < joined else during if a < long["end"] else []).append(b - a)
    before.sort()
    during.sort()
    steady = before[len(before) // 2] if before else float("nan")
    p99 = during[min(len(during) - 1, int(len(during) * 0.99))] if during else float("nan")
    return {"steady_ms": 1e3 * steady, "p99_ms": 1e3 * p99, "join_ms": 1e3 * (long["end"] - joined),
            "gaps_during": len(during)}


def chat(url: str, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    reply = httpx.post(url + "/v1/chat/completions", timeout=600,
                       json={"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    reply.raise_for_status()
    body = reply.json()
    usage = body["usage"]
    return {"seconds": time.perf_counter() - start, "text": body["choices"][0]["message"]["content"] or "",
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def trace(url: str, side_requests: bool, turns: int) -> dict[str, Any]:
    system = "You are a coding agent working in a large repository. " + filler(2800, 1)
    side_system = "You write short titles for conversations."
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    reuse, main_seconds, started = [], 0.0, time.perf_counter()
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Step {turn}: " + filler(40, turn + 2)})
        main = chat(url, messages, 16)
        main_seconds += main["seconds"]
        if turn:
            reuse.append(main["cached_tokens"] / main["prompt_tokens"])
        messages.append({"role": "assistant", "content": main["text"]})
        if side_requests:
            chat(url, [{"role": "system", "content": side_system},
                       {"role": "user", "content": "Title this: " + filler(30, turn)}], 8)
    return {"seconds": time.perf_counter() - started, "main_seconds": main_seconds,
            "reuse": sum(reuse) / len(reuse), "min_reuse": min(reuse), "prompt_tokens": main["prompt_tokens"]}


def client_main(url: str) -> None:
    for line in sys.stdin:
        order = json.loads(line)
        if order["kind"] == "parallel":
            result = parallel(url, order["n"], order["tokens"], order["run"])
        elif order["kind"] == "join":
            result = join(url, order["tokens"])
        else:
            result = trace(url, order["side"], order["turns"])
        print(json.dumps(result), flush=True)


class Client:
    def __init__(self, url: str):
        self._process = subprocess.Popen([sys.executable, __file__, "--client", url], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)

    def ask(self, **order: Any) -> dict[str, Any]:
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(json.dumps(order) + "\n")
        self._process.stdin.flush()
        return json.loads(self._process.stdout.readline())

    def close(self) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()
        self._process.wait(timeout=30)


# --- llama.cpp's batched decode of the same file

_QUIET: Any = None  # llama.cpp's log callback that drops its lines (set on first use)


def llama_cpp_batched(model: Path, threads: int, n_seq: int, tokens: int) -> float | None:
    """Tokens/s of llama.cpp decoding `tokens` tokens in each of `n_seq` sequences, one batch per step (greedy
    is not needed: the cost of a step does not depend on which tokens it holds). None without llama-cpp-python."""
    global _QUIET
    try:
        import llama_cpp
    except ImportError:
        return None
    if _QUIET is None:
        _QUIET = llama_cpp.llama_log_callback(lambda level, text, data: None)
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    llama_cpp.llama_log_set(_QUIET, None)
    lm = llama_cpp.llama_model_load_from_file(str(model).encode(), mparams)
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_seq_max = 512 * n_seq, 512, n_seq
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(lm, cparams)
    batch = llama_cpp.llama_batch_init(512, 0, n_seq)
    prompt = [100 + i for i in range(32)]

    def fill(entries: list[tuple[int, int, int, bool]]) -> None:
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits

    for seq in range(n_seq):  # each sequence's prompt
        fill([(t, p, seq, p == len(prompt) - 1) for p, t in enumerate(prompt)])
        assert llama_cpp.llama_decode(ctx, batch) == 0
    started = 0.0
    for step in range(tokens):  # the first step is a warm-up (it sizes llama.cpp's buffers): not timed
        fill([(1000 + step, len(prompt) + step, seq, True) for seq in range(n_seq)])
        assert llama_cpp.llama_decode(ctx, batch) == 0
        started = started or time.perf_counter()
    rate = n_seq * (tokens - 1) / (time.perf_counter() - started)
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(lm)
    return rate


# --- the run


async def run(model: Path, threads: int, tokens: int, turns: int) -> dict[str, Any]:
    results: dict[str, Any] = {"parallel": {}, "trace": {}}
    for slots in (8, 1):
        config = config_from_dict({"model": str(model), "context": 4096, "threads": threads, "slots": slots,
                                   "host": "127.0.0.1", "port": 0})
        async with open_service(config, log=lambda line: None) as service, served(service) as (host, port):
            client = Client(f"http://{host}:{port}")
            try:
                if slots == 8:
                    await trio.to_thread.run_sync(lambda: client.ask(kind="parallel", n=1, tokens=8, run=-1))
                    for n in STREAMS:
                        results["parallel"][n] = await trio.to_thread.run_sync(
                            lambda n=n: client.ask(kind="parallel", n=n, tokens=tokens, run=n))
                        results["parallel"][n]["llama_cpp"] = llama_cpp_batched(model, threads, n, tokens)
                    results["join"] = await trio.to_thread.run_sync(
                        lambda: client.ask(kind="join", tokens=4 * tokens))
                for side in ((True, False) if slots == 8 else (True,)):
                    results["trace"][(slots, side)] = await trio.to_thread.run_sync(
                        lambda side=side: client.ask(kind="trace", side=side, turns=turns))
                    for slot in service.loop.batcher.slots:  # the next trace starts cold
                        slot.keys = []
            finally:
                client.close()
    return results


def report(model: Path, threads: int, tokens: int, r: dict[str, Any]) -> None:
    print(f"model {model.name}, {threads} threads, {tokens} tokens per stream\n")
    print("| streams | Strata tok/s | ratio to 1 | ttft max ms | llama.cpp batched tok/s | Strata / llama.cpp |")
    print("|---|---|---|---|---|---|")
    one = r["parallel"][1]["tokens_per_s"]
    for n in STREAMS:
        p = r["parallel"][n]
        rate, ll = p["tokens_per_s"], p["llama_cpp"]
        theirs = "- | -" if ll is None else f"{ll:.1f} | {rate / ll:.2f}"
        print(f"| {n} | {rate:.1f} | {rate / one:.2f} | {max(p['ttft_ms']):.0f} | {theirs} |")
    with_side, without, one_slot = r["trace"][(8, True)], r["trace"][(8, False)], r["trace"][(1, True)]
    print(f"\nagent trace: {with_side['prompt_tokens']} prompt tokens at the last main turn")
    print("| run | main-turn reuse (mean / min) | trace s | main turns s |")
    print("|---|---|---|---|")
    for name, t in (("8 slots, side requests", with_side), ("8 slots, main turns only", without),
                    ("1 slot, side requests", one_slot)):
        print(f"| {name} | {t['reuse']:.1%} / {t['min_reuse']:.1%} | {t['seconds']:.2f} | {t['main_seconds']:.2f} |")
    print(f"\nmain turns with side requests / without: {with_side['main_seconds'] / without['main_seconds']:.2f}")
    j = r["join"]
    print(f"\n3 streams while a ~3,000-token prompt joins ({j['join_ms']:.0f} ms to its answer): steady step "
          f"{j['steady_ms']:.1f} ms, p99 gap while it joins {j['p99_ms']:.1f} ms "
          f"({j['p99_ms'] / j['steady_ms']:.2f}x, {j['gaps_during']} gaps)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=SMALL_MODEL)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--client", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        client_main(args.client)
        return
    if not args.model.is_file():
        sys.exit(f"no model at {args.model}: strata make-model --arch qwen3moe --size small --dtype q8_0 "
                 f"--vocab qwen --out {args.model}")
    results = trio.run(run, args.model, args.threads, args.tokens, args.turns)
    report(args.model, args.threads, args.tokens, results)


if __name__ == "__main__":
    main()
