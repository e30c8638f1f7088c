"""How fast a hang-up frees the engine, in each phase of a request.

A client hangs up while its request is queued, during prompt processing of a long prompt (a new one each time,
between 30% and 60% of its time alone), or while decoding;
the script measures (1) how long until the server has released the request (it left the queue, or the engine
aborted and the turn was released: the request's history row is written) and (2) for the engine phases, how long
until the next queued request's first token arrives, minus that request's own time to first token on an idle
engine. Then the same with 8 concurrent clients hanging up at random moments. Goal: under 50 ms everywhere.

    python bench/cancel.py [--model F.gguf] [--repeats 10] [--threads 2]

Without --model a tiny random qwen3moe model is generated in a temporary directory. The server runs in this
process (hypercorn, trio worker) and clients are plain sockets, so a hang-up is a closed TCP connection.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from strata.config import config_from_dict
from strata.service import Service, open_service

from served import served

LONG_PROMPT = " ".join(str(i) for i in range(700))  # about 2,700 tokens with a byte-level vocabulary, 2,500 with Qwen's


class Client:
    """A raw HTTP client: one request per connection, so that closing it is a hang-up."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port

    async def open(self, payload: dict[str, Any]) -> trio.SocketStream:
        data = json.dumps(payload).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        stream = await trio.open_tcp_stream(self.host, self.port)
        await stream.send_all(head + data)
        return stream

    async def first_token(self, payload: dict[str, Any]) -> float:
        """Send a streamed request; return the time.perf_counter() at which its first content chunk arrived."""
        stream = await self.open({**payload, "stream": True})
        async with stream:
            received = b""
            while b'"content":"' not in received.replace(b'"content":""', b""):
                chunk = await stream.receive_some()
                if not chunk:
                    raise RuntimeError(f"connection closed early: {received[-300:]!r}")
                received += chunk
            return time.perf_counter()


def request(text: str, max_tokens: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0}


async def until(predicate: Any, timeout: float = 30) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.0005)


async def released_after(service: Service, hung_up_wall: float, n_rows: int) -> float | None:
    """Seconds from a hang-up (time.time()) until the request's history row was written; None when the first
    row written since is not a cancellation (the model ended that answer before the hang-up)."""
    await until(lambda: service.history.totals.requests > n_rows)
    row = list(service.history.rows)[n_rows - service.history.totals.requests]
    return row.start + row.duration - hung_up_wall if row.finish == "cancel" else None


class Marks:
    """Where a release's time goes: hang-up -> the batcher told (`cancel`) -> the job out of its slot."""

    def __init__(self, service: Service):
        batcher = service.loop.batcher
        self.told: dict[Any, float] = {}
        self.left: dict[Any, float] = {}
        self.hung_up: list[tuple[float, float]] = []  # (hang-up, batcher told), time.time()
        cancel, leave = batcher.cancel, batcher._leave

        def told(job: Any) -> None:
            self.told.setdefault(job, time.time())
            if HANG_UPS and len(self.hung_up) < len(HANG_UPS):
                self.hung_up.append((HANG_UPS[-1], self.told[job]))
            cancel(job)

        def left(job: Any, finish: str) -> None:
            leave(job, finish)
            if finish == "cancel":
                self.left[job] = time.time()

        batcher.cancel, batcher._leave = told, left

    def split(self) -> str:
        """Median ms from the batcher being told to the job leaving its slot, since the last call."""
        spans = [1e3 * (self.left[job] - t) for job, t in self.told.items() if job in self.left]
        before = [1e3 * (told - hung_up) for hung_up, told in self.hung_up]
        self.told.clear()
        self.left.clear()
        self.hung_up.clear()
        HANG_UPS.clear()
        out = f"hang-up -> told {statistics.median(before):.1f} (max {max(before):.1f})" if before else ""
        return out + (f", told -> left {statistics.median(spans):.1f} (max {max(spans):.1f})" if spans else "")


HANG_UPS: list[float] = []  # time.time() of each measured hang-up


def states(service: Service) -> list[str]:
    return [slot["state"] for slot in service.slots()]


async def one_hang_up(service: Service, client: Client, phase: str, idle_ttft: float, long_ttft: float,
                      rng: random.Random) -> tuple[float | None, float | None]:
    """One measurement with every slot taken: the other slots decode, the first request is on the last slot
    (processing a long prompt, or decoding) and a next one waits in the queue; (release seconds, the next
    request's extra wait in seconds) when the first (or, for `queued`, the waiting one) hangs up; None for what
    was not measured (the model stopped on its own before the hang-up)."""
    await until(lambda: not service.turn.busy and service.turn.queued == 0)
    n_slots = len(service.slots())
    others = [await client.open({**request(f"other {i} {rng.random()}", 4000), "stream": True})
              for i in range(n_slots - 1)]
    await until(lambda: states(service).count("decode") == n_slots - 1)
    # A long prompt of its own each time (no cached prefix), hung up on between 30% and 60% of its time alone.
    first_text = f"{rng.random()} {LONG_PROMPT}" if phase == "prompt" else f"busy {rng.random()}"
    first = await client.open({**request(first_text, 4000 if phase != "prompt" else 1), "stream": True})
    await until(lambda: states(service).count("prompt" if phase == "prompt" else "decode")
                == (1 if phase == "prompt" else n_slots))
    result: dict[str, float] = {}
    try:
        async with trio.open_nursery() as nursery:
            if phase == "queued":
                victim = await client.open({**request(f"victim {rng.random()}", 4), "stream": True})
                await until(lambda: service.turn.queued == 1)
                await trio.sleep(rng.uniform(0, 0.01))
                n_rows = service.history.totals.requests
                hung_up = time.time()
                HANG_UPS.append(hung_up)
                await victim.aclose()
                release = await released_after(service, hung_up, n_rows)
                await first.aclose()
                return release, None

            async def next_request() -> None:
                result["next"] = await client.first_token(request(f"next {rng.random()}", 1))

            nursery.start_soon(next_request)
            await until(lambda: service.turn.queued == 1)
            # the middle of the long prompt, or between two tokens
            await trio.sleep(rng.uniform(0.3, 0.6) * long_ttft if phase == "prompt" else rng.uniform(0.005, 0.02))
            if states(service).count("prompt" if phase == "prompt" else "decode") != (
                    1 if phase == "prompt" else n_slots):  # a request ended on its own (a stop token): not measured
                await first.aclose()
                nursery.cancel_scope.cancel()
                return None, None
            n_rows = service.history.totals.requests
            hung_up_wall, hung_up = time.time(), time.perf_counter()
            HANG_UPS.append(hung_up_wall)
            await first.aclose()
            release = await released_after(service, hung_up_wall, n_rows)
    finally:
        for other in others:
            await other.aclose()
    if release is None:
        return None, None
    return release, result["next"] - hung_up - idle_ttft


async def idle_first_token(service: Service, client: Client, text: str = "next", runs: int = 5) -> float:
    """The median time to the first token of a prompt `text` (made unique) on an idle engine."""
    times = []
    for i in range(runs):
        await until(lambda: not service.turn.busy)
        start = time.perf_counter()
        times.append(await client.first_token(request(f"{random.random()} {text}", 1)) - start)
    return statistics.median(times)


async def random_storm(service: Service, client: Client, rng: random.Random, n_clients: int = 8) -> list[float]:
    """n_clients stream at once and hang up at random moments; the release time of each cancelled one."""
    releases: list[float] = []

    async def one(i: int) -> None:
        stream = await client.open({**request(f"storm {i} {rng.random()}" + "y" * rng.randrange(0, 800), 300),
                                    "stream": True})
        await trio.sleep(rng.uniform(0.0, 1.0))
        hung_up = time.time()
        await stream.aclose()
        record_count[i] = hung_up

    record_count: dict[int, float] = {}
    before = service.history.totals.requests
    async with trio.open_nursery() as nursery:
        for i in range(n_clients):
            nursery.start_soon(one, i)
    await until(lambda: service.history.totals.requests >= before + n_clients)
    # Rows carry no client identity: each cancelled row is paired with the latest hang-up before its end, which
    # can only overstate the release time.
    rows = list(service.history.rows)[-n_clients:]
    hang_ups = sorted(record_count.values())
    for row in rows:
        if row.finish != "cancel":
            continue
        end = row.start + row.duration
        earlier = [t for t in hang_ups if t <= end]
        if earlier:
            releases.append(end - earlier[-1])
    return releases


def summary(values: list[float]) -> str:
    if not values:
        return "      -         -"
    ms = [v * 1e3 for v in values]
    return f"{statistics.median(ms):7.1f} {max(ms):9.1f}"


async def main(args: argparse.Namespace) -> None:
    config = config_from_dict({"model": str(args.model), "context": 4096, "threads": args.threads,
                               "slots": args.slots, "host": "127.0.0.1", "port": 0})
    rng = random.Random(args.seed)
    async with open_service(config, log=lambda line: None) as service:
        async with served(service) as (host, port):
            client = Client(host, port)
            marks = Marks(service)
            idle_ttft = await idle_first_token(service, client)
            long_ttft = await idle_first_token(service, client, LONG_PROMPT, runs=1)
            print(f"model {args.model.name}, threads {service.engine.threads}, slots {args.slots}; idle time to "
                  f"first token {idle_ttft * 1e3:.1f} ms (the long prompt's {long_ttft * 1e3:.0f} ms); "
                  f"{args.repeats} repeats; load average "
                  f"{os.getloadavg()[0]:.1f}")
            print(f"{'phase':<22} {'release ms (median, max)':>26} {'next request extra wait ms':>30}")
            for phase in ("queued", "prompt", "decode"):
                releases, waits = [], []
                while len(releases) < args.repeats:
                    release, wait = await one_hang_up(service, client, phase, idle_ttft, long_ttft, rng)
                    if release is not None:
                        releases.append(release)
                    if wait is not None:
                        waits.append(wait)
                print(f"{phase:<22} {summary(releases):>26} {summary(waits):>30}   {marks.split()}")
            storm: list[float] = []
            for _ in range(max(1, args.repeats // 3)):
                storm += await random_storm(service, client, rng)
            print(f"{'8 clients, random':<22} {summary(storm):>26} {'-':>30}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="GGUF model (default: a generated tiny qwen3moe)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--slots", type=int, default=4, help="the other slots decode while one is measured")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    with tempfile.TemporaryDirectory() as directory:
        if arguments.model is None:
            from strata.modelgen import write_random_model

            arguments.model = write_random_model(Path(directory) / "tiny.gguf", arch="qwen3moe", size="tiny",
                                                 dtype="f32", vocab="bytes", seed=0)
        trio.run(main, arguments)
