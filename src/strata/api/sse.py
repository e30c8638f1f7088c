"""Server-sent events framing (pure: bytes in, nothing sent)."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"
"""The end marker of an OpenAI chat stream."""


def encode(data: Any, event: str | None = None) -> bytes:
    """One event: an optional `event:` line, then the JSON data on one `data:` line, then a blank line.

    Args:
        data: JSON-serialisable; compact JSON never contains a newline, so one `data:` line always suffices.
        event: the event name (Anthropic and Responses streams name their events; OpenAI chat does not).
    """
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


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
