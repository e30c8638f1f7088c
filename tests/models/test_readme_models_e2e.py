"""The README's several-models example runs as written: its `strata make-model` commands, its `models.json`, and
the server it configures, whose two models take turns under its `models_memory` as the README says."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import httpx
from conftest import live_server

from strata.config import load_config

README = Path(__file__).parents[2] / "README.md"


def example() -> list[str]:
    """The indented code block of the README's "Several models" section, as lines."""
    section = README.read_text().split("### Several models", 1)[1].split("\n### ", 1)[0]
    return [line[4:] for line in section.splitlines() if line.startswith("    ")]


def test_the_several_models_example_runs_as_written(tmp_path, monkeypatch):
    from strata.cli import main

    monkeypatch.chdir(tmp_path)
    lines = example()
    for line in lines:
        if line.startswith("strata make-model "):
            assert main(shlex.split(line)[1:]) == 0
    heredoc = "\n".join(lines).split("<<'EOF'\n", 1)[1].split("\nEOF", 1)[0]
    Path("models.json").write_text(heredoc)
    assert lines[-1] == "strata serve --config models.json"
    config = dataclasses.replace(load_config("models.json", environ={}), port=0)
    with live_server(config) as server:
        def ask(name: str) -> httpx.Response:
            return httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
                "model": name, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})

        def states() -> dict[str, str]:
            return {entry["id"]: entry["state"] for entry in httpx.get(server.url + "/v1/models").json()["data"]}

        assert states() == {"coder": "not loaded", "fast": "not loaded"}
        assert ask("titles").json()["model"] == "fast"
        assert ask("coder").json()["model"] == "coder"
        # As the README says: the request to coder after one to titles unloaded fast first.
        assert states() == {"coder": "loaded", "fast": "not loaded"}
    budget = re.search(r"`models_memory` at (\d+) MiB", README.read_text())
    assert budget is not None and int(budget[1]) * 2**20 == config.models_memory
