"""`/health` latency while one client sends the largest bodies the limits allow (issue 13's target: p99 <= 100 ms).

`strata serve` runs the shipped demo model in its own process; a second process polls `/health` every 20 ms on
one keep-alive connection (its own GIL: the sender's work cannot delay it) while this one sends one attack
request, and the latency percentiles are reported with the attack's own answer and the server's memory.
The MCP attacks come from configured stdio servers (this file run with `--serve-mcp KIND`): a listing of 20,001
tools, a tool whose schema has 150,000 properties, and a tool whose result is 100 MB (issue 29, items 4 and 7);
GBNF grammars and `/tokenize` bodies (items 2 and 5); and 300 status streams opened at once (item 13: at most
`limits.status_streams` are served, the rest get a 503).
Run: `python bench/health_under_load.py` (a few minutes).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


MCP_ATTACKS = ("many", "wide", "huge")


def serve_mcp(kind: str) -> None:
    """A stdio MCP server for one attack: `many` lists 20,001 tools, `wide` a tool whose schema has 150,000
    properties, `huge` a tool whose result is 100 MB."""
    from mcp.server.mcpserver import MCPServer
    from mcp_types import Tool

    class Attack(MCPServer):
        async def list_tools(self):  # type: ignore[no-untyped-def]
            tools = await super().list_tools()
            if kind == "many":
                tools += [Tool(name=f"t{i}", input_schema={"type": "object"}) for i in range(20_001)]
            if kind == "wide":
                properties = {f"p{i}": {"type": "string"} for i in range(150_000)}
                tools.append(Tool(name="wide", input_schema={"type": "object", "properties": properties}))
            return tools

    server = Attack("attack")
    if kind == "huge":

        @server.tool()
        def huge() -> str:
            """A 100 MB answer."""
            return "x" * (100 * MiB)

    server.run("stdio")


def mcp_servers() -> str:
    return json.dumps({kind: {"command": sys.executable, "args": [__file__, "--serve-mcp", kind]}
                       for kind in MCP_ATTACKS})


def attacks() -> dict[str, tuple[str, bytes]]:
    chat = "/v1/chat/completions"
    user = [{"role": "user", "content": "hi"}]
    words = "word " * ((63 * MiB) // 5)  # under the 64 MiB body limit with the JSON around it
    return {
        "none (baseline)": ("", b""),
        "63 MB message": (chat, json.dumps({"model": "m", "messages": [{"role": "user", "content": words}]}).encode()),
        "20,000 stop strings": (chat, json.dumps({"model": "m", "messages": user, "stop": ["zz"] * 20_000}).encode()),
        "5 MB tool description": (chat, json.dumps({"model": "m", "messages": user, "tools": [
            {"type": "function", "function": {"name": "f", "description": "d " * (5 * MiB // 2),
                                              "parameters": {}}}]}).encode()),
        "30,000 messages": (chat, json.dumps({"model": "m", "messages": user * 30_000}).encode()),
        "nested 100,000 deep": (chat, b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        "MCP listing of 20,001 tools": ("/v1/responses", mcp_request("many")),
        "MCP schema of 150,000 properties": ("/v1/responses", mcp_request("wide")),
        "MCP result of 100 MB": ("/v1/responses", mcp_request("huge", tool_choice="required")),
    }


def chained_gbnf(n_rules: int) -> str:
    """A GBNF grammar whose rules each refer to the next: llguidance's conversion takes time quadratic in them."""
    rules = [f'r{i} ::= "t{i}" | r{i + 1}' for i in range(n_rules - 1)]
    return "\n".join(["root ::= r0", *rules, f'r{n_rules - 1} ::= "end"'])


def grammar_attacks() -> dict[str, tuple[str, bytes]]:
    """GBNF grammars (issue 29 item 2): at the rule limit (converted in a worker thread), over it (the issue's
    55 KB grammar blocked /health 4.8 s), and 5 MB (over the byte limit)."""
    chat = "/v1/chat/completions"
    user = [{"role": "user", "content": "hi"}]

    def body(grammar: str) -> bytes:
        return json.dumps({"model": "m", "messages": user, "grammar": grammar, "max_tokens": 4}).encode()

    return {
        "GBNF 1,000 rules (999 chained)": (chat, body(chained_gbnf(999))),
        "GBNF 2,200 chained rules": (chat, body(chained_gbnf(2200))),
        "GBNF 5 MB": (chat, body('root ::= "' + "a" * (5 * MiB) + '"')),
    }


def tokenize_attacks() -> dict[str, tuple[str, bytes]]:
    """`POST /tokenize` (issue 29 item 5): 4.8 MB blocked /health 6.4 s, 48 MB never returned; and the longest
    content the default context lets through (4,096 tokens' worth at the demo vocabulary's longest token)."""
    def body(content: str) -> bytes:
        return json.dumps({"content": content}).encode()

    return {
        "/tokenize 80 KB": ("/tokenize", body(("word " * 20_000)[:81_000])),
        "/tokenize 4.8 MB": ("/tokenize", body("word " * (48 * MiB // 50))),
        "/tokenize 48 MB": ("/tokenize", body("word " * (48 * MiB // 5))),
    }


def mcp_request(label: str, **options: Any) -> bytes:
    """A request naming a configured attack server (it failed at startup: the request starts it again)."""
    tool = {"type": "mcp", "server_label": label, "require_approval": "never"}
    return json.dumps({"model": "m", "input": "hi", "tools": [tool], "max_output_tokens": 32,
                       "reasoning": {"effort": "none"}, **options}).encode()


POLLER = """
import json, sys, time, httpx
latencies = []
with httpx.Client(timeout=120) as client:
    while not sys.stdin.closed:
        started = time.perf_counter()
        client.get(sys.argv[1] + "/health").raise_for_status()
        latencies.append((time.perf_counter() - started) * 1000)
        time.sleep(0.02)
        import select
        if select.select([sys.stdin], [], [], 0)[0]:
            break
print(json.dumps(latencies))
"""


STATUS_STREAMS = 300  # the attack: 300 unauthenticated status streams pushed /health to 1.26 s


def open_status_streams(url: str, n: int) -> str:
    """Open `n` status streams at once (interval 0.1 s), read them for 5 s, close them: the answers' statuses."""
    host, port = url.removeprefix("http://").split(":")
    request = f"GET /v1/status/stream?interval=0.1 HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    streams = []
    for _ in range(n):
        sock = socket.create_connection((host, int(port)))
        sock.sendall(request)
        streams.append(sock)
    deadline = time.monotonic() + 5.0
    statuses: dict[str, int] = {}
    for sock in streams:
        sock.settimeout(max(deadline - time.monotonic(), 0.5))
        try:
            head = sock.recv(64).split(b" ", 2)
            status = head[1].decode() if len(head) > 1 else "none"
        except OSError:
            status = "none"
        statuses[status] = statuses.get(status, 0) + 1
    time.sleep(max(deadline - time.monotonic(), 0.0))
    for sock in streams:
        sock.close()
    return ", ".join(f"{count}x{status}" for status, count in sorted(statuses.items()))


def run_attack(url: str, path: str, body: bytes) -> dict[str, Any]:
    result: dict[str, Any] = {}
    poller = subprocess.Popen([sys.executable, "-c", POLLER, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    time.sleep(1.0)  # a baseline before the attack
    started = time.perf_counter()
    if path == "status streams":
        result["status"] = open_status_streams(url, STATUS_STREAMS)
    elif path:
        reply = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=600)
        result["status"] = reply.status_code
    else:
        time.sleep(5.0)
        result["status"] = "-"
    result["seconds"] = time.perf_counter() - started
    time.sleep(0.3)
    latencies = sorted(json.loads(poller.communicate("stop\n", timeout=60)[0]))
    result["n"] = len(latencies)
    result["p50"] = statistics.median(latencies)
    result["p99"] = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    result["max"] = latencies[-1]
    return result


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "strata.cli", "serve", "--port", str(port),
                               "--mcp-servers", mcp_servers()],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.2)
        print("| attack | answer | request s | /health p50 ms | p99 ms | max ms | samples | server RSS MB after |")
        print("|---|---|---|---|---|---|---|---|")
        streams = {f"{STATUS_STREAMS} status streams at once": ("status streams", b"")}
        for name, (path, body) in {**attacks(), **grammar_attacks(), **tokenize_attacks(), **streams}.items():
            r = run_attack(url, path, body)
            print(f"| {name} ({len(body) / MiB:.1f} MiB) | {r['status']} | {r['seconds']:.2f} | {r['p50']:.1f} | "
                  f"{r['p99']:.1f} | {r['max']:.1f} | {r['n']} | {rss_mb(server.pid):.0f} |", flush=True)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve-mcp"]:
        serve_mcp(sys.argv[2])
    else:
        sys.exit(main())
