"""The generation loop: prompt in, token ids out. No I/O and no detokenising: callers render the ids.

The engine is anything with the `strata.engine_cffi.Engine` calls used here (`eval`, `keep`, `n_past`, `n_ctx`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence

import numpy as np

from strata.sampling import Sampler

# (index in the prompt, float32 rows (n_rows, n_embd)): rows that replace the embeddings of prompt placeholders.
Embeds = Sequence[tuple[int, np.ndarray]]


def prefill(engine, ids: Sequence[int], embeds: Embeds | None = None) -> np.ndarray:
    """Append `ids` to the KV cache; return the logits (n_vocab,) after the last of them.

    `embeds` indices count from the start of `ids`.
    """
    return engine.eval(list(ids), embeds=list(embeds) if embeds else None)


def decode_one(engine, token: int) -> np.ndarray:
    """Append one token to the KV cache; return the logits (n_vocab,) for the next one."""
    return engine.eval([token])


def generate(engine, prompt_ids: Sequence[int], sampler: Sampler, max_tokens: int, stop_ids: Collection[int],
             embeds: Embeds | None = None) -> Iterator[int]:
    """Yield up to `max_tokens` generated token ids; a token in `stop_ids` ends the generation and is not yielded.

    The KV cache may already hold a prefix of `prompt_ids` (the first `engine.n_past`, kept from an earlier
    request with `engine.keep`); only the rest is evaluated. Generation also ends where the context does, so every
    yielded token has a place in the cache. The last yielded token is not evaluated (nothing needs its logits):
    afterwards the cache holds the prompt and all yielded tokens but the last.

    Penalties see the prompt and the output (the sampler looks at its own window of the most recent ones).

    Args:
        engine: the engine, its cache holding nothing or a prefix of `prompt_ids`.
        prompt_ids: the whole prompt, at least one token.
        sampler: picks each token from the logits.
        max_tokens: the most tokens to yield.
        stop_ids: ids that end the generation (end-of-turn and end-of-text tokens).
        embeds: rows for image placeholders, indices counted in `prompt_ids`.

    Raises:
        ValueError: the prompt is empty.
        EngineError, EngineAborted: from the engine.
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    start = _reusable_prefix(engine, len(prompt_ids), embeds or ())
    logits = prefill(engine, prompt_ids[start:], [(at - start, rows) for at, rows in embeds or () if at >= start])
    history = list(prompt_ids)
    budget = min(max_tokens, engine.n_ctx - len(prompt_ids))
    for produced in range(1, budget + 1):
        token = sampler.sample(logits, history)
        if token in stop_ids:
            return
        yield token
        if produced == budget:
            return
        history.append(token)
        logits = decode_one(engine, token)


def _reusable_prefix(engine, n_prompt: int, embeds: Embeds) -> int:
    """Trim the cache to the prompt positions it can keep, and return how many that is.

    At least the last prompt token is evaluated again (its logits start the generation), and an image whose rows
    begin before the kept prefix is evaluated whole.
    """
    start = min(engine.n_past, n_prompt - 1)
    for at, rows in embeds:
        if at < start < at + len(rows):
            start = at
    if start < engine.n_past:
        engine.keep(start)
    return start
