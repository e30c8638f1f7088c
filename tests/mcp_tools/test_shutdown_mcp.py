"""A graceful shutdown whose time runs out during an MCP tool call: the call is cancelled (the MCP server hears
it) and the stream ends with its dialect's error event, not a cut connection; through hypercorn, a real MCP test
server over stdio, and a scripted model that calls its slow tool."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
from conftest import live_server, server_config

from .conftest import RoundsEngine, call, mcp, stdio_server


def wait_for(predicate: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_tool_call_running_when_the_grace_ends_is_cut_with_an_error_event(tokenizer, tmp_path):
    mark = tmp_path / "mark"
    engine = RoundsEngine(tokenizer)
    engine.say(call("slow", seconds=30), "Never.")
    config = server_config(limits={"graceful_timeout": 1.0}, mcp_servers={"tools": stdio_server(mark)})
    chunks: list[bytes] = []
    with live_server(config, engine, tokenizer) as server:
        wait_for(lambda: server.call(lambda: server.service.mcp.status()[0]["state"] == "ready"))
        body = {"model": "m", "input": "hi", "stream": True,
                "tools": [mcp()]}
        with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=30) as reply:
            lines = reply.iter_bytes()
            wait_for(lambda: chunks.append(next(lines)) is None and "started" in
                     (mark.read_text() if mark.exists() else ""))
            began = time.monotonic()
            server.call(server.service.begin_shutdown, 1.0)  # as `serve()` does when SIGTERM comes
            chunks.extend(lines)
            ended = time.monotonic()
    text = b"".join(chunks).decode()
    last = text.strip().split("\n\n")[-1]
    assert last.startswith("event: error"), last
    assert json.loads(last.split("data: ", 1)[1])["code"] == "server_shutting_down"
    assert ended - began < 1.0  # before hypercorn's own cut at the end of the grace
    wait_for(lambda: "cancelled" in Path(mark).read_text())  # the MCP server heard the cancellation
