"""Server-side MCP tool rounds in the Anthropic dialect (the MCP connector: `mcp_servers`, `mcp_toolset`), through
hypercorn with the official `anthropic` client, on a scripted engine and a real stdio MCP test server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from conftest import live_server, server_config

from .conftest import RoundsEngine, call, stdio_server

BETA = ["mcp-client-2025-11-20"]
SERVERS = [{"type": "url", "name": "tools"}]  # a configured server: no URL needed


@pytest.fixture(scope="module")
def server(tokenizer, tmp_path_factory: pytest.TempPathFactory):
    mark: Path = tmp_path_factory.mktemp("mcp") / "mark"
    engine = RoundsEngine(tokenizer)
    with live_server(server_config(mcp_servers={"tools": stdio_server(mark)}), engine, tokenizer) as live:
        live.engine = engine
        yield live


@pytest.fixture(scope="module")
def api(server):
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as client:
        yield client


def create(api, server, *scripts: str, **options: Any) -> Any:
    server.engine.say(*scripts)
    options.setdefault("mcp_servers", SERVERS)
    return api.beta.messages.create(model="m", max_tokens=200, betas=BETA,
                                    messages=[{"role": "user", "content": "hi"}], **options)


def test_a_tool_round_runs_on_the_server(server, api):
    message = create(api, server, call("echo", text="hi"), "Done.")
    assert [block.type for block in message.content] == ["mcp_tool_listing", "mcp_tool_use", "mcp_tool_result",
                                                         "text"]
    listing, use, result, text = message.content
    assert listing.mcp_server_name == "tools" and "echo" in [tool.name for tool in listing.tools]
    assert (use.name, use.server_name, use.input) == ("echo", "tools", {"text": "hi"})
    assert result.tool_use_id == use.id and result.is_error is False
    assert result.content[0].text == "echo: hi"
    assert text.text == "Done." and message.stop_reason == "end_turn"


def test_streamed_blocks_match_the_message(server, api):
    server.engine.say(call("echo", text="s"), "Done.")
    with api.beta.messages.stream(model="m", max_tokens=200, betas=BETA, mcp_servers=SERVERS,
                                  messages=[{"role": "user", "content": "hi"}]) as stream:
        kinds = [(event.type, getattr(getattr(event, "content_block", None), "type", None)) for event in stream]
        streamed = stream.get_final_message()
    message = create(api, server, call("echo", text="s"), "Done.")
    started = [kind for name, kind in kinds if name == "content_block_start"]
    assert started == ["mcp_tool_listing", "mcp_tool_use", "mcp_tool_result", "text"]
    assert [block.model_dump(exclude={"id", "tool_use_id"}) for block in streamed.content] == \
           [block.model_dump(exclude={"id", "tool_use_id"}) for block in message.content]
    assert streamed.content[2].tool_use_id == streamed.content[1].id


def test_a_tool_error_is_an_error_result(server, api):
    message = create(api, server, call("fail", reason="x"), "Sorry.")
    result = message.content[2]
    assert result.type == "mcp_tool_result" and result.is_error is True
    assert message.content[-1].text == "Sorry."


def test_toolsets_choose_the_tools(server, api):
    toolset = {"type": "mcp_toolset", "mcp_server_name": "tools", "default_config": {"enabled": False},
               "configs": {"echo": {"enabled": True}, "get_weather": {"enabled": True}}}
    message = create(api, server, "Hi.", tools=[toolset])
    assert sorted(tool.name for tool in message.content[0].tools) == ["echo", "get_weather"]
    denied = {"type": "mcp_toolset", "mcp_server_name": "tools", "configs": {"slow": {"enabled": False}}}
    message = create(api, server, "Hi.", tools=[denied])
    names = [tool.name for tool in message.content[0].tools]
    assert "slow" not in names and "echo" in names


def test_the_conversation_goes_on_with_the_blocks_sent_back(server, api, tokenizer):
    first = create(api, server, call("echo", text="one"), "Done.")
    server.engine.say("Again.")
    again = api.beta.messages.create(
        model="m", max_tokens=200, betas=BETA, mcp_servers=SERVERS,
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": "more"}])
    assert [block.type for block in again.content] == ["text"]  # the listing is in the history already
    prompt = tokenizer.decode(server.call(lambda: list(server.engine.kv)))
    assert prompt.count("<tool_response>\necho: one\n</tool_response>") == 1


def test_count_tokens_counts_the_mcp_tools(server, api):
    plain = api.messages.count_tokens(model="m", messages=[{"role": "user", "content": "hi"}]).input_tokens
    reply = httpx.post(server.url + "/v1/messages/count_tokens", timeout=30,
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "mcp_servers": SERVERS})
    assert reply.status_code == 200 and reply.json()["input_tokens"] > plain + 50


@pytest.mark.parametrize(("body", "message"), [
    ({"mcp_servers": [{"type": "url", "name": "nope"}]}, "no MCP server named 'nope' is configured"),
    ({"mcp_servers": [{"type": "url", "name": "x", "url": "http://127.0.0.1:1/mcp"}]}, "mcp.request_urls"),
    ({"mcp_servers": [{"type": "url", "name": "tools", "url": "http://elsewhere/mcp"}]}, "at another URL"),
    ({"mcp_servers": SERVERS * 2}, "duplicate MCP server name"),
    ({"tools": [{"type": "mcp_toolset", "mcp_server_name": "zzz"}]}, "no entry of mcp_servers is named 'zzz'"),
])
def test_refusals_are_anthropic_errors(server, body, message):
    reply = httpx.post(server.url + "/v1/messages", timeout=30,
                       json={"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert message in error["error"]["message"]


def test_message_start_carries_the_prompt_size(server, api):
    server.engine.say(call("echo", text="u"), "Done.")
    with api.beta.messages.stream(model="m", max_tokens=200, betas=BETA, mcp_servers=SERVERS,
                                  messages=[{"role": "user", "content": "hi"}]) as stream:
        start = next(event for event in stream if event.type == "message_start").message.usage
        stream.get_final_message()
    size = httpx.post(server.url + "/v1/messages/count_tokens", timeout=30, json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "mcp_servers": SERVERS}).json()
    assert start.input_tokens + start.cache_read_input_tokens == size["input_tokens"] > 50


def test_the_token_budget_spans_the_tool_rounds(server, api, tokenizer):
    """`max_tokens` counts every round's tokens: a later round gets what the earlier ones left; a call that spends
    the whole budget ends the response there, its tool not run."""
    first = call("echo", text="hi")
    n = len(tokenizer.encode(first, special=True))

    def answer(max_tokens: int, *scripts: str) -> Any:
        server.engine.say(*scripts)
        return api.beta.messages.create(model="m", max_tokens=max_tokens, betas=BETA, mcp_servers=SERVERS,
                                        messages=[{"role": "user", "content": "hi"}])

    message = answer(n + 2, first, "Done, and a longer answer than the budget.")
    assert [block.type for block in message.content][-1] == "text" and len(message.content[-1].text) == 2
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == n + 2
    spent = answer(n, first, "Done.")
    assert [block.type for block in spent.content][-1] == "mcp_tool_use"
    assert spent.stop_reason == "max_tokens" and spent.usage.output_tokens == n
