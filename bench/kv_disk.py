"""The disk tier under the prefix cache (`kv_disk`), on the generated small Q8_0 qwen3moe (or, with `--arch
qwen35moe`, the hybrid Qwen3.5 one, whose slots resume from the recurrent states stored beside the blocks):

- **Restart.** A 6,000-token agent prompt is answered (16 greedy tokens) by a batcher with the tier; its blocks
  are saved as the job leaves and written at the tier's close. The block files are then dropped from the page
  cache (`posix_fadvise(DONTNEED)`: a restart after a reboot, or after other files took the memory), a new engine
  and batcher open the same directory, and the same prompt's time to its first token is measured, against a new
  engine without the tier (the prompt computed). The two answers must be the same tokens.
- **Read rate.** The tier reading the prompt's blocks (its reader thread: the files read and their checksums,
  from the load's start to the last block taken) against Python reading the same files one after another, and
  against the same bytes as one file read front to back in 8 MiB reads (as `dd` does), each from the disk
  (dropped from the page cache first), alternated 9 times: the median of each round's ratio.
- **A pool too small.** 8 conversations, each a ~6,000-token prompt of its own and then turns adding ~150 tokens
  of tool output, taken in turn by one client on an engine of 2 slots; each turn's reuse is its cached tokens
  over the positions the conversation's last turn left in a cache (its prompt and answer). RAM only (the slots'
  prefix cache) against RAM with the disk tier, side by side.

Each prompt's last message (the user's, after the system prompt and the tools) is its last `USER` tokens: a
hybrid model's slot snapshots its state where that message starts, and resumes there after a restart.
The batcher is driven directly, as the engine thread drives it (no HTTP): the figures are the tier's.

    python bench/kv_disk.py [--arch qwen3moe|qwen35moe] [--model bench/out/ARCH-small-q8_0.gguf] [--threads 2]
                            [--prompt 6000] [--turns 3] [--block 256] [--only restart]
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
from typing import Any

import numpy as np

from strata.engine_cffi import Engine
from strata.kv_disk import KvTier
from strata.scheduling.batcher import Batcher, Job
from strata.text.sampling import Sampler, SamplingParams

OUT = Path(__file__).parent / "out"
ANSWER = 16
USER = 64
TOOL_OUTPUT = 150
CONVERSATIONS, SLOTS = 8, 2


def ids(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1000, 100_000, n)]


def drop_from_page_cache(directory: Path, files: list[Path] | None = None) -> int:
    """Ask the kernel to drop the directory's block files (or `files`) from its page cache (written back first:
    dirty pages are not dropped); returns their bytes."""
    total = 0
    for file in files if files is not None else directory.glob("*.kvb"):
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
    job = Job(prompt, Sampler(SamplingParams(temperature=0), batcher.engine.n_vocab), ANSWER, set(),
              turn_starts=[0, len(prompt) - USER])
    started = time.perf_counter()
    batcher.add(job)
    job.loaded = started  # type: ignore[attr-defined]  # when its blocks were all imported (the bench's note)
    while job.finish is None:
        batcher.step()
        if job.loading is not None:
            job.loaded = time.perf_counter()  # type: ignore[attr-defined]
    return job, job.prompt_done - started


def open_engine(args: argparse.Namespace, n_seq: int, n_ctx: int) -> Engine:
    return Engine.load(args.model, n_ctx=n_ctx, threads=args.threads, n_seq=n_seq, kv="f16")


def restart(args: argparse.Namespace, directory: Path, rounds: int = 3) -> dict[str, Any]:
    """The prompt answered and saved once; then `rounds` restarts with the tier (its files dropped from the page
    cache first) alternated with restarts without it: medians, and every answer the first one."""
    prompt = ids(args.prompt, 0)
    n_ctx = args.prompt + 2 * ANSWER
    with open_engine(args, 1, n_ctx) as engine:
        tier = KvTier(str(directory), engine.kv_identity, 2**34, engine.kv_position_bytes, args.block)
        first, _ = answer(Batcher(engine, tier=tier), prompt)
        tier.close()
        identity, position_bytes = engine.kv_identity, engine.kv_position_bytes
    with_tier, without, reading = [], [], []
    for _ in range(rounds):
        file_bytes = drop_from_page_cache(directory)
        with open_engine(args, 1, n_ctx) as engine:
            tier = KvTier(str(directory), identity, 2**34, position_bytes, args.block)
            warm, seconds = answer(Batcher(engine, tier=tier), prompt)
            read = tier.status()
            tier.close()
        with_tier.append(seconds)
        reading.append(warm.loaded - warm.started)
        with open_engine(args, 1, n_ctx) as engine:
            cold, seconds = answer(Batcher(engine), prompt)
        without.append(seconds)
        assert warm.tokens == cold.tokens == first.tokens, "the answers differ"
    rates = read_rates(args, directory, identity, position_bytes, prompt)
    return {"prompt": len(prompt), "with": statistics.median(with_tier), "without": statistics.median(without),
            "reading": statistics.median(reading), "rounds": list(zip(with_tier, without, strict=True)),
            "disk_tokens": warm.disk_tokens, "files": read["read_blocks"], "file_bytes": file_bytes,
            "rates": rates}


def read_rates(args: argparse.Namespace, directory: Path, identity: str, position_bytes: int, prompt: list[int],
               rounds: int = 9) -> dict[str, list[float]]:
    """Bytes/s, each from the disk (dropped from the page cache first), alternated `rounds` times: the tier
    reading the prompt's blocks (its reader thread, from the load's start to its last block taken), Python reading
    the same files one after another (`files`), and the same bytes as one file read front to back in 8 MiB reads
    (`one_file`: what `dd` measures). A shared disk's rate moves from one second to the next: compare each
    round's ratios."""
    tier = KvTier(str(directory), identity, 2**34, position_bytes, args.block)
    names = tier.names(prompt)
    files = [directory / (name.hex() + ".kvb") for name in names]
    whole = directory / "sequential.bin"  # not a block file: the tier's index never sees it
    with open(whole, "wb") as out:
        for file in files:
            out.write(file.read_bytes())
    rates: dict[str, list[float]] = {"tier": [], "files": [], "one_file": []}

    def timed(kind: str, read: Any) -> None:
        drop_from_page_cache(directory, [*files, whole])
        started = time.perf_counter()
        got = read()
        rates[kind].append(got / (time.perf_counter() - started))

    def by_tier() -> int:
        got, load = 0, tier.read(names)
        while not load.finished:
            tier.wait(0.01)
            got += sum(len(payload) for _, payload, _ in load.take())
        return got

    def by_files() -> int:
        return sum(len(file.read_bytes()) for file in files)

    def one_file() -> int:
        got = 0
        with open(whole, "rb", buffering=0) as f:
            while chunk := f.read(8 << 20):
                got += len(chunk)
        return got

    for _ in range(rounds):
        timed("tier", by_tier)
        timed("files", by_files)
        timed("one_file", one_file)
    tier.close()
    whole.unlink()
    return rates


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
    parser.add_argument("--arch", choices=["qwen3moe", "qwen35moe"], default="qwen3moe",
                        help="the default model's architecture")
    parser.add_argument("--model", type=Path, default=None, help="default: bench/out/ARCH-small-q8_0.gguf")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=6000)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--only", choices=["restart"], help="the restart and the read rate only")
    parser.add_argument("--dir", type=Path, default=None, help="where the block files go (default: a temporary "
                        "directory under the bench's out/, on the disk the repository is on)")
    args = parser.parse_args()
    args.model = args.model or OUT / f"{args.arch}-small-q8_0.gguf"
    if not args.model.is_file():
        sys.exit(f"no model at {args.model}: strata make-model --arch {args.arch} --size small --dtype q8_0 "
                 f"--vocab qwen --out {args.model}")
    base = args.dir or args.model.parent
    print(f"{cpu_name()}, {os.cpu_count()} CPUs, {args.threads} engine threads; blocks of {args.block} positions")
    with tempfile.TemporaryDirectory(dir=base) as one, tempfile.TemporaryDirectory(dir=base) as two:
        r = restart(args, Path(one))
        print(f"restart, a {r['prompt']}-token prompt: first token {r['with']:.3f} s with the tier "
              f"({r['disk_tokens']} tokens in {r['files']} files read (blocks, and a hybrid's state record), "
              f"{r['file_bytes'] / 2**20:.1f} MiB stored, in {r['reading']:.3f} s), {r['without']:.3f} s without: "
              f"{r['with'] / r['without']:.3f}x (medians of 3; "
              "each round " + ", ".join(f"{a:.3f}/{b:.3f}" for a, b in r["rounds"]) + "); the same answers")
        rates = r["rates"]
        tier_rates = rates["tier"]
        for kind, what in (("files", "Python reading the same files one after another"),
                           ("one_file", "the same bytes as one file read front to back")):
            pairs = list(zip(tier_rates, rates[kind], strict=True))
            ratio = statistics.median(a / b for a, b in pairs)
            mine, theirs = statistics.median(tier_rates) / 2**20, statistics.median(rates[kind]) / 2**20
            print(f"read rate, the tier against {what}: {ratio:.2f}x (median of {len(pairs)} rounds' ratios; "
                  f"medians {mine:,.0f} / {theirs:,.0f} MiB/s; each round "
                  + ", ".join(f"{a / 2**20:,.0f}/{b / 2**20:,.0f}" for a, b in pairs) + ")")
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
