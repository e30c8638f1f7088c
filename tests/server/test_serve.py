"""`strata serve` and `hypercorn 'strata.api:create_app()'` as real processes, and `strata.serve` in-process:
startup lines, config errors that name the key, and shutdown (SIGTERM or a trigger) with requests in flight."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import trio
from conftest import server_config
from gguf_rewrite import rewrite
from hub_server import fake_hub

import strata
from strata.cli import main

SRC = str(Path(strata.__file__).resolve().parents[1])


def environment(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("STRATA_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, env.get("PYTHONPATH")]))
    return {**env, **extra}


def wait_for_line(process: subprocess.Popen, pattern: str, timeout: float = 30) -> tuple[re.Match, list[str]]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        found = re.search(pattern, line)
        if found:
            return found, lines
    raise AssertionError(f"no line matching {pattern!r} in {lines}")


def test_config_errors_name_the_key(tmp_path, capsys):
    path = tmp_path / "strata.json"
    path.write_text(json.dumps({"model": "m.gguf", "vision": {"gpuu": True}}))
    assert main(["serve", "--config", str(path)]) == 2
    assert 'unknown key "vision.gpuu"' in capsys.readouterr().err
    assert main(["serve", "--model", "m.gguf", "--limits.queue-length", "0"]) == 2
    assert '"limits.queue_length" must be at least 1' in capsys.readouterr().err
    assert main(["serve", "--model", "m.gguf", "--port", "eighty"]) == 2
    assert '"port" must be int' in capsys.readouterr().err


def test_strata_serve_hf_downloads_the_model_then_serves_it_from_the_cache(tiny_model, tmp_path):
    repos = {"owner/tiny-GGUF": {"tiny-Q8_0.gguf": tiny_model.read_bytes(), "tiny-F32.gguf": tiny_model.read_bytes()}}
    command = [sys.executable, "-m", "strata.cli", "serve", "--hf", "owner/tiny-GGUF:F32", "--port", "0",
               "--threads", "1", "--context", "256"]

    def serve_and_chat(env: dict[str, str]) -> None:
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env) as process:
            try:
                found, lines = wait_for_line(process, r"serving \S+ on (http://\S+)")
                assert re.search(r"hf:owner/tiny-GGUF:F32: \S+hf-cache\S+tiny-F32.gguf", "".join(lines))
                url = found.group(1)
                deadline = time.monotonic() + 60
                while httpx.get(url + "/health").status_code != 200:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                reply = httpx.post(url + "/v1/chat/completions", timeout=60,
                                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
                assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 2
            finally:
                process.send_signal(signal.SIGINT)
                process.wait(timeout=30)

    with fake_hub(repos) as hub:
        env = environment(HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(tmp_path / "hf-cache"), HF_HUB_OFFLINE="0")
        serve_and_chat(env)
        downloads = [request for request in hub.requests if request.startswith("GET /owner/tiny-GGUF/resolve/")]
        assert downloads == ["GET /owner/tiny-GGUF/resolve/main/tiny-F32.gguf"]
        hub.requests.clear()
        serve_and_chat({**env, "HF_HUB_OFFLINE": "1"})
        assert hub.requests == []  # the second start asked the hub nothing


def test_strata_serve_hf_errors_are_one_line_before_listening(tmp_path, capsys):
    with fake_hub({}) as hub:
        env = environment(HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(tmp_path / "hf-cache"))
        done = subprocess.run([sys.executable, "-m", "strata.cli", "serve", "--hf", "owner/nothing", "--port", "0"],
                              capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 1
    assert done.stdout + done.stderr == ("error: hf:owner/nothing: no such repository on the hub (or a private one: "
                                         "set HF_TOKEN)\n")


def test_strata_serve_prints_what_it_loaded_and_stops_on_sigterm_mid_request(tiny_model):
    command = [sys.executable, "-m", "strata.cli", "serve", "--model", str(tiny_model), "--port", "0",
               "--context", "4096", "--threads", "1", "--limits.graceful-timeout", "0.2", "--kv-budget", "512"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=environment())
    try:
        found, lines = wait_for_line(process, r"serving \S+ on (http://\S+)")
        url = found.group(1)
        startup = "".join(lines)
        assert "context 4096" in startup and "threads 1" in startup and "backend cpu" in startup
        assert re.search(r"KV cache: 4 slots x 4096 positions \(f16\), \d+ MiB of a 512 MiB budget", startup)
        assert re.search(r"weights copied to huge pages \d+ MiB", startup)
        # Seconds of prompt processing on one thread: still running when the graceful deadline comes.
        body = {"messages": [{"role": "user", "content": "x" * 4000}], "max_tokens": 1, "stream": True}
        with ThreadPoolExecutor(1) as pool:
            request = pool.submit(httpx.post, url + "/v1/chat/completions", json=body, timeout=30)
            deadline = time.monotonic() + 10
            while httpx.get(url + "/status").json()["phase"] != "prompt":
                assert time.monotonic() < deadline
                time.sleep(0.01)
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=10) == 0
            exited_after = time.monotonic() - signalled
            # Invariant 6: the request got the graceful deadline, then was cancelled: the engine aborted its
            # prompt (seconds of work left) and the process ended. Cut before its first token, the streamed
            # request had sent no status yet: it is a 503 saying why, not a dropped connection.
            assert exited_after < 0.2 + 1.5
            reply = request.result()
            assert reply.status_code == 503 and reply.json()["error"]["code"] == "server_shutting_down"
    finally:
        process.kill()
        process.wait()
        process.stdout.close()


@pytest.mark.parametrize("interrupts", [1, 2])
def test_ctrl_c_once_waits_for_the_requests_and_twice_stops_now(tiny_model, interrupts):
    # Graceful wait of 600 s: with two interrupts, only "stop now" can end the stream in time.
    graceful = "0.5" if interrupts == 1 else "600"
    command = [sys.executable, "-m", "strata.cli", "serve", "--model", str(tiny_model), "--port", "0", "--threads",
               "1", "--slots", "1", "--limits.graceful-timeout", graceful, "--mapped-weights", "true"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=environment())
    try:
        found, lines = wait_for_line(process, r"serving \S+ on (http://\S+)")
        url = found.group(1)
        assert "backend cpu" in "".join(lines) and "weights copied" not in "".join(lines)
        # A stream that only the context ends (thousands of tokens): still running at shutdown.
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000, "stream": True,
                "logit_bias": {str(ord("A")): 100}}
        streaming, chunks = threading.Event(), []

        def read() -> None:
            with contextlib.suppress(httpx.HTTPError), httpx.stream(
                    "POST", url + "/v1/chat/completions", json=body, timeout=60) as reply:
                for line in reply.iter_lines():
                    chunks.append(line)
                    if '"content":"A' in line:
                        streaming.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert streaming.wait(30)
        process.send_signal(signal.SIGINT)
        lines = wait_for_line(process, r"shutting down")[1]
        if interrupts == 2:
            process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
        reader.join(30)
        lines += process.stdout.readlines()
        output = "".join(lines)
        assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
        assert output.count("SIGINT: shutting down") == 1
        assert output.count("SIGINT again: stopping now") == (interrupts == 2), output
        if interrupts == 1:  # the grace ran out: the stream ends with its error event and its end marker
            frames = [chunk for chunk in chunks if chunk]
            assert '"code":"server_shutting_down"' in frames[-2] and frames[-1] == "data: [DONE]", frames[-3:]
        else:  # "stop now": the stream is cut, not finished
            assert not any("[DONE]" in chunk for chunk in chunks)
    finally:
        process.kill()
        process.wait()
        process.stdout.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_hypercorn_command_line_with_strata_config(tiny_model, tmp_path):
    config = tmp_path / "strata.json"
    config.write_text(json.dumps({"model": str(tiny_model), "context": 256, "api_key": "k"}))
    port = free_port()
    hypercorn = Path(sys.executable).with_name("hypercorn")
    process = subprocess.Popen([str(hypercorn), "strata.api:create_app()", "--worker-class", "trio",
                                "--bind", f"127.0.0.1:{port}"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=environment(STRATA_CONFIG=str(config)))
    try:
        wait_for_line(process, r"Running on")
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                           headers={"authorization": "Bearer k"},
                           json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 2
        status = httpx.get(f"http://127.0.0.1:{port}/v1/status", headers={"x-api-key": "k"}).json()
        assert status["context"] == 256
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=10)
        finally:
            process.kill()
            process.wait()
            process.stdout.close()


def test_hypercorn_command_line_names_a_wrong_model_in_one_line(tmp_path):
    config = tmp_path / "strata.json"
    config.write_text(json.dumps({"model": str(tmp_path)}))
    hypercorn = Path(sys.executable).with_name("hypercorn")
    done = subprocess.run([str(hypercorn), "strata.api:create_app()", "--worker-class", "trio", "--bind",
                           f"127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=60,
                          env=environment(STRATA_CONFIG=str(config)))
    output = done.stdout + done.stderr
    assert output == f"error: model {tmp_path}: a directory, not a GGUF model file (name the .gguf file in it)\n"


async def test_serve_in_process_shuts_down_on_its_trigger(tiny_model):
    config = server_config(model=str(tiny_model), context=512, limits={"graceful_timeout": 0.3})
    stop = trio.Event()
    lines: list[str] = []
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(lambda task_status: strata.serve(
            config, shutdown_trigger=stop.wait, log=lines.append, task_status=task_status))
        async with httpx.AsyncClient(base_url=binds[0]) as client:
            await _wait_healthy(client)
            reply = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                    "max_tokens": 1})
            assert reply.status_code == 200
        stopped = trio.current_time()
        stop.set()
    assert trio.current_time() - stopped < 2
    assert any(line.startswith("serving tiny on http://127.0.0.1:") for line in lines)


async def _wait_healthy(client: httpx.AsyncClient) -> None:
    with trio.fail_after(30):
        while (await client.get("/health")).status_code != 200:
            await trio.sleep(0.05)


async def test_serve_returns_1_when_the_model_fails_to_load(tiny_model, tmp_path):
    # A file that passes the path's checks (tests/cli) and still fails to load: a tensor is missing.
    config = server_config(model=str(rewrite(tiny_model, tmp_path / "no-embeddings.gguf", drop="token_embd.weight")))
    lines: list[str] = []
    with trio.fail_after(30):
        assert await strata.serve(config, log=lines.append) == 1
    assert any("failed to load" in line for line in lines)


def test_strata_serve_without_a_model_serves_the_demo_with_its_encoder():
    command = [sys.executable, "-m", "strata.cli", "serve", "--port", "0", "--threads", "1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=environment())
    try:
        found, lines = wait_for_line(process, r"serving \S+ on (http://\S+)")
        assert "demo.gguf" in "".join(lines)
        url = found.group(1)
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        vision = httpx.get(url + "/v1/status").json()["vision"]
        assert vision["mode"] == "cpu" and vision["available"]
        answer = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 40,
            "temperature": 0, "reasoning_effort": "none"}).json()
        assert "Paris" in answer["choices"][0]["message"]["content"]
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=10)
        process.stdout.close()


def test_a_port_in_use_or_an_unknown_host_is_one_line(tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for host, cause in (("127.0.0.1", "Address already in use"), ("no-such-host.invalid", "not known")):
            command = [sys.executable, "-m", "strata.cli", "serve", "--model", str(tiny_model), "--host", host,
                       "--port", str(port)]
            done = subprocess.run(command, capture_output=True, text=True, env=environment(), timeout=60)
            output = done.stdout + done.stderr
            assert done.returncode == 1, output
            assert f"error: cannot listen on {host}:{port}: " in output and cause in output
            assert "Traceback" not in output
            assert "loading" not in output  # startup stopped before the model


async def test_several_listen_addresses(tiny_model):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = server_config(model=str(tiny_model), context=512, host="127.0.0.1,::1", port=port)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(lambda task_status: strata.serve(
            config, shutdown_trigger=stop.wait, log=lambda line: None, task_status=task_status))
        assert binds == [f"http://127.0.0.1:{port}", f"http://[::1]:{port}"]
        for bind in binds:
            async with httpx.AsyncClient(base_url=bind) as client:
                await _wait_healthy(client)
        stop.set()


async def test_status_streams_end_when_shutdown_begins(tiny_model):
    # A long graceful timeout: were the stream left open, shutdown would wait all of it.
    config = server_config(model=str(tiny_model), context=512, limits={"graceful_timeout": 60.0})
    stop = trio.Event()
    events: list[bytes] = []
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(lambda task_status: strata.serve(
                config, shutdown_trigger=stop.wait, log=lambda line: None, task_status=task_status))
            async with httpx.AsyncClient(base_url=binds[0]) as client:
                await _wait_healthy(client)
                async with client.stream("GET", "/v1/status/stream?interval=0.1") as reply:
                    async for chunk in reply.aiter_bytes():
                        events.append(chunk)
                        stop.set()
    assert events and events[0].startswith(b"event: status\n")


def test_a_wrong_model_path_is_one_line_before_anything_listens(tmp_path):
    command = [sys.executable, "-m", "strata.cli", "serve", "--model", str(tmp_path), "--port", "0"]
    done = subprocess.run(command, capture_output=True, text=True, env=environment(), timeout=60)
    assert done.returncode == 1
    assert done.stdout + done.stderr == f"error: model {tmp_path}: a directory, not a GGUF model file (name the " \
                                        ".gguf file in it)\n"


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine: the encoder would start")
def test_a_gpu_encoder_without_a_gpu_names_the_users_flag():
    command = [sys.executable, "-m", "strata.cli", "serve", "--port", "0", "--threads", "1", "--vision.gpu", "true"]
    done = subprocess.run(command, capture_output=True, text=True, env=environment(), timeout=60)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert re.search(r"error: the image encoder did not start: cuda: [^\n]*; set vision\.gpu to false "
                     r"\(--vision\.gpu false\) to encode on the CPU", output)
    assert "--gpu to" not in output and "Traceback" not in output


def test_strata_serve_runs_the_gpu_backend_on_the_host_device(tiny_model):
    command = [sys.executable, "-m", "strata.cli", "serve", "--model", str(tiny_model), "--port", "0", "--threads",
               "1", "--device", "host", "--gpu-memory", "0.25"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=environment())
    try:
        _, lines = wait_for_line(process, r"serving \S+ on (http://\S+)")
        startup = "".join(lines)
        assert "backend host" in startup
        assert re.search(r"^expert cache: \d+ experts, \d+\.\d\d GiB$", startup, re.MULTILINE)
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=30)
