"""What a KV-aware router asks of a replica, through hypercorn on the tiny real model: the render routes give the
ids the chat route evaluates, the KV events announce the blocks of those ids, and `/metrics` has vLLM's names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
from conftest import live_server, server_config

from strata.kv_events import AllBlocksCleared, BlockStored, KvEvent, block_hash
from strata.kv_events.wire import decode_batch

BLOCK = 4
CHAT: dict[str, Any] = {"messages": [{"role": "system", "content": "You are a careful assistant who answers briefly."},
                     {"role": "user", "content": "Name three colours of the rainbow, please."}],
        "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def real(tiny_model: Path):
    config = server_config(model=str(tiny_model), context=512, slots=2,
                           kv_events={"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*",
                                      "block_size": BLOCK})
    with live_server(config) as live:
        yield live


def replayed_events(endpoint: str) -> list[KvEvent]:
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        events: list[KvEvent] = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return events
            events += decode_batch(payload)[1]
    finally:
        dealer.close(linger=0)
        context.term()


def test_the_chat_render_route_gives_the_ids_the_chat_route_evaluates(real):
    with httpx.Client(base_url=real.url, timeout=60) as client:
        rendered = client.post("/v1/chat/completions/render", json=CHAT)
        answer = client.post("/v1/chat/completions", json=CHAT)
    assert rendered.status_code == 200 and answer.status_code == 200
    body = rendered.json()
    ids = body["token_ids"]
    assert body["request_id"].startswith("chatcmpl-") and body["model"] == real.service.model_name
    assert body["sampling_params"]["temperature"] == 0 and body["sampling_params"]["max_tokens"] == 2
    assert len(ids) == answer.json()["usage"]["prompt_tokens"]
    held = real.call(lambda: [list(slot.keys) for slot in real.service.loop.batcher.slots])
    assert any(keys[:len(ids)] == ids for keys in held)


def test_the_kv_events_announce_the_blocks_of_the_rendered_ids(real):
    with httpx.Client(base_url=real.url, timeout=60) as client:
        ids = client.post("/v1/chat/completions/render", json=CHAT).json()["token_ids"]
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    events = replayed_events(real.service.kv_events.replay_endpoint)
    assert isinstance(events[0], AllBlocksCleared)
    stored = {block for event in events if isinstance(event, BlockStored) for block in event.block_hashes}
    parent = None
    for start in range(0, len(ids) - BLOCK + 1, BLOCK):
        parent = block_hash(parent, ids[start:start + BLOCK])
        assert parent in stored, f"the block at {start} was not announced"


def test_the_responses_render_route_gives_the_ids_of_the_same_conversation(real):
    responses = {"model": real.service.model_name, "input": CHAT["messages"][1:],
                 "instructions": CHAT["messages"][0]["content"], "max_output_tokens": 2}
    with httpx.Client(base_url=real.url, timeout=60) as client:
        chat = client.post("/v1/chat/completions/render", json=CHAT).json()
        rendered = client.post("/v1/responses/render", json=responses)
        refused = client.post("/v1/responses/render", json={**responses, "previous_response_id": "resp_1"})
    assert rendered.status_code == 200 and rendered.json()["request_id"].startswith("resp_")
    assert rendered.json()["token_ids"] == chat["token_ids"]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "previous_response_id"


def test_the_replayed_events_hold_what_the_status_and_the_slots_hold(real):
    with httpx.Client(base_url=real.url, timeout=60) as client:
        for i in range(3):  # two slots, three conversations: the third overwrites one
            body = {**CHAT, "messages": [CHAT["messages"][0], {"role": "user", "content": f"Question {i}?"}]}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
        status = client.get("/v1/status").json()["kv_events"]
    held: set[int] = set()
    for event in replayed_events(status["replay_endpoint"]):
        if isinstance(event, AllBlocksCleared):
            held.clear()
        elif isinstance(event, BlockStored):
            held.update(event.block_hashes)
        else:
            held.difference_update(event.block_hashes)
    expected = set()
    for keys in real.call(lambda: [list(slot.keys) for slot in real.service.loop.batcher.slots]):
        parent = None
        for start in range(0, len(keys) - BLOCK + 1, BLOCK):
            parent = block_hash(parent, keys[start:start + BLOCK])
            expected.add(parent)
    assert held == expected and status["blocks"] == len(held) > 0
    assert status["dropped_steps"] == 0 and status["endpoint"].startswith("tcp://127.0.0.1:")


def test_the_completions_render_route_gives_one_request_per_prompt(real):
    with httpx.Client(base_url=real.url, timeout=60) as client:
        several = client.post("/v1/completions/render", json={"prompt": ["Hello there", "Goodbye"]})
        one = client.post("/v1/completions/render", json={"prompt": "Hello there"})
        bad = client.post("/v1/completions/render", json={"prompt": 3})
        bad_chat = client.post("/v1/chat/completions/render", json={"messages": []})
    assert several.status_code == 200 and len(several.json()) == 2
    assert [item["request_id"][:5] for item in several.json()] == ["cmpl-", "cmpl-"]
    assert several.json()[0]["token_ids"] == one.json()[0]["token_ids"]
    assert several.json()[0]["token_ids"] != several.json()[1]["token_ids"]
    tokenizer = real.service.tokenizer
    assert one.json()[0]["token_ids"] == tokenizer.with_bos(tokenizer.encode("Hello there", special=False))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    assert bad_chat.status_code == 400 and bad_chat.json()["error"]["param"] == "messages"


def test_metrics_have_vllms_names_with_the_model_name(real):
    with httpx.Client(base_url=real.url, timeout=60) as client:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        text = client.get("/metrics").text
    model = real.service.model_name
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert f'{name}{{model_name="{model}"}}' in text, name
    assert f'vllm:cache_config_info{{block_size="{BLOCK}",model_name="{model}",num_gpu_blocks="256"}} 1.0' in text
    queries = float(text.split(f'vllm:prefix_cache_queries_total{{model_name="{model}"}} ')[1].split()[0])
    assert queries > 0
