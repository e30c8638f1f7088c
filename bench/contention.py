"""Text latency while a picture encodes on the CPU: the measurement users care about.

    python bench/contention.py [--engine-threads 1] [--encoder-threads 1,2] [--runs 3]

For each encoder thread count: a text request's latency alone; the same request sent while a new picture encodes
on the CPU, once with the encode holding the engine's turn (forced, as servers that serialise encodes with
generation do) and once without (Strata's behaviour for an encoder without a CUDA context); the picture's own
latency; and the time from a client leaving to its running encode stopping (`CANCELLED` received) and to the
encoder's CPU going idle. Each number is the best of `--runs` (the least disturbed by other work on the machine);
every picture is new (no cache hits).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import sys
import time
from contextlib import aclosing

import numpy as np
import trio
from PIL import Image

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from strata.config import config_from_dict
from strata.events import ChatRequest
from strata.modelgen import write_random_model
from strata.modelgen.mmproj import write_random_mmproj
from strata.text.sampling import SamplingParams
from strata.service import open_service
from strata.vision.client import VisionClient

OUT = ROOT / "bench" / "out"
TEXT_TOKENS = 48
ENCODE_HEAD_START = 0.5  # seconds the encode runs before the text request is sent


def picture(seed: int, width: int = 1280, height: int = 800) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def cpu_seconds(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Bench:
    def __init__(self, service, client: VisionClient):
        self.service, self.client = service, client
        self._seed = 1000 * client.threads
        self._runs = 0

    def new_picture(self) -> bytes:
        self._seed += 1
        return picture(self._seed)

    async def text(self) -> float:
        self._runs += 1
        # A new first word each time: no run reuses the previous one's prompt from the KV cache.
        content = f"{self._runs}. Tell me about the sea, in detail."
        request = ChatRequest(messages=[{"role": "user", "content": content}],
                              sampling=SamplingParams(temperature=0.0), max_tokens=TEXT_TOKENS,
                              enable_thinking=False)
        started = time.perf_counter()
        async with aclosing(self.service.chat(request)) as events:
            async for _ in events:
                pass
        return time.perf_counter() - started

    async def picture_alone(self) -> float:
        started = time.perf_counter()
        await self.client.encode(self.new_picture())
        return time.perf_counter() - started

    async def text_during_encode(self, hold_turn: bool) -> float:
        data = self.new_picture()
        async with trio.open_nursery() as nursery:
            async def encode() -> None:
                if hold_turn:
                    async with self.service.turn.hold():
                        await self.client.encode(data)
                else:
                    await self.client.encode(data)

            nursery.start_soon(encode)
            await trio.sleep(ENCODE_HEAD_START)
            latency = await self.text()
            nursery.cancel_scope.cancel()
        return latency

    async def cancel_to_idle(self) -> tuple[float, float]:
        """(ms from the client leaving to CANCELLED, ms until the encoder's CPU time stops growing)."""
        pid = self.client.pid
        with trio.move_on_after(1.0) as scope:
            await self.client.encode(self.new_picture())
        stopped = (trio.current_time() - scope.deadline) * 1000
        left = time.perf_counter()
        last = cpu_seconds(pid)
        tick = 1 / os.sysconf("SC_CLK_TCK")
        idle_at = time.perf_counter()
        while time.perf_counter() - left < 0.5:
            await trio.sleep(tick)
            now = cpu_seconds(pid)
            if now != last:
                last, idle_at = now, time.perf_counter()
        return stopped, (idle_at - left) * 1000 + stopped


async def measure(model: pathlib.Path, mmproj: pathlib.Path, engine_threads: int, encoder_threads: int,
                  runs: int) -> dict[str, float]:
    config = config_from_dict({"model": str(model), "threads": engine_threads, "context": 2048})
    vision = config_from_dict({"vision": {"mmproj": str(mmproj), "threads": encoder_threads}}).vision
    async with open_service(config, log=lambda line: None) as service:
        client = VisionClient(vision, engine_threads=engine_threads, log=lambda line: None)
        await service.nursery.start(client.run)
        bench = Bench(service, client)
        await bench.text()  # warm-up
        await bench.picture_alone()
        rows: dict[str, list[float]] = {k: [] for k in ("text", "text_during", "text_during_turn", "picture",
                                                         "cancel_ms", "idle_ms")}
        for _ in range(runs):
            rows["text"].append(await bench.text())
            rows["text_during"].append(await bench.text_during_encode(hold_turn=False))
            rows["text_during_turn"].append(await bench.text_during_encode(hold_turn=True))
            rows["picture"].append(await bench.picture_alone())
            stopped, idle = await bench.cancel_to_idle()
            rows["cancel_ms"].append(stopped)
            rows["idle_ms"].append(idle)
        service.nursery.cancel_scope.cancel()
    return {key: min(values) for key, values in rows.items()}


def files() -> tuple[pathlib.Path, pathlib.Path]:
    OUT.mkdir(parents=True, exist_ok=True)
    model, mmproj = OUT / "contention-qwen3moe-small-f16.gguf", OUT / "contention-mmproj-small-f16.gguf"
    if not model.exists():
        write_random_model(model, arch="qwen3moe", size="small", dtype="f16", vocab="bytes", seed=0)
    if not mmproj.exists():
        write_random_mmproj(mmproj, 512, "small", seed=0, dtype="f16")
    return model, mmproj


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-threads", type=int, default=1)
    parser.add_argument("--encoder-threads", default="1,2")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    model, mmproj = files()
    results = {}
    for threads in (int(t) for t in args.encoder_threads.split(",")):
        results[threads] = trio.run(measure, model, mmproj, args.engine_threads, threads, args.runs)
    print(f"engine threads {args.engine_threads}, cores {len(os.sched_getaffinity(0))}, "
          f"{TEXT_TOKENS}-token answers, 1280x800 pictures (1000 tokens), best of {args.runs}")
    print("| encoder threads | text alone | text during encode | ratio | text during encode holding the turn "
          "| ratio | picture alone | cancel to CANCELLED | cancel to CPU idle |")
    print("|---|---|---|---|---|---|---|---|---|")
    for threads, r in results.items():
        print(f"| {threads} | {r['text']:.2f} s | {r['text_during']:.2f} s | {r['text_during'] / r['text']:.2f}x "
              f"| {r['text_during_turn']:.2f} s | {r['text_during_turn'] / r['text']:.2f}x | {r['picture']:.2f} s "
              f"| {r['cancel_ms']:.0f} ms | {r['idle_ms']:.0f} ms |")
    (OUT / "contention.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
