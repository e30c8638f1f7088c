"""Vision test helpers: generated mmproj files, pictures, and a `strata-vision` process driven over its pipes."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import IO

import numpy as np
import pytest
from PIL import Image

import strata
from strata.modelgen.mmproj import VisionShape, write_random_mmproj
from strata.vision.protocol import Ready, Reply, Result, parse_reply

N_EMBD_TEXT = 48
# Twelve thin layers: an encode of a few hundred tokens lasts long enough to cancel mid-way, and its layer
# boundaries come often.
SLOW_SHAPE = VisionShape(image_size=32, patch_size=8, n_embd=64, n_ff=128, n_head=2, n_layer=12)


_FAKE_CUDA_ENCODER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from strata.vision.protocol import Capabilities, Ready, Result, encode_reply, encode_sve, parse_request
    seconds, width = float(sys.argv[1]), int(sys.argv[2])
    out = sys.stdout.buffer
    caps = Capabilities(cuda=True, threads=1, max_tokens=64, fingerprint="sha256:" + "0" * 64, projector="lfm2")
    out.write(encode_reply(Ready(width, caps))); out.flush()
    while line := sys.stdin.buffer.readline():
        request = parse_request(line)
        sys.stdin.buffer.read(request.n_bytes)
        time.sleep(seconds)
        data = encode_sve(np.ones((4, width), np.float32), 2, 2)
        out.write(encode_reply(Result(request.job_id, 4, 2, 2, seconds * 1000, len(data))) + data); out.flush()
""")


def fake_cuda_encoder(directory: Path, seconds: float, width: int) -> list[str]:
    """The command of an encoder that says it holds a CUDA context and answers every in-band job with four rows of
    ones, `width` wide, after `seconds`."""
    script = directory / "fake_cuda_encoder.py"
    script.write_text(_FAKE_CUDA_ENCODER)
    src = str(Path(strata.__file__).resolve().parents[1])
    return ["env", f"PYTHONPATH={src}", sys.executable, str(script), str(seconds), str(width)]


@pytest.fixture(scope="session")
def mmproj_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mmproj")


@pytest.fixture(scope="session")
def tiny_mmproj(mmproj_dir: Path) -> Path:
    path = mmproj_dir / "tiny-f32.gguf"
    write_random_mmproj(path, N_EMBD_TEXT, "tiny", seed=0, dtype="f32")
    return path


@pytest.fixture(scope="session")
def slow_mmproj(mmproj_dir: Path) -> Path:
    path = mmproj_dir / "slow-f16.gguf"
    write_random_mmproj(path, N_EMBD_TEXT, SLOW_SHAPE, seed=1, dtype="f16")
    return path


def qwen_patches(pixels: np.ndarray, patch: int, merge: int) -> np.ndarray:
    """Normalised pixels (3, H, W) as Qwen's processor hands them to its vision tower: the picture is both frames
    of a temporal patch, patches grouped by merge window, one row (3 * 2 * patch * patch) per patch."""
    _, height, width = pixels.shape
    gy, gx = height // patch, width // patch
    frames = np.stack([pixels, pixels])  # (2, 3, H, W)
    patches = frames.reshape(2, 3, gy // merge, merge, patch, gx // merge, merge, patch)
    return np.ascontiguousarray(patches.transpose(2, 5, 3, 6, 1, 0, 4, 7).reshape(gy * gx, -1))


def noise_png(width: int, height: int, seed: int = 0) -> bytes:
    """A unique random RGB picture, PNG-encoded."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


class WorkerProcess:
    """`python -m strata.vision.worker` with its stdin and stdout as the protocol's pipes."""

    def __init__(self, *args: str | os.PathLike[str]):
        env = dict(os.environ)
        src = str(Path(strata.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen([sys.executable, "-m", "strata.vision.worker", *map(str, args)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        self.stdin: IO[bytes] = self.proc.stdin  # type: ignore[assignment]
        self.stdout: IO[bytes] = self.proc.stdout  # type: ignore[assignment]

    def send(self, data: bytes) -> None:
        self.stdin.write(data)
        self.stdin.flush()

    def line(self) -> bytes:
        line = self.stdout.readline()
        assert line, f"the worker closed its output; stderr: {self.stderr_tail()}"
        return line

    def reply(self) -> tuple[Reply, bytes]:
        """The next reply and, for a RES, its payload."""
        reply = parse_reply(self.line())
        payload = self.stdout.read(reply.n_bytes) if isinstance(reply, Result) else b""
        return reply, payload

    def ready(self) -> Ready:
        reply = parse_reply(self.line())
        assert isinstance(reply, Ready), reply
        return reply

    def stderr_tail(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        return self.proc.stderr.read().decode(errors="replace")[-2000:]  # type: ignore[union-attr]

    def cpu_seconds(self) -> float:
        """User plus system CPU time the process has used so far (Linux /proc)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(BrokenPipeError):
                stream.close()  # type: ignore[union-attr]


@pytest.fixture
def start_worker():
    """A factory of worker processes; each is killed at the end of the test if still running."""
    started: list[WorkerProcess] = []

    def start(*args: str | os.PathLike[str]) -> WorkerProcess:
        worker = WorkerProcess(*args)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.close()
