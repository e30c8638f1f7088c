"""A fleet on this machine: 3 replicas of a small model (1 engine thread each) behind `vllm-router`, 12 agent
conversations interleaved, under three routing policies in the same run.

The conversations: 3 groups of 4 share a ~2,000-token system prompt; each has its own growing history over 6 main
turns, and after some turns a side request (the same system prompt and a short question of its own, as an agent's
title or summary call). The 12 conversations run at once, as 12 agents would
(each sends its next turn when it has the answer to the last; they start `--stagger` seconds apart), so their
turns interleave; each policy gets a fresh fleet (empty caches).

- **Fleet-wide prefix reuse**: the prompt tokens the replicas found in their caches (the answers' `cached_tokens`)
  over the reusable ones: for each request, the longest prefix its prompt ids (from the render route) share with
  any prompt sent before it, anywhere in the fleet; a request's cached tokens count up to its reusable ones.
- **Time to first token** of the main turns (streamed; median and p90), at the client.

    python bench/fleet.py [--model demo] [--router PATH] [--policies kv_aware round_robin cache_aware]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from strata.fleet import Fleet, FleetPlan
from strata.scheduling.batcher import common_prefix

GROUPS, PER_GROUP, TURNS = 3, 4, 6
WORDS = ["river", "stone", "lantern", "copper", "quiet", "harbor", "meadow", "signal", "thread", "orbit", "canvas",
         "ember", "falcon", "glacier", "pocket", "ladder", "marble", "violet", "engine", "summit"]


def system_prompt(group: int, words: int) -> str:
    rng = random.Random(1000 + group)
    rules = [f"Rule {i}: " + " ".join(rng.choice(WORDS) for _ in range(12)) + "." for i in range(words // 14)]
    return f"You are agent team {group}. Follow these rules.\n" + "\n".join(rules)


def side_turns(seed: int, conversation: int) -> set[int]:
    """The turns after which a conversation sends a side request (about a third of them)."""
    rng = random.Random(f"{seed}-{conversation}")
    return {turn for turn in range(TURNS) if rng.random() < 1 / 3}


def stream(client: httpx.Client, body: dict[str, Any]) -> tuple[float, str, dict[str, Any]]:
    """(seconds to the first token, the answer's text, usage) of a streamed chat request."""
    started = time.perf_counter()
    first = None
    text, usage = [], {}
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True,
                                                              "stream_options": {"include_usage": True}}) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{reply.status_code}: {reply.read().decode()[:300]}")
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                if piece and first is None:
                    first = time.perf_counter() - started
                text.append(delta.get("content") or "")
    return first if first is not None else time.perf_counter() - started, "".join(text), usage


class Run:
    """The requests of one policy's run, from the conversations' threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[list[int]] = []  # every prompt's ids, in the order sent
        self.rows: list[dict[str, Any]] = []

    def sent(self, ids: list[int]) -> int:
        """Record a prompt as sent; the tokens it can reuse: its longest common prefix with an earlier prompt."""
        with self.lock:
            can = max((common_prefix(ids, earlier) for earlier in self.seen), default=0)
            self.seen.append(ids)
            return can


def conversation(c: int, args: argparse.Namespace, base: int, render_url: str, run: Run) -> None:
    """One agent: its 6 main turns, each after the answer to the last, and its side requests."""
    system = system_prompt(c // PER_GROUP, args.system_words)
    history = [{"role": "system", "content": system}]
    sides = side_turns(args.seed, c)
    with httpx.Client(base_url=f"http://127.0.0.1:{base}", timeout=600) as client, \
            httpx.Client(base_url=render_url, timeout=600) as renderer:
        for turn in range(TURNS):
            for kind in ("main", "side") if turn in sides else ("main",):
                rng = random.Random(f"{c}-{turn}-{kind}")
                question = " ".join(rng.choice(WORDS) for _ in range(args.question_words))
                if kind == "main":
                    history.append({"role": "user", "content": f"Turn {turn}: {question}?"})
                    messages = history
                else:
                    messages = [history[0], {"role": "user", "content": f"Five words on: {question}"}]
                body = {"model": "demo", "messages": messages, "max_tokens": args.tokens, "temperature": 0}
                ids = renderer.post("/v1/chat/completions/render", json=body).json()["token_ids"]
                can = run.sent(ids)
                ttft, answer, usage = stream(client, body)
                if kind == "main":
                    history.append({"role": "assistant", "content": answer})
                got = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
                with run.lock:
                    run.rows.append({"kind": kind, "conversation": c, "turn": turn, "prompt": len(ids),
                                     "reusable": can, "cached": got, "ttft_ms": round(1000 * ttft, 1)})


def run_policy(policy: str, args: argparse.Namespace, base: int, log_dir: Path) -> dict[str, Any]:
    serve_args = ["--threads", "1", "--slots", str(args.slots), "--context", str(args.context), "--web", "false"]
    if args.model != "demo":
        serve_args += ["--model", args.model]
    plan = FleetPlan(replicas=3, policy=policy, port=base, first_port=base + 1, events_port=base + 10,
                     router_metrics_port=base + 20, serve_args=tuple(serve_args), router=args.router)
    run = Run()
    with Fleet(plan, log_dir / policy, timeout=120):
        threads = []
        for c in range(GROUPS * PER_GROUP):
            threads.append(threading.Thread(target=conversation, args=(c, args, base, plan.replica_url(0), run)))
            threads[-1].start()
            time.sleep(args.stagger)
        for thread in threads:
            thread.join()
        spread = [len(httpx.get(f"{plan.replica_url(i)}/v1/history", timeout=10).json()["data"])
                  for i in range(plan.replicas)]
    rows = run.rows
    cached = sum(min(row["cached"], row["reusable"]) for row in rows)
    reusable = sum(row["reusable"] for row in rows)
    ttfts = sorted(row["ttft_ms"] for row in rows if row["kind"] == "main")
    return {"policy": policy, "reuse": cached / reusable if reusable else 0.0, "cached": cached,
            "reusable": reusable, "prompt": sum(row["prompt"] for row in rows), "requests": len(rows),
            "ttft_median_ms": statistics.median(ttfts),
            "ttft_p90_ms": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))], "rows": rows, "spread": spread}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo", help="a GGUF file for every replica (default: the demo model)")
    parser.add_argument("--router", help="the vllm-router executable (default: the one on PATH)")
    parser.add_argument("--policies", nargs="+", default=["kv_aware", "round_robin", "cache_aware"])
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--system-words", type=int, default=600,
                        help="words of each group's system prompt (600: ~2,040 tokens of the demo model)")
    parser.add_argument("--question-words", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=16, help="max_tokens of each answer")
    parser.add_argument("--seed", type=int, default=33)
    parser.add_argument("--stagger", type=float, default=0.5, help="seconds between the conversations' starts")
    parser.add_argument("--port", type=int, default=38000, help="the first of 30 ports the fleets use")
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="strata-fleet-bench-"))
    print(f"logs and each request's figures (POLICY.json) in {log_dir}")
    print("| policy | fleet-wide prefix reuse | cached / reusable tokens | main-turn TTFT median | p90 | requests per "
          "replica |")
    print("|---|---|---|---|---|---|")
    for policy in args.policies:
        r = run_policy(policy, args, args.port, log_dir)
        (log_dir / f"{policy}.json").write_text(json.dumps(r["rows"], indent=1))
        print(f"| `{r['policy']}` | {100 * r['reuse']:.1f}% | {r['cached']:,} / {r['reusable']:,} "
              f"(of {r['prompt']:,} prompt tokens, {r['requests']} requests) | {r['ttft_median_ms']:.0f} ms "
              f"| {r['ttft_p90_ms']:.0f} ms | {' / '.join(map(str, r['spread']))} |", flush=True)


if __name__ == "__main__":
    main()
