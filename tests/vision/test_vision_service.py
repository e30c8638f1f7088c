"""Pictures through the service with real encoder processes and a scripted engine: rows at the pad positions,
prefix reuse across turns, tool-result pictures, refusals, cancellation in every phase, and text that never
waits for a CPU encode."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from conftest import server_config, wait_until
from fakes import ScriptedEngine
from pictures.test_sources import PictureServer

import strata
from strata.events import ChatRequest, TextDelta, Usage
from strata.modelgen.mmproj import VisionShape, write_random_mmproj
from strata.pictures.sources import ImageSource, check_image
from strata.request_errors import RequestError, ServiceUnavailable
from strata.service import open_service
from strata.text.sampling import SamplingParams
from strata.vision.client import VisionStartError
from strata.vision.embeds import PrecomputedEmbeds
from strata.vision.encoder import Encoder
from strata.vision.mmproj import Mmproj
from strata.vision.preprocess import load_image, preprocess
from strata.vision.protocol import parse_sve

from .conftest import SLOW_SHAPE, fake_cuda_encoder, noise_png

pytestmark = pytest.mark.timeout(60)

WIDTH = 256  # the tiny text model's embedding width
GREEDY = SamplingParams(temperature=0.0)
SLOW_TOKENS = 1024  # a 640x480 picture through the twelve-layer encoder: about a second on one thread


@pytest.fixture
def scripted(scripted: Callable[..., ScriptedEngine]) -> Callable[..., ScriptedEngine]:
    """Scripted engines as wide as this module's encoders' rows."""
    return lambda *args, **options: scripted(*args, **{"n_embd": WIDTH, **options})


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("vision-service") / "tiny.gguf"
    write_random_mmproj(path, WIDTH, "tiny", seed=3, dtype="f32")
    return path


@pytest.fixture(scope="module")
def slow_encoder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("vision-service") / "slow.gguf"
    write_random_mmproj(path, WIDTH, SLOW_SHAPE, seed=4, dtype="f16")
    return path


def data_url(picture: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(picture).decode()


def with_picture(url: str, text: str = "What is this?", role: str = "user") -> dict[str, Any]:
    return {"role": role, "content": [{"type": "text", "text": text},
                                      {"type": "image", "image": image_source(url, role)}]}


def image_source(url: str, role: str = "user", param: str = "messages[0].content[1]") -> ImageSource:
    return ImageSource(param, url=url, in_tool_result=role == "tool")


def chat(*messages: dict[str, Any], **fields: Any) -> ChatRequest:
    return ChatRequest(messages=list(messages), sampling=GREEDY, **fields)


async def collect(service, chat_request: ChatRequest) -> list[Any]:
    async with aclosing(service.chat(chat_request)) as events:
        return [event async for event in events]


def reference_rows(mmproj: Path, picture: bytes, max_tokens: int, tmp_path: Path) -> np.ndarray:
    path = tmp_path / "reference.png"
    path.write_bytes(picture)
    encoder = Encoder(Mmproj.load(mmproj), 1)
    return encoder.encode(preprocess(load_image(str(path)), encoder.hp, max_tokens).pixels)


def vision_config(mmproj: Path, **keys: Any):
    return server_config(vision={"mmproj": str(mmproj), "threads": 1, "max_tokens": 64, **keys})


async def test_rows_go_to_the_pad_positions(scripted, tokenizer, mmproj, tmp_path):
    engine = scripted("A picture.")
    picture = noise_png(64, 48, seed=30)
    async with open_service(vision_config(mmproj), engine=engine, tokenizer=tokenizer, log=lambda line: None) as svc:
        events = await collect(svc, chat(with_picture(data_url(picture))))
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "A picture."
    expected = reference_rows(mmproj, picture, 64, tmp_path)
    tokens, embeds = engine.calls[0], engine.embeds[0]
    pad = tokenizer.token_to_id("<|image_pad|>")
    (index, rows), = embeds
    assert tokens[index - 1] == tokenizer.token_to_id("<|vision_start|>")
    assert tokens[index:index + len(expected)] == [pad] * len(expected)
    assert tokens[index + len(expected)] == tokenizer.token_to_id("<|vision_end|>")
    np.testing.assert_allclose(rows, expected, rtol=0, atol=1e-5)


async def test_prefix_reuse_tells_pictures_apart(scripted, tokenizer, mmproj):
    engine = scripted("Seen.")
    a, b = data_url(noise_png(64, 48, seed=31)), data_url(noise_png(64, 48, seed=32))
    async with open_service(vision_config(mmproj), engine=engine, tokenizer=tokenizer, log=lambda line: None) as svc:
        await collect(svc, chat(with_picture(a)))
        first_prompt = engine.calls[0]
        follow_up = [with_picture(a), {"role": "assistant", "content": "Seen."}, {"role": "user", "content": "And?"}]
        events = await collect(svc, chat(*follow_up))
        same = next(e for e in events if isinstance(e, Usage))
        follow_up[0] = with_picture(b)
        third = len(engine.calls)
        events = await collect(svc, chat(*follow_up))
        other = next(e for e in events if isinstance(e, Usage))
    start = first_prompt.index(tokenizer.token_to_id("<|image_pad|>"))
    n_rows = first_prompt.count(tokenizer.token_to_id("<|image_pad|>"))
    assert same.cached_tokens > start + n_rows  # the picture's rows were reused
    assert other.cached_tokens == start  # another picture in the same place: reuse stops where it starts
    assert engine.embeds[third][0][0] == 0  # and its rows were evaluated again


async def test_tool_result_picture_that_fails_is_omitted(scripted, tokenizer, mmproj):
    engine = scripted("ok")
    call = {"id": "c1", "type": "function", "function": {"name": "shot", "arguments": {}}}
    broken = {"role": "tool", "tool_call_id": "c1", "content": [
        {"type": "image", "image": image_source(data_url(b"\x89PNG\r\n\x1a\n broken"), "tool")}]}
    messages = [{"role": "user", "content": "Take a screenshot"}, {"role": "assistant", "content": "",
                                                                   "tool_calls": [call]}, broken]
    async with open_service(vision_config(mmproj), engine=engine, tokenizer=tokenizer, log=lambda line: None) as svc:
        await collect(svc, chat(*messages))
    prompt = tokenizer.decode(engine.calls[0])
    assert "[image omitted: the data is not a picture" in prompt
    assert "<|image_pad|>" not in prompt


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64,AAAA", "messages[0].content[1]: the data is not a picture"),
    ("ftp://example.com/a.png", "unsupported image URL scheme 'ftp'"),
])
async def test_users_own_bad_picture_is_a_request_error(scripted, tokenizer, mmproj, url, message):
    config = vision_config(mmproj)
    async with open_service(config, engine=scripted(), tokenizer=tokenizer, log=lambda line: None) as svc:
        with pytest.raises(RequestError, match=re.escape(message)) as caught:
            await collect(svc, chat(with_picture(url)))
        assert caught.value.param == "messages[0].content[1]"
        assert svc.history.last.finish == "refused" and not svc.turn.busy


async def test_picture_without_an_encoder(scripted, tokenizer):
    async with open_service(server_config(), engine=scripted(), tokenizer=tokenizer) as svc:
        with pytest.raises(RequestError, match="has none"):
            await collect(svc, chat(with_picture(data_url(noise_png(8, 8)))))


async def test_local_encoder_with_a_bad_file_stops_startup(scripted, tokenizer, tmp_path):
    missing = tmp_path / "missing-mmproj.gguf"
    with pytest.raises(VisionStartError, match="missing-mmproj.gguf"):
        async with open_service(vision_config(missing), engine=scripted(), tokenizer=tokenizer,
                                log=lambda line: None):
            pass


async def test_absent_remote_encoder_serves_text_and_refuses_pictures(scripted, tokenizer):
    script = "import sys; print('ssh: connect to host box port 22: Connection refused', file=sys.stderr); sys.exit(255)"
    config = server_config(vision={"exe": [sys.executable, "-c", script], "remote": True})
    lines = []
    async with open_service(config, engine=scripted("text"), tokenizer=tokenizer, log=lines.append) as svc:
        events = await collect(svc, chat({"role": "user", "content": "hi"}))
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "text"
        with pytest.raises(ServiceUnavailable, match="^the image encoder is not available: .*Connection refused"):
            await collect(svc, chat(with_picture(data_url(noise_png(8, 8)))))
    assert any("not available yet" in line for line in lines)


async def test_precomputed_embeddings(scripted, tokenizer, mmproj, tmp_path):
    picture = tmp_path / "p.png"
    picture.write_bytes(noise_png(48, 32, seed=33))
    out = tmp_path / "p.sve"
    env = dict(os.environ, PYTHONPATH=str(Path(strata.__file__).parents[1]))  # already absolute
    done = await trio.run_process([sys.executable, "-m", "strata.vision.worker", "encode", str(picture), "--mmproj",
                                   str(mmproj), "--out", str(out), "--max-tokens", "64"], capture_stdout=True,
                                  env=env)
    fingerprint = json.loads(done.stdout)["fingerprint"]

    def embeds_message(fingerprint: str) -> dict[str, Any]:
        part = PrecomputedEmbeds("messages[0].content[0]", out.read_bytes(), fingerprint)
        return {"role": "user", "content": [{"type": "image", "image": part}]}

    engine = scripted("ok")
    async with open_service(vision_config(mmproj), engine=engine, tokenizer=tokenizer, log=lambda line: None) as svc:
        await collect(svc, chat(embeds_message(fingerprint)))
        with pytest.raises(RequestError, match="fingerprint .* is not this server's encoder"):
            await collect(svc, chat(embeds_message("sha256:" + "0" * 64)))
        assert svc.vision.status()["encodes"] == 0
    np.testing.assert_array_equal(engine.embeds[0][0][1], parse_sve(out.read_bytes())[1])


# --- cancellation in every phase


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def assert_clean_after_cancel(svc, engine: ScriptedEngine) -> None:
    assert not svc.turn.busy and svc.turn.queued == 0
    assert svc.history.last.finish == "cancel"
    assert svc.vision.status()["queued"] == 0
    pid = svc.vision.pid
    if pid is not None:
        before = cpu_seconds(pid)
        await trio.sleep(0.2)
        assert cpu_seconds(pid) - before < 0.03  # the encoder is idle


async def test_cancel_during_download(scripted, tokenizer, mmproj, nursery):
    pictures = PictureServer()
    await nursery.start(pictures.serve)
    engine = scripted()
    config = server_config(vision={"mmproj": str(mmproj), "threads": 1, "max_tokens": 64},
                           images={"allow_private": True})  # the picture server is on 127.0.0.1
    async with open_service(config, engine=engine, tokenizer=tokenizer, log=lambda line: None) as svc:
        with trio.move_on_after(0.3) as scope:
            await collect(svc, chat(with_picture(f"http://127.0.0.1:{pictures.port}/slow")))
        assert scope.cancelled_caught and trio.current_time() - scope.deadline < 0.05
        await assert_clean_after_cancel(svc, engine)
        await wait_until(lambda: pictures.open_connections == 0)
    assert engine.calls == []


async def test_cancel_while_queued_and_during_encode(scripted, tokenizer, slow_encoder, nursery):
    engine = scripted()
    config = vision_config(slow_encoder, max_tokens=SLOW_TOKENS)
    async with open_service(config, engine=engine, tokenizer=tokenizer, log=lambda line: None) as svc:
        first = trio.CancelScope()

        async def first_request():
            with first:
                await collect(svc, chat(with_picture(data_url(noise_png(640, 480, seed=34)))))

        nursery.start_soon(first_request)
        await wait_until(lambda: svc.vision._fifo.locked())
        with trio.move_on_after(0.2) as queued:  # waits behind the first encode
            await collect(svc, chat(with_picture(data_url(noise_png(640, 480, seed=35)))))
        assert queued.cancelled_caught and svc.vision.status()["queued"] == 0
        assert svc.history.last.finish == "cancel"
        first.cancel()  # mid-encode
        await wait_until(lambda: len(svc.history.rows) == 2)
        await assert_clean_after_cancel(svc, engine)
        assert svc.vision.status()["encodes"] == 0 and engine.calls == []


async def test_cancel_during_generation(scripted, tokenizer, mmproj, nursery):
    engine = scripted("x" * 200, decode_s=0.01)
    async with open_service(vision_config(mmproj), engine=engine, tokenizer=tokenizer, log=lambda line: None) as svc:
        scope = trio.CancelScope()

        async def picture_request():
            with scope:
                await collect(svc, chat(with_picture(data_url(noise_png(32, 32, seed=36)))))

        nursery.start_soon(picture_request)
        await wait_until(lambda: svc.phase == "decode" and engine.running.is_set(), timeout=20)
        scope.cancel()
        await wait_until(lambda: svc.history.rows)
        await assert_clean_after_cancel(svc, engine)
    assert engine.aborts == 1 and engine.embeds[0]


# --- text and encodes at the same time


async def text_latency(svc) -> float:
    started = trio.current_time()
    await collect(svc, chat({"role": "user", "content": "hi"}))
    return trio.current_time() - started


async def latencies_around_an_encode(svc, png: bytes, encoding: Callable[[], bool]) -> tuple[float, float, bool]:
    """(a text request's latency before a picture, its latency once `encoding()` says the picture's encode is under
    way, whether that encode was still unfinished when the text answer was complete)."""
    baseline = await text_latency(svc)
    done = trio.Event()

    async def picture():
        await collect(svc, chat(with_picture(data_url(png))))
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(picture)
        await wait_until(encoding)
        during = await text_latency(svc)
        overlapped = not done.is_set()
    return baseline, during, overlapped


async def test_text_does_not_wait_for_a_cpu_encode(scripted, tokenizer, slow_encoder):
    engine = scripted("Hello!", prompt_s=0.001, decode_s=0.01)
    config = vision_config(slow_encoder, max_tokens=SLOW_TOKENS)
    async with open_service(config, engine=engine, tokenizer=tokenizer, log=lambda line: None) as svc:
        baseline, during, overlapped = await latencies_around_an_encode(
            svc, noise_png(640, 480, seed=37), lambda: svc.vision._fifo.locked())
    assert overlapped  # the encode was still running when the text answer was complete
    # About its baseline (a loose bound: the test machine's cores are shared), and far below an encode.
    assert during < baseline * 3 + 0.2


async def test_a_cuda_encoder_holds_the_turn_and_text_waits(scripted, tokenizer, tmp_path):
    config = server_config(vision={"exe": fake_cuda_encoder(tmp_path, seconds=0.6, width=256)})
    engine = scripted("Hello!")
    async with open_service(config, engine=engine, tokenizer=tokenizer, log=lambda line: None) as svc:
        baseline, during, _ = await latencies_around_an_encode(svc, noise_png(32, 32, seed=38),
                                                               lambda: svc.turn.busy)
    assert svc.vision.cuda and during > 0.3 > baseline


async def test_a_cuda_encoder_pauses_the_whole_batch_between_steps(scripted, tokenizer, tmp_path):
    """Three streams decoding on three slots: a picture's encode on an encoder that holds a CUDA context waits
    for the step in flight, no engine call runs while it encodes, and then every stream goes on, each with the
    answer it gives alone."""
    config = server_config(slots=4, vision={"exe": fake_cuda_encoder(tmp_path, seconds=0.4, width=WIDTH)})
    engine = scripted("y" * 80, decode_s=0.005, n_seq=4)
    calls: list[tuple[float, float]] = []
    evaluate = engine.eval_batch

    def timed(items, notify_fd=-1):
        started = time.perf_counter()
        try:
            return evaluate(items, notify_fd=notify_fd)
        finally:
            calls.append((started, time.perf_counter()))

    engine.eval_batch = timed
    async with open_service(config, engine=engine, tokenizer=tokenizer, log=lambda line: None) as svc:
        held: list[tuple[float, float]] = []
        pause = svc.loop.paused

        @contextlib.asynccontextmanager
        async def recorded():
            async with pause():
                started = time.perf_counter()
                try:
                    yield
                finally:
                    held.append((started, time.perf_counter()))

        svc.loop.paused = recorded
        alone = "".join(e.text for e in await collect(svc, chat({"role": "user", "content": "s"}))
                        if isinstance(e, TextDelta))
        answers: dict[int, list[tuple[float, str]]] = {i: [] for i in range(3)}

        async def stream(i: int) -> None:
            async with aclosing(svc.chat(chat({"role": "user", "content": f"stream {i}"}))) as events:
                async for event in events:
                    if isinstance(event, TextDelta):
                        answers[i].append((time.perf_counter(), event.text))

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(stream, i)
            await wait_until(lambda: all(len(a) >= 5 for a in answers.values()))
            assert svc.loop.batcher.free_slots == 1  # three slots busy
            picture = await collect(svc, chat(with_picture(data_url(noise_png(32, 32, seed=39)))))
    assert svc.vision.cuda and len(held) == 1
    start, end = held[0]
    assert end - start >= 0.4  # the encode ran inside the hold
    assert all(e <= start or s >= end for s, e in calls)  # and no engine call overlapped it
    for answer in answers.values():
        assert "".join(text for _, text in answer) == alone
        assert any(t < start for t, _ in answer) and any(t > end for t, _ in answer)  # paused, then went on
    assert "".join(e.text for e in picture if isinstance(e, TextDelta)) == alone


async def test_server_with_a_bad_local_encoder_exits_naming_the_file(tiny_model, tmp_path):
    from strata.api.server import serve

    missing = tmp_path / "missing-mmproj.gguf"
    config = server_config(model=str(tiny_model), vision={"mmproj": str(missing)})
    lines: list[str] = []
    with trio.fail_after(60):
        status = await serve(config, log=lines.append)
    assert status == 1
    assert any(line.startswith("error: the image encoder did not start") and "missing-mmproj.gguf" in line
               for line in lines)


async def test_a_hung_encoder_is_restarted_and_the_picture_gets_a_503(scripted, tokenizer, mmproj):
    """SIGSTOP on the encoder: the picture's encode times out (its own rows x the configured seconds per row),
    the encoder is stopped and reported, and the next picture starts it again."""
    config = vision_config(mmproj, encode_timeout=0.5, encode_timeout_per_row=0.01)
    async with open_service(config, engine=scripted("ok"), tokenizer=tokenizer, log=lambda line: None) as svc:
        assert svc.vision.encode_timeout(svc.vision.last_ready) == pytest.approx(1.14)  # at most 64 rows
        assert svc.vision.encode_timeout(svc.vision.last_ready, 12) == pytest.approx(0.62)
        pid = svc.vision.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            # 64x48 in 16-pixel tokens: 4x3 = 12 rows, so 0.62 s, not the 1.14 s of the largest picture
            with trio.fail_after(10), pytest.raises(ServiceUnavailable, match="within 0.62 s") as caught:
                await collect(svc, chat(with_picture(data_url(noise_png(64, 48, seed=50)))))
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        assert caught.value.retry_after is not None
        state = svc.vision.status()
        assert (state["available"], state["timeouts"]) == (False, 1)
        assert "did not finish a picture" in state["last_error"]
        events = await collect(svc, chat(with_picture(data_url(noise_png(64, 48, seed=51)))))
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "ok"
        state = svc.vision.status()
        assert state["available"] and state["restarts"] == 1 and svc.vision.pid != pid
        assert svc.history.totals.finishes["unavailable"] == 1


async def test_refused_requests_are_not_counted_as_errors(scripted, tokenizer):
    engine = scripted("ok", n_ctx=64)
    async with open_service(server_config(), engine=engine, tokenizer=tokenizer, log=lambda line: None) as svc:
        with pytest.raises(RequestError):
            await collect(svc, chat({"role": "user", "content": "x" * 500}))
        assert svc.history.totals.finishes == {"refused": 1}


async def test_too_many_pictures_are_refused_before_any_encode(scripted, tokenizer, mmproj):
    """100 large pictures used to be encoded (35-40 s) before the request was found too long."""
    config = server_config(vision={"mmproj": str(mmproj), "threads": 1, "max_tokens": 64},
                           limits={"max_pictures": 3})
    picture = {"type": "image", "image": ImageSource("p", data=noise_png(64, 48, seed=60))}
    async with open_service(config, engine=scripted("ok"), tokenizer=tokenizer, log=lambda line: None) as svc:
        parts = [dict(picture, image=ImageSource(f"messages[0].content[{k}]", data=noise_png(64, 48, seed=k)))
                 for k in range(100)]
        with pytest.raises(RequestError, match=r"messages\[0\].content\[3\]: the request has 100 pictures") as e:
            await collect(svc, chat({"role": "user", "content": parts}))
        assert e.value.param == "messages[0].content[3]"
        assert svc.vision.status()["encodes"] == 0
        events = await collect(svc, chat({"role": "user", "content": parts[:3]}))
        assert svc.vision.status()["encodes"] == 3 and any(isinstance(e, TextDelta) for e in events)


async def test_pictures_that_cannot_fit_the_context_are_refused_before_any_encode(scripted, tokenizer, mmproj):
    """Each 640x480 picture takes 9x7 = 63 rows (known from its header): five cannot fit a 256-position context, so the
    request is refused as too long with no picture encoded; three fit and are encoded."""
    config = vision_config(mmproj)
    parts = [{"type": "image", "image": ImageSource(f"messages[0].content[{k}]", data=noise_png(640, 480, seed=70 + k))}
             for k in range(5)]
    async with open_service(config, engine=scripted("ok", n_ctx=256), tokenizer=tokenizer,
                            log=lambda line: None) as svc:
        with pytest.raises(RequestError, match="pictures take 315 prompt tokens; the context holds 256") as caught:
            await collect(svc, chat({"role": "user", "content": parts}))
        assert caught.value.code == "context_length_exceeded"
        assert svc.vision.status()["encodes"] == 0
        with pytest.raises(RequestError, match="pictures take 315 prompt tokens"):
            await svc.count_tokens(chat({"role": "user", "content": parts}))
        assert svc.vision.status()["encodes"] == 0
        events = await collect(svc, chat({"role": "user", "content": parts[:3]}))
        assert svc.vision.status()["encodes"] == 3 and any(isinstance(e, TextDelta) for e in events)


async def test_rows_predicted_from_the_header_equal_the_encoders(scripted, tokenizer, mmproj):
    """The server's prediction (READY's sizing rule on the header's size) against the encoder process's answer."""
    async with open_service(vision_config(mmproj, min_tokens=4), engine=scripted(), tokenizer=tokenizer,
                            log=lambda line: None) as svc:
        ready = svc.vision.last_ready
        assert ready.capabilities.sizing is not None
        for seed, (width, height) in enumerate([(1, 1), (20, 300), (64, 48), (100, 37), (640, 480), (3000, 40)]):
            data = noise_png(width, height, seed=80 + seed)
            embedding = await svc.vision.encode(data)
            assert svc.vision.rows(ready, check_image(data)) == embedding.n_tokens, (width, height)


async def test_shutdown_during_a_download_is_a_503(scripted, tokenizer, mmproj, nursery):
    pictures = PictureServer()
    await nursery.start(pictures.serve)
    config = server_config(vision={"mmproj": str(mmproj), "threads": 1, "max_tokens": 64},
                           images={"allow_private": True})  # the picture server is on 127.0.0.1
    async with open_service(config, engine=scripted(), tokenizer=tokenizer, log=lambda line: None) as svc:
        async def shut_down_soon() -> None:
            await trio.sleep(0.3)
            svc.stopping.set()

        nursery.start_soon(shut_down_soon)
        with trio.fail_after(5), pytest.raises(ServiceUnavailable, match="shutting down"):
            await collect(svc, chat(with_picture(f"http://127.0.0.1:{pictures.port}/slow")))
        await wait_until(lambda: pictures.open_connections == 0)
        assert svc.history.last.finish == "unavailable"


@pytest.fixture(scope="module")
def lfm2_vl_mmproj(tmp_path_factory) -> Path:
    """An LFM2-VL file (no variant key) with LFM2-VL's 16-pixel patches: a 512-pixel tile is 16x16 = 256 rows."""
    path = tmp_path_factory.mktemp("vision-service") / "lfm2-vl.gguf"
    shape = VisionShape(image_size=32, patch_size=16, n_embd=32, n_ff=64, n_head=2, n_layer=2)
    write_random_mmproj(path, WIDTH, shape, seed=5, dtype="f32", variant="lfm2-vl")
    return path


async def test_a_tiled_pictures_parts_follow_their_markers(scripted, tokenizer, lfm2_vl_mmproj, tmp_path):
    """A 600x300 picture over a 16-row budget is split as LFM2-VL splits it: two 512-pixel tiles (256 rows each)
    and a 5x2 thumbnail, each after its marker (this vocabulary has no LFM2 markers: their text); the rows are the
    worker's; the context check and count_tokens count the markers too."""
    picture = noise_png(600, 300, seed=91)
    config = vision_config(lfm2_vl_mmproj, max_tokens=16, min_tokens=4)
    markers = ["<|img_row_1_col_1|>", "<|img_row_1_col_2|>", "<|img_thumbnail|>"]
    marker_ids = [tokenizer.encode(marker, special=False) for marker in markers]
    n_positions = 2 * 256 + 10 + sum(map(len, marker_ids))
    engine = scripted("A picture.", n_ctx=2048)
    async with open_service(config, engine=engine, tokenizer=tokenizer, log=lambda line: None) as svc:
        request = chat(with_picture(data_url(picture)))
        plain = await svc.count_tokens(chat({"role": "user", "content": [{"type": "text", "text": "What is this?"}]}))
        # the picture: <|vision_start|>, its positions, <|vision_end|>
        assert await svc.count_tokens(request) == plain + 2 + n_positions
        await collect(svc, request)
    path = tmp_path / "tiled.png"
    path.write_bytes(picture)
    encoder = Encoder(Mmproj.load(lfm2_vl_mmproj), 1)
    resized = preprocess(load_image(str(path)), encoder.hp, 16, 4)
    expected = [encoder.encode(part) for part in resized.parts]
    assert [len(rows) for rows in expected] == [256, 256, 10]
    # the prompt reaches the engine in chunks: put its positions and rows back together
    tokens: list[int] = []
    row_at: dict[int, np.ndarray] = {}
    for call, embeds in zip(engine.calls, engine.embeds, strict=True):
        for index, rows in embeds:
            row_at.update((len(tokens) + index + k, row) for k, row in enumerate(np.asarray(rows)))
        tokens += call
    pad = tokenizer.token_to_id("<|image_pad|>")
    index = tokens.index(tokenizer.token_to_id("<|vision_start|>")) + 1
    for ids, want in zip(marker_ids, expected, strict=True):
        assert tokens[index:index + len(ids)] == ids
        index += len(ids)
        assert tokens[index:index + len(want)] == [pad] * len(want)
        np.testing.assert_allclose(np.stack([row_at[index + k] for k in range(len(want))]), want, rtol=0, atol=1e-5)
        index += len(want)
    assert tokens[index] == tokenizer.token_to_id("<|vision_end|>") and len(row_at) == 2 * 256 + 10

    async with open_service(config, engine=scripted("ok", n_ctx=512), tokenizer=tokenizer,
                            log=lambda line: None) as svc:
        with pytest.raises(RequestError, match=f"pictures take {n_positions} prompt tokens") as caught:
            await collect(svc, chat(with_picture(data_url(picture))))
        assert caught.value.code == "context_length_exceeded"
        assert svc.vision.status()["encodes"] == 0
