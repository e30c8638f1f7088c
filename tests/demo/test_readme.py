"""Every Python example in the README runs as written against the demo model: each block in order, in one
namespace (later blocks use the client the first one makes), with only the server's address replaced by this
test server's; the answers are the ones the comments show."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import live_server, server_config

from strata.models import with_demo_model

README = Path(__file__).parents[2] / "README.md"


@pytest.fixture(scope="module")
def demo():
    with live_server(with_demo_model(server_config())) as live:
        yield live


def test_every_readme_python_example_runs(demo, capsys):
    blocks = [block.split("```", 1)[0] for block in README.read_text().split("```python\n")[1:]]
    assert len(blocks) >= 3
    namespace: dict[str, object] = {}
    for block in blocks:
        assert "http://127.0.0.1:8080" in block or "client." in block or "trio.run" in block, block
        exec(block.replace("http://127.0.0.1:8080", demo.url), namespace)
    printed = capsys.readouterr().out
    assert "The capital of France is Paris." in printed
    assert "A red circle in the middle." in printed


def test_the_anthropic_base_url_note_is_true(demo):
    import anthropic

    client = anthropic.Anthropic(base_url=demo.url, api_key="unused", max_retries=0)
    reply = client.messages.create(model="demo", max_tokens=32, extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in "".join(block.text for block in reply.content if block.type == "text")
