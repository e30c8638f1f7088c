"""Tool results cut to fit the context: after a tool round, the results the model has not read yet are cut so that
the next round's prompt leaves the answer its room, the largest result cut first; each cut one says so
(`[cut: N characters of M]`). Nothing about a tool fails the request: not even a result too long to read whole.

Pure functions; the service counts the tokens (`fit_results` is blocking work, run in its worker thread)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MARGIN = 4  # tokens per cut result: a cut text's last tokens may merge otherwise, and the note's count grows


def fit_results(messages: list[dict[str, Any]], results: int, budget: int,
                count: Callable[[list[dict[str, Any]]], int], encode: Callable[[str], list[int]],
                decode: Callable[[list[int]], str]) -> list[dict[str, Any]]:
    """The messages with the texts of the last `results` (tool messages) cut so that `count(messages)` is
    about `budget` tokens at most.

    Args:
        count: the prompt's tokens for a list of messages.
        encode, decode: a text's token ids as plain text, and back.
    """
    head, tail = messages[:-results], [dict(message) for message in messages[-results:]]
    texts = _all_texts(tail)
    if not texts:
        return messages
    ids = [encode(text) for _, _, text in texts]
    for (i, j, text), _ in zip(texts, ids, strict=True):  # the rest of the prompt, each note at its longest
        _set_text(tail[i], j, _note(len(text), len(text)))
    room = budget - count(head + tail) - _MARGIN * len(texts)
    for (i, j, text), tokens, keep in zip(texts, ids, shares([len(t) for t in ids], room), strict=True):
        _set_text(tail[i], j, text if keep >= len(tokens) else _cut(text, decode(tokens[:keep]) if keep > 0 else ""))
    return head + tail


def shares(sizes: list[int], room: int) -> list[int]:
    """How much of each size to keep so that together they take at most `room`: every size above a common cap is
    cut to it (the largest first), the smaller ones are kept whole."""
    if sum(sizes) <= room:
        return list(sizes)
    left = max(room, 0)
    cap = 0
    for n_left, size in zip(range(len(sizes), 0, -1), sorted(sizes), strict=True):
        cap = left // n_left
        if size > cap:
            break
        left -= size
    return [min(size, cap) for size in sizes]


def _note(kept: int, whole: int) -> str:
    return f"[cut: {kept} characters of {whole}]"


def _cut(text: str, kept: str) -> str:
    return f"{kept}\n{_note(len(kept), len(text))}" if kept else _note(0, len(text))


def _all_texts(messages: list[dict[str, Any]]) -> list[tuple[int, int, str]]:
    """(message index, text index, text) of the messages' texts (see `_texts`)."""
    return [(i, j, text) for i, message in enumerate(messages) for j, text in _texts(message)]


def _texts(message: dict[str, Any]) -> list[tuple[int, str]]:
    """(index, text) of a tool message's texts: -1 for a string content, else each text part's index."""
    content = message.get("content")
    if isinstance(content, str):
        return [(-1, content)] if content else []
    if isinstance(content, list):
        return [(j, part["text"]) for j, part in enumerate(content)
                if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)]
    return []


def _set_text(message: dict[str, Any], j: int, text: str) -> None:
    if j < 0:
        message["content"] = text
    else:
        content = list(message["content"])
        content[j] = {**content[j], "text": text}
        message["content"] = content
