"""The GPU backend in the server (`device`): on the host device (the test device) it answers as the CPU engine
does, through hypercorn, and shows its expert cache in /v1/status and /metrics; `device: cuda` where no GPU can
be opened, or with an architecture the backend does not run, runs the CPU engine and says why in one startup line.
A Qwen3.5 MoE model (recurrent layers) answers as on the CPU engine, speculation's verify steps and their rolled
back states included; its MTP block runs on the backend where speculation may use it, its drafts verified to
the same answer."""

from __future__ import annotations

import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from conftest import live_server, server_config

from strata.engine_cffi.device import Device
from strata.engine_cffi.device_engine import DeviceEngine
from strata.modelgen import write_random_model
from strata.request_errors import ServiceUnavailable
from strata.service import open_service

ASK = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def qwen35_model(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random qwen35moe (F32, byte vocabulary) with its MTP block."""
    return write_random_model(tmp_path_factory.mktemp("q35") / "q35.gguf", arch="qwen35moe", size="tiny",
                              dtype="f32", seed=1)


def answer(url: str, messages: list[dict[str, str]] | None = None, prediction: str | None = None, **ask: Any) -> str:
    body = ASK | ({"messages": messages} if messages else {}) | ask
    if prediction is not None:
        body["prediction"] = {"type": "content", "content": prediction}
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    reply.raise_for_status()
    return reply.json()["choices"][0]["message"]["content"]


def test_the_host_device_answers_as_the_cpu_engine_and_shows_its_expert_cache(tiny_model):
    with live_server(server_config(model=str(tiny_model), context=256, kv="f32")) as cpu:
        want = answer(cpu.url)
    config = server_config(model=str(tiny_model), context=256, kv="f32", device="host", gpu_memory=0.25)
    with live_server(config) as server:
        assert answer(server.url) == want
        status = httpx.get(server.url + "/v1/status").json()
        metrics = httpx.get(server.url + "/metrics").text
    engine = status["engine"]
    assert engine["backend"] == "host"
    cache = engine["expert_cache"]
    # 0.25 GiB holds every expert of the tiny model: all uploaded at load, each step resident (no miss, no upload)
    assert cache["capacity"] == cache["preloaded"] == 16 and cache["hits"] > 0
    assert cache["misses"] == cache["uploads"] == 0
    samples = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if not line.startswith("#"))
    for outcome, key in (("hit", "hits"), ("miss", "misses"), ("upload", "uploads")):
        assert float(samples[f'strata_expert_cache_experts_total{{outcome="{outcome}"}}']) == cache[key]
    assert float(samples["strata_expert_cache_bytes"]) == cache["bytes"]


def test_concurrent_requests_and_a_reused_prefix_answer_as_on_the_cpu_engine(tiny_model):
    """Several sequences decoding in one step, and a second turn whose prefix the slot's cache (or a copy of it to
    another slot) supplies: the backend's positions, keep and copy_prefix."""
    turns = [[{"role": "user", "content": text}] for text in ("Tell me a story.", "Name a colour.", "Count.")]
    follow = turns[0] + [{"role": "assistant", "content": "Once"}, {"role": "user", "content": "Go on."}]

    def answers(url: str) -> list[str]:
        with ThreadPoolExecutor(3) as pool:
            first = list(pool.map(lambda m: answer(url, m), turns))
        return first + [answer(url, follow), answer(url, turns[1])]

    with live_server(server_config(model=str(tiny_model), context=256, kv="f32", slots=3)) as cpu:
        want = answers(cpu.url)
    with live_server(server_config(model=str(tiny_model), context=256, kv="f32", slots=3, device="host")) as server:
        assert answers(server.url) == want
        status = httpx.get(server.url + "/v1/status").json()
    assert status["totals"]["reused_tokens"] > 0


async def test_the_cpu_engine_shows_no_expert_cache(tiny_model):
    async with open_service(server_config(model=str(tiny_model), context=256), log=lambda line: None) as service:
        assert service.engine.expert_counts() is None


async def test_the_host_device_says_what_its_expert_cache_holds(tiny_model):
    lines: list[str] = []
    config = server_config(model=str(tiny_model), context=256, device="host")
    async with open_service(config, log=lines.append) as service:
        capacity = service.engine.expert_counts()["capacity"]
    assert any("backend host" in line for line in lines)
    cache = [line for line in lines if line.startswith("expert cache: ")]
    assert len(cache) == 1 and re.fullmatch(rf"expert cache: {capacity} experts, \d+\.\d\d GiB", cache[0])


def test_a_restart_starts_its_expert_cache_from_the_routing_the_last_run_recorded(tiny_model, tmp_path):
    """`expert_prior` naming record_routing's own file: each start holds the last run's most used experts (read
    before recording starts afresh) and answers as without it."""
    trace = tmp_path / "routing.trace"
    shape = dict(model=str(tiny_model), context=256, kv="f32", device="host", record_routing=str(trace))
    config = server_config(**shape)
    with DeviceEngine.open(tiny_model, Device("host"), n_ctx=config.context, kv=config.kv, n_batch=config.batch,
                           n_seq=config.slots, capacity=0) as engine:
        dense, slot = engine.device.used, engine.slots.slot_bytes  # weights, KV cache, activations; one expert
    with live_server(config) as server:
        want = answer(server.url)
    config = server_config(**shape, expert_prior=str(trace), gpu_memory=(dense + 4.5 * slot) / 2**30)
    with live_server(config) as server:
        cache = httpx.get(server.url + "/v1/status").json()["engine"]["expert_cache"]
        assert cache["preloaded"] == cache["capacity"] == 4  # of the tiny model's 2 layers of 8 experts
        assert answer(server.url) == want
        cache = httpx.get(server.url + "/v1/status").json()["engine"]["expert_cache"]
    assert cache["hits"] > 0


async def test_an_expert_prior_that_is_not_a_routing_trace_is_a_startup_error(tiny_model, tmp_path):
    bad = tmp_path / "not.trace"
    bad.write_bytes(b"hello")
    config = server_config(model=str(tiny_model), context=256, device="host", expert_prior=str(bad))
    with pytest.raises(ExceptionGroup) as failed:  # the service's nursery's
        async with open_service(config, log=lambda line: None):
            pass
    assert failed.group_contains(ServiceUnavailable, match=r"expert_prior: .*not a routing trace", depth=None)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine: the backend would run")
async def test_cuda_without_a_gpu_runs_the_cpu_engine_and_says_so_in_one_line(tiny_model):
    lines: list[str] = []
    config = server_config(model=str(tiny_model), context=256, device="cuda")
    async with open_service(config, log=lines.append) as service:
        assert service.engine.backend == "cpu"
    said = [line for line in lines if line.startswith("device cuda")]
    assert len(said) == 1 and said[0].endswith("; running on the CPU") and "\n" not in said[0]
    assert not any(line.startswith("expert cache") for line in lines)


def test_a_qwen35moe_model_on_the_host_device_answers_as_the_cpu_engine(qwen35_model):
    """Speculation on (source auto: the request's prediction, the MTP block on the device after it): a prediction
    right at first and wrong later makes verify steps of several tokens through the recurrent layers, and a
    refused draft's rolled-back state."""
    ask = {"max_tokens": 24, "chat_template_kwargs": {"enable_thinking": False}}
    with live_server(server_config(model=str(qwen35_model), context=256, kv="f32")) as cpu:
        want = answer(cpu.url, **ask)
    half = len(want) // 2
    config = server_config(model=str(qwen35_model), context=256, kv="f32", device="host",
                           speculative={"source": "auto", "adaptive": False})
    with live_server(config) as server:
        assert answer(server.url, prediction=want[:half] + "#" * half, **ask) == want
        assert answer(server.url, **ask) == want  # again, from the prefix cache
        status = httpx.get(server.url + "/v1/status").json()
    assert status["engine"]["backend"] == "host" and status["engine"]["expert_cache"]["hits"] > 0
    totals = status["totals"]
    assert len(want) > 10 and 0 < totals["accepted_tokens"] < totals["draft_tokens"]
    assert totals["reused_tokens"] > 0


async def test_source_auto_runs_the_mtp_block_on_the_backend_without_a_line(qwen35_model):
    lines: list[str] = []
    config = server_config(model=str(qwen35_model), context=256, device="host", speculative={"source": "auto"})
    async with open_service(config, log=lines.append) as service:
        assert service.engine.backend == "host" and service.engine.mtp
        assert service.models.default.mtp is service.engine
    # no notice about the block: only the expert cache's line names it, whose experts it holds beside the trunk's
    assert [line for line in lines if "MTP" in line] == ["expert cache: 16 experts, 0.01 GiB, and the MTP block's 4"]
    config = server_config(model=str(qwen35_model), context=256, device="host", speculative={"source": "off"})
    async with open_service(config, log=lambda line: None) as service:
        assert service.engine.has_mtp and not service.engine.mtp and service.models.default.mtp is None


def test_a_chat_request_drafted_by_the_mtp_block_on_the_host_device_answers_as_the_cpu_engine(qwen35_model):
    """Speculation's source mtp on the backend: every step's drafts are the block's, run through the device
    interface; verified and rolled back, the answer is the CPU engine's without speculation."""
    ask = {"max_tokens": 24, "chat_template_kwargs": {"enable_thinking": False}}
    with live_server(server_config(model=str(qwen35_model), context=256, kv="f32")) as cpu:
        want = answer(cpu.url, **ask)
    config = server_config(model=str(qwen35_model), context=256, kv="f32", device="host",
                           speculative={"source": "mtp", "adaptive": False})
    with live_server(config) as server:
        assert answer(server.url, **ask) == want
        status = httpx.get(server.url + "/v1/status").json()
    assert status["engine"]["backend"] == "host"
    assert len(want) > 10 and status["totals"]["draft_tokens"] > 0


async def test_cuda_with_an_architecture_the_backend_does_not_run_says_which_it_runs(tmp_path):
    dense = write_random_model(tmp_path / "dense.gguf", arch="qwen3", size="tiny", dtype="f32")
    lines: list[str] = []
    async with open_service(server_config(model=str(dense), context=64, device="cuda"), log=lines.append) as service:
        assert service.engine.backend == "cpu"
    assert [line for line in lines if line.startswith("device cuda")] == [
        "device cuda: the GPU backend runs qwen3moe, qwen35moe models, not qwen3; running on the CPU"]
