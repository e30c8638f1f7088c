"""`--hf` downloads with the real `huggingface_hub` client against a local stand-in for the hub
(`tests/hub_server.py`), with GGUF files made by our writer: download, cache reuse offline, each error
(`strata serve --hf` answering a chat request: `server/test_serve.py`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import server_config
from gguf_rewrite import rewrite
from hub_server import fake_hub

from strata.models import hub
from strata.models.hub import HubError, HubRef, fetch
from strata.models.resolve import resolve_config


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    """The client's cache in a temporary folder, online; returns a function pointing it at an endpoint."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def point_at(url: str) -> None:  # as HF_ENDPOINT=url does when the client is imported
        monkeypatch.setattr(constants, "ENDPOINT", url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")

    return point_at


@pytest.fixture(scope="module")
def repo(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, bytes]]:
    data = tiny_model.read_bytes()
    first = rewrite(tiny_model, tmp_path_factory.mktemp("split") / "tiny-Q4_0.gguf", split_max_tensors=12)
    parts = {part.name: part.read_bytes() for part in sorted(first.parent.glob("tiny-Q4_0-*-of-*.gguf"))}
    assert len(parts) > 1
    return {"owner/tiny-GGUF": {"README.md": b"tiny", "tiny-Q8_0.gguf": data, "tiny-F32.gguf": data + b"",
                                "mmproj-tiny-BF16.gguf": b"bf16", "mmproj-tiny-F16.gguf": b"f16", **parts}}


def test_one_file_and_its_mmproj_are_downloaded_with_progress(hub_env, repo, tiny_model):
    lines: list[str] = []
    with fake_hub(repo) as server:
        hub_env(server.url)
        model, mmproj = fetch(HubRef("owner/tiny-GGUF", "F32"), "F16", lines.append)
    assert Path(model).name == "tiny-F32.gguf" and Path(model).read_bytes() == tiny_model.read_bytes()
    assert mmproj is not None and Path(mmproj).read_bytes() == b"f16"
    assert "hf-cache" in model  # the client's cache, in its layout
    assert lines[-1].startswith("mmproj-tiny-F16.gguf: ") and "MB/s" in lines[-1]
    assert any(line.startswith("tiny-F32.gguf: ") for line in lines)


def test_a_second_start_uses_the_cache_without_the_network(hub_env, repo):
    from huggingface_hub import constants

    with fake_hub(repo) as server:
        hub_env(server.url)
        first = fetch(HubRef("owner/tiny-GGUF", "Q8_0"), "F16")
    # The hub is gone (connection refused): the cached files serve.
    assert fetch(HubRef("owner/tiny-GGUF", "Q8_0"), "F16") == first
    # Offline mode: no request at all.
    with fake_hub(repo) as server:
        hub_env(server.url)
        constants.HF_HUB_OFFLINE = True  # restored by the fixture's monkeypatch
        assert fetch(HubRef("owner/tiny-GGUF", "Q8_0"), "F16") == first
        assert server.requests == []
    # A quant that was never downloaded is not in the cache.
    with pytest.raises(HubError, match=r"no GGUF file for quant F32 \(there are: Q8_0\)"):
        fetch(HubRef("owner/tiny-GGUF", "F32"), None)


def test_network_down_with_nothing_cached(hub_env):
    with fake_hub({}) as server:
        url = server.url
    hub_env(url)  # nothing listens there any more
    with pytest.raises(HubError, match=r"^hf:owner/tiny-GGUF: the hub cannot be reached and nothing of the "
                                       r"repository is cached$"):
        fetch(HubRef("owner/tiny-GGUF", None), None)


def test_each_error_is_one_line(hub_env, repo, monkeypatch):
    with fake_hub(repo) as server:
        hub_env(server.url)
        with pytest.raises(HubError, match=r"^hf:owner/nothing: no such repository on the hub"):
            fetch(HubRef("owner/nothing", None), None)
        with pytest.raises(HubError, match=r"no GGUF file for quant Q5_K_M \(there are: F32, Q4_0, Q8_0\)$"):
            fetch(HubRef("owner/tiny-GGUF", "Q5_K_M"), None)
        monkeypatch.setattr(hub.shutil, "disk_usage", lambda _: type("Usage", (), {"free": 1000})())
        with pytest.raises(HubError, match=r"the download needs 0\.\d+ GB and .*hf-cache has 0\.00 GB free$"):
            fetch(HubRef("owner/tiny-GGUF", "F32"), "F16")
        assert not any("/resolve/" in request for request in server.requests)  # nothing was downloaded


def test_a_split_model_is_downloaded_whole_and_loads_from_its_first_part(hub_env, repo, tiny_model):
    from strata.engine_cffi import Engine
    from strata.model_file import check_model_file

    lines: list[str] = []
    with fake_hub(repo) as server:
        hub_env(server.url)
        model, mmproj = fetch(HubRef("owner/tiny-GGUF", "Q4_0"), None, lines.append)
    parts = sorted(name for name in repo["owner/tiny-GGUF"] if name.startswith("tiny-Q4_0-"))
    assert Path(model).name == parts[0] and mmproj is None
    assert sorted(path.name for path in Path(model).parent.glob("tiny-Q4_0-*")) == parts  # beside each other
    assert {line.split(":")[0] for line in lines} == set(parts)  # the progress names each part
    assert check_model_file(model) == "qwen3moe"
    with Engine.load(model, n_ctx=32) as split, Engine.load(tiny_model, n_ctx=32) as whole:
        assert (split.eval([1, 2, 3]) == whole.eval([1, 2, 3])).all()
    broken = {"owner/broken": {name: data for name, data in repo["owner/tiny-GGUF"].items() if name != parts[-1]}}
    with fake_hub(broken) as server:
        hub_env(server.url)
        with pytest.raises(HubError, match=rf"lacks 1 of its {len(parts)} parts \({parts[-1]}\)$"):
            fetch(HubRef("owner/broken", "Q4_0"), None)


async def test_the_config_names_the_downloaded_files(hub_env, repo):
    with fake_hub(repo) as server:
        hub_env(server.url)
        lines: list[str] = []
        config = await resolve_config(server_config(model="hf:owner/tiny-GGUF:Q8_0"), lines.append)
        assert Path(config.model or "").name == "tiny-Q8_0.gguf"
        assert Path(config.vision.mmproj or "").name == "mmproj-tiny-F16.gguf"
        assert lines == [f"hf:owner/tiny-GGUF:Q8_0: {config.model} (mmproj {config.vision.mmproj})"]
        mine = await resolve_config(server_config(model="hf:owner/tiny-GGUF:Q8_0", vision={"mmproj": "m.gguf"}),
                                    lines.append)
        assert mine.vision.mmproj == "m.gguf"
        none = await resolve_config(server_config(model="hf:owner/tiny-GGUF", vision={"hf_mmproj": "none"}),
                                    lines.append)
        assert Path(none.model or "").name == "tiny-F32.gguf" and none.vision.mmproj is None  # no Q4_K_M: the first
    await trio.lowlevel.checkpoint()



def test_strata_generate_hf_downloads_and_generates(hub_env, repo, capsys):
    from strata.cli import main

    with fake_hub(repo) as server:
        hub_env(server.url)
        assert main(["generate", "--hf", "owner/tiny-GGUF:Q8_0", "--prompt", "hi", "--max-tokens", "2",
                     "--temperature", "0", "--threads", "1", "--context", "64"]) == 0
        assert main(["generate", "--hf", "owner/tiny-GGUF:Q5_K_M", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert re.search(r"^hf:owner/tiny-GGUF:Q8_0: \S+tiny-Q8_0.gguf$", err, re.MULTILINE)
    assert "strata generate: error: hf:owner/tiny-GGUF:Q5_K_M: no GGUF file for quant Q5_K_M" in err


async def test_a_slow_download_prints_progress_lines(hub_env, repo):
    with fake_hub(repo, stall=2.5) as server:
        hub_env(server.url)
        lines: list[str] = []
        await resolve_config(server_config(model="hf:owner/tiny-GGUF:Q8_0", vision={"hf_mmproj": "none"}),
                             lines.append)
    assert re.fullmatch(r"downloading hf:owner/tiny-GGUF:Q8_0 \.\.\. 2 s \(tiny-Q8_0.gguf: 0\.0 of \d+\.\d MB, "
                        r"0\.0 MB/s\)", lines[0]), lines
    assert lines[-1].startswith("hf:owner/tiny-GGUF:Q8_0: ")


def test_a_download_cut_by_the_network_resumes_where_it_stopped(hub_env, repo):
    data = repo["owner/tiny-GGUF"]["tiny-F32.gguf"]
    cut = len(data) // 2
    lines: list[str] = []
    with fake_hub(repo, cut=cut) as server:
        hub_env(server.url)
        model, _ = fetch(HubRef("owner/tiny-GGUF", "F32"), None, lines.append)
    assert Path(model).read_bytes() == data
    # Every byte written before the cut is kept (unchunked writes: `fetch`), so the resumed GET starts there.
    resumed = [request for request in server.requests if "(bytes=" in request]
    assert resumed == [f"GET /owner/tiny-GGUF/resolve/main/tiny-F32.gguf (bytes={cut}-)"]
    assert lines[-1].startswith(f"tiny-F32.gguf: {len(data) / 1e6:.1f} of {len(data) / 1e6:.1f} MB")


async def test_a_named_hf_model_downloads_when_first_asked_for_with_its_progress_on_the_status(hub_env, repo,
                                                                                              tiny_model):
    import httpx
    from conftest import live_server, wait_until

    models = [{"name": "local", "model": str(tiny_model), "context": 64},
              {"name": "hubbed", "model": "hf:owner/tiny-GGUF:Q8_0", "context": 64, "aliases": ["h"]}]
    config = server_config(models=models, vision={"hf_mmproj": "none"})
    with fake_hub(repo, stall=1.0) as hub_server, live_server(config) as server:
        hub_env(hub_server.url)
        assert not any("/resolve/" in request for request in hub_server.requests)  # nothing at startup
        hubbed = server.service.models.find("hubbed")
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client, trio.open_nursery() as nursery:
            answers: list[httpx.Response] = []

            async def ask() -> None:
                answers.append(await client.post("/v1/chat/completions", json={
                    "model": "h", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}))

            nursery.start_soon(ask)
            await wait_until(lambda: hubbed.transfer is not None, timeout=10)
            status = (await client.get("/v1/status")).json()["models"]["data"][1]
            await wait_until(lambda: bool(answers), timeout=30)
            listed = {entry["id"]: entry["state"] for entry in (await client.get("/v1/models")).json()["data"]}
    assert status["state"] == "downloading"
    download = status["download"]
    assert download["file"] == "tiny-Q8_0.gguf"
    assert download["total"] == len(repo["owner/tiny-GGUF"]["tiny-Q8_0.gguf"])
    assert download["done"] <= download["total"] and "bytes_per_second" in download and "eta_seconds" in download
    assert answers[0].status_code == 200 and answers[0].json()["model"] == "hubbed"
    assert listed == {"local": "not loaded", "hubbed": "loaded"}
    assert Path(hubbed.config.model or "").name == "tiny-Q8_0.gguf" and "hf-cache" in (hubbed.config.model or "")
    assert hubbed.footprint > len(repo["owner/tiny-GGUF"]["tiny-Q8_0.gguf"])  # measured once downloaded


def first_snapshot(url: str) -> dict[str, Any]:
    """The first event of the live status stream the monitor page reads."""
    import json

    import httpx

    with httpx.stream("GET", url + "/v1/status/stream", timeout=30) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: "):
                return dict(json.loads(line.removeprefix("data: ")))
    raise AssertionError("the status stream ended before its first event")


async def test_a_single_hf_model_downloads_while_the_server_listens_with_its_progress_on_the_status(
        hub_env, repo):
    import threading

    import httpx

    import strata

    hold = threading.Event()
    config = server_config(model="hf:owner/tiny-GGUF:Q8_0", context=64, threads=1, vision={"hf_mmproj": "none"})
    lines: list[str] = []
    with fake_hub(repo, hold=hold) as hub_server:
        hub_env(hub_server.url)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(lambda task_status: strata.serve(
                config, shutdown_trigger=stop.wait, log=lines.append, task_status=task_status))
            async with httpx.AsyncClient(base_url=binds[0], timeout=60) as client:
                # The file's bytes are held back: the server listens, the download runs.
                with trio.fail_after(30):
                    while not (await client.get("/v1/status")).json()["models"]["data"][0]["download"]:
                        await trio.sleep(0.02)
                status = (await client.get("/v1/status")).json()
                live = await trio.to_thread.run_sync(first_snapshot, binds[0])  # what the monitor reads
                live_health, health = await client.get("/health/live"), await client.get("/health")
                listed = (await client.get("/v1/models")).json()["data"]
                early = await client.post("/v1/chat/completions", json={
                    "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
                hold.set()
                with trio.fail_after(60):
                    while (await client.get("/health")).status_code != 200:
                        await trio.sleep(0.05)
                answer = await client.post("/v1/chat/completions", json={
                    "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
                after = (await client.get("/v1/status")).json()["models"]["data"][0]
            stop.set()
    model = status["models"]["data"][0]
    assert (status["model"], status["loaded"], model["state"]) == ("tiny-Q8_0", False, "downloading")
    size = len(repo["owner/tiny-GGUF"]["tiny-Q8_0.gguf"])
    assert model["download"]["file"] == "tiny-Q8_0.gguf" and model["download"]["total"] == size
    assert live["models"]["data"][0]["download"]["file"] == "tiny-Q8_0.gguf"
    assert live_health.status_code == 200
    assert health.status_code == 503 and health.json() == {"status": "downloading"}
    assert [(entry["id"], entry["state"]) for entry in listed] == [("tiny-Q8_0", "downloading")]
    assert early.status_code == 503 and early.json()["error"]["message"] == "the model is still downloading"
    assert answer.status_code == 200 and answer.json()["model"] == "tiny-Q8_0"
    assert (after["state"], after["download"]) == ("loaded", None) and "hf-cache" in after["file"]
    listening = next(i for i, line in enumerate(lines) if line.startswith("listening on "))
    downloaded = next(i for i, line in enumerate(lines) if line.startswith("hf:owner/tiny-GGUF:Q8_0: "))
    assert listening < downloaded < next(i for i, line in enumerate(lines) if line.startswith("serving tiny-Q8_0"))


async def test_a_download_that_fails_once_the_server_listens_ends_serving_with_one_line(hub_env, repo):
    import threading

    import strata

    hold = threading.Event()
    config = server_config(model="hf:owner/tiny-GGUF:Q8_0", context=64, vision={"hf_mmproj": "none"})
    lines: list[str] = []
    exits: list[int] = []

    async def serve() -> None:
        exits.append(await strata.serve(config, log=lines.append))

    with fake_hub(repo, hold=hold) as hub_server:
        hub_env(hub_server.url)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            with trio.fail_after(30):
                while not any(line.startswith("listening on ") for line in lines) or \
                        not any(request.startswith("GET /owner/tiny-GGUF/resolve/") for request in hub_server.requests):
                    await trio.sleep(0.02)
            # The held GET ends its connection before its first byte, and the file is gone when the client resumes.
            hub_server.cut, hub_server.repos = 0, {}
            hold.set()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and re.fullmatch(r"error: hf:owner/tiny-GGUF:Q8_0: downloading tiny-Q8_0\.gguf failed "
                                             r"\(404 Client Error\. Entry Not Found for url: \S+\); run again to "
                                             r"resume", errors[0]), errors
    assert exits == [1] and not any(line.startswith("serving ") for line in lines)


async def test_a_shutdown_during_the_download_does_not_wait_for_it(hub_env, repo):
    import threading

    import strata

    hold = threading.Event()
    config = server_config(model="hf:owner/tiny-GGUF:Q8_0", context=64, vision={"hf_mmproj": "none"})
    lines: list[str] = []
    with fake_hub(repo, hold=hold) as hub_server:
        hub_env(hub_server.url)
        stop = trio.Event()
        with trio.fail_after(30):  # the held GET would keep a server that waited for it going for a minute
            async with trio.open_nursery() as nursery:
                await nursery.start(lambda task_status: strata.serve(
                    config, shutdown_trigger=stop.wait, log=lines.append, task_status=task_status))
                while not any(request.startswith("GET /owner/tiny-GGUF/resolve/") for request in hub_server.requests):
                    await trio.sleep(0.02)
                stop.set()
        assert not hold.is_set() and not any(line.startswith("error") for line in lines)
        hold.set()  # the abandoned download ends in its own thread
