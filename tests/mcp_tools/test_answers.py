"""What Strata reads of an MCP server's answers, without a server: the answer that stands for one past the byte
limit, a tool listing's limits, and the HTTP body bound."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import pytest
import trio

from strata.config import McpConfig, McpServerConfig
from strata.mcp_tools.answers import Pending, checked, leading_text
from strata.mcp_tools.transports import BoundedHttp


def call_answer(text: str, request_id: Any = 7, id_last: bool = False) -> bytes:
    result = {"content": [{"type": "text", "text": text}]}
    answer = {"result": result, "jsonrpc": "2.0", "id": request_id} if id_last else \
        {"jsonrpc": "2.0", "id": request_id, "result": result}
    return json.dumps(answer).encode()


def test_the_text_read_before_the_cut_is_kept():
    whole = call_answer('héllo "q" \\ ' + "a" * 50)
    assert leading_text(whole) == 'héllo "q" \\ ' + "a" * 50
    for n in range(len(whole)):  # wherever the cut falls, in an escape too, a prefix of the text comes out
        assert ('héllo "q" \\ ' + "a" * 50).startswith(leading_text(whole[:n]))
    assert leading_text(b'{"jsonrpc": "2.0", "id": 1, "result": {"content": [{"type": "image", "data": "AAAA') == ""


@pytest.mark.parametrize("id_last", [False, True])
def test_an_over_long_answer_is_told_by_its_id_first_or_last(id_last):
    pending = Pending()
    pending.sent(3, "tools/list")
    pending.sent(7, "tools/call")
    whole = call_answer("x" * 1000, 7, id_last)
    answer = pending.over_long(whole[:100], whole[-50:], 100)
    assert answer is not None and answer["id"] == 7 and answer["result"]["isError"] is True
    text = answer["result"]["content"][0]["text"]
    assert text.startswith("x") and text.endswith("[cut: the result is over 100 bytes (mcp.max_result_bytes); "
                                                  "the rest was not read]")
    listing = pending.over_long(b'{"jsonrpc": "2.0", "id": 3, "result": {"tools": [', b"", 100)
    assert listing == {"jsonrpc": "2.0", "id": 3, "error": {
        "code": -32603, "message": "the answer to tools/list is over 100 bytes (mcp.max_result_bytes)"}}


def test_an_over_long_answer_without_a_readable_id_is_the_one_waiting_or_dropped():
    pending = Pending()
    pending.sent("a", "tools/call")
    assert pending.over_long(b'{"result": {"content": [', b"xxxx", 10)["id"] == "a"  # type: ignore[index]
    pending.sent("b", "tools/call")
    pending.sent("c", "tools/call")
    assert pending.over_long(b'{"result": {"content": [', b"xxxx", 10) is None
    pending.cancelled("b")  # its answer may never come: it is not waited for
    assert pending.over_long(b'{"result": {"content": [', b"xxxx", 10)["id"] == "c"  # type: ignore[index]


def test_a_listing_over_the_limits_becomes_an_error():
    tools = [{"name": f"t{i}", "inputSchema": {"type": "object"}} for i in range(3)]
    listing = {"jsonrpc": "2.0", "id": 1, "result": {"tools": tools}}
    assert checked(listing, "tools/list", McpConfig(max_tools=2))["error"]["message"] == \
        "the tool listing has 3 tools, more than mcp.max_tools (2)"
    assert checked(listing, "tools/call", McpConfig(max_tools=2)) is listing
    assert checked(listing, "tools/list", McpConfig(max_tools=3)) is listing
    tools[1]["inputSchema"] = {"type": "object", "properties": {f"p{i}": {} for i in range(100)}}
    message = checked(listing, "tools/list", McpConfig(max_schema_bytes=500))["error"]["message"]
    assert message == "the input schema of the tool 't1' is over 500 bytes (mcp.max_schema_bytes)"
    assert checked(listing, "tools/list", McpConfig(max_schema_bytes=1500)) is listing  # 922 bytes compact


def post(body: bytes, content_type: str, settings: McpConfig, method: str = "tools/call") -> bytes:
    """The body the SDK would read for a JSON-RPC request answered with `body`."""

    async def main() -> bytes:
        inner = httpx2.MockTransport(lambda request: httpx2.Response(
            200, headers={"content-type": content_type}, content=body))
        async with httpx2.AsyncClient(transport=BoundedHttp(inner, settings)) as client:
            request = {"jsonrpc": "2.0", "id": 5, "method": method, "params": {}}
            return (await client.post("http://mcp.test/mcp", json=request)).content

    return trio.run(main)


def test_a_json_body_past_the_limit_is_not_read_on():
    body = post(call_answer("y" * 5000, 5), "application/json", McpConfig(max_result_bytes=1000))
    answer = json.loads(body)
    assert answer["id"] == 5 and answer["result"]["isError"] is True
    assert answer["result"]["content"][0]["text"].startswith("yyy")
    whole = call_answer("y" * 500, 5)
    assert post(whole, "application/json", McpConfig(max_result_bytes=1000)) == whole


def test_an_event_stream_is_bounded_per_event():
    note = b'event: message\r\ndata: {"jsonrpc": "2.0", "method": "notifications/progress", "params": {}}\r\n\r\n'
    big = b"event: message\r\ndata: " + call_answer("z" * 5000, 5) + b"\r\n\r\n"
    body = post(note + big, "text/event-stream", McpConfig(max_result_bytes=1000))
    assert body.startswith(note)  # an event within the limit goes as it came
    events = [chunk for chunk in body.replace(b"\r\n", b"\n").split(b"\n\n") if chunk]
    assert len(events) == 2
    answer = json.loads(events[1].split(b"data: ", 1)[1])
    assert answer["result"]["isError"] is True and answer["result"]["content"][0]["text"].startswith("zzz")


def test_a_listing_over_http_is_checked():
    tools = [{"name": f"t{i}", "inputSchema": {"type": "object"}} for i in range(3)]
    listing = json.dumps({"jsonrpc": "2.0", "id": 5, "result": {"tools": tools}}).encode()
    settings = McpConfig(max_tools=2)
    for kind, body in (("application/json", listing), ("text/event-stream", b"data: " + listing + b"\n\n")):
        data = post(body, kind, settings, "tools/list")
        answer = json.loads(data.split(b"data: ", 1)[-1])
        assert answer["error"]["message"] == "the tool listing has 3 tools, more than mcp.max_tools (2)"


def test_the_http_client_asks_for_uncompressed_answers():
    from strata.mcp_tools.transports import bounded_http_client

    client = bounded_http_client(McpServerConfig(url="http://mcp.test/mcp", headers={"X-Key": "k"}), McpConfig())
    assert client.headers["accept-encoding"] == "identity" and client.headers["x-key"] == "k"


def test_stdio_lines_keep_at_most_the_limit():
    from strata.mcp_tools.transports import _Lines

    lines = _Lines(10)
    assert lines.feed(b'{"a"') == []
    assert lines.feed(b': 1}\n{"b": 2}\n{') == [(b'{"a": 1}', None), (b'{"b": 2}', None)]
    long = lines.feed(b'"c": "' + b"x" * 1000)
    assert long == []
    assert lines.feed(b'y"}\n\n') == [(b'{"c": "xxx', b"x" * 253 + b'y"}'), (b"", None)]
