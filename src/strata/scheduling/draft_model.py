"""Speculative decoding's drafts from a separate small model of the same vocabulary (`speculative.draft_model`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from strata.engine_cffi import BatchItem
from strata.scheduling.batcher import common_prefix
from strata.scheduling.engine_like import EngineLike


class DraftModel:
    """Drafts from a small model of the same vocabulary on a context of its own, drawn greedily (q one-hot: the
    verification stays exact), one of its sequences per slot of the batcher's engine. Each sequence keeps what it
    has evaluated and is cut back to the part the job's history shares, like the prefix cache; a sequence behind
    its job (a new prompt) catches up `CATCH_UP` tokens a step and drafts nothing meanwhile, so a long prompt
    never holds a step up. One object serves every job (`speculation(..., draft_model=...)`).

    Args:
        engine: the draft model's context, as many sequences as the batcher's engine and as long.
    """

    CATCH_UP = 256
    shadow_every = 1  # its context catches up with the job at each guess: the same work, spread over the steps

    def __init__(self, engine: EngineLike):
        self.engine = engine
        self._held: list[list[int]] = [[] for _ in range(engine.n_seq)]  # what each sequence has evaluated
        self._last: list[np.ndarray | None] = [None] * engine.n_seq  # the logits after it

    def propose(self, history: Sequence[int], n_prompt: int, n: int, seq: int = 0) -> list[int]:
        held = self._held[seq]
        keep = common_prefix(held, history)
        if keep < len(held) or self._last[seq] is None:  # cut back, and at least one token evaluated again
            keep = min(keep, len(history) - 1)
            self.engine.keep(keep, seq)
            del held[keep:]
            self._last[seq] = None
        new = list(history[keep:keep + self.CATCH_UP])
        if new:
            self._last[seq] = self._eval(seq, new)
        if len(held) < len(history):
            return []
        draft: list[int] = []
        logits = self._last[seq]
        while logits is not None and len(draft) < n:
            draft.append(int(np.argmax(logits)))
            if len(draft) < n:
                logits = self._eval(seq, draft[-1:])
        return draft

    def _eval(self, seq: int, tokens: list[int]) -> np.ndarray:
        (rows,) = self.engine.eval_batch([BatchItem(seq, tokens)])
        self._held[seq] += tokens
        return rows[-1]
