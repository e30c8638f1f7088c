"""What every request in flight is doing right now: its phase and its prompt's progress, for the live status
stream (`/v1/status/stream`) and the monitor page.

The service registers each request for its lifetime (`Activity.track`) and moves it through its phases; whatever
runs the engine reports prompt progress with `RequestProgress.prompt_progress` (from any thread: the fields are
plain ints and strings, written by one side and read by the other). A scheduler running several requests at once
sets each one's `slot`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from strata.history import HistoryRow

# In order: waiting for its model to load (a server of several models), tokenising and checking the request,
# fetching a picture, encoding it, waiting for the engine, processing the prompt, generating.
Phase = Literal["loading", "prepare", "download", "encoding", "queued", "prompt", "decode",
                "tool"]  # tool: an MCP call runs


@dataclass
class RequestProgress:
    """One request in flight. `row` is its history row (output tokens and decode time as they grow)."""

    row: HistoryRow
    phase: Phase = "prepare"
    slot: int | None = None  # the engine slot serving it, while it has one
    prompt_done: int = 0  # prompt positions in the KV cache so far, reused ones included
    cached_tokens: int = 0  # positions reused from the previous request's cache

    def prompt_progress(self, done: int, cached: int | None = None) -> None:
        """The prompt's positions now in the KV cache (and, first, how many of them were reused)."""
        if cached is not None:
            self.cached_tokens = cached
        self.prompt_done = done

    def as_dict(self) -> dict[str, Any]:
        row = self.row
        return {
            "id": row.id,
            "route": row.route,
            "model": row.model,
            "phase": self.phase,
            "slot": self.slot,
            "seconds": round(time.time() - row.start, 3),
            "prompt_tokens": row.prompt_tokens,
            "prompt_done": self.prompt_done,
            "cached_tokens": self.cached_tokens,
            "output_tokens": row.output_tokens,
            "tokens_per_second": row.tokens_per_second,
            "draft_length": row.draft_length,
            "acceptance_rate": row.acceptance_rate,
        }


class Activity:
    """The requests in flight, in arrival order."""

    def __init__(self) -> None:
        self._requests: dict[int, RequestProgress] = {}

    @contextmanager
    def track(self, row: HistoryRow) -> Iterator[RequestProgress]:
        progress = RequestProgress(row)
        key = id(progress)
        self._requests[key] = progress
        try:
            yield progress
        finally:
            del self._requests[key]

    def __iter__(self) -> Iterator[RequestProgress]:
        return iter(list(self._requests.values()))

    def __len__(self) -> int:
        return len(self._requests)
