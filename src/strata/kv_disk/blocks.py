"""A prompt's KV blocks named by content: the hash a block of positions is stored under.

The positions of a sequence are cut into blocks of `block_tokens`; block i's name is the hash of block i - 1's
name and block i's keys (what each position holds: a token id, a picture's (digest, row), the salt joined to the
first key), and block 0 continues from the hash of the model's KV identity (`Engine.kv_identity`: the model file,
the KV type, the rows' layout). A name thus stands for the whole prefix up to the end of its block under one model
and KV type, as vLLM's and SGLang's prefix caches name theirs. A router that places a request where its prefix is
cached computes the same function.

A hybrid model's recurrent state at a position P (`state_name`) is named by the name of the last whole block
before P, P, and the keys from that block's end to P: the whole prefix up to P again, at any position.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Hashable, Sequence

import numpy as np

# Positions per block. A block is one file and one engine call to import: 256 positions of the small Q8_0
# qwen3moe in f16 are 1.5 MiB (bench/kv_disk.py measures reads of them at the disk's own rate), and a prompt's
# last partial block (at most 255 positions) is recomputed.
BLOCK_TOKENS = 256
_SCHEME = b"strata-kv-blocks/1"
_STATE_SCHEME = b"strata-kv-state/1"


def block_hashes(identity: str, keys: Sequence[Hashable], block_tokens: int = BLOCK_TOKENS,
                 start: Sequence[bytes] = ()) -> list[bytes]:
    """The names (32-byte sha256 digests) of the whole blocks of `keys`, in order.

    Args:
        identity: what the rows' bits depend on besides the keys (`Engine.kv_identity`).
        keys: each position's key; a last partial block has no name.
        start: the names of the first blocks, already computed for these keys: the chain continues after them.
    """
    names = list(start)
    previous = names[-1] if names else _chain_start(identity)
    for first in range(len(names) * block_tokens, len(keys) - block_tokens + 1, block_tokens):
        previous = hashlib.sha256(previous + _keys_bytes(keys[first:first + block_tokens])).digest()
        names.append(previous)
    return names


def state_name(identity: str, keys: Sequence[Hashable], position: int, names: Sequence[bytes],
               block_tokens: int = BLOCK_TOKENS) -> bytes:
    """The name of the recurrent state after keys[:position] (a 32-byte sha256 digest).

    Args:
        names: the block names of `keys` (`block_hashes`), at least the position // block_tokens first.
    """
    whole = position // block_tokens
    previous = names[whole - 1] if whole else _chain_start(identity)
    tail = _keys_bytes(keys[whole * block_tokens:position])
    return hashlib.sha256(_STATE_SCHEME + previous + struct.pack("<Q", position) + tail).digest()


def _chain_start(identity: str) -> bytes:
    return hashlib.sha256(_SCHEME + identity.encode()).digest()


def _keys_bytes(keys: Sequence[Hashable]) -> bytes:
    """Keys as bytes that only equal keys give: token ids as int64, anything else tagged and spelled out."""
    if all(type(key) is int for key in keys):
        return b"i" + np.asarray(keys, dtype=np.int64).tobytes()
    return b"k" + b"".join(_key_bytes(key) for key in keys)


def _key_bytes(key: Hashable) -> bytes:
    if type(key) is int:
        return b"i" + struct.pack("<q", key)
    if isinstance(key, str):
        data = key.encode()
        return b"s" + struct.pack("<I", len(data)) + data
    if isinstance(key, bytes):
        return b"b" + struct.pack("<I", len(key)) + key
    if isinstance(key, tuple):
        return b"t" + struct.pack("<I", len(key)) + b"".join(_key_bytes(part) for part in key)
    raise TypeError(f"a prompt key of type {type(key).__name__} has no stored form")
