"""What Strata reads of an MCP server's answers, whatever the transport: the requests still waiting for one, the
answer given in place of one past `mcp.max_result_bytes` (a tool result cut there, saying so), and the limits
on a tool listing (`mcp.max_tools`, `mcp.max_schema_bytes`). Pure functions, no I/O: the transports
(`strata.mcp_tools.transports`) call them, parsing in worker threads."""

from __future__ import annotations

import json
import re
from typing import Any

from strata.config import McpConfig
from strata.mcp_tools.tools import MAX_RESULT_CHARS

INTERNAL_ERROR = -32603  # JSON-RPC's code for an answer that cannot be used
_TEXT = re.compile(rb'"text"\s*:\s*"')  # where the first text of a result starts
_STRING_BODY = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*')  # a JSON string's body, to its end or the cut
_PARTIAL_ESCAPE = re.compile(r"\\(?:u[0-9a-fA-F]{0,3})?$")
_ID = r'"id"\s*:\s*(-?\d+|"[^"\\]*")'
_ID_FIRST = re.compile(r'^\s*\{\s*(?:"jsonrpc"\s*:\s*"2\.0"\s*,\s*)?' + _ID)
_ID_LAST = re.compile(_ID + r"\s*\}\s*$")


class Pending:
    """Our requests to a server still waiting for an answer, by JSON-RPC id: the method each one called."""

    def __init__(self) -> None:
        self._methods: dict[Any, str] = {}

    def sent(self, request_id: Any, method: str) -> None:
        self._methods[request_id] = method

    def cancelled(self, request_id: Any) -> None:
        """We cancelled a request: its answer may never come."""
        self._methods.pop(request_id, None)

    def answered(self, message: dict[str, Any]) -> str | None:
        """The method a message from the server answers (None: it answers none of ours)."""
        if "method" in message:
            return None  # the server's own request or notification
        return self._methods.pop(message.get("id"), None)

    def over_long(self, prefix: bytes, tail: bytes, limit: int) -> dict[str, Any] | None:
        """The answer that stands for a message longer than `limit` bytes, of which `prefix` (its start) and
        `tail` (its last bytes) were kept; None when it cannot be told which of our requests it answers.

        Its id is the message's first key as the Python SDK writes it, or its last as the TypeScript one does;
        else the one request waiting, if only one is."""
        for text, pattern in ((prefix, _ID_FIRST), (tail, _ID_LAST)):
            match = pattern.search(text.decode("utf-8", "ignore"))
            if match is not None and json.loads(match[1]) in self._methods:
                request_id = json.loads(match[1])
                break
        else:
            if len(self._methods) != 1:
                return None
            request_id = next(iter(self._methods))
        return cut_answer(request_id, self._methods.pop(request_id), prefix, limit)


def cut_answer(request_id: Any, method: str | None, prefix: bytes, limit: int) -> dict[str, Any]:
    """The answer that stands for one longer than `limit` bytes, of which `prefix` was read: a tool call's
    result holds the text read so far and says it was cut; any other answer is an error that says why.

    A cut result is an error result (`isError`): the SDK holds a complete one to the tool's output schema,
    which a cut one cannot meet."""
    if method == "tools/call":
        note = f"[cut: the result is over {limit} bytes (mcp.max_result_bytes); the rest was not read]"
        text = leading_text(prefix)
        return {"jsonrpc": "2.0", "id": request_id,
                "result": {"resultType": "complete", "isError": True,
                           "content": [{"type": "text", "text": f"{text}\n{note}" if text else note}]}}
    return error_answer(request_id, f"the answer to {method or 'a request'} is over {limit} bytes "
                                    "(mcp.max_result_bytes)")


def error_answer(request_id: Any, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "error": {"code": INTERNAL_ERROR, "message": message}}


def leading_text(prefix: bytes) -> str:
    """The first text of a JSON-RPC answer cut short, as far as it was read and at most about what the model
    is given of a result ("" when none was read)."""
    match = _TEXT.search(prefix)
    if match is None:
        return ""
    most = prefix[match.end():match.end() + 6 * MAX_RESULT_CHARS]  # a character is at most 6 bytes escaped
    body = _PARTIAL_ESCAPE.sub("", _STRING_BODY.match(most.decode("utf-8", "ignore"))[0])  # type: ignore[index]
    try:
        return str(json.loads(f'"{body}"'))
    except ValueError:
        return ""


def listing_refusal(answer: dict[str, Any], settings: McpConfig) -> str | None:
    """Why a `tools/list` answer is refused (None: it is within the limits). Run in a worker thread."""
    result = answer.get("result")
    tools = result.get("tools") if isinstance(result, dict) else None
    if not isinstance(tools, list):
        return None  # not a listing: the SDK says what is wrong with it
    if len(tools) > settings.max_tools:
        return f"the tool listing has {len(tools)} tools, more than mcp.max_tools ({settings.max_tools})"
    for tool in tools:
        schema = tool.get("inputSchema") if isinstance(tool, dict) else None
        if _longer_than(schema, settings.max_schema_bytes):
            name = str(tool.get("name"))[:80] if isinstance(tool, dict) else "?"
            return (f"the input schema of the tool {name!r} is over {settings.max_schema_bytes} bytes "
                    "(mcp.max_schema_bytes)")
    return None


def _longer_than(value: Any, limit: int) -> bool:
    """Whether `value` as compact JSON is longer than `limit` bytes (about: strings counted unescaped). The walk
    stops once past the limit, so a huge schema costs no more than one at the limit."""
    left = limit
    stack = [value]
    while stack and left >= 0:
        item = stack.pop()
        if isinstance(item, dict):
            left -= 1
            for key, sub in item.items():
                left -= len(str(key)) + 4  # quotes, colon, comma
                stack.append(sub)
                if left < 0:
                    break
        elif isinstance(item, list):
            left -= 1
            for sub in item:
                left -= 1
                stack.append(sub)
                if left < 0:
                    break
        else:
            left -= len(item) + 2 if isinstance(item, str) else len(str(item))
    return left < 0


def checked(answer: dict[str, Any], method: str | None, settings: McpConfig) -> dict[str, Any]:
    """The answer, or an error in its place when it is a tool listing over the limits (the session then fails
    with one clear reason, and no model sees the listing)."""
    if method == "tools/list" and "result" in answer:
        why = listing_refusal(answer, settings)
        if why is not None:
            return error_answer(answer.get("id"), why)
    return answer
