"""`POST /tokenize` and `/detokenize` in llama.cpp's shapes, for clients written against its server: translation
over the model's tokenizer, no engine. Bounded like a chat prompt: text that cannot fit the context is refused
before it is tokenised, and all but short text is tokenised in a worker thread, in slices
(`strata.text.prompt_tokens`)."""

from __future__ import annotations

from typing import Any

import trio

from strata.api.translate import bad_request, check_type, get
from strata.prompts import INLINE_PROMPT_CHARS

TOKENIZE_THREADS = 2  # requests tokenised or detokenised at once, each in a worker thread


async def tokenize(model: Any, body: Any, limiter: trio.CapacityLimiter) -> dict[str, Any]:
    """`{"content": str, "add_special": bool, "parse_special": bool, "with_pieces": bool}` to `{"tokens": [...]}`:
    ids, or with pieces `{"id": id, "piece": text}` (the piece as a list of bytes when it is not valid UTF-8
    on its own, as llama.cpp does).

    `add_special` prepends the model's BOS token when it has one; `parse_special` (default true) reads special
    tokens' text (`<|im_end|>`) as those tokens.

    Args:
        model: a loaded model (`strata.served_model.ServedModel`: its tokenizer, prompt tokens and context).
        limiter: the worker threads of the app's token routes (`TOKENIZE_THREADS`).

    Raises:
        ApiError: 400 for a body that is not one, or content longer than the context could hold.
    """
    body = check_type(body, dict, "body")
    content = get(body, "content", str, "content", required=True)
    special = get(body, "parse_special", bool, "parse_special") is not False
    add_special = get(body, "add_special", bool, "add_special")
    with_pieces = get(body, "with_pieces", bool, "with_pieces")
    try:
        model.prompts.tokens.check_length([content], model.engine.n_ctx)
    except ValueError as error:
        raise bad_request("content", str(error)) from None

    def run() -> dict[str, Any]:
        tokenizer = model.tokenizer
        ids = model.prompts.tokens.encode_text(content, special=special)
        if add_special and tokenizer.bos_id is not None:
            ids = [tokenizer.bos_id, *ids]
        if not with_pieces:
            return {"tokens": ids}
        return {"tokens": [{"id": token, "piece": _piece(tokenizer.id_bytes[token])} for token in ids]}

    if len(content) <= INLINE_PROMPT_CHARS:  # as a chat prompt: the thread's round trip would cost more
        return run()
    return await trio.to_thread.run_sync(run, limiter=limiter)


async def detokenize(model: Any, body: Any, limiter: trio.CapacityLimiter) -> dict[str, Any]:
    """`{"tokens": [id, ...]}` to `{"content": text}` (special tokens as their text); at most a context's worth.

    Raises:
        ApiError: 400 for a body that is not one, a token that is not an id, or more tokens than the context.
    """
    body = check_type(body, dict, "body")
    ids = get(body, "tokens", list, "tokens", required=True)
    n_ctx = model.engine.n_ctx
    if len(ids) > n_ctx:
        raise bad_request("tokens", f"has {len(ids)} tokens; the context holds {n_ctx}")
    tokenizer = model.tokenizer
    for i, token in enumerate(ids):
        check_type(token, int, f"tokens[{i}]")
        if not 0 <= token < tokenizer.n_vocab:
            raise bad_request(f"tokens[{i}]", f"must be a token id below {tokenizer.n_vocab}, got {token}")
    return {"content": await trio.to_thread.run_sync(tokenizer.decode, ids, limiter=limiter)}


def _piece(data: bytes) -> str | list[int]:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)
