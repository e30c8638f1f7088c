"""MCP's limits against a hostile client or server, through hypercorn on a scripted engine with real MCP test
servers (stdio and streamable HTTP): servers per request, labels, tool listings, result bytes, and a result
larger than the context."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest
from conftest import live_server, server_config

from .conftest import RoundsEngine, call, http_server, mcp, stdio_server

RESULT_BYTES = 64 * 1024
CONTEXT = 4096


@pytest.fixture(scope="module")
def server(tokenizer):
    engine = RoundsEngine(tokenizer, n_ctx=CONTEXT)
    big = {"STRATA_TEST_BIG": "1", "STRATA_TEST_TOOLS": "echo,big"}
    with http_server(**big) as web, http_server(STRATA_TEST_TOOLS="echo", STRATA_TEST_MANY_TOOLS="21") as web_many:
        config = server_config(
            mcp={"max_servers": 3, "max_tools": 20, "max_result_bytes": RESULT_BYTES, "request_urls": True},
            images={"allow_hosts": ["127.0.0.1"]},
            mcp_servers={"tools": stdio_server(env=big), "web": {"url": web},
                         "many": stdio_server(env={"STRATA_TEST_TOOLS": "echo", "STRATA_TEST_MANY_TOOLS": "21"}),
                         "wide": stdio_server(env={"STRATA_TEST_TOOLS": "echo",
                                                   "STRATA_TEST_SCHEMA_PROPERTIES": "1000"}),
                         "web_many": {"url": web_many}})
        with live_server(config, engine, tokenizer) as live:
            live.engine = engine
            live.web = web
            yield live


@pytest.fixture(scope="module")
def api(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


def ask(api, server, *scripts: str, tools=None, **options: Any) -> Any:
    server.engine.say(*scripts)
    return api.responses.create(model="m", input="hi", tools=tools or [mcp()], **options)


def status(server, name: str) -> dict[str, Any]:
    return next(entry for entry in server.service.mcp.status() if entry["name"] == name)


def settled(server, name: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while status(server, name)["state"] == "starting" and time.monotonic() < deadline:
        time.sleep(0.05)
    return status(server, name)


def post(server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"anthropic-beta": "mcp-client-2025-11-20"}, timeout=30)


# --- servers per request (issue 29, item 7)


def test_more_servers_than_the_cap_are_refused_before_any_opens(server):
    starts = {name: settled(server, name)["starts"] for name in ("tools", "web", "many", "wide")}
    tools = [mcp("tools", allowed_tools=["big"]), mcp("web", allowed_tools=["echo"]),
             mcp("many", allowed_tools=["many_0"]), mcp("wide", allowed_tools=[])]  # no two tools share a name
    reply = post(server, "/v1/responses", {"model": "m", "input": "hi", "tools": tools})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "tools[3]" and "at most 3 MCP servers" in error["message"], error
    assert {name: status(server, name)["starts"] for name in starts} == starts  # none was started again

    servers = [{"type": "url", "name": name} for name in ("tools", "web", "many", "wide")]
    reply = post(server, "/v1/messages", {"model": "m", "max_tokens": 8, "mcp_servers": servers,
                                          "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 400
    assert "mcp_servers[3]" in reply.json()["error"]["message"]


# --- labels (item 14)


def test_a_label_that_could_forge_log_lines_is_refused(server):
    label = "x\nmcp: tools: ready, 0 tools"
    reply = post(server, "/v1/responses", {"model": "m", "input": "hi",
                                           "tools": [mcp(label, server_url=server.web)]})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "tools[0].server_label"

    reply = post(server, "/v1/messages", {"model": "m", "max_tokens": 8,
                                          "mcp_servers": [{"type": "url", "name": label, "url": server.web}],
                                          "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 400
    assert "mcp_servers[0].name" in reply.json()["error"]["message"]


# --- tool listings (item 4)


@pytest.mark.parametrize("name", ["many", "web_many"])
def test_a_listing_over_max_tools_is_refused(server, api, name):
    entry = settled(server, name)
    assert entry["state"] == "failed" and entry["tools"] == []
    assert entry["error"] == "the tool listing has 22 tools, more than mcp.max_tools (20)"
    response = ask(api, server, "Hi.", tools=[mcp(name)])
    listing = response.output[0]
    assert listing.type == "mcp_list_tools" and listing.tools == []
    assert "more than mcp.max_tools (20)" in listing.error
    assert response.output_text == "Hi."


def test_a_listing_with_a_schema_over_max_schema_bytes_is_refused(server):
    entry = settled(server, "wide")
    assert entry["state"] == "failed"
    assert entry["error"] == "the input schema of the tool 'wide' is over 16384 bytes (mcp.max_schema_bytes)"


# --- result bytes (item 7)


@pytest.mark.parametrize("label", ["tools", "web"])
def test_a_result_over_max_result_bytes_is_cut_unread(server, api, label, tokenizer):
    response = ask(api, server, call("big", chars=10 * RESULT_BYTES), "Done.", tools=[mcp(label)])
    mcp_call = response.output[1]
    assert mcp_call.status == "failed"  # a cut result cannot meet the tool's output schema: an error result
    note = f"[cut: the result is over {RESULT_BYTES} bytes (mcp.max_result_bytes); the rest was not read]"
    text, _, last = mcp_call.error.content[0]["text"].rpartition("\n")
    assert last == note
    assert 60_000 < len(text) < RESULT_BYTES and text == ("0123456789" * RESULT_BYTES)[:len(text)]
    # The session goes on: the next call of the same server is answered.
    response = ask(api, server, call("echo", text="after"), "Done.", tools=[mcp(label)])
    assert response.output[1].output == "echo: after"
    assert status(server, label)["starts"] == 1


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

