"""How fast a hang-up during an MCP tool call reaches the tool and frees the request.

The shipped demo model is asked for the weather with an MCP server offered whose `get_weather` takes 60 s. While
the tool runs the client closes its connection; the script measures (1) the time until the MCP server's tool saw
its cancellation (its own clock, same machine) and (2) the time until the server had released the request (its
history row written: the tool call cancelled, the request's MCP state closed, nothing of it left running).
Goal: under 100 ms.

    python bench/mcp_cancel.py [--repeats 20]

The server runs in this process (hypercorn, trio worker); the MCP server is this file run with --serve-mcp (the
SDK's server API, stdio); the client is a plain socket, so a hang-up is a closed TCP connection.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

from strata.config import config_from_dict
from strata.service import open_service

from served import served


def serve_mcp() -> None:
    import anyio
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("slow-weather")
    mark = os.environ["BENCH_MARK"]

    def note(what: str) -> None:
        with open(mark, "a") as file:
            file.write(f"{what} {time.time():.6f}\n")

    @server.tool()
    async def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        note("started")
        try:
            await anyio.sleep(60)
        except anyio.get_cancelled_exc_class():
            note("cancelled")
            raise
        return "sunny"

    server.run("stdio")


def _marks(path: Path, what: str) -> list[float]:
    text = path.read_text() if path.exists() else ""
    return [float(line.split()[1]) for line in text.splitlines() if line.startswith(what)]


async def _until(predicate, timeout: float = 30.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.0005)


async def main(repeats: int) -> None:
    model = Path(str(importlib.resources.files("strata.models"))) / "demo.gguf"
    with tempfile.TemporaryDirectory() as tmp:
        mark = Path(tmp) / "marks"
        config = config_from_dict({
            "model": str(model), "context": 1024, "sampling": {"temperature": 0.0},
            "mcp_servers": {"weather": {"command": sys.executable, "args": [__file__, "--serve-mcp"],
                                        "env": {"BENCH_MARK": str(mark)}}}})
        body = json.dumps({"model": "demo", "stream": True, "reasoning": {"effort": "none"},
                           "input": "What is the weather in Paris?",
                           "tools": [{"type": "mcp", "server_label": "weather", "require_approval": "never"}]})
        async with open_service(config, log=lambda line: None) as service, served(service) as (host, port):
            await service.mcp.servers["weather"].client()
            to_tool, released = [], []
            for _ in range(repeats):
                started, cancelled = len(_marks(mark, "started")), len(_marks(mark, "cancelled"))
                last = service.history.last
                stream = await trio.open_tcp_stream(host, port)
                await stream.send_all((f"POST /v1/responses HTTP/1.1\r\nHost: {host}:{port}\r\n"
                                       f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                                       f"{body}").encode())
                await _until(lambda: len(_marks(mark, "started")) > started)  # noqa: B023
                hung_up = time.time()
                await stream.aclose()
                await _until(lambda: service.history.last is not last)  # noqa: B023
                released.append(time.time() - hung_up)
                assert service.history.last is not None and service.history.last.finish == "cancel"
                await _until(lambda: len(_marks(mark, "cancelled")) > cancelled)  # noqa: B023
                to_tool.append(_marks(mark, "cancelled")[-1] - hung_up)
            assert not service.turn.busy and service.mcp.servers["weather"].state == "ready"
    for name, values in (("the tool saw the cancellation", to_tool), ("the request was released", released)):
        ms = sorted(1000 * value for value in values)
        print(f"{name}: median {statistics.median(ms):.1f} ms, max {ms[-1]:.1f} ms ({len(ms)} hang-ups)")


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve-mcp"]:
        serve_mcp()
    else:
        parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        parser.add_argument("--repeats", type=int, default=20)
        trio.run(main, parser.parse_args().repeats)
