"""`POST /tokenize` and `/detokenize` in llama.cpp's shapes, for clients written against its server. Pure
translation over the model's tokenizer, no engine."""

from __future__ import annotations

from typing import Any

from strata.api.translate import bad_request, check_type, get


def tokenize(tokenizer: Any, body: Any) -> dict[str, Any]:
    """`{"content": str, "add_special": bool, "parse_special": bool, "with_pieces": bool}` to `{"tokens": [...]}`:
    ids, or with pieces `{"id": id, "piece": text}` (the piece as a list of bytes when it is not valid UTF-8
    on its own, as llama.cpp does).

    `add_special` prepends the model's BOS token when it has one; `parse_special` (default true) reads special
    tokens' text (`<|im_end|>`) as those tokens.
    """
    body = check_type(body, dict, "body")
    content = get(body, "content", str, "content", required=True)
    parse_special = get(body, "parse_special", bool, "parse_special")
    ids = tokenizer.encode(content, special=parse_special is not False)
    if get(body, "add_special", bool, "add_special") and tokenizer.bos_id is not None:
        ids = [tokenizer.bos_id, *ids]
    if not get(body, "with_pieces", bool, "with_pieces"):
        return {"tokens": ids}
    return {"tokens": [{"id": token, "piece": _piece(tokenizer.id_bytes[token])} for token in ids]}


def detokenize(tokenizer: Any, body: Any) -> dict[str, Any]:
    """`{"tokens": [id, ...]}` to `{"content": text}` (special tokens as their text)."""
    body = check_type(body, dict, "body")
    ids = get(body, "tokens", list, "tokens", required=True)
    for i, token in enumerate(ids):
        check_type(token, int, f"tokens[{i}]")
        if not 0 <= token < tokenizer.n_vocab:
            raise bad_request(f"tokens[{i}]", f"must be a token id below {tokenizer.n_vocab}, got {token}")
    return {"content": tokenizer.decode(ids)}


def _piece(data: bytes) -> str | list[int]:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)
