"""Two replicas of the demo model behind `vllm-router --policy kv_aware`, as real processes (`strata.fleet`): a
conversation's turns go to the replica holding its prefix, which reuses it; a killed replica's traffic goes to the
other; a restarted one starts its events clean. Needs `vllm-router` (pip install vllm-router, or
STRATA_VLLM_ROUTER naming the executable)."""

from __future__ import annotations

import os
import shutil
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
    """A base port with `n` free ports after it (a random base, checked by binding each)."""
    import random
    import socket

    for _ in range(50):
        base = random.randrange(20000, 60000 - n)
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


def test_a_conversation_stays_on_the_replica_that_holds_its_prefix(tmp_path: Path) -> None:
    base = free_port_block(8)
    plan = FleetPlan(replicas=2, port=base, first_port=base + 1, events_port=base + 3,
                     router_metrics_port=base + 7, router=ROUTER,
                     serve_args=("--threads", "1", "--slots", "2", "--context", "2048", "--web", "false"),
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
