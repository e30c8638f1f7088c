"""Helpers shared by the engine's tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from strata.engine_cffi import Engine, EngineAborted


def abort_mid_prefill(engine: Engine, prompt: Sequence[int]) -> float:
    """Evaluate `prompt` in another thread, abort it once its first chunk is in the cache, and return the seconds
    from the abort to the call's return. Asserts that the call raised `EngineAborted`."""
    outcome: dict[str, object] = {}

    def prefill() -> None:
        try:
            engine.eval(prompt, all_logits=True)
        except EngineAborted as exc:
            outcome["error"] = exc
        outcome["returned"] = time.perf_counter()

    worker = threading.Thread(target=prefill)
    worker.start()
    while engine.n_past == 0 and worker.is_alive():
        time.sleep(0.001)
    aborted_at = time.perf_counter()
    engine.abort()
    worker.join(timeout=10)
    assert isinstance(outcome.get("error"), EngineAborted)
    return outcome["returned"] - aborted_at  # type: ignore[operator]
