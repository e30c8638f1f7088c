"""`EngineLike`: what the scheduler and the service call on an engine.

`strata.engine_cffi.Engine` implements it; so do the scripted engines of the tests (`tests/fakes.py`, which mypy
checks against this protocol) and the wrappers that record an engine's calls. Every member is required: the
batcher and the service call them without asking whether an engine has them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from strata.engine_cffi import BatchItem
from strata.text.sampling import SamplingParams


class EngineLike(Protocol):
    """A context of `n_seq` sequences of `n_ctx` positions each, and its model."""

    @property
    def n_vocab(self) -> int: ...
    @property
    def picture_width(self) -> int:
        """The width of a picture's rows: n_embd, wider with Qwen3-VL's deepstack slices."""
    @property
    def n_ctx(self) -> int: ...
    @property
    def n_seq(self) -> int: ...
    @property
    def n_batch(self) -> int:
        """The most tokens of one call."""
    @property
    def arch(self) -> str: ...
    @property
    def backend(self) -> str: ...
    @property
    def threads(self) -> int: ...

    def eval_batch(self, items: Sequence[BatchItem], notify_fd: int = -1) -> list[np.ndarray]:
        """Per item, its logits rows; `EngineAborted` (with the results of the sequences not dropped) when
        `abort(seq)` stopped some sequence. `notify_fd`: an eventfd the call adds 1 to as it starts (-1: none)."""
    @property
    def recurrent(self) -> bool:
        """The model has recurrent layers (Qwen3.5's Gated DeltaNet): a sequence's state cannot be cut back, so
        `keep` or `copy_prefix` to fewer positions than the sequence holds leaves it unusable until `load_state`
        or keep(0). False for a transformer, whose every prefix is reusable."""
    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's recurrent state (0 without recurrent layers)."""
    def save_state(self, seq: int = 0) -> bytes:
        """Sequence `seq`'s recurrent state at its n_past (empty without recurrent layers)."""
    def load_state(self, seq: int, data: bytes) -> None:
        """Set sequence `seq`'s recurrent state (from `save_state` at the position the sequence now holds)."""
    def checkpoint_state(self, seq: int = 0) -> None:
        """Keep sequence `seq`'s recurrent state at its n_past for `restore_state` (a speculative step's rollback:
        cheaper than `save_state` and `load_state`)."""
    def restore_state(self, seq: int = 0) -> None:
        """Sequence `seq`'s recurrent state = its checkpoint's, after `keep` back to the position it was taken at."""
    def seq_n_past(self, seq: int) -> int: ...
    def keep(self, n: int, seq: int = 0) -> None: ...
    def copy_prefix(self, src: int, dst: int, n: int) -> None: ...
    @property
    def kv_identity(self) -> str:
        """What the bits of the cached rows depend on besides the tokens: the model file, the KV type, the layout."""
    @property
    def kv_position_bytes(self) -> int:
        """The bytes of one position's rows as `export_kv` gives them."""
    def export_kv(self, seq: int, first: int, n: int) -> np.ndarray:
        """Positions [first, first + n) of sequence `seq` as bytes (uint8)."""
    def import_kv(self, seq: int, first: int, data: Any) -> None:
        """Append positions that `export_kv` gave from `first` to sequence `seq`, which holds `first`."""
    def abort(self, seq: int = 0) -> None: ...
    def clear_abort(self, seq: int = 0) -> None: ...
    def sample_rows(self, rows: Sequence[np.ndarray], settings: Sequence[SamplingParams], u: Sequence[float]
                    ) -> list[int]:
        """A token drawn from each row of logits, as `strata.text.sampling.draw` draws it (the arg-max where
        settings[i] is greedy): the draws of one step at once."""
    def expert_counts(self) -> dict[str, int] | None:
        """The GPU backend's expert cache: its capacity (experts) and bytes, and the routed experts of its
        layer-steps since loading computed on the device (hits) and by the CPU (misses), and uploaded; None
        without one (the CPU engine)."""
    def cpu_seconds(self) -> float:
        """CPU seconds the engine's own threads have run (the clock the batcher times its steps by)."""
    def close(self) -> None: ...
