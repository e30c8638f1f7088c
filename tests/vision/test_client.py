"""`VisionClient` against real encoder processes: encodes, the cache, cancellation while queued and while
encoding (the encoder's CPU goes idle), crashes and restarts, startup failures, and the turn for CUDA encoders."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import trio

from strata.config import VisionConfig
from strata.scheduling.turn import Turn
from strata.vision.client import (
    PictureRefused,
    VisionClient,
    VisionStartError,
    VisionUnavailable,
    default_threads,
    encoder_command,
)
from strata.vision.encoder import Encoder
from strata.vision.mmproj import Mmproj
from strata.vision.preprocess import load_image, preprocess

from .conftest import N_EMBD_TEXT, fake_cuda_encoder, noise_png

pytestmark = pytest.mark.timeout(60)

SLOW_TOKENS = 1024  # a 640x480 picture through the twelve-layer encoder: about a second on one thread


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def wait_for(predicate, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.005)


async def start(nursery: trio.Nursery, timeout: float | None = None, **keys) -> VisionClient:
    """A client of `VisionConfig(**keys)`, run in the test's nursery."""
    client = VisionClient(VisionConfig(**keys), log=lambda line: None, start_timeout=timeout)
    await nursery.start(client.run)
    return client


def test_the_budget_flags_are_passed_only_when_configured():
    assert not {"--max-tokens", "--min-tokens"} & set(encoder_command(VisionConfig(mmproj="v.gguf"), 1))
    argv = encoder_command(VisionConfig(mmproj="v.gguf", max_tokens=256, min_tokens=16), 1)
    assert argv[argv.index("--max-tokens") + 1] == "256" and argv[argv.index("--min-tokens") + 1] == "16"


def test_a_gpu_encoder_runs_on_the_servers_test_device_when_it_has_one():
    gpu = VisionConfig(mmproj="v.gguf", gpu=True)
    assert encoder_command(gpu, 1)[-1] == "--gpu"
    assert encoder_command(gpu, 1, gpu_device="host")[-3:] == ["--gpu", "--device", "host"]
    assert "--device" not in encoder_command(VisionConfig(mmproj="v.gguf"), 1, gpu_device="host")


async def test_encode_matches_the_encoder_in_process(nursery, tiny_mmproj, tmp_path):
    client = await start(nursery, mmproj=str(tiny_mmproj), threads=1, max_tokens=64)
    picture = noise_png(96, 64, seed=3)
    embedding = await client.encode(picture)
    path = tmp_path / "p.png"
    path.write_bytes(picture)
    encoder = Encoder(Mmproj.load(tiny_mmproj), 1)
    pre = preprocess(load_image(str(path)), encoder.hp, 64)
    expected = encoder.encode(pre.pixels)
    assert (embedding.nx, embedding.ny) == (pre.nx, pre.ny)
    np.testing.assert_allclose(embedding.rows, expected, rtol=0, atol=1e-6)
    assert embedding.rows.shape[1] == N_EMBD_TEXT
    assert client.status()["encodes"] == 1 and client.status()["available"]


async def test_cache_hit_costs_no_encode(nursery, tiny_mmproj):
    client = await start(nursery, mmproj=str(tiny_mmproj), threads=1, max_tokens=64)
    picture = noise_png(64, 64, seed=4)
    first = await client.encode(picture)
    pid = client.pid
    before = cpu_seconds(pid)
    second = await client.encode(picture)
    assert second is first
    assert client.status()["encodes"] == 1 and client.status()["cache_hits"] == 1
    assert cpu_seconds(pid) == pytest.approx(before, abs=0.02)


async def test_refused_picture_and_next_one(nursery, tiny_mmproj):
    client = await start(nursery, mmproj=str(tiny_mmproj), threads=1, max_tokens=64)
    with pytest.raises(PictureRefused, match="image"):
        await client.encode(b"not a picture at all")
    assert (await client.encode(noise_png(32, 32))).n_tokens > 0


async def test_cancel_during_encode_stops_the_encoder(nursery, slow_mmproj):
    client = await start(nursery, mmproj=str(slow_mmproj), threads=1, max_tokens=SLOW_TOKENS)
    pid = client.pid
    picture = noise_png(640, 480, seed=5)
    with trio.move_on_after(0.4) as scope:
        await client.encode(picture)
    assert scope.cancelled_caught
    # The encoder said CANCELLED before the cancellation completed, within 100 ms: it is idle now.
    assert trio.current_time() - scope.deadline < 0.1
    idle_from = cpu_seconds(pid)
    await trio.sleep(0.3)
    assert cpu_seconds(pid) - idle_from < 0.03
    assert client.pid == pid and client.status()["encodes"] == 0
    assert (await client.encode(noise_png(32, 32))).n_tokens > 0


async def test_cancel_while_queued_drops_the_job(nursery, slow_mmproj):
    client = await start(nursery, mmproj=str(slow_mmproj), threads=1, max_tokens=SLOW_TOKENS)
    results = []

    async def first():
        results.append(await client.encode(noise_png(640, 480, seed=6)))

    nursery.start_soon(first)
    await wait_for(lambda: client._fifo.locked())
    with trio.move_on_after(0.2) as scope:
        await client.encode(noise_png(640, 480, seed=7))
    assert scope.cancelled_caught
    assert client.status()["queued"] == 0
    await wait_for(lambda: results, 20)
    # Only the first picture was ever encoded.
    assert client.status()["encodes"] == 1 and len(client.cache) == 1


async def test_crashed_encoder_restarts_on_the_next_picture(nursery, tiny_mmproj):
    client = await start(nursery, mmproj=str(tiny_mmproj), threads=1, max_tokens=64)
    pid = client.pid
    os.kill(pid, 9)
    await wait_for(lambda: not client.available)
    assert "status -9" in client.status()["last_error"]
    embedding = await client.encode(noise_png(48, 48, seed=8))
    assert embedding.n_tokens > 0 and client.pid != pid and client.status()["last_error"] is None


async def test_crash_during_encode_is_unavailable(nursery, slow_mmproj):
    client = await start(nursery, mmproj=str(slow_mmproj), threads=1, max_tokens=SLOW_TOKENS)
    pid = client.pid

    async def kill_soon():
        await trio.sleep(0.2)
        os.kill(pid, 9)

    nursery.start_soon(kill_soon)
    with pytest.raises(VisionUnavailable, match="exited"):
        await client.encode(noise_png(640, 480, seed=9))


async def test_bad_mmproj_stops_startup_naming_the_file(nursery, tmp_path):
    missing = tmp_path / "no-such-encoder.gguf"
    with pytest.raises(VisionStartError, match="no-such-encoder.gguf"):
        await start(nursery, mmproj=str(missing))


async def test_absent_remote_encoder_lets_startup_go_on(nursery):
    script = "import sys; print('ssh: connect to host box: Connection refused', file=sys.stderr); sys.exit(255)"
    client = await start(nursery, exe=[sys.executable, "-c", script], remote=True)
    assert not client.available
    with pytest.raises(VisionUnavailable, match="Connection refused") as error:
        await client.encode(noise_png(32, 32))
    assert str(error.value).startswith("the image encoder is not available: ")
    assert "status 255" in client.status()["last_error"]


async def test_remote_encoder_that_never_answers_times_out(nursery):
    client = await start(nursery, exe=[sys.executable, "-c", "import time; time.sleep(60)"], remote=True,
                         timeout=0.5)
    with pytest.raises(VisionUnavailable, match="no READY"):
        await client.encode(noise_png(32, 32))


async def test_lazy_load_starts_on_the_first_picture(nursery, tiny_mmproj):
    client = await start(nursery, mmproj=str(tiny_mmproj), threads=1, max_tokens=64, lazy_load=True)
    assert client.pid is None
    await client.encode(noise_png(32, 32))
    assert client.pid is not None




@pytest.mark.parametrize("cuda", [True, False])
async def test_turn_is_taken_only_by_a_cuda_encoder(nursery, tiny_mmproj, tmp_path, cuda):
    turn = Turn()
    if cuda:
        client = await start(nursery, exe=fake_cuda_encoder(tmp_path, seconds=0.5, width=8))
    else:
        client = await start(nursery, mmproj=str(tiny_mmproj), threads=1, max_tokens=64)
    busy_seen = []

    async def encode():
        await client.encode(noise_png(32, 32, seed=10), turn)

    nursery.start_soon(encode)
    with trio.fail_after(10):
        while client.status()["encodes"] == 0:
            busy_seen.append(turn.busy)
            await trio.sleep(0.01)
    assert client.status()["cuda"] is cuda
    assert any(busy_seen) is cuda
    assert not turn.busy


def test_default_threads_leave_the_engine_its_cores():
    assert default_threads(engine_threads=2, cores=2) == 1
    assert default_threads(engine_threads=8, cores=8) == 1
    assert default_threads(engine_threads=6, cores=8) == 2
    assert default_threads(engine_threads=4, cores=16) == 4


async def test_state_and_job_as_the_monitor_shows_them(nursery, slow_mmproj):
    client = await start(nursery, mmproj=str(slow_mmproj), threads=1, max_tokens=SLOW_TOKENS)
    assert client.state() == "ready" and client.status()["job"] is None
    picture = noise_png(640, 480, seed=10)
    async with trio.open_nursery() as encoding:
        encoding.start_soon(client.encode, picture)
        await wait_for(lambda: client.job is not None)
        assert client.status()["job"]["bytes"] == len(picture)
        encoding.cancel_scope.cancel()
    assert client.job is None
    os.kill(client.pid, 9)
    await wait_for(lambda: not client.available)
    assert client.state() == "absent"


async def test_state_while_a_remote_encoder_starts(nursery):
    client = await start(nursery, exe=[sys.executable, "-c", "import time; time.sleep(60)"], remote=True,
                         timeout=1.0)
    assert client.state() == "absent"
    failures = []

    async def picture() -> None:
        with pytest.raises(VisionUnavailable) as error:
            await client.encode(noise_png(32, 32))
        failures.append(error.value)

    nursery.start_soon(picture)
    await wait_for(lambda: client.state() == "starting")
    await wait_for(lambda: failures, 5)
    assert client.state() == "absent"
