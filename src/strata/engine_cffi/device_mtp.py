"""The hidden states the device backend keeps for the model's MTP block: each sequence's last `MTP_HISTORY`
positions an eval computed (the trunk's hidden state after the output norm, its RoPE position and its token id),
held on the host as the CPU engine holds them (mtp.c): position p at row p % MTP_HISTORY, found only where that row
still holds p. The block's pairs and drafts read them (`DeviceEngine.mtp_draft`)."""

from __future__ import annotations

import numpy as np

MTP_HISTORY = 128  # the CPU engine's STRATA_MTP_HISTORY


class HiddenHistory:
    """Of each of `n_seq` sequences, the rows of its last `MTP_HISTORY` evaluated positions (`n_embd` wide)."""

    def __init__(self, n_seq: int, n_embd: int) -> None:
        self.hidden = np.zeros((n_seq, MTP_HISTORY, n_embd), np.float32)
        self.pos = np.full((n_seq, MTP_HISTORY), -1, np.int64)
        self.rope = np.zeros((n_seq, MTP_HISTORY, 3), np.int32)
        self.token = np.full((n_seq, MTP_HISTORY), -1, np.int32)  # -1: an embedding row stood for the token

    def held(self, seq: int, pos: int) -> int | None:
        """The row holding (seq, pos), or None."""
        at = pos % MTP_HISTORY
        return at if pos >= 0 and self.pos[seq, at] == pos else None

    def keep(self, seqs: np.ndarray, pos: np.ndarray, hidden: np.ndarray, rope: np.ndarray,
             tokens: np.ndarray) -> None:
        """A chunk's rows (in order, each sequence's adjacent), of each sequence its last MTP_HISTORY positions."""
        for s in set(seqs.tolist()):
            mine = np.flatnonzero(seqs == s)
            mine = mine[pos[mine] > pos[mine].max() - MTP_HISTORY]
            at = pos[mine] % MTP_HISTORY
            self.hidden[s, at], self.pos[s, at], self.rope[s, at], self.token[s, at] = (
                hidden[mine], pos[mine], rope[mine], tokens[mine])

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """`dst` holds what `src` holds of positions below n, and nothing else."""
        below = (self.pos[src] >= 0) & (self.pos[src] < n)
        self.pos[dst] = np.where(below, self.pos[src], -1)
        self.hidden[dst], self.rope[dst], self.token[dst] = self.hidden[src], self.rope[src], self.token[src]
