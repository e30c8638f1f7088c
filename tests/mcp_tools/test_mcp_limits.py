"""MCP's limits against a hostile client or server, through hypercorn on a scripted engine with real MCP test
servers: a result larger than the context."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from conftest import live_server, server_config

from .conftest import RoundsEngine, call, stdio_server

CONTEXT = 4096


@pytest.fixture(scope="module")
def server(tokenizer):
    engine = RoundsEngine(tokenizer, n_ctx=CONTEXT)
    big = {"STRATA_TEST_BIG": "1", "STRATA_TEST_TOOLS": "echo,big"}
    config = server_config(mcp_servers={"tools": stdio_server(env=big)})
    with live_server(config, engine, tokenizer) as live:
        live.engine = engine
        yield live


@pytest.fixture(scope="module")
def api(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


def mcp(label: str = "tools", **options: Any) -> dict[str, Any]:
    return {"type": "mcp", "server_label": label, "require_approval": "never", **options}


# --- a result larger than the context (item 8)


@pytest.mark.parametrize("stream", [False, True])
def test_a_result_over_the_context_is_cut_to_fit(server, api, tokenizer, stream):
    chars = 2 * CONTEXT  # under the 100,000-character cut and the byte limit, over the context
    server.engine.say(call("big", chars=chars), "Done.")
    if stream:
        with api.responses.stream(model="m", input="hi", tools=[mcp()]) as events:
            kinds = [event.type for event in events]
            response = events.get_final_response()
        assert "error" not in kinds and kinds[-1] == "response.completed"
    else:
        response = api.responses.create(model="m", input="hi", tools=[mcp()])
    assert response.status == "completed" and response.output_text == "Done."
    mcp_call = response.output[1]
    assert len(mcp_call.output) == chars  # the client sees what the tool returned
    prompt = tokenizer.decode(server.call(lambda: list(server.engine.kv)))
    shown = prompt.split("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]
    kept, _, note = shown.rpartition("\n")
    assert note == f"[cut: {len(kept)} characters of {chars}]"
    assert 0 < len(kept) < CONTEXT and kept == ("0123456789" * chars)[:len(kept)]
    assert len(server.call(lambda: list(server.engine.kv))) <= CONTEXT

