"""Agent traffic through HTTP: parallel streams, and a long conversation with side requests between its turns.

- **Parallel streams.** N clients (1, 2, 4, 8) stream answers of `--tokens` tokens at once, each its own prompt,
  greedy unless `--temperature` says otherwise (agents that leave it out get the APIs' default, 1); the figure
  is the aggregate generated tokens/s (all streams' chunks over the wall time from the first request to the last
  chunk) and its ratio to one stream. Beside it, when llama-cpp-python is installed,
  llama.cpp's own batched decode of the same file, in a process of its own: one `llama_decode` per step with a
  `llama_batch` holding one token of each of N sequences (prompts first, one per sequence; each step's tokens
  drawn, different in each sequence, as the streams' are: a MoE step's experts follow its tokens), the same token
  counts and threads, its tokens/s over the decode steps (a better case than ours, which counts prompts, HTTP
  and sampling), run twice: with libgomp's default wait (threads spin at each of ggml's barriers: on a machine
  whose cores other work also uses, a spinning thread burns the time slice its partner needs) and with
  `OMP_WAIT_POLICY=PASSIVE`. The ratio is Strata / the better of the two. The CPU time per token of the
  server's event loop (the trio thread: HTTP, rendering, the hand-off of tokens), the engine's threads
  (`threadcpu`) and the client process show what serving costs beside the engine, on the same cores. Our own
  engine's batched decode of the same steps, and its ratio to one sequence, bound what any serving path can
  reach; the last column is HTTP against it.
- **A long prompt joins.** Three streams run, then a request with a ~3,000-token prompt arrives: the streams'
  inter-token gaps while it is processed (p99, at the client) against their steady step (median gap before it
  came; the median after it was answered is shown too: their step grows with their context meanwhile). The
  streams ask for `logprobs` so that the client knows each chunk's tokens: a chunk whose text waited for a later
  token (a character split across tokens) ends a gap of two steps that is the text's, and is left out. Beside
  it the engine's own step times (p99 / median, from the server, in wall time and in the server process's CPU
  time, which another process taking a core does not stretch), the time from a step's end to the client's read
  of its token (median / p99: trio's wake-up, the writes, the client), the client's worst 1% of gaps split into
  the engine's part (between the two steps' ends) and the rest, and the long prompt's time to its first token
  against the same prompt with nobody else on the engine. Budgets, one after the other and then again: the
  default (`step_slowdown` 1.6, the engine's threads' CPU time, the decode step re-measured every 32 steps),
  `step_slowdown` 2, 1.75 timed by the process's CPU time (every thread of the server), the budget before the
  CPU clocks (2, wall clock, never re-measured), a budget of tokens only (`step_tokens` 64), and
  `step_slowdown` 1.5; `--join-runs N` runs the default alone N times instead.
The server runs in this process (hypercorn, trio worker, `slots` = 8); the client runs in a process of its own
(a client here would compete with the server for the GIL) and reads all its connections in one thread.

    python bench/agents.py [--model bench/out/qwen3moe-small-q8_0.gguf] [--threads 2] [--tokens 64] [--only join]
                           [--join-runs N] [--slowdown S] [--temperature T]
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import os
import random
import selectors
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import trio

from strata.config import config_from_dict
from strata.scheduling.batcher import StepBudget
from strata.service import open_service

import threadcpu
from served import served

SMALL_MODEL = Path(__file__).parent / "out" / "qwen3moe-small-q8_0.gguf"
STREAMS = (1, 2, 4, 8)
DECODE_RUNS = 3  # of each engine's batched decode per number of sequences: the median is reported
HTTP_RUNS = 5  # of each number of HTTP streams, the counts alternated: the median is reported
WORDS = ("agent", "tool", "file", "patch", "test", "build", "review", "commit", "branch", "error", "trace", "plan")


def filler(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * i) % len(WORDS)] for i in range(n_words))


# --- the client process


def stream_body(text: str, tokens: int, logprobs: bool = False, temperature: float = 0.0) -> dict[str, Any]:
    return {"model": "m", "stream": True, "max_tokens": tokens, "temperature": temperature, "logprobs": logprobs,
            "messages": [{"role": "user", "content": text}]}


def parallel(url: str, n: int, tokens: int, run: int, temperature: float = 0.0) -> dict[str, Any]:
    """`n` streams at once, each on its own connection, all read by one thread (`Streams`)."""
    bodies = [stream_body(f"run {run} stream {i}: " + filler(20, run * 10 + i), tokens, temperature=temperature)
              for i in range(n)]
    cpu = time.process_time()
    with Streams(url) as streams:
        results = [streams.send(body) for body in bodies]
        streams.read()
    cpu = time.process_time() - cpu
    start, end = min(r["start"] for r in results), max(r["end"] for r in results)
    chunks = sum(len(r["times"]) for r in results)
    return {"tokens_per_s": chunks / (end - start), "chunks": chunks, "client_cpu_s": cpu,
            "ttft_ms": [1e3 * (r["first"] - r["start"]) for r in results]}


_CONTENT, _EMPTY = b'"delta":{"content":"', b'"delta":{"content":""'
_LOGPROBS = b'"logprobs":{"content":['


def _text_waited(event: bytes) -> bool:
    """Whether a content chunk (with `logprobs`) carries tokens whose text could not be shown before the last one
    came: the bytes of a character split across tokens, which the server holds until the character is whole."""
    data = event[event.index(b"data: {") + 6:]  # after the chunked encoding's size line
    tokens = json.loads(data)["choices"][0]["logprobs"]["content"]
    try:
        b"".join(bytes(token["bytes"]) for token in tokens[:-1]).decode()
    except UnicodeDecodeError:
        return True
    return False


class Streams:
    """Streamed chat requests on plain sockets, read as they come by one thread (`selectors`) that finds content
    chunks in the raw bytes: per stream its start, the time of each content chunk (one per token, but where a
    token's text waits for the next), its first and its end. A thread per stream with an HTTP library and `json.loads` of every chunk cost the client more CPU
    per token than the server's own event loop, on the cores the server needs, and its threads' turns at the
    client's GIL added their own milliseconds to the gaps it measured. Leaving the block hangs up on the streams
    still open."""

    def __init__(self, url: str):
        host, _, port = url.removeprefix("http://").rpartition(":")
        self.address = (host, int(port))
        self.selector = selectors.DefaultSelector()

    def __enter__(self) -> Streams:
        return self

    def __exit__(self, *exc: object) -> None:
        for key in list(self.selector.get_map().values()):
            self.selector.unregister(key.fileobj)
            key.fileobj.close()  # type: ignore[union-attr]
        self.selector.close()

    def send(self, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {self.address[0]}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()
        result: dict[str, Any] = {"start": time.perf_counter(), "first": 0.0, "end": 0.0, "times": [], "waited": []}
        sock = socket.create_connection(self.address)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(head + data)
        self.selector.register(sock, selectors.EVENT_READ, [result, b""])
        return result

    def read(self, until: Callable[[], bool] = lambda: False, seconds: float | None = None) -> None:
        """Read until every stream has ended, `until()` holds or `seconds` have passed."""
        deadline = None if seconds is None else time.perf_counter() + seconds
        while self.selector.get_map() and not until():
            left = None if deadline is None else deadline - time.perf_counter()
            if left is not None and left <= 0:
                return
            for key, _ in self.selector.select(left):
                result, buffer = key.data
                data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                now = time.perf_counter()
                *events, key.data[1] = (buffer + data).split(b"\n\n")
                done = not data
                for event in events:
                    if _CONTENT in event and _EMPTY not in event:
                        result["times"].append(now)
                        result["first"] = result["first"] or now
                        if _LOGPROBS in event:
                            result["waited"].append(_text_waited(event))
                    done = done or b"data: [DONE]" in event
                if done:
                    result["end"] = now
                    result["first"] = result["first"] or now
                    self.selector.unregister(key.fileobj)
                    key.fileobj.close()  # type: ignore[union-attr]


def join(url: str, tokens: int, streams: int, run: int) -> dict[str, Any]:
    """`streams` streams of up to `tokens` tokens run; a request with a ~3,000-token prompt joins once they stream.
    Their inter-token gaps while it is processed (p99) against their gaps before it joined (median), and after
    it was answered (their own step grows with their context meanwhile). Every prompt is new (`run`): no prefix
    is reused. The streams ask for `logprobs`, which name each chunk's tokens: a chunk whose text waited for a
    later token (a character split across tokens: about 1 chunk in 100 of the random model's text) ends a gap
    of two steps that is the text's, not the scheduler's, and is left out (counted in `text_waits`)."""
    with Streams(url) as reader:
        results = [reader.send(stream_body(f"join {run} stream {i}: " + filler(20, i), tokens, logprobs=True))
                   for i in range(streams)]
        reader.read(seconds=1.0 if streams else 0.0)  # their short prompts are through: they are streaming
        joined = time.perf_counter()
        long = reader.send(stream_body(f"Run {run}. Read this. " + filler(2800, 5), 1))
        reader.read(until=lambda: bool(long["end"]))
        reader.read(seconds=0.5 if streams else 0.0)  # the streams' own step after it; then they hang up
        for r in results:
            r["end"] = r["end"] or time.perf_counter()
    before, during, after, waits = [], [], [], 0
    for r in results:
        for (a, b), waited in zip(itertools.pairwise(r["times"]), r["waited"][1:], strict=True):
            if waited:
                waits += joined <= b and a < long["end"]
            elif b < joined:
                before.append(b - a)
            elif a < long["end"]:
                during.append(b - a)
            elif a > long["end"] + 0.02:
                after.append(b - a)
    return {"steady_ms": 1e3 * median(before), "after_ms": 1e3 * median(after),
            "p99_ms": 1e3 * percentile(during, 0.99), "ttft_ms": 1e3 * (long["end"] - joined),
            "gaps_during": len(during), "text_waits": waits, "joined": joined, "answered": long["end"],
            "streams_end": min((r["end"] for r in results), default=long["end"]),
            "times": [r["times"] for r in results]}


def median(values: list[float]) -> float:
    return percentile(values, 0.5)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))] if values else float("nan")


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
            result = parallel(url, order["n"], order["tokens"], order["run"], order.get("temperature", 0.0))
        elif order["kind"] == "join":
            result = join(url, order["tokens"], order["streams"], order["run"])
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


# --- llama.cpp's batched decode of the same file, in a process of its own


def batched_decode(engine: str, model: Path, threads: int, n_seq: int, tokens: int,
                   passive: bool = False) -> dict[str, float] | None:
    """`engine` ("llama.cpp" or "strata") decoding `tokens` tokens in each of `n_seq` sequences in a child
    process (libgomp reads OMP_WAIT_POLICY once, at its start): tokens/s over the timed steps, and the rate its
    median step gives. None for llama.cpp without llama-cpp-python."""
    if engine == "llama.cpp":
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            return None
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    out = subprocess.run([sys.executable, __file__, "--decode", engine, "--model", str(model), "--threads",
                          str(threads), "--tokens", str(tokens), "--n-seq", str(n_seq)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


PROMPT = [100 + i for i in range(32)]


def step_tokens(n_seq: int, tokens: int) -> list[list[int]]:
    """Each step's token of every sequence, the same for both engines: drawn, one per sequence. In a MoE the
    experts a step reads follow its tokens; n copies of one token would read the experts of one token (4 of 16 a
    layer in the small qwen3moe, against ~11 for 4 different tokens) and flatter both engines' batching."""
    draw = random.Random(n_seq)
    return [[draw.randrange(1000, 100_000) for _ in range(n_seq)] for _ in range(tokens)]


def decode_rates(steps: list[float], n_seq: int) -> None:
    steps = steps[1:]  # the first step is a warm-up (it sizes llama.cpp's buffers): not timed
    print(json.dumps({"tokens_per_s": n_seq * len(steps) / sum(steps), "median_rate": n_seq / median(steps)}))


def strata_main(model: Path, threads: int, n_seq: int, tokens: int) -> None:
    """The same steps as `llama_cpp_main` on our engine (`Engine.eval_batch`, the last token's logits of each
    sequence)."""
    from strata.engine_cffi import BatchItem, Engine

    with Engine.load(model, n_ctx=512, threads=threads, n_seq=n_seq) as engine:
        for seq in range(n_seq):
            engine.eval_batch([BatchItem(seq, PROMPT)])
        steps = []
        for row in step_tokens(n_seq, tokens):
            started = time.perf_counter()
            engine.eval_batch([BatchItem(seq, [token]) for seq, token in enumerate(row)])
            steps.append(time.perf_counter() - started)
    decode_rates(steps, n_seq)


def llama_cpp_main(model: Path, threads: int, n_seq: int, tokens: int) -> None:
    """The child: each sequence's 32-token prompt, then `tokens` steps of one token per sequence (`step_tokens`)
    with logits for each (as a sampler needs)."""
    import llama_cpp

    quiet = llama_cpp.llama_log_callback(lambda level, text, data: None)
    llama_cpp.llama_log_set(quiet, None)
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    # ggml's AMX weight layout (an "extra" buffer type) crashes in its matrix product on an AMX Xeon (0.3.36):
    # the weights stay in ggml's CPU layout.
    mparams.use_extra_bufts = False
    lm = llama_cpp.llama_model_load_from_file(str(model).encode(), mparams)
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch, cparams.n_seq_max = 512 * n_seq, 512, 512, n_seq
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(lm, cparams)
    batch = llama_cpp.llama_batch_init(512, 0, n_seq)
    prompt = PROMPT

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    for seq in range(n_seq):
        decode([(t, p, seq, p == len(prompt) - 1) for p, t in enumerate(prompt)])
    steps = []
    for step, row in enumerate(step_tokens(n_seq, tokens)):
        started = time.perf_counter()
        decode([(token, len(prompt) + step, seq, True) for seq, token in enumerate(row)])
        steps.append(time.perf_counter() - started)
    decode_rates(steps, n_seq)
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(lm)


# --- the run


class Steps:
    """The engine's steps, timed in the server: (start, end, tokens, CPU seconds of this process) of each
    `Batcher.step()` with work. The CPU time shows what the budget controls apart from the machine's load: another
    process taking a core stretches a step's wall time, not its work."""

    def __init__(self, batcher: Any):
        self.rows: list[tuple[float, float, int, float]] = []
        step = batcher.step

        def timed() -> Any:
            started, cpu = time.perf_counter(), time.process_time()
            changed = step()
            if batcher.last_batch:
                self.rows.append((started, time.perf_counter(), batcher.last_batch, time.process_time() - cpu))
            return changed

        batcher.step = timed

    def of_join(self, j: dict[str, Any], streams: int) -> dict[str, float]:
        """Median of the decode-only steps before the prompt joined; p99 of the steps with its chunks while the
        streams ran."""
        steady = [end - start for start, end, n, _ in self.rows if end < j["joined"] and n == streams]
        until = min(j["answered"], j["streams_end"])
        during = [end - start for start, end, n, _ in self.rows
                  if j["joined"] <= start and end < until and n > streams]
        cpu_steady = [cpu for _, end, n, cpu in self.rows if end < j["joined"] and n == streams]
        cpu_during = [cpu for start, end, n, cpu in self.rows if j["joined"] <= start and end < until and n > streams]
        ends = sorted(end for _, end, _, _ in self.rows)
        delivery = [t - ends[i - 1] for times in j["times"] for t in times
                    if j["joined"] <= t < until and (i := bisect.bisect_right(ends, t)) > 0]

        def last_end(t: float) -> float:  # of the step whose token the client read at t
            return ends[max(bisect.bisect_right(ends, t) - 1, 0)]

        # the client's worst 1% of gaps: how much is the engine's (between the two steps' ends), how much the
        # difference of the two tokens' ways to the client
        gaps = sorted(((b - a, last_end(b) - last_end(a)) for times in j["times"]
                       for a, b in zip(times, times[1:], strict=False) if b >= j["joined"] and a < j["answered"]),
                      reverse=True)
        gaps = gaps[:len(gaps) - int(0.99 * len(gaps))]  # those at or above the p99 gap (`percentile`)
        return {"engine_steady_ms": 1e3 * median(steady), "engine_p99_ms": 1e3 * percentile(during, 0.99),
                "engine_max_ms": 1e3 * max(during, default=float("nan")),
                "delivery_ms": (1e3 * median(delivery), 1e3 * percentile(delivery, 0.99)),
                "engine_cpu": percentile(cpu_during, 0.99) / median(cpu_steady),
                "worst_gaps_ms": (1e3 * sum(engine for _, engine in gaps) / len(gaps),
                                  1e3 * sum(gap - engine for gap, engine in gaps) / len(gaps))}


async def run(model: Path, threads: int, tokens: int, turns: int, parts: set[str],
              join_runs: int | None = None, slowdown: float | None = None, temperature: float = 0.0
              ) -> dict[str, Any]:
    results: dict[str, Any] = {"parallel": {}, "trace": {}, "join": {}}
    for slots in (8, 1):
        if slots == 1 and "trace" not in parts:
            continue
        config = config_from_dict({"model": str(model), "context": 4096, "threads": threads, "slots": slots,
                                   "host": "127.0.0.1", "port": 0}
                                  | ({} if slowdown is None else {"step_slowdown": slowdown}))
        async with open_service(config, log=lambda line: None) as service, served(service) as (host, port):
            client = Client(f"http://{host}:{port}")
            ask = lambda **order: trio.to_thread.run_sync(lambda: client.ask(**order))  # noqa: E731
            try:
                if slots == 8:
                    await ask(kind="parallel", n=1, tokens=8, run=-1)
                for round_ in range(HTTP_RUNS) if slots == 8 and "parallel" in parts else ():
                    for n in STREAMS:  # the counts alternated, so that a change of load hits each alike
                        cpu_before, names = threadcpu.snapshot(), threadcpu.Names()
                        with names:
                            p = await ask(kind="parallel", n=n, tokens=tokens, run=100 * round_ + n,
                                          temperature=temperature)
                        p["cpu_s"] = threadcpu.spent(cpu_before, threadcpu.snapshot(), names)
                        results["parallel"].setdefault(n, {"http": []})["http"].append(p)
                for n in STREAMS if slots == 8 and "parallel" in parts else ():
                    decodes = results["parallel"][n]["decode"] = {}
                    for _ in range(DECODE_RUNS):  # alternated, so that a change of load hits each alike
                        for name in ("strata", "spin", "passive"):
                            rate = await trio.to_thread.run_sync(
                                lambda name=name, n=n: batched_decode("strata" if name == "strata" else "llama.cpp",
                                                                      model, threads, n, tokens, name == "passive"))
                            decodes.setdefault(name, []).append(rate)
                if slots == 8 and "join" in parts:
                    batcher = service.loop.batcher
                    steps, budget = Steps(batcher), batcher.budget
                    results["join"]["alone"] = await ask(kind="join", tokens=0, streams=0, run=0)
                    before = lambda: StepBudget(2.0, time.perf_counter, refresh=None)  # noqa: E731
                    default = f"default (slowdown {budget.slowdown:g})" if budget is not None else "default"
                    clock = budget.clock if budget is not None else time.process_time  # the engine's threads'
                    budgets = {default: budget, "slowdown 2": StepBudget(2.0, clock),
                               "slowdown 1.75, the process's CPU time": StepBudget(1.75),
                               "slowdown 2, wall clock, never re-measured (older)": before(),
                               "tokens only (step_tokens 64)": None, "slowdown 1.5": StepBudget(1.5, clock),
                               f"{default} again": budget, "slowdown 2 again": StepBudget(2.0, clock)}
                    if join_runs:  # the default alone, again and again: its spread from run to run
                        budgets = {f"default, run {i}": budget for i in range(1, join_runs + 1)}
                    for run_, (name, batcher.budget) in enumerate(budgets.items(), 1):
                        # the streams outlast the long prompt (they hang up once it is answered)
                        j = results["join"][name] = await ask(kind="join", tokens=3000, streams=3, run=run_)
                        j.update(steps.of_join(j, 3))
                    batcher.budget = budget
                    if os.environ.get("AGENTS_STEPS"):
                        Path(os.environ["AGENTS_STEPS"]).write_text(json.dumps(
                            {"steps": steps.rows, "join": {k: {x: v[x] for x in ("joined", "answered", "times")}
                                                           for k, v in results["join"].items()}}))
                for side in ((True, False) if slots == 8 else (True,)) if "trace" in parts else ():
                    results["trace"][(slots, side)] = await ask(kind="trace", side=side, turns=turns)
                    for slot in service.loop.batcher.slots:  # the next trace starts cold
                        slot.keys = []
            finally:
                client.close()
    return results


def report(model: Path, threads: int, tokens: int, r: dict[str, Any]) -> None:
    print(f"model {model.name}, {threads} threads, {tokens} tokens per stream, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end\n")
    if r["parallel"]:
        print("| streams | Strata tok/s (HTTP) | ratio to 1 | ttft max ms | CPU ms/token: server loop | "
              "engine threads | client | "
              "batched decode tok/s: Strata engine | its ratio to 1 | llama.cpp (spin wait) | "
              "llama.cpp (passive wait) | Strata HTTP / llama.cpp | Strata engine / llama.cpp | Strata HTTP / engine |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        one = median([h["tokens_per_s"] for h in r["parallel"][1]["http"]])
        engine_one = median([x["tokens_per_s"] for x in r["parallel"][1]["decode"]["strata"]])
        for n in STREAMS:
            runs, d = r["parallel"][n]["http"], r["parallel"][n]["decode"]
            rate = median([h["tokens_per_s"] for h in runs])
            chunks = sum(h["chunks"] for h in runs)
            ours = median([x["tokens_per_s"] for x in d["strata"]])
            if None in d["spin"]:
                theirs = f"{ours:.1f} | {ours / engine_one:.2f} | - | - | - | -"
            else:
                spin, passive = (median([x["tokens_per_s"] for x in d[k]]) for k in ("spin", "passive"))
                best = max(spin, passive)
                theirs = (f"{ours:.1f} | {ours / engine_one:.2f} | {spin:.1f} | {passive:.1f} | {rate / best:.2f} | "
                          f"{ours / best:.2f}")
            spent = [sum(h["cpu_s"][part] for h in runs) for part in ("loop", "engine")]
            spent.append(sum(h["client_cpu_s"] for h in runs))
            cpu = " | ".join(f"{1e3 * seconds / chunks:.3f}" for seconds in spent)
            ttft = max(max(h["ttft_ms"]) for h in runs)
            print(f"| {n} | {rate:.1f} | {rate / one:.2f} | {ttft:.0f} | {cpu} | {theirs} | {rate / ours:.2f} |")
        print(f"\nHTTP: median of {HTTP_RUNS} runs of each count, alternated; batched decode: median of "
              f"{DECODE_RUNS} runs each, alternated; llama.cpp is the better of its two waits")
    if r["trace"]:
        with_side, without, one_slot = r["trace"][(8, True)], r["trace"][(8, False)], r["trace"][(1, True)]
        print(f"\nagent trace: {with_side['prompt_tokens']} prompt tokens at the last main turn")
        print("| run | main-turn reuse (mean / min) | trace s | main turns s |")
        print("|---|---|---|---|")
        for name, t in (("8 slots, side requests", with_side), ("8 slots, main turns only", without),
                        ("1 slot, side requests", one_slot)):
            print(f"| {name} | {t['reuse']:.1%} / {t['min_reuse']:.1%} | {t['seconds']:.2f} | "
                  f"{t['main_seconds']:.2f} |")
        print(f"\nmain turns with side requests / without: "
              f"{with_side['main_seconds'] / without['main_seconds']:.2f}")
    if r["join"]:
        alone = r["join"]["alone"]["ttft_ms"]
        print(f"\n3 streams while a ~3,000-token prompt joins (its first token alone: {alone:.0f} ms)")
        print("| step budget | steady step ms (before / after) | p99 gap ms | p99 / steady | "
              "gaps (text waits left out) | engine: steady step ms | p99 step ms | max step ms | p99 / steady | "
              "in CPU time | "
              "step end to client read ms (median / p99) | worst 1% of gaps: engine / way to the client ms | "
              "joining prompt's first token ms | / alone |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for name, j in r["join"].items():
            if name == "alone":
                continue
            print(f"| {name} | {j['steady_ms']:.1f} / {j['after_ms']:.1f} | {j['p99_ms']:.1f} | "
                  f"{j['p99_ms'] / j['steady_ms']:.2f} | {j['gaps_during']} ({j['text_waits']}) | "
                  f"{j['engine_steady_ms']:.1f} | {j['engine_p99_ms']:.1f} | {j['engine_max_ms']:.1f} | "
                  f"{j['engine_p99_ms'] / j['engine_steady_ms']:.2f} | {j['engine_cpu']:.2f} | "
                  f"{j['delivery_ms'][0]:.1f} / {j['delivery_ms'][1]:.1f} | "
                  f"{j['worst_gaps_ms'][0]:.1f} / {j['worst_gaps_ms'][1]:+.1f} | {j['ttft_ms']:.0f} | "
                  f"{j['ttft_ms'] / alone:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=SMALL_MODEL)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--only", nargs="+", choices=("parallel", "join", "trace"),
                        default=["parallel", "join", "trace"], help="parts to run (default: all)")
    parser.add_argument("--join-runs", type=int, metavar="N",
                        help="run only the default step budget in the join part, N times")
    parser.add_argument("--slowdown", type=float, help="the server's step_slowdown (default: the config's)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="the parallel streams' temperature (default 0: greedy; 1 is the APIs' default)")
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--decode", choices=("llama.cpp", "strata"), help=argparse.SUPPRESS)
    parser.add_argument("--n-seq", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        client_main(args.client)
        return
    if args.decode:
        (llama_cpp_main if args.decode == "llama.cpp" else strata_main)(args.model, args.threads, args.n_seq,
                                                                         args.tokens)
        return
    if not args.model.is_file():
        sys.exit(f"no model at {args.model}: strata make-model --arch qwen3moe --size small --dtype q8_0 "
                 f"--vocab qwen --out {args.model}")
    results = trio.run(run, args.model, args.threads, args.tokens, args.turns, set(args.only), args.join_runs,
                       args.slowdown, args.temperature)
    report(args.model, args.threads, args.tokens, results)


if __name__ == "__main__":
    main()
