"""Server-sent events framing (pure: bytes in, nothing sent)."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"
"""The end marker of an OpenAI chat stream."""

# One encoder for every event: `json.dumps` with options builds a new one per call, once per streamed token.
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def encode(data: Any, event: str | None = None) -> bytes:
    """One event: an optional `event:` line, then the JSON data on one `data:` line, then a blank line.

    Args:
        data: JSON-serialisable; compact JSON never contains a newline, so one `data:` line always suffices.
        event: the event name (Anthropic and Responses streams name their events; OpenAI chat does not).
    """
    if event:
        return f"event: {event}\ndata: {_JSON.encode(data)}\n\n".encode()
    return f"data: {_JSON.encode(data)}\n\n".encode()


def decode(stream: bytes) -> list[tuple[str | None, str]]:
    """Split an SSE byte stream into (event name, data) pairs; the inverse of `encode`, for tests and tools."""
    events = []
    for block in stream.decode().split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
        events.append((name, "\n".join(data)))
    return events
