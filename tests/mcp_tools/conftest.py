"""MCP test servers (the SDK's server API, as subprocesses: stdio, and streamable HTTP on 127.0.0.1) and a
scripted engine whose model writes one script per tool round."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fakes import ScriptedEngine

SERVER = str(Path(__file__).with_name("mcp_test_server.py"))


def stdio_server(mark: Path | None = None, **extra: Any) -> dict[str, Any]:
    """The config entry of a stdio test server (`STRATA_TEST_MARK` = `mark`)."""
    env = {"STRATA_TEST_MARK": str(mark)} if mark is not None else {}
    return {"command": sys.executable, "args": [SERVER, "stdio"], "env": env, **extra}


@contextmanager
def http_server(**env: str) -> Iterator[str]:
    """A streamable-HTTP test server on 127.0.0.1 (`env` added to its environment): its URL."""
    proc = subprocess.Popen([sys.executable, SERVER, "http"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **env})
    try:
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()


@pytest.fixture(scope="module")
def http_mcp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A streamable-HTTP test server on 127.0.0.1: (its URL, its mark file)."""
    mark = tmp_path_factory.mktemp("mcp") / "http-mark"
    with http_server(STRATA_TEST_MARK=str(mark)) as url:
        yield url, mark


class RoundsEngine(ScriptedEngine):
    """A scripted engine whose model writes `scripts[k]` after the k-th `<tool_response>` of the prompt (the
    last script again after more)."""

    def __init__(self, tokenizer: Any, **options: Any):
        super().__init__(tokenizer, **options)
        self._encode = lambda text: tokenizer.encode(text, special=True)
        self._response = self._encode("<tool_response>")
        self.scripts: list[list[int]] = [[]]

    def say(self, *texts: str) -> None:
        """The scripts of the rounds to come, in order."""
        self.scripts = [self._encode(text) for text in texts]

    def _next_token(self, kv: list[int]) -> int:
        n, k = len(self._response), 0
        for i in range(len(kv) - n + 1):
            if kv[i:i + n] == self._response:
                k += 1
        self.script = self.scripts[min(k, len(self.scripts) - 1)]
        return super()._next_token(kv)


def mcp(label: str = "tools", **options: Any) -> dict[str, Any]:
    """A Responses API `mcp` tool naming the configured server `label`, run without asking."""
    return {"type": "mcp", "server_label": label, "require_approval": "never", **options}


def call(name: str, **arguments: Any) -> str:
    """The text with which the model calls a tool."""
    import json

    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'
