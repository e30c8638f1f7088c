"""Two replicas of the demo model behind `vllm-router --policy kv_aware`, as real processes (`strata.fleet`): a
conversation's turns go to the replica holding its prefix, which reuses it; a killed replica's traffic goes to the
other; a restarted one starts its events clean; a replica killed under a stream cuts that stream only. Needs
`vllm-router` (pip install vllm-router, or STRATA_VLLM_ROUTER naming the executable)."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
import zmq

from strata.fleet import Fleet, FleetPlan
from strata.kv_events import AllBlocksCleared
from strata.kv_events.wire import decode_batch

ROUTER = os.environ.get("STRATA_VLLM_ROUTER") or shutil.which("vllm-router")
pytestmark = pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (pip install vllm-router, or "
                                "set STRATA_VLLM_ROUTER to its executable)")

SYSTEM = " ".join(f"Rule {i}: answer in plain words and keep to the facts you were given." for i in range(60))


def free_port_block(n: int) -> int:
    """A base port with `n` free ports after it (a random base, checked by binding each), below the range the
    kernel gives outgoing connections their own ports from: a killed replica's ports are free until it restarts,
    and one in that range may meanwhile become the local port of any connection (the router's health checks and
    reconnections, the test's requests), so that the restarted replica could not bind it ("Address already in
    use" for its events port, seen once)."""
    import random
    import socket

    low, _ = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for _ in range(50):
        base = random.randrange(10000, low - n)
        sockets = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free ports")


def history(url: str) -> list[dict]:
    return httpx.get(f"{url}/v1/history", timeout=10).json()["data"]


def first_batch(endpoint: str) -> list:
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert dealer.poll(5000), "no replay answer"
        _, seq, payload = dealer.recv_multipart()
        assert int.from_bytes(seq, "big") == 0
        return decode_batch(payload)[1]
    finally:
        dealer.close(linger=0)
        context.term()


def decoding(plan: FleetPlan, i: int) -> int:
    slots = httpx.get(f"{plan.replica_url(i)}/status", timeout=10).json()["slots"]
    return sum(slot["state"] == "decode" for slot in slots)


def long_stream(port: int, name: str, banned: list[int], results: dict[str, str]) -> None:
    """A 4,000-token stream through the router (a second or two of the demo model; the end-of-turn tokens banned):
    "finished" (every chunk and the end marker) or "cut"."""
    body = {"model": "demo", "max_tokens": 4000, "stream": True, "logit_bias": {str(t): -100 for t in banned},
            "messages": [{"role": "user", "content": f"Tell a long story, {name}."}]}
    lines = []
    try:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60) as reply:
            lines = [line for line in reply.iter_lines() if line]
    except httpx.RemoteProtocolError:  # the router closed the stream unfinished
        pass
    finished = lines[-1:] == ["data: [DONE]"] and '"finish_reason":"length"' in lines[-2].replace(" ", "")
    results[name] = "finished" if finished else f"cut after {len(lines)} events"


def test_a_conversation_stays_on_the_replica_that_holds_its_prefix(tmp_path: Path) -> None:
    base = free_port_block(8)
    plan = FleetPlan(replicas=2, port=base, first_port=base + 1, events_port=base + 3,
                     router_metrics_port=base + 7, router=ROUTER,
                     # speculation off: the demo's banned-end stories repeat themselves, and the prompt lookup's
                     # drafts would end a 4,000-token stream before the next one starts beside it
                     serve_args=("--threads", "1", "--slots", "2", "--context", "4096", "--web", "false",
                                 "--speculative.source", "off"),
                     router_args=("--health-check-interval-secs", "1", "--health-failure-threshold", "1"))
    with Fleet(plan, tmp_path, timeout=60) as fleet, httpx.Client(base_url=f"http://127.0.0.1:{base}",
                                                                   timeout=60) as client:
        messages = [{"role": "system", "content": SYSTEM}]
        for turn in range(4):
            messages.append({"role": "user", "content": f"Question {turn}: what is rule {turn}?"})
            reply = client.post("/v1/chat/completions", json={"model": "demo", "messages": messages,
                                                               "max_tokens": 4, "temperature": 0})
            assert reply.status_code == 200, reply.text
            messages.append({"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]})
        rows = [history(plan.replica_url(i)) for i in range(2)]
        holder = 0 if len(rows[0]) == 4 else 1
        assert len(rows[holder]) == 4 and not rows[1 - holder], "the turns went to both replicas"
        later = sorted(rows[holder], key=lambda row: row["id"])
        assert all(row["reused_tokens"] > 0.9 * row["prompt_tokens"] for row in rows[holder]
                   if row["prompt_tokens"] != min(r["prompt_tokens"] for r in later))

        fleet.kill_replica(holder)  # the replica holding the conversation dies: the next turn goes to the other
        messages.append({"role": "user", "content": "And rule 9?"})
        reply = client.post("/v1/chat/completions", json={"model": "demo", "messages": messages, "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        assert len(history(plan.replica_url(1 - holder))) == 1

        fleet.start_replica(holder)  # back, with its events starting clean
        assert first_batch(plan.replay_endpoint(holder)) == [AllBlocksCleared()]

        deadline = time.monotonic() + 20  # the router's health check takes the restarted replica back
        while not history(plan.replica_url(holder)):
            assert time.monotonic() < deadline, "the restarted replica gets no requests"
            reply = client.post("/v1/chat/completions", json={"model": "demo", "max_tokens": 1,
                                                               "messages": [{"role": "user", "content": "hi"}]})
            assert reply.status_code == 200, reply.text

        # Two long streams, one on each replica (the router sends the second to the less loaded one); a replica
        # killed under its stream: that stream is cut, the other one finishes.
        eos = httpx.post(f"{plan.replica_url(0)}/tokenize", json={"content": "<|im_end|><|endoftext|>"}).json()
        results: dict[str, str] = {}
        streams = [threading.Thread(target=long_stream, args=(base, name, eos["tokens"], results))
                   for name in ("a", "b")]
        for thread in streams:
            thread.start()
            time.sleep(0.3)
        deadline = time.monotonic() + 20
        while sorted(decoding(plan, i) for i in range(2)) != [1, 1]:
            assert time.monotonic() < deadline, ("the streams are not one on each replica",
                                                 [decoding(plan, i) for i in range(2)], results)
            time.sleep(0.05)
        fleet.kill_replica(0)
        for thread in streams:
            thread.join(60)
        assert sorted(results.values())[1] == "finished" and results["a"] != results["b"], results
