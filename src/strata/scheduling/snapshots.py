"""Snapshots of a hybrid model's recurrent state, for prefix reuse.

A Gated DeltaNet layer keeps one state per sequence that sums up every position before it: unlike attention's KV
rows, it cannot be cut back to a shorter prefix. So a slot of a recurrent model can resume only where it has that
state: its live state at the end of what it holds, or a snapshot taken at an earlier position of the same
sequence (its attention rows up to there are still in the cache). The batcher takes snapshots where a later
request is likely to branch off (`snapshot_points`) and keeps them here, least recently used first out, within a
byte budget.

A snapshot of slot `seq` at position `p` stays valid while the slot holds its first `p` positions unchanged: the
batcher drops the slot's snapshots past the length it cuts the slot back to (`truncate`), and all of them when it
overwrites the slot from another (`clear`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class Snapshots:
    """The snapshots of one context's slots.

    Args:
        budget: the most bytes they take together; 0 keeps none.
        state_bytes: the bytes of one snapshot (the engine's `state_bytes`).
    """

    def __init__(self, budget: int, state_bytes: int):
        self.budget, self.state_bytes = budget, state_bytes
        self._held: OrderedDict[tuple[int, int], bytes] = OrderedDict()  # (seq, position) -> state, oldest first
        self.taken = self.evicted = 0  # counters, for the status

    @property
    def capacity(self) -> int:
        """How many snapshots the budget holds."""
        return self.budget // self.state_bytes if self.state_bytes else 0

    @property
    def held_bytes(self) -> int:
        return len(self._held) * self.state_bytes

    def __len__(self) -> int:
        return len(self._held)

    def positions(self, seq: int) -> list[int]:
        """The positions slot `seq` has snapshots at, increasing."""
        return sorted(p for s, p in self._held if s == seq)

    def best(self, seq: int, limit: int) -> int:
        """The largest position at most `limit` that slot `seq` has a snapshot at; 0 if none."""
        return max((p for s, p in self._held if s == seq and p <= limit), default=0)

    def put(self, seq: int, position: int, state: bytes) -> None:
        """Keep slot `seq`'s state at `position`, evicting the least recently used snapshots beyond the budget."""
        if self.capacity == 0 or position <= 0:
            return
        self._held[seq, position] = state
        self._held.move_to_end((seq, position))
        self.taken += 1
        while len(self._held) > self.capacity:
            self._held.popitem(last=False)
            self.evicted += 1

    def take(self, seq: int, position: int) -> bytes:
        """The state of slot `seq` at `position` (marked as just used).

        Raises:
            KeyError: no such snapshot.
        """
        self._held.move_to_end((seq, position))
        return self._held[seq, position]

    def truncate(self, seq: int, n: int) -> None:
        """Slot `seq` now holds only its first `n` positions: its snapshots past them are gone."""
        for key in [key for key in self._held if key[0] == seq and key[1] > n]:
            del self._held[key]

    def clear(self, seq: int) -> None:
        self.truncate(seq, 0)


def snapshot_points(turn_starts: Sequence[int], n_prompt: int, reused: int, keep_last: int = 2) -> list[int]:
    """Where a job's prompt is snapshotted: past the positions its slot resumed from, the first message boundary
    (the end of the system prompt, which side requests share), the last `keep_last` boundaries (where the next
    turn of the conversation, or a retry, branches off) and the end of the prompt (the next turn re-renders the
    answer after it); increasing.

    Args:
        turn_starts: the positions where the prompt's messages start (a chat template's turn-opening token).
        n_prompt: the prompt's length.
        reused: the positions the job resumed from (snapshots there or before would duplicate the slot's own).
    """
    starts = sorted(p for p in set(turn_starts) if 0 < p < n_prompt)
    chosen = set(starts[:1]) | set(starts[-keep_last:] if keep_last else ()) | {n_prompt}
    return sorted(p for p in chosen if p > reused)
