"""`strata-vision` through the real subprocess: every verb, every refusal, cancellation, startup failures."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from strata.modelgen.mmproj import write_random_mmproj
from strata.vision.device_encoder import encoder_share
from strata.vision.encoder import Encoder
from strata.vision.mmproj import Mmproj
from strata.vision.preprocess import load_image, preprocess
from strata.vision.protocol import (
    MAX_LINE_BYTES,
    PROTOCOL_VERSION,
    Cancel,
    Cancelled,
    EncodeBytes,
    Encoded,
    EncodePath,
    Failed,
    Quit,
    Result,
    encode_request,
    parse_sve,
)

from .conftest import N_EMBD_TEXT, noise_png

pytestmark = pytest.mark.timeout(120)

SLOW_MAX_TOKENS = 576  # a 384x384 picture: 24x24 merged tokens, 48x48 patches through twelve layers


def job(job_id: str, image: bytes) -> bytes:
    return encode_request(EncodeBytes(job_id, len(image))) + image


def in_process_rows(mmproj: Path, image: bytes | str, threads: int, max_tokens: int) -> np.ndarray:
    encoder = Encoder(Mmproj.load(mmproj), threads)
    picture = preprocess(load_image(image), encoder.hp, max_tokens)
    return encoder.encode(picture.pixels)


def test_ready_reports_width_and_capabilities(start_worker, tiny_mmproj: Path):
    worker = start_worker("--mmproj", tiny_mmproj, "--threads", "1", "--max-tokens", "64")
    ready = worker.ready()
    assert ready.n_embd == N_EMBD_TEXT
    caps = ready.capabilities
    assert (caps.cuda, caps.threads, caps.max_tokens, caps.protocol) == (False, 1, 64, PROTOCOL_VERSION)
    assert caps.projector == "lfm2"
    assert caps.fingerprint == Mmproj.load(tiny_mmproj).fingerprint
    worker.send(encode_request(Quit()))
    assert worker.proc.wait(10) == 0


def test_the_files_budget_is_the_default_and_small_pictures_are_scaled_up(start_worker, tmp_path: Path):
    mmproj = tmp_path / "budget.gguf"
    write_random_mmproj(mmproj, N_EMBD_TEXT, "tiny", budget=(36, 48))
    image = tmp_path / "small.png"
    image.write_bytes(noise_png(20, 20))  # about 2 tokens as it is
    worker = start_worker("--mmproj", mmproj, "--threads", "1")
    assert worker.ready().capabilities.max_tokens == 48
    worker.send(encode_request(EncodePath(str(image), str(tmp_path / "a.sve"))))
    reply, _ = worker.reply()
    assert isinstance(reply, Encoded) and (reply.nx, reply.ny) == (6, 6)
    worker.send(encode_request(Quit()))
    assert worker.proc.wait(10) == 0
    flags = start_worker("--mmproj", mmproj, "--threads", "1", "--max-tokens", "100", "--min-tokens", "1")
    assert flags.ready().capabilities.max_tokens == 100
    flags.send(encode_request(EncodePath(str(image), str(tmp_path / "b.sve"))))
    reply, _ = flags.reply()
    assert isinstance(reply, Encoded) and (reply.nx, reply.ny) == (1, 1)
    encoded = run_worker("encode", image, "--mmproj", mmproj, "--out", tmp_path / "c.sve", "--threads", "1")
    assert encoded.returncode == 0, encoded.stderr
    assert (json.loads(encoded.stdout)["nx"], json.loads(encoded.stdout)["ny"]) == (6, 6)  # `encode` too


def test_path_form_writes_sve1(start_worker, tiny_mmproj: Path, tmp_path: Path):
    image = tmp_path / "a picture.png"  # a space: the path travels as a quoted word
    image.write_bytes(noise_png(200, 120))
    out = tmp_path / "a.sve"
    worker = start_worker("--mmproj", tiny_mmproj, "--threads", "1", "--max-tokens", "40")
    worker.ready()
    worker.send(encode_request(EncodePath(str(image), str(out))))
    reply, _ = worker.reply()
    assert isinstance(reply, Encoded)
    assert (reply.nx, reply.ny, reply.n_tokens) == (8, 5, 40) and reply.ms > 0
    header, rows = parse_sve(out.read_bytes())
    assert (header.n_tokens, header.nx, header.ny, header.n_embd) == (40, 8, 5, N_EMBD_TEXT)
    np.testing.assert_allclose(rows, in_process_rows(tiny_mmproj, str(image), 1, 40), rtol=1e-6, atol=1e-7)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a picture.png", "a.sve"]  # no temporary file left


def test_path_form_errors_name_the_problem(start_worker, tiny_mmproj: Path, tmp_path: Path):
    image = tmp_path / "p.png"
    image.write_bytes(noise_png(32, 32))
    (tmp_path / "notes.txt").write_text("hello")
    worker = start_worker("--mmproj", tiny_mmproj, "--threads", "1")
    worker.ready()
    cases = [
        (EncodePath(str(tmp_path / "missing.png"), str(tmp_path / "o.sve")), "image", "missing.png"),
        (EncodePath(str(tmp_path / "notes.txt"), str(tmp_path / "o.sve")), "image", "cannot identify image file"),
        (EncodePath(str(image), str(tmp_path / "no-such-dir" / "o.sve")), "output", "no-such-dir"),
    ]
    for request, kind, detail in cases:
        worker.send(encode_request(request))
        reply, _ = worker.reply()
        assert isinstance(reply, Failed) and reply.job_id is None
        assert reply.kind == kind and detail in reply.detail
    assert not (tmp_path / "o.sve").exists()


def test_in_band_jobs_answer_in_order_with_sve1_bytes(start_worker, tiny_mmproj: Path, tmp_path: Path):
    pictures = [noise_png(64, 48, seed) for seed in range(3)]
    worker = start_worker("--mmproj", tiny_mmproj, "--threads", "1", "--max-tokens", "64")
    worker.ready()
    worker.send(b"".join(job(f"j{i}", picture) for i, picture in enumerate(pictures)))
    for i, picture in enumerate(pictures):
        reply, payload = worker.reply()
        assert isinstance(reply, Result) and reply.job_id == f"j{i}"
        header, rows = parse_sve(payload)
        assert (reply.n_tokens, reply.nx, reply.ny, reply.n_bytes) == (12, 4, 3, len(payload))
        assert (header.n_tokens, header.nx, header.ny, header.n_embd) == (12, 4, 3, N_EMBD_TEXT)
        np.testing.assert_allclose(rows, in_process_rows(tiny_mmproj, picture, 1, 64), rtol=1e-6, atol=1e-7)

    # The same picture by path gives the same bytes.
    path = tmp_path / "p.png"
    path.write_bytes(pictures[0])
    worker.send(encode_request(EncodePath(str(path), str(tmp_path / "p.sve"))))
    assert isinstance(worker.reply()[0], Encoded)
    worker.send(job("again", pictures[0]))
    assert worker.reply()[1] == (tmp_path / "p.sve").read_bytes()


def test_bad_pictures_fail_their_job_only(start_worker, tiny_mmproj: Path):
    worker = start_worker("--mmproj", tiny_mmproj, "--threads", "1")
    worker.ready()
    worker.send(job("bad", b"\x89PNG but not really") + job("empty", b"") + job("good", noise_png(32, 32)))
    first, second = worker.reply()[0], worker.reply()[0]
    assert first == Failed("image", first.detail, "bad") and "cannot read image" in first.detail
    assert second.job_id == "empty" and second.kind == "image"
    assert worker.reply()[0].job_id == "good"


def test_malformed_lines_get_an_error_and_the_worker_keeps_serving(start_worker, tiny_mmproj: Path):
    worker = start_worker("--mmproj", tiny_mmproj, "--threads", "1", "--max-image-bytes", "4096")
    worker.ready()
    malformed = [
        (b"HELLO\n", None, "unknown verb"),
        (b"\n", None, "empty line"),
        (b"ENC only-one-path\n", None, "expected 'ENC <image> <out>'"),
        (b"ENC \xff\xfe x\n", None, "UTF-8"),
        (b"A" * (MAX_LINE_BYTES + 500) + b"\n", None, "line longer than"),
        (b"CANCEL\n", None, "expected 'CANCEL <id>'"),
        (b"QUIT please\n", None, "expected 'QUIT'"),
        (b"JOB big 5000\n" + b"x" * 5000, "big", "bad byte count"),  # refused, and its bytes skipped
        (b"JOB bad:id 5\n12345", None, "bad job id"),
        (b"JOB nocount\n", "nocount", "expected 'JOB <id> <n_bytes>'"),  # the id was readable
    ]
    for line, job_id, message in malformed:
        worker.send(line)
        reply, _ = worker.reply()
        assert isinstance(reply, Failed) and reply.kind == "protocol", (line[:40], reply)
        assert reply.job_id == job_id and message in reply.detail
    worker.send(job("after", noise_png(32, 32)))
    reply, payload = worker.reply()
    assert reply.job_id == "after" and parse_sve(payload)[0].n_embd == N_EMBD_TEXT
    assert worker.proc.poll() is None


def slow_worker(start_worker, slow_mmproj: Path):
    worker = start_worker("--mmproj", slow_mmproj, "--threads", "1", "--max-tokens", str(SLOW_MAX_TOKENS))
    worker.ready()
    return worker


def timed_encode(worker, job_id: str, picture: bytes) -> float:
    start = time.perf_counter()
    worker.send(job(job_id, picture))
    reply, _ = worker.reply()
    assert isinstance(reply, Result) and reply.job_id == job_id
    return time.perf_counter() - start


def test_cancel_drops_a_queued_job(start_worker, slow_mmproj: Path):
    worker = slow_worker(start_worker, slow_mmproj)
    worker.send(job("first", noise_png(384, 384, 1)) + job("second", noise_png(384, 384, 2)))
    worker.send(encode_request(Cancel("second")))
    assert worker.reply()[0] == Cancelled("second")  # at once, ahead of the running job's result
    assert worker.reply()[0].job_id == "first"
    worker.send(encode_request(Cancel("second")))  # answered already: ignored, no second reply
    worker.send(job("third", noise_png(32, 32)))
    assert worker.reply()[0].job_id == "third"


def test_cancel_stops_a_running_encode_at_a_layer_boundary(start_worker, slow_mmproj: Path):
    worker = slow_worker(start_worker, slow_mmproj)
    full = timed_encode(worker, "warm", noise_png(384, 384, 3))
    worker.send(job("victim", noise_png(384, 384, 4)))
    time.sleep(0.4 * full)
    cancel_sent = time.perf_counter()
    worker.send(encode_request(Cancel("victim")))
    reply, _ = worker.reply()
    stopped_after = time.perf_counter() - cancel_sent
    assert reply == Cancelled("victim")
    # Checks come every slice of a product and every attention tile (milliseconds here); the bounds leave room
    # for a loaded machine and still fail if the encode only stopped at a layer boundary or ran to its end.
    assert stopped_after < min(0.25, 0.3 * full), (stopped_after, full)
    # And the process is idle now, not finishing the encode in the background.
    before = worker.cpu_seconds()
    time.sleep(0.5)
    assert worker.cpu_seconds() - before < 0.1
    worker.send(job("next", noise_png(32, 32)))
    assert worker.reply()[0].job_id == "next"


def test_cancel_stops_an_encode_on_the_device_at_a_layer_boundary(start_worker, slow_mmproj: Path):
    """`--gpu` (on the host device): the check before each of the twelve layers stops a running encode, and the
    process is idle after its CANCELLED."""
    worker = start_worker("--mmproj", slow_mmproj, "--threads", "1", "--max-tokens", "256", "--gpu", "--device",
                          "host")
    worker.ready()
    started = worker.cpu_seconds()
    worker.send(job("victim", noise_png(256, 256, 6)))  # 1024 patches: seconds on the host device
    while worker.cpu_seconds() - started < 0.3:  # well into the encode
        time.sleep(0.01)
    worker.send(encode_request(Cancel("victim")))
    assert worker.reply()[0] == Cancelled("victim")
    before = worker.cpu_seconds()
    time.sleep(0.5)
    assert worker.cpu_seconds() - before < 0.1
    worker.send(job("next", noise_png(32, 32)))
    assert worker.reply()[0].job_id == "next"


def test_an_id_in_use_is_refused_without_touching_its_job(start_worker, slow_mmproj: Path):
    worker = slow_worker(start_worker, slow_mmproj)
    worker.send(job("same", noise_png(256, 256, 5)) + job("same", noise_png(32, 32)))
    refusal = worker.reply()[0]
    assert refusal == Failed("protocol", "job id same is already queued or running")
    reply, _ = worker.reply()
    assert reply.job_id == "same" and reply.n_tokens == 256


def test_quit_answers_the_jobs_received_then_exits(start_worker, tiny_mmproj: Path):
    worker = start_worker("--mmproj", tiny_mmproj, "--threads", "1")
    worker.ready()
    worker.send(job("a", noise_png(32, 32, 1)) + job("b", noise_png(32, 32, 2)) + encode_request(Quit()))
    assert [worker.reply()[0].job_id for _ in range(2)] == ["a", "b"]
    assert worker.proc.wait(10) == 0
    assert worker.stdout.read() == b""


def test_end_of_input_stops_a_running_encode(start_worker, slow_mmproj: Path):
    worker = slow_worker(start_worker, slow_mmproj)
    full = timed_encode(worker, "warm", noise_png(384, 384, 6))
    worker.send(job("orphan", noise_png(384, 384, 7)))
    time.sleep(0.3 * full)
    closed = time.perf_counter()
    worker.stdin.close()
    assert worker.proc.wait(10) == 0
    assert time.perf_counter() - closed < 0.5 * full + 0.2


def run_worker(*args: str | Path) -> subprocess.CompletedProcess:
    from .conftest import WorkerProcess

    worker = WorkerProcess(*args)
    out, err = worker.proc.communicate(timeout=60)
    return subprocess.CompletedProcess(worker.proc.args, worker.proc.returncode, out, err)


def test_a_bad_mmproj_path_fails_naming_the_file(tmp_path: Path):
    missing = tmp_path / "nowhere" / "vision.gguf"
    result = run_worker("--mmproj", missing)
    assert result.returncode == 1
    assert result.stdout.startswith(f"ERR mmproj: cannot load mmproj '{missing}'".encode())
    assert str(missing) in result.stderr.decode()

    not_gguf = tmp_path / "vision.gguf"
    not_gguf.write_bytes(b"\x00" * 100)
    result = run_worker("--mmproj", not_gguf)
    assert result.returncode == 1 and f"'{not_gguf}'".encode() in result.stdout


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine: --gpu would run")
def test_gpu_without_a_gpu_fails_with_a_clear_message(tiny_mmproj: Path):
    result = run_worker("--mmproj", tiny_mmproj, "--gpu")
    assert result.returncode == 1
    line = result.stdout.decode()
    assert line.startswith("ERR gpu: cuda: ") and line.endswith("; leave out --gpu to encode on the CPU\n")
    assert line.count("\n") == 1 and "leave out --gpu" in result.stderr.decode()
    assert run_worker("--mmproj", tiny_mmproj, "--device", "host").returncode == 2  # --device needs --gpu


def test_the_gpu_encoder_on_the_host_device_says_it_holds_the_device_and_encodes(start_worker, tiny_mmproj: Path):
    """`--gpu --device host`: the device encoder's code on the test device; READY says it holds the device (so a
    server gives it the engine's turn) and how much memory it took there, and its rows are the CPU encoder's."""
    worker = start_worker("--mmproj", tiny_mmproj, "--threads", "1", "--max-tokens", "64", "--gpu", "--device", "host")
    caps = worker.ready().capabilities
    assert caps.cuda and caps.device_bytes == encoder_share(tiny_mmproj, None, 64)
    image = noise_png(72, 40, seed=44)
    worker.send(job("g1", image))
    reply, payload = worker.reply()
    assert isinstance(reply, Result)
    _, rows = parse_sve(payload)
    want = in_process_rows(tiny_mmproj, image, 1, 64)
    assert np.abs(rows - want).max() <= 1e-5 * np.abs(want).max()
    worker.send(encode_request(Quit()))
    assert worker.proc.wait(10) == 0


def test_encode_command_writes_what_the_worker_returns(start_worker, tiny_mmproj: Path, tmp_path: Path):
    image = tmp_path / "p.png"
    image.write_bytes(noise_png(100, 60))
    out = tmp_path / "p.sve"
    result = run_worker("encode", image, "--mmproj", tiny_mmproj, "--out", out, "--threads", "1",
                        "--max-tokens", "32")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    header, _ = parse_sve(out.read_bytes())
    assert (summary["n_tokens"], summary["nx"], summary["ny"], summary["n_embd"]) == (
        header.n_tokens, header.nx, header.ny, header.n_embd)

    worker = start_worker("--mmproj", tiny_mmproj, "--threads", "1", "--max-tokens", "32")
    assert summary["fingerprint"] == worker.ready().capabilities.fingerprint
    worker.send(job("x", image.read_bytes()))
    assert worker.reply()[1] == out.read_bytes()

    failed = run_worker("encode", tmp_path / "missing.png", "--mmproj", tiny_mmproj, "--out", tmp_path / "m.sve")
    assert failed.returncode == 1 and "missing.png" in failed.stderr.decode()
    assert not (tmp_path / "m.sve").exists()
