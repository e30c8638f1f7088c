"""Prompt text to token ids, such that only the chat template's own markup becomes control tokens.

A rendered prompt is one string: tokenised as a whole with special tokens on, a `<|im_end|>` that a user, a tool
result or a document typed closes its turn, and what follows can pose as a system or assistant turn. So before
rendering, every control token's text inside the request's strings is swapped for a sentinel (a private-use
character, an index, another private-use character); after rendering, the prompt is cut at the sentinels, the
pieces between them are tokenised with special tokens on (they hold the template's markup and text free of
control tokens), and each sentinel becomes its original text tokenised as plain text.

Work that grows with the request is bounded before it starts: `check_length` refuses text that cannot fit the
context even if every token were the vocabulary's longest, and `encode` tokenises in slices of about
`SLICE_CHARS`, so that the worker thread it runs in hands the GIL back to the event loop between slices (the
tokenizer holds it for the whole of one call: about 2 ms per kilobyte on a busy core).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

SENTINEL_OPEN, SENTINEL_CLOSE = "\ue000", "\ue001"
SLICE_CHARS = 4096
_SENTINEL_RE = re.compile(f"{SENTINEL_OPEN}(\\d+){SENTINEL_CLOSE}")
# Places where the pre-tokenizers we support always start a new piece, so tokenising either side alone gives the
# same ids: between an ASCII letter and a space that precedes another, and after a newline before a letter.
_SAFE_CUT = re.compile(r"(?<=[A-Za-z])(?= [A-Za-z])|(?<=\n)(?=[A-Za-z])")


class PromptTokens:
    """Token ids of rendered prompts for one tokenizer (`strata.text.tokenizer.Tokenizer`).

    Args:
        tokenizer: has `encode(text, special=...)`, `control_texts` and `id_bytes`.
    """

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        # Longest first, so that a control text holding another is replaced whole. The sentinel's own opening
        # character is protected too: a client cannot type a sentinel.
        self._protected: tuple[str, ...] = (*sorted(set(getattr(tokenizer, "control_texts", ())), key=len,
                                                    reverse=True), SENTINEL_OPEN)
        self._protect_re = re.compile("|".join(map(re.escape, self._protected)))
        # Control texts all start with "<" (true of every vocabulary we know): one scan skips most strings.
        self._lead = "<" if all(text.startswith("<") for text in self._protected[:-1]) else None
        self.max_token_chars = max(1, max(len(piece) for piece in tokenizer.id_bytes))

    # --- before rendering

    def protect(self, value: Any) -> Any:
        """A copy of `value` (JSON-like: dicts, lists, strings, other objects kept as they are) in which every
        control token's text inside a string or key is a sentinel."""
        if isinstance(value, str):
            return self._protect_text(value)
        if isinstance(value, dict):
            return {self._protect_text(key) if isinstance(key, str) else key: self.protect(item)
                    for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.protect(item) for item in value]
        return value

    def _protect_text(self, text: str) -> str:
        if self._lead is not None and self._lead not in text and SENTINEL_OPEN not in text:
            return text
        return self._protect_re.sub(lambda m: f"{SENTINEL_OPEN}{self._protected.index(m[0])}{SENTINEL_CLOSE}",
                                    text)

    def check_length(self, strings: Sequence[str], n_ctx: int) -> int:
        """The fewest tokens `strings` can take; raises ValueError (with the message a client sees) when even
        that does not fit `n_ctx`, before any rendering or tokenising is done."""
        n_chars = sum(map(len, strings))
        least = -(-n_chars // self.max_token_chars)
        if least >= n_ctx:
            raise ValueError(f"the prompt has at least {least} tokens ({n_chars} characters); the context holds "
                             f"{n_ctx} (prompt and answer)")
        return least

    # --- after rendering

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a prompt rendered from protected values (see the module docstring)."""
        ids: list[int] = []
        at = 0
        for match in _SENTINEL_RE.finditer(prompt):
            ids += self._encode_special(prompt[at:match.start()])
            ids += self._tokenizer.encode(self._protected[int(match[1])], special=False)
            at = match.end()
        ids += self._encode_special(prompt[at:])
        return ids

    def encode_text(self, text: str, special: bool = False) -> list[int]:
        """Token ids of `text`, in slices like `encode`: as plain text (control-token text included), or with
        `special` reading control tokens' text as those tokens."""
        return self._encode_special(text, special=special)

    def _encode_special(self, text: str, special: bool = True) -> list[int]:
        ids: list[int] = []
        for piece in slices(text, SLICE_CHARS):
            ids += self._tokenizer.encode(piece, special=special)
        return ids


def strings_of(value: Any) -> Iterator[str]:
    """Every string in a JSON-like value (keys included), iteratively."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str):
                    yield key
                stack.append(child)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def slices(text: str, size: int) -> Iterator[str]:
    """`text` cut into pieces of about `size` characters at places tokenisation never joins across (see
    `_SAFE_CUT`); text without such places stays whole."""
    start = 0
    while len(text) - start > size:
        cut = _SAFE_CUT.search(text, start + size)
        if cut is None:
            break
        yield text[start:cut.start()]
        start = cut.start()
    yield text[start:]
