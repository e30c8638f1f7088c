"""Several models behind one server (issue 34), over HTTP on an in-process server:

- **switch**: the time to a first token of a request to the model that is not loaded, under a `models_memory`
  that holds one model (the other unloaded, this one loaded, its prompt, its first token), against the same
  request to the model already loaded;
- **steps**: two models decoding at once, one stream each, each model's engine on its own threads (what the server
  does) or their engine calls serialised by one lock, against one stream alone: the tokens a second the cores
  give in each arrangement, and the process's CPU time a token (what spinning on contended cores would waste);
- **download**: a model file from the local hub server (`tests/hub_server.py`, in a process of its own) through
  `huggingface_hub` (what `--hf` runs, `strata.models.hub.fetch`: the listing, the file's metadata, the transfer
  into the cache), against `curl` of the same URL; after one untimed fetch (the client's imports and session).

The two models are the generated `qwen3moe` of `--size` in Q8_0 with Qwen's vocabulary, from two seeds, written to
`bench/out/` on first use.

Usage: python bench/models.py [--size small] [--threads 2] [--rounds 5] [--tokens 64] [--download-mb N]
                              [--only switch,steps,download]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import trio
from served import served

from strata.config import Config, config_from_dict
from strata.model_set import footprint
from strata.service import open_service

OUT = Path(__file__).parent / "out"
PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]


def model_files(size: str) -> dict[str, Path]:
    from strata.modelgen import write_random_model

    OUT.mkdir(exist_ok=True)
    files = {}
    for name, seed in (("alpha", 1), ("beta", 2)):
        path = OUT / f"qwen3moe-{size}-q8_0-seed{seed}.gguf"
        if not path.exists():
            print(f"writing {path} ...", flush=True)
            write_random_model(path, arch="qwen3moe", size=size, dtype="q8_0", vocab="qwen", seed=seed)
        files[name] = path
    return files


def two_models(files: dict[str, Path], threads: int, budget_for_one: bool) -> Config:
    entries = [{"name": name, "model": str(path), "context": 1024, "slots": 1} for name, path in files.items()]
    config = config_from_dict({"models": entries, "threads": threads})
    if not budget_for_one:
        return config
    sizes = [footprint(config.for_model(entry)) for entry in config.models]
    return config_from_dict({"models": entries, "threads": threads, "models_memory": max(sizes) + min(sizes) // 2})


async def ask(client: httpx.AsyncClient, model: str, max_tokens: int) -> float:
    """Seconds to the whole answer of `max_tokens` tokens (one: the first token's time)."""
    started = time.perf_counter()
    reply = await client.post("/v1/chat/completions", json={"model": model, "messages": PROMPT, "temperature": 0,
                                                             "max_tokens": max_tokens})
    reply.raise_for_status()
    return time.perf_counter() - started


# --- switch


async def switch(files: dict[str, Path], threads: int, rounds: int) -> dict[str, Any]:
    config = two_models(files, threads, budget_for_one=True)
    loads: list[float] = []  # each load's own time, as the service logs it ("loaded in 0.4 s")

    def log(line: str) -> None:
        if line.startswith("loaded in "):
            loads.append(float(line.split()[2]))

    async with open_service(config, log=log) as service, served(service) as (host, port), \
            httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=600) as client:
        await ask(client, "alpha", 1)  # alpha loaded, its prompt's first run done
        warm, cold = [], []
        for _ in range(rounds):
            warm.append(await ask(client, "alpha", 1))  # alpha loaded: a prompt cached but its last token
            cold.append(await ask(client, "beta", 1))  # alpha unloaded, beta loaded
            cold.append(await ask(client, "alpha", 1))  # and back
            assert [model.state for model in service.models.models].count("loaded") == 1
        return {"warm_ms": 1e3 * statistics.median(warm), "switch_ms": 1e3 * statistics.median(cold),
                "load_ms": 1e3 * statistics.median(loads[1:]), "file_mb": files["alpha"].stat().st_size / 1e6}


# --- steps


class Serialised:
    """An engine whose calls (a step's forward pass, its draws) wait for one lock that two models' engines share:
    one model's step at a time on the cores, the other's Python between steps beside it."""

    def __init__(self, engine: Any, lock: threading.Lock):
        self._engine, self._lock = engine, lock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def eval_batch(self, items: Any, notify_fd: int = -1) -> Any:
        with self._lock:
            return self._engine.eval_batch(items, notify_fd)

    def sample_rows(self, rows: Any, settings: Any, u: Any) -> Any:
        with self._lock:
            return self._engine.sample_rows(rows, settings, u)


async def steps(files: dict[str, Path], threads: int, rounds: int, tokens: int) -> dict[str, Any]:
    """Tokens a second and the process's CPU milliseconds a token: one stream alone, then two models with a
    stream each, their engine calls serialised or each on its own threads (alternated round by round)."""
    config = two_models(files, threads, budget_for_one=False)
    rates: dict[str, list[float]] = {"alone": [], "serialised": [], "own": []}
    cpu: dict[str, list[float]] = {name: [] for name in rates}
    async with open_service(config, log=lambda line: None) as service, served(service) as (host, port), \
            httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=600) as client:
        for name in ("alpha", "beta"):
            await ask(client, name, 1)  # both loaded
        batchers = [model.loop.batcher for model in service.models.models if model.loop is not None]
        engines = [batcher.engine for batcher in batchers]
        lock = threading.Lock()
        for round_ in range(rounds):
            started, clock = time.perf_counter(), time.process_time()
            await ask(client, "alpha", tokens)
            rates["alone"].append(tokens / (time.perf_counter() - started))
            cpu["alone"].append(1e3 * (time.process_time() - clock) / tokens)
            for arrangement in ("serialised", "own")[::1 if round_ % 2 else -1]:  # neither always first
                for batcher, engine in zip(batchers, engines, strict=True):
                    batcher.engine = Serialised(engine, lock) if arrangement == "serialised" else engine
                started, clock = time.perf_counter(), time.process_time()
                async with trio.open_nursery() as nursery:
                    for name in ("alpha", "beta"):
                        nursery.start_soon(ask, client, name, tokens)
                rates[arrangement].append(2 * tokens / (time.perf_counter() - started))
                cpu[arrangement].append(1e3 * (time.process_time() - clock) / (2 * tokens))
        for batcher, engine in zip(batchers, engines, strict=True):
            batcher.engine = engine
    return {name: (statistics.median(rates[name]), statistics.median(cpu[name])) for name in rates}


# --- download


def download(path: Path, rounds: int, size_mb: int) -> dict[str, Any]:
    """MB/s of `fetch` and of curl for the model file, or one of about `size_mb` MB (the model file repeated),
    alternated round by round. The hub runs in a process of its own, as a real hub does: in the client's, its
    writes waited for the interpreter the client's reads hold, which curl's never did."""
    from huggingface_hub import constants

    from strata.models.hub import fetch, parse_ref

    copies = max(1, round(size_mb * 1e6 / path.stat().st_size))  # 0: the file as it is
    size = path.stat().st_size * copies
    name = "bench-Q8_0.gguf"
    hub_mbps, curl_mbps = [], []
    hub_cpu, curl_cpu = [], []  # ms of CPU a MB: the client's (the hub's is not counted), curl's
    hub_server = Path(__file__).parent.parent / "tests" / "hub_server.py"
    with subprocess.Popen([sys.executable, str(hub_server), "bench/models", name, str(path), str(copies)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as hub, \
            tempfile.TemporaryDirectory() as scratch:
        assert hub.stdout is not None and hub.stdin is not None
        hub_url = hub.stdout.readline().strip()
        constants.ENDPOINT = hub_url  # as HF_ENDPOINT does when the client is imported
        constants.HUGGINGFACE_CO_URL_TEMPLATE = hub_url + "/{repo_id}/resolve/{revision}/{filename}"
        constants.HF_HUB_OFFLINE = False
        url = f"{hub_url}/bench/models/resolve/main/{name}"
        # Once untimed: the client's modules are imported on first use (about a second), and its session made.
        constants.HF_HUB_CACHE = os.path.join(scratch, "warm-up")
        fetch(parse_ref("hf:bench/models:Q8_0"), None)
        shutil.rmtree(constants.HF_HUB_CACHE)
        for round_ in range(rounds):
            constants.HF_HUB_CACHE = cache = os.path.join(scratch, f"cache-{round_}")
            started, clock = time.perf_counter(), time.process_time()
            fetched, _ = fetch(parse_ref("hf:bench/models:Q8_0"), None)
            hub_mbps.append(size / (time.perf_counter() - started) / 1e6)
            hub_cpu.append((time.process_time() - clock) / size * 1e9)
            assert Path(fetched).stat().st_size == size
            shutil.rmtree(cache)
            target = os.path.join(scratch, "curl.gguf")
            started, clock = time.perf_counter(), _children_cpu()
            subprocess.run(["curl", "-sS", "-o", target, url], check=True)
            curl_mbps.append(size / (time.perf_counter() - started) / 1e6)
            curl_cpu.append((_children_cpu() - clock) / size * 1e9)
            os.remove(target)
        hub.stdin.close()
    hub_rate, curl_rate = statistics.median(hub_mbps), statistics.median(curl_mbps)
    return {"mb": size / 1e6, "hub_mbps": hub_rate, "curl_mbps": curl_rate, "ratio": hub_rate / curl_rate,
            "ratios": [round(a / b, 3) for a, b in zip(hub_mbps, curl_mbps, strict=True)],
            "hub_cpu": statistics.median(hub_cpu), "curl_cpu": statistics.median(curl_cpu)}


def _children_cpu() -> float:
    """Seconds of CPU the finished child processes took (curl's)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small", "medium"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--download-mb", type=int, default=0,
                        help="the downloaded file's size (default: the model file's)")
    parser.add_argument("--only", default="switch,steps,download")
    args = parser.parse_args()
    only = set(args.only.split(","))
    files = model_files(args.size)
    print("| figure | value |\n|---|---|")
    if "switch" in only:
        result = trio.run(switch, files, args.threads, args.rounds)
        print(f"| first token, model loaded (median of {args.rounds}) | {result['warm_ms']:.1f} ms |")
        print(f"| first token after a switch: the other unloaded, this one loaded ({result['file_mb']:.0f} MB file), "
              f"median of {2 * args.rounds} | {result['switch_ms']:.1f} ms, of which the load (engine and "
              f"tokenizer) {result['load_ms']:.1f} ms |")
    if "steps" in only:
        rates = trio.run(steps, files, args.threads, args.rounds, args.tokens)
        for name, what in (("alone", f"one stream alone, {args.tokens} tokens"),
                           ("own", "two models, one stream each, each engine on its own threads"),
                           ("serialised", "two models, one stream each, their engine calls serialised")):
            rate, ms = rates[name]
            print(f"| {what} (median of {args.rounds}) | {rate:.1f} tok/s, {ms:.2f} ms CPU a token |")
    if "download" in only:
        result = download(files["alpha"], args.rounds, args.download_mb)
        print(f"| download of {result['mb']:.0f} MB from the local hub: huggingface_hub / curl (median of "
              f"{args.rounds}) | {result['hub_mbps']:.0f} / {result['curl_mbps']:.0f} MB/s = "
              f"{result['ratio']:.2f}x (rounds {result['ratios']}); CPU {result['hub_cpu']:.2f} / "
              f"{result['curl_cpu']:.2f} ms a MB |")


if __name__ == "__main__":
    main()
