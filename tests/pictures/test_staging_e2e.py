"""A request's text and pictures counted together before any encode, through hypercorn with the shipped demo model
and its real encoder process: a request that cannot fit the context gets its 400 without costing an encode, and
one that fits is rendered and tokenised once."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import live_server, server_config
from vision.conftest import noise_png

import strata

pytestmark = pytest.mark.timeout(120)

SHIPPED = Path(strata.__file__).parent / "models"
CONTEXT = 1024


@pytest.fixture(scope="module")
def demo():
    config = server_config(model=str(SHIPPED / "demo.gguf"), context=CONTEXT,
                           vision={"mmproj": str(SHIPPED / "demo-mmproj.gguf"), "threads": 1})
    with live_server(config) as live:
        yield live


def user(text: str, n_pictures: int, seed: int) -> list[dict[str, Any]]:
    pictures = [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(noise_png(64, 48, seed=seed + i)).decode()}}
        for i in range(n_pictures)]
    return [{"role": "user", "content": [{"type": "text", "text": text}, *pictures]}]


def test_text_and_pictures_that_cannot_fit_together_cost_no_encode(demo):
    # 16 new pictures fit the context alone, and so does the text by its cheapest count (characters over the
    # vocabulary's longest token); together, tokenised, they are many times the context.
    n_chars = (CONTEXT - 100) * demo.service.prompts.tokens.max_token_chars
    text = ("x7q " * n_chars)[:n_chars]
    before = demo.service.vision.encodes
    with httpx.Client(base_url=demo.url, timeout=60) as client:
        reply = client.post("/v1/chat/completions", json={"messages": user(text, 16, seed=100), "max_tokens": 5})
    assert reply.status_code == 400, reply.text
    assert demo.service.vision.encodes == before
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded" and "of text" in error["message"]


def test_a_request_that_fits_is_encoded_and_tokenised_once(demo, monkeypatch):
    service = demo.service
    prompts = []
    render = type(service.prompts).text_and_ids

    def counting(self: Any, request: Any) -> Any:
        prompts.append(request)
        return render(self, request)

    monkeypatch.setattr(type(service.prompts), "text_and_ids", counting)
    before = service.vision.encodes
    with httpx.Client(base_url=demo.url, timeout=60) as client:
        reply = client.post("/v1/chat/completions", json={"messages": user("What is this?", 2, seed=200),
                                                          "max_tokens": 3, "reasoning_effort": "none"})
    assert reply.status_code == 200, reply.text
    assert service.vision.encodes == before + 2 and len(prompts) == 1
