"""`/tokenize` and `/detokenize` under attack, through hypercorn on the tiny real model: bounded like a chat prompt
(text that cannot fit the context is refused before it is tokenised, a context's worth of ids at most), and the
work done in a worker thread, in slices that give the same ids as the whole."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import live_server, server_config

CONTEXT = 512


@pytest.fixture(scope="module")
def real(tiny_model: Path):
    with live_server(server_config(model=str(tiny_model), context=CONTEXT)) as live:
        yield live


def test_content_that_cannot_fit_the_context_is_refused_untokenised(real, monkeypatch):
    monkeypatch.setattr(type(real.service.tokenizer), "encode", lambda *_, **__: pytest.fail("tokenised"))
    content = "a" * (CONTEXT * real.service.prompts.tokens.max_token_chars)  # at least a context of tokens
    with httpx.Client(base_url=real.url, timeout=60) as client:
        reply = client.post("/tokenize", json={"content": content})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "content"
    assert "the context holds 512" in reply.json()["error"]["message"]


def test_more_ids_than_the_context_are_refused(real):
    with httpx.Client(base_url=real.url, timeout=60) as client:
        reply = client.post("/detokenize", json={"tokens": [1] * (CONTEXT + 1)})
        fits = client.post("/detokenize", json={"tokens": [1] * CONTEXT})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tokens"
    assert fits.status_code == 200


def test_tokenising_runs_in_a_worker_thread_in_slices_with_the_ids_of_the_whole(real, monkeypatch):
    tokenizer = real.service.tokenizer
    threads: list[str] = []
    encode = type(tokenizer).encode

    def recording(self: Any, text: str, special: bool = True) -> list[int]:
        threads.append(threading.current_thread().name)
        return encode(self, text, special=special)

    # Several slices' worth of text that still fits the context's least count.
    room = (CONTEXT - 1) * real.service.prompts.tokens.max_token_chars
    content = ("The sky is blue.\nIt <|im_end|> rains " * 1000)[:room]
    expected = {special: tokenizer.encode(content, special=special) for special in (True, False)}
    monkeypatch.setattr(type(tokenizer), "encode", recording)
    loop_thread = real.call(lambda: threading.current_thread().name)
    with httpx.Client(base_url=real.url, timeout=60) as client:
        got: dict[bool, Any] = {special: client.post("/tokenize", json={"content": content,
                                                                         "parse_special": special}).json()
                                for special in (True, False)}
    assert got == {special: {"tokens": ids} for special, ids in expected.items()}
    assert len(threads) > 2 and loop_thread not in threads
