"""The GPU encoder in the server: with `device: host` (the test device) and `vision.gpu`, the server runs the real
`strata-vision --gpu --device host`, whose READY says it holds the device; a picture then takes the engine's turn
and a text request waits for the encode, through hypercorn, with the GPU backend's engine on the same device. The
backend's budget leaves the encoder its share of the card (`gpu_memory`, or the free memory less the reserve, less
what the encoder says it takes)."""

from __future__ import annotations

import base64
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import live_server, server_config

from strata.engine_cffi.device import Device
from strata.engine_cffi.device_engine import RESERVE, device_budget, open_device
from strata.modelgen.mmproj import write_random_mmproj
from strata.service import open_service
from strata.vision import gpu_check
from strata.vision.device_encoder import encoder_share

from .conftest import SLOW_SHAPE, noise_png

pytestmark = pytest.mark.timeout(180)

MAX_TOKENS = 256  # a 256x256 picture: 16x16 tokens, 1024 patches through twelve layers (over a second here)
GiB, MiB = 1 << 30, 1 << 20


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory, tiny_model) -> Path:
    from strata.engine_cffi import Engine

    with Engine.load(tiny_model, n_ctx=64) as probe:
        width = probe.n_embd
    path = tmp_path_factory.mktemp("gpu-encoder") / "slow-f32.gguf"
    write_random_mmproj(path, width, SLOW_SHAPE, seed=7, dtype="f32")
    return path


def gpu_config(tiny_model: Path, mmproj: Path, **keys):
    return server_config(model=str(tiny_model), context=1024, kv="f32", device="host",
                         vision={"mmproj": str(mmproj), "gpu": True, "max_tokens": MAX_TOKENS}, **keys)


def test_the_backends_budget_leaves_the_encoder_its_share():
    assert device_budget(8 * GiB, None, 300 * MiB) == 8 * GiB - RESERVE - 300 * MiB
    assert device_budget(8 * GiB, 4 * GiB, 300 * MiB) == 4 * GiB - 300 * MiB  # gpu_memory: both within it
    assert device_budget(0, 4 * GiB, 0) == 4 * GiB
    assert device_budget(RESERVE + MiB, None, 2 * MiB) == 1  # nothing left: the model's load refuses it
    with open_device("host", 10 * MiB, 3 * MiB) as dev:
        assert dev.budget == 7 * MiB
    with open_device("host", None, 3 * MiB) as dev, Device("host") as unlimited:
        assert dev.budget == unlimited.budget


async def test_startup_gives_the_expert_cache_what_the_encoder_leaves(tiny_model, mmproj):
    lines: list[str] = []
    async with open_service(gpu_config(tiny_model, mmproj, gpu_memory=0.25), log=lines.append) as service:
        status = service.vision.status()
        share = encoder_share(mmproj, None, MAX_TOKENS)
        assert status["cuda"] and status["takes_turn"] and status["device_bytes"] == share
        assert service.engine.device.budget == GiB // 4 - share
    said = [line for line in lines if line.startswith("expert cache: ")]
    assert len(said) == 1 and said[0].endswith(f"GiB ({share / MiB:,.0f} MiB left to the GPU image encoder)")


def test_a_picture_on_the_gpu_encoder_takes_the_engines_turn_and_text_waits(tiny_model, mmproj):
    picture = "data:image/png;base64," + base64.b64encode(noise_png(256, 256, seed=70)).decode()
    ask = {"max_tokens": 4, "temperature": 0}
    with live_server(gpu_config(tiny_model, mmproj)) as server:
        vision = server.call(lambda: server.service.vision)
        status = httpx.get(server.url + "/v1/status").json()["vision"]
        assert (status["mode"], status["cuda"], status["takes_turn"]) == ("gpu", True, True)
        answered: list[httpx.Response] = []

        def picture_request() -> None:
            content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": picture}}]
            answered.append(httpx.post(server.url + "/v1/chat/completions", timeout=120,
                                       json=ask | {"messages": [{"role": "user", "content": content}]}))

        thread = threading.Thread(target=picture_request)
        thread.start()
        try:
            while not server.call(lambda: server.service.turn.exclusive > 0):  # the encode holds the engine
                assert thread.is_alive()
                time.sleep(0.005)
            text = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                              json=ask | {"messages": [{"role": "user", "content": "hi"}]})
            # the text request was answered only after the encode it waited for had finished
            assert text.status_code == 200 and server.call(lambda: vision.encodes) == 1
        finally:
            thread.join(120)
        assert answered[0].status_code == 200, answered[0].text


def test_the_gpu_checks_encoder_table_passes_on_the_host(capsys):
    """`scripts/gpu-check.sh`'s fourth part (strata.vision.gpu_check), its quick form on the host device."""
    assert gpu_check.main(["--device", "host", "--quick"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("strata-vision --gpu on host against the CPU encoder")
    assert len(table) == 4 and table[3].startswith("| demo (F32)               |    63 |") and "| pass   |" in table[3]
