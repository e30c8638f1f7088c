"""Every Python example in the README runs as written against the demo model: each block on its own, in a fresh
namespace (a reader copies one example, not the page), with only the server's address replaced by this test
server's; the answers are the ones the comments show."""

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


# What each example prints, in the README's order: the answers its comments show.
PRINTED = [
    ["The capital of France is Paris."],
    ["A red circle in the middle."],
    ['{"capital": "Rome", "country": "Italy"}'],
    ['get_weather {"city": "Paris"}'],
    [],  # the embedded service: the demo model's greeting, whatever its words
]


def readme_examples() -> list[str]:
    return [block.split("```", 1)[0] for block in README.read_text().split("```python\n")[1:]]


def test_the_expected_answers_name_every_example():
    assert len(readme_examples()) == len(PRINTED)


@pytest.mark.parametrize("index", range(len(PRINTED)))
def test_each_readme_python_example_runs_alone(demo, capsys, index):
    block = readme_examples()[index]
    assert "http://127.0.0.1:8080" in block or "DEMO_MODEL" in block, block
    exec(block.replace("http://127.0.0.1:8080", demo.url), {})  # a fresh namespace: nothing from other examples
    printed = capsys.readouterr().out
    assert printed.strip(), block
    for answer in PRINTED[index]:
        assert answer in printed


def test_the_anthropic_base_url_note_is_true(demo):
    import anthropic

    client = anthropic.Anthropic(base_url=demo.url, api_key="unused", max_retries=0)
    reply = client.messages.create(model="demo", max_tokens=32, extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in "".join(block.text for block in reply.content if block.type == "text")
