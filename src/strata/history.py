"""Recent requests, one row each, and running totals (kept in memory, bounded)."""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class HistoryRow:
    """One request. Times are seconds; `start` is wall-clock (Unix time)."""

    id: str
    route: str
    start: float
    model: str = ""  # the name of the model that answered (the first of its names)
    duration: float = 0.0
    finish: str = "cancel"
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens not computed: found in a slot's cache or read from the disk tier
    disk_tokens: int = 0  # of those, the ones read from the disk tier
    output_tokens: int = 0
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    # speculative decoding: draft tokens verified, and accepted; the draft length last chosen
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_length: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def prompt_tokens_per_second(self) -> float | None:
        evaluated = self.prompt_tokens - self.reused_tokens
        return evaluated / self.prompt_seconds if self.prompt_seconds > 0 else None

    @property
    def tokens_per_second(self) -> float | None:
        # The first output token comes from the prompt's logits, so decode time covers the others.
        decoded = self.output_tokens - 1
        return decoded / self.decode_seconds if decoded > 0 and self.decode_seconds > 0 else None

    def as_dict(self) -> dict[str, Any]:
        row = dataclasses.asdict(self)
        row["prompt_tokens_per_second"] = self.prompt_tokens_per_second
        row["tokens_per_second"] = self.tokens_per_second
        row["acceptance_rate"] = self.acceptance_rate
        return row


@dataclass
class Totals:
    requests: int = 0
    finishes: Counter[str] = field(default_factory=Counter)
    prompt_tokens: int = 0
    reused_tokens: int = 0
    disk_tokens: int = 0
    output_tokens: int = 0
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def add(self, row: HistoryRow) -> None:
        self.requests += 1
        self.finishes[row.finish] += 1
        self.prompt_tokens += row.prompt_tokens
        self.reused_tokens += row.reused_tokens
        self.disk_tokens += row.disk_tokens
        self.output_tokens += row.output_tokens
        self.prompt_seconds += row.prompt_seconds
        self.decode_seconds += row.decode_seconds
        self.draft_tokens += row.draft_tokens
        self.accepted_tokens += row.accepted_tokens

    def as_dict(self) -> dict[str, Any]:
        totals = dataclasses.asdict(self)
        totals["finishes"] = dict(self.finishes)
        return totals


class History:
    """The last `size` finished requests and the totals over every request since startup, of all models and of
    each one."""

    def __init__(self, size: int):
        self.rows: deque[HistoryRow] = deque(maxlen=size)
        self.totals = Totals()
        self.by_model: dict[str, Totals] = {}  # the totals of each model's requests

    def record(self, row: HistoryRow) -> None:
        self.rows.append(row)
        self.totals.add(row)
        self.by_model.setdefault(row.model, Totals()).add(row)

    @property
    def last(self) -> HistoryRow | None:
        return self.rows[-1] if self.rows else None
