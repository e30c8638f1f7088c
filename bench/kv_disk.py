"""The disk tier under the prefix cache (`kv_disk`), on the generated small Q8_0 qwen3moe:

- **Restart.** A 6,000-token agent prompt is answered (16 greedy tokens) by a batcher with the tier; its blocks
  are saved as the job leaves and written at the tier's close. The block files are then dropped from the page
  cache (`posix_fadvise(DONTNEED)`: a restart after a reboot, or after other files took the memory), a new engine
  and batcher open the same directory, and the same prompt's time to its first token is measured, against a new
  engine without the tier (the prompt computed). The two answers must be the same tokens.
- **Read rate.** The tier's reads in that restart (the reader thread's time per block: the file read and its
  checksum) against Python reading the same files one after another, each dropped from the page cache first.
- **A pool too small.** 8 conversations, each a ~6,000-token prompt of its own and then turns adding ~150 tokens
  of tool output, taken in turn by one client on an engine of 2 slots; each turn's reuse is its cached tokens
  over the positions the conversation's last turn left in a cache (its prompt and answer). RAM only (the slots'
  prefix cache) against RAM with the disk tier, side by side.

The batcher is driven directly, as the engine thread drives it (no HTTP): the figures are the tier's.

    python bench/kv_disk.py [--model bench/out/qwen3moe-small-q8_0.gguf] [--threads 2] [--prompt 6000]
                            [--turns 3] [--block 256] [--only restart]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from strata.engine_cffi import Engine
from strata.kv_disk import KvTier
from strata.scheduling.batcher import Batcher, Job
from strata.text.sampling import Sampler, SamplingParams

SMALL_MODEL = Path(__file__).parent / "out" / "qwen3moe-small-q8_0.gguf"
ANSWER = 16
TOOL_OUTPUT = 150
CONVERSATIONS, SLOTS = 8, 2


def ids(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1000, 100_000, n)]


def drop_from_page_cache(directory: Path) -> int:
    """Ask the kernel to drop the directory's block files from its page cache (written back first: dirty pages
    are not dropped); returns their bytes."""
    total = 0
    for file in directory.glob("*.kvb"):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def answer(batcher: Batcher, prompt: list[int]) -> tuple[Job, float]:
    """Answer `prompt` greedily; (the job, seconds to its first token)."""
    job = Job(prompt, Sampler(SamplingParams(temperature=0), batcher.engine.n_vocab), ANSWER, set())
    started = time.perf_counter()
    batcher.add(job)
    while job.finish is None:
        batcher.step()
    return job, job.prompt_done - started


def open_engine(args: argparse.Namespace, n_seq: int, n_ctx: int) -> Engine:
    return Engine.load(args.model, n_ctx=n_ctx, threads=args.threads, n_seq=n_seq, kv="f16")


def restart(args: argparse.Namespace, directory: Path) -> dict[str, float]:
    prompt = ids(args.prompt, 0)
    n_ctx = args.prompt + 2 * ANSWER
    with open_engine(args, 1, n_ctx) as engine:
        tier = KvTier(str(directory), engine.kv_identity, 2**34, engine.kv_position_bytes, args.block)
        first, _ = answer(Batcher(engine, tier=tier), prompt)
        tier.close()
    file_bytes = drop_from_page_cache(directory)
    with open_engine(args, 1, n_ctx) as engine:
        tier = KvTier(str(directory), engine.kv_identity, 2**34, engine.kv_position_bytes, args.block)
        warm, with_tier = answer(Batcher(engine, tier=tier), prompt)
        read = tier.status()
        tier.close()
    with open_engine(args, 1, n_ctx) as engine:
        cold, without = answer(Batcher(engine), prompt)
    assert warm.tokens == cold.tokens == first.tokens, "the answers differ"
    drop_from_page_cache(directory)
    started, sequential = time.perf_counter(), 0
    for file in sorted(directory.glob("*.kvb")):
        with open(file, "rb") as f:
            sequential += len(f.read())
    sequential_rate = sequential / (time.perf_counter() - started)
    return {"prompt": len(prompt), "with": with_tier, "without": without, "disk_tokens": warm.disk_tokens,
            "blocks": read["read_blocks"], "file_bytes": file_bytes,
            "read_rate": read["read_bytes"] / read["read_seconds"], "sequential_rate": sequential_rate}


def trace(args: argparse.Namespace, directory: Path | None) -> dict[str, float]:
    """The conversations in turn on 2 slots; each later turn's reuse (cached / what its last turn left)."""
    n_ctx = args.prompt + args.turns * (TOOL_OUTPUT + ANSWER) + ANSWER
    reuse, seconds = [], []
    with open_engine(args, SLOTS, n_ctx) as engine:
        tier = None if directory is None else KvTier(str(directory), engine.kv_identity, 2**34,
                                                      engine.kv_position_bytes, args.block)
        batcher = Batcher(engine, tier=tier)
        history = {c: ids(args.prompt, 100 + c) for c in range(CONVERSATIONS)}
        left = dict.fromkeys(history, 0)  # positions the conversation's last turn left in a cache
        for turn in range(args.turns):
            for c in range(CONVERSATIONS):
                if turn:
                    history[c] += ids(TOOL_OUTPUT, 1000 * turn + c)
                job, first_token = answer(batcher, history[c])
                if turn:
                    reuse.append(job.reused / left[c])
                    seconds.append(first_token)
                left[c] = len(history[c]) + len(job.tokens) - 1  # the last answer token was never evaluated
                history[c] += job.tokens
        if tier is not None:
            tier.close()
    return {"reuse": statistics.mean(reuse), "min_reuse": min(reuse), "turn_seconds": statistics.median(seconds)}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=SMALL_MODEL)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=6000)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--only", choices=["restart"], help="the restart and the read rate only")
    parser.add_argument("--dir", type=Path, default=None, help="where the block files go (default: a temporary "
                        "directory under the bench's out/, on the disk the repository is on)")
    args = parser.parse_args()
    if not args.model.is_file():
        sys.exit(f"no model at {args.model}: strata make-model --arch qwen3moe --size small --dtype q8_0 "
                 f"--vocab qwen --out {args.model}")
    base = args.dir or args.model.parent
    print(f"{cpu_name()}, {os.cpu_count()} CPUs, {args.threads} engine threads; blocks of {args.block} positions")
    with tempfile.TemporaryDirectory(dir=base) as one, tempfile.TemporaryDirectory(dir=base) as two:
        r = restart(args, Path(one))
        print(f"restart, a {r['prompt']}-token prompt: first token {r['with']:.3f} s with the tier "
              f"({r['disk_tokens']} tokens in {r['blocks']} blocks read, {r['file_bytes'] / 2**20:.1f} MiB), "
              f"{r['without']:.3f} s without: {r['with'] / r['without']:.3f}x; the same answer")
        print(f"read rate: the tier {r['read_rate'] / 2**20:,.0f} MiB/s, sequential reads of the same files "
              f"{r['sequential_rate'] / 2**20:,.0f} MiB/s: {r['read_rate'] / r['sequential_rate']:.2f}x")
        if args.only:
            return
        ram = trace(args, None)
        disk = trace(args, Path(two))
        print(f"{CONVERSATIONS} conversations on {SLOTS} slots, {args.turns} turns: later turns' reuse RAM only "
              f"{ram['reuse']:.1%} (min {ram['min_reuse']:.1%}, first token {ram['turn_seconds']:.3f} s), with the "
              f"disk tier {disk['reuse']:.1%} (min {disk['min_reuse']:.1%}, first token "
              f"{disk['turn_seconds']:.3f} s)")


if __name__ == "__main__":
    main()
