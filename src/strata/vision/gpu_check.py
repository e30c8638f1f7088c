"""The GPU encoder against the CPU encoder (`scripts/gpu-check.sh`): a picture through the real `strata-vision --gpu`
process (an in-band JOB, as a server sends it) and through the CPU encoder in this process, for the demo encoder
(F32) and a generated `small` one (F16, width 384, six layers; 1000 rows of a 1280x800 picture). One table: the
rows' largest difference over their largest value (within 1e-4: float32 sums in another order), the device memory
READY reports, and the times: the encode as the process reports it (`RES`'s ms, the second of two runs: the first
loads the card's kernels) and the CPU encoder's on every core.

    python -m strata.vision.gpu_check                    # on the CUDA device
    python -m strata.vision.gpu_check --device host --quick
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from strata.modelgen.mmproj import write_random_mmproj
from strata.models import DEMO_MMPROJ
from strata.vision.load import open_encoder
from strata.vision.preprocess import load_image, preprocess, token_budget
from strata.vision.protocol import (
    EncodeBytes,
    Quit,
    Ready,
    Reply,
    Result,
    encode_request,
    parse_reply,
    parse_sve,
)

TOLERANCE = 1e-4


@dataclass(frozen=True)
class Row:
    encoder: str
    tokens: int
    rel_err: float
    device_bytes: int
    gpu_ms: float  # the device encoder's
    cpu_ms: float

    @property
    def passed(self) -> bool:
        return self.rel_err <= TOLERANCE


def noise_picture(width: int, height: int) -> bytes:
    """A PNG of random pixels (every patch different)."""
    path = Path(tempfile.mkstemp(suffix=".png")[1])
    try:
        pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(path)
        return path.read_bytes()
    finally:
        path.unlink()


def _reply(proc: subprocess.Popen) -> tuple[Reply, bytes]:
    assert proc.stdout is not None
    reply = parse_reply(proc.stdout.readline())
    payload = proc.stdout.read(reply.n_bytes) if isinstance(reply, Result) else b""
    return reply, payload


def on_device(mmproj: Path, picture: bytes, device: str, max_tokens: int) -> tuple[Ready, np.ndarray, float]:
    """READY, the rows and the encode's ms (the second run's) of `strata-vision --gpu --device <device>`."""
    argv = [sys.executable, "-m", "strata.vision.worker", "--mmproj", str(mmproj), "--gpu", "--device", device,
            "--max-tokens", str(max_tokens), "--threads", "1"]
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as proc:
        assert proc.stdin is not None
        ready, _ = _reply(proc)
        if not isinstance(ready, Ready):
            raise RuntimeError(f"strata-vision --gpu did not start: {ready}")
        ms = 0.0
        for job in ("warm", "timed"):
            proc.stdin.write(encode_request(EncodeBytes(job, len(picture))) + picture)
            proc.stdin.flush()
            reply, payload = _reply(proc)
            if not isinstance(reply, Result):
                raise RuntimeError(f"strata-vision --gpu: {reply}")
            ms = reply.ms
        proc.stdin.write(encode_request(Quit()))
        proc.stdin.close()
        proc.wait(60)
    return ready, parse_sve(payload)[1], ms


def on_cpu(mmproj: Path, picture: bytes, max_tokens: int) -> tuple[np.ndarray, float]:
    """The CPU encoder's rows on every core, and its ms from decoding the picture to the rows (as `RES`'s), the
    second of two runs."""
    encoder = open_encoder(mmproj, len(os.sched_getaffinity(0)))
    low, high = token_budget(encoder.hp, None, max_tokens)
    for _ in range(2):
        started = time.perf_counter()
        parts = preprocess(load_image(picture), encoder.hp, high, low).parts
        rows = np.concatenate([encoder.encode(part) for part in parts])
        ms = (time.perf_counter() - started) * 1000
    return rows, ms


def check(name: str, mmproj: Path, picture: bytes, device: str, max_tokens: int) -> Row:
    ready, got, gpu_ms = on_device(mmproj, picture, device, max_tokens)
    want, cpu_ms = on_cpu(mmproj, picture, max_tokens)
    rel = float(np.abs(got - want).max() / np.abs(want).max()) if got.shape == want.shape else float("inf")
    return Row(name, want.shape[0], rel, ready.capabilities.device_bytes or 0, gpu_ms, cpu_ms)


def format_table(rows: list[Row], device: str) -> str:
    lines = [f"strata-vision --gpu on {device} against the CPU encoder ({len(os.sched_getaffinity(0))} cores)",
             f"| {'encoder':<24} | {'rows':>5} | {'rel err':>9} | {'result':<6} | {'device MiB':>10} "
             f"| {'device ms':>9} | {'CPU ms':>8} | {'speed-up':>8} |",
             f"|{'-' * 26}|{'-' * 7}|{'-' * 11}|{'-' * 8}|{'-' * 12}|{'-' * 11}|{'-' * 10}|{'-' * 10}|"]
    for r in rows:
        lines.append(f"| {r.encoder:<24} | {r.tokens:>5} | {r.rel_err:>9.2e} | {'pass' if r.passed else 'FAIL':<6} "
                     f"| {r.device_bytes / 2**20:>10.1f} | {r.gpu_ms:>9.1f} | {r.cpu_ms:>8.1f} "
                     f"| {r.cpu_ms / r.gpu_ms if r.gpu_ms else 0.0:>7.1f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m strata.vision.gpu_check",
                                     description="strata-vision --gpu against the CPU encoder, timed.")
    parser.add_argument("--device", choices=("cuda", "host"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="the demo encoder only, on a small picture")
    args = parser.parse_args(argv)
    rows = []
    try:
        rows.append(check("demo (F32)", DEMO_MMPROJ, noise_picture(256, 192), args.device, 64))
        if not args.quick:
            with tempfile.TemporaryDirectory() as tmp:
                small = Path(tmp) / "small-f16.gguf"
                write_random_mmproj(small, 2048, "small", seed=0, dtype="f16")
                rows.append(check("generated small (F16)", small, noise_picture(1280, 800), args.device, 1024))
    except RuntimeError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows, args.device))
    return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
