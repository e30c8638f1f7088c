"""`VisionPool`: several remote encoders (real `strata-vision` processes) as one, for a fleet's replicas to
share: a picture goes to an idle encoder, and past one that is down."""

from __future__ import annotations

import base64
import os
import shlex
import signal
import sys
from contextlib import aclosing
from pathlib import Path

import pytest
import trio
from conftest import server_config

import strata
from strata.config import ConfigError, VisionConfig, config_from_dict
from strata.events import ChatRequest, TextDelta
from strata.modelgen.mmproj import write_random_mmproj
from strata.pictures.sources import ImageSource
from strata.service import open_service
from strata.vision.pool import VisionPool

from .conftest import noise_png

pytestmark = pytest.mark.timeout(60)


def encoder_line(mmproj: Path) -> str:
    src = str(Path(strata.__file__).resolve().parents[1])
    return shlex.join(["env", f"PYTHONPATH={src}", sys.executable, "-m", "strata.vision.worker", "--mmproj",
                       str(mmproj), "--threads", "1", "--max-tokens", "64"])


async def test_pictures_go_to_idle_encoders_and_past_one_that_is_down(nursery, tiny_mmproj):
    pool = VisionPool(VisionConfig(pool=[encoder_line(tiny_mmproj)] * 2), log=lambda line: None)
    await nursery.start(pool.run)
    assert pool.available and pool.startup_line() == "vision: a pool of 2 remote encoders, 2 ready"
    embeddings = {}

    async def encode(seed: int) -> None:
        embeddings[seed] = await pool.encode(noise_png(64, 48, seed))

    async with trio.open_nursery() as pictures:  # two at once: one each
        for seed in (1, 2):
            pictures.start_soon(encode, seed)
    assert [client.encodes for client in pool.clients] == [1, 1]
    assert embeddings[1].rows.shape == embeddings[2].rows.shape and (embeddings[1].rows != embeddings[2].rows).any()

    pid = pool.clients[0].pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)  # the first encoder's host goes away
    with trio.fail_after(10):
        while pool.clients[0].available:
            await trio.sleep(0.01)
    await encode(3)
    assert [client.encodes for client in pool.clients] == [1, 2]
    assert (await pool.encode(noise_png(64, 48, 1))) is embeddings[1]  # the shared cache
    status = pool.status()
    assert (status["encodes"], status["cache_hits"], len(status["pool"])) == (3, 1, 2)
    assert status["available"] and [each["available"] for each in status["pool"]] == [False, True]


def test_a_pool_entry_must_be_a_command_line():
    with pytest.raises(ConfigError, match=r'"vision.pool\[1\]" must be a command line'):
        config_from_dict({"vision": {"pool": ["ssh gpu1 strata-vision", "  "]}})
    with pytest.raises(ConfigError, match=r'"vision.pool\[0\]" is not a command line'):
        config_from_dict({"vision": {"pool": ["ssh 'gpu1"]}})


async def test_a_service_with_a_pool_answers_about_a_picture(scripted, tokenizer, tmp_path):
    mmproj = tmp_path / "tiny.gguf"
    write_random_mmproj(mmproj, 256, "tiny", seed=3, dtype="f32")  # rows as wide as the scripted engine's
    engine = scripted("A picture.", n_embd=256)
    config = server_config(vision={"pool": [encoder_line(mmproj)] * 2})
    picture = "data:image/png;base64," + base64.b64encode(noise_png(64, 48, seed=5)).decode()
    message = {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                           {"type": "image", "image": ImageSource("messages[0].content[1]",
                                                                                  url=picture)}]}
    async with open_service(config, engine=engine, tokenizer=tokenizer, log=lambda line: None) as service:
        async with aclosing(service.chat(ChatRequest(messages=[message]))) as events:
            text = "".join([event.text async for event in events if isinstance(event, TextDelta)])
        status = service.vision.status() if service.vision is not None else {}
    assert text == "A picture."
    ((_, rows),) = engine.embeds[0]
    assert rows.shape[1] == 256 and len(rows) > 0
    assert status["mode"] == "remote" and status["encodes"] == 1 and len(status["pool"]) == 2
