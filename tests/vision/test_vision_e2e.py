"""Pictures end to end: hypercorn, the official `openai` and `anthropic` clients, a real encoder process and the
real engine. Each dialect's picture (and a picture a tool returned) reaches the engine as rows at its pad
positions, equal to the encoder's output; an encoder that is not available is a 503 (with Retry-After) in the
route's format."""

from __future__ import annotations

import base64
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import anthropic
import httpx
import numpy as np
import openai
import pytest
from conftest import live_server, server_config
from fakes import RecordingEngine

import strata
from strata.modelgen.mmproj import write_random_mmproj
from strata.vision.encoder import Encoder
from strata.vision.mmproj import Mmproj
from strata.vision.preprocess import load_image, preprocess
from strata.vision.protocol import parse_sve

from .conftest import noise_png

pytestmark = pytest.mark.timeout(120)

MAX_TOKENS = 64
PICTURE = noise_png(64, 48, seed=40)
TOOL_PICTURE = noise_png(48, 64, seed=41)
DATA_URL = "data:image/png;base64," + base64.b64encode(PICTURE).decode()


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory, tiny_model) -> Path:
    from strata.engine_cffi import Engine

    with Engine.load(tiny_model, n_ctx=64) as probe:
        width = probe.n_embd
    path = tmp_path_factory.mktemp("vision-e2e") / "tiny-mmproj.gguf"
    write_random_mmproj(path, width, "tiny", seed=5, dtype="f32")
    return path


@pytest.fixture
def engine(tiny_model):
    from strata.engine_cffi import Engine

    with Engine.load(tiny_model, n_ctx=1024, threads=1) as real:
        yield RecordingEngine(real)


@pytest.fixture
def server(engine, tokenizer, mmproj):
    # The picture server is on 127.0.0.1: let downloads reach it, as a user would their own.
    config = server_config(vision={"mmproj": str(mmproj), "threads": 1, "max_tokens": MAX_TOKENS},
                           images={"allow_hosts": ["127.0.0.1"]})
    with live_server(config, engine, tokenizer) as live:
        yield live


@pytest.fixture(scope="module")
def picture_url():
    """A picture served over http by a local server (in a thread)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("content-type", "image/png")
            self.send_header("content-length", str(len(PICTURE)))
            self.end_headers()
            self.wfile.write(PICTURE)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/picture.png"
    httpd.shutdown()
    httpd.server_close()


def expected_rows(mmproj: Path, picture: bytes, tmp_path: Path) -> np.ndarray:
    path = tmp_path / "picture.png"
    path.write_bytes(picture)
    encoder = Encoder(Mmproj.load(mmproj), 1)
    return encoder.encode(preprocess(load_image(str(path)), encoder.hp, MAX_TOKENS).pixels)


def assert_pictures_reached_the_engine(engine: RecordingEngine, tokenizer, rows: list[np.ndarray]) -> None:
    tokens, embeds = engine.calls[0]
    pad = tokenizer.token_to_id("<|image_pad|>")
    assert len(embeds) == len(rows)
    for (index, got), want in zip(embeds, rows, strict=True):
        assert tokens[index - 1] == tokenizer.token_to_id("<|vision_start|>")
        assert tokens[index:index + len(want)] == [pad] * len(want)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert tokens.count(pad) == sum(len(r) for r in rows)


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def anthropic_client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)


@pytest.mark.parametrize("source", ["data", "http"])
def test_openai_chat_image_url(server, engine, tokenizer, mmproj, tmp_path, picture_url, source):
    url = DATA_URL if source == "data" else picture_url
    with openai_client(server) as client:
        answer = client.chat.completions.create(model="m", max_tokens=4, temperature=0, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}])
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert_pictures_reached_the_engine(engine, tokenizer, [expected_rows(mmproj, PICTURE, tmp_path)])


def test_openai_chat_tool_message_picture(server, engine, tokenizer, mmproj, tmp_path):
    tool_url = "data:image/png;base64," + base64.b64encode(TOOL_PICTURE).decode()
    call = {"id": "c1", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}
    with openai_client(server) as client:
        client.chat.completions.create(model="m", max_tokens=2, temperature=0, messages=[
            {"role": "user", "content": "Take a screenshot."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "image_url", "image_url": {"url": tool_url}}]},
        ])
    assert_pictures_reached_the_engine(engine, tokenizer, [expected_rows(mmproj, TOOL_PICTURE, tmp_path)])


def test_responses_input_image(server, engine, tokenizer, mmproj, tmp_path):
    with openai_client(server) as client:
        response = client.responses.create(model="m", max_output_tokens=4, temperature=0, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                         {"type": "input_image", "image_url": DATA_URL, "detail": "auto"}]}])
    assert response.status in ("completed", "incomplete")
    assert_pictures_reached_the_engine(engine, tokenizer, [expected_rows(mmproj, PICTURE, tmp_path)])


def test_anthropic_image_blocks_and_tool_result(server, engine, tokenizer, mmproj, tmp_path, picture_url):
    tool_data = base64.b64encode(TOOL_PICTURE).decode()
    with anthropic_client(server) as client:
        client.messages.create(model="m", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": picture_url}},
                                         {"type": "text", "text": "Compare with a screenshot."}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": tool_data}}]}]},
        ])
    assert_pictures_reached_the_engine(engine, tokenizer, [expected_rows(mmproj, PICTURE, tmp_path),
                                                           expected_rows(mmproj, TOOL_PICTURE, tmp_path)])


def test_anthropic_count_tokens_counts_each_picture_as_its_rows(server, engine, mmproj, tmp_path):
    text = [{"type": "text", "text": "What is in the picture?"}]
    picture = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": base64.b64encode(PICTURE).decode()}}
    messages = [{"role": "user", "content": [picture, *text]}]
    with anthropic_client(server) as client:
        bare = client.messages.count_tokens(model="m", messages=[{"role": "user", "content": text}])
        counted = client.messages.count_tokens(model="m", messages=messages)
        answer = client.messages.create(model="m", max_tokens=1, messages=messages)
    prompt, _ = engine.calls[0]
    assert counted.input_tokens == len(prompt) == answer.usage.input_tokens
    assert counted.input_tokens > bare.input_tokens + len(expected_rows(mmproj, PICTURE, tmp_path))


def test_status_shows_the_vision_state(server):
    state = httpx.get(server.url + "/v1/status", timeout=30).json()["vision"]
    assert (state["mode"], state["available"], state["cuda"], state["threads"]) == ("cpu", True, False, 1)
    assert state["fingerprint"].startswith("sha256:")


def test_unavailable_encoder_is_a_503_in_each_format(engine, tokenizer):
    script = "import sys; print('ssh: connect to host box port 22: Connection refused', file=sys.stderr); sys.exit(255)"
    config = server_config(vision={"exe": [sys.executable, "-c", script], "remote": True})
    with live_server(config, engine, tokenizer) as server:
        with openai_client(server) as client:
            text = client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
            with pytest.raises(openai.InternalServerError, match="the image encoder is not available: .*refused") as e:
                client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": DATA_URL}}]}])
            assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "5"
        with anthropic_client(server) as client, pytest.raises(anthropic.InternalServerError) as caught:
            client.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(PICTURE).decode()}}]}])
        state = httpx.get(server.url + "/v1/status", timeout=30).json()["vision"]
    assert text.choices[0].message is not None
    assert caught.value.body["error"]["type"] == "overloaded_error"
    assert caught.value.body["error"]["message"].startswith("the image encoder is not available: ")
    assert (state["mode"], state["available"]) == ("remote", False) and "refused" in state["last_error"]


def test_precomputed_embeddings_over_http(server, engine, mmproj, tmp_path):
    picture = tmp_path / "p.png"
    picture.write_bytes(PICTURE)
    out = tmp_path / "p.sve"
    env = dict(os.environ, PYTHONPATH=str(Path(strata.__file__).resolve().parents[1]))
    done = subprocess.run([sys.executable, "-m", "strata.vision.worker", "encode", str(picture), "--mmproj",
                           str(mmproj), "--out", str(out), "--max-tokens", str(MAX_TOKENS)], capture_output=True,
                          text=True, env=env, check=True)
    fingerprint = json.loads(done.stdout)["fingerprint"]

    def send(fingerprint: str) -> httpx.Response:
        part = {"type": "image_embeds", "image_embeds": base64.b64encode(out.read_bytes()).decode(),
                "fingerprint": fingerprint}
        body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [part]}]}
        return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)

    assert send(fingerprint).status_code == 200
    refused = send("sha256:" + "f" * 64)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "messages[0].content[0]"
    assert "is not this server's encoder" in refused.json()["error"]["message"]
    (_, rows), = engine.calls[0][1]
    np.testing.assert_array_equal(rows, parse_sve(out.read_bytes())[1])
