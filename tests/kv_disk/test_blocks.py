"""Block names: a name stands for the whole prefix to the end of its block, under one KV identity."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from strata.kv_disk.blocks import block_hashes
from strata.scheduling.batcher import salted


def test_a_name_is_the_chain_of_the_blocks_before_it() -> None:
    keys = list(range(100))
    names = block_hashes("m:f16:layout1", keys, 16)
    assert len(names) == 6  # the last 4 keys are no whole block
    assert block_hashes("m:f16:layout1", keys[:48], 16) == names[:3]  # a prefix has the same names
    changed = block_hashes("m:f16:layout1", [*keys[:20], 999, *keys[21:]], 16)
    assert changed[:1] == names[:1] and all(a != b for a, b in zip(changed[1:], names[1:], strict=True))
    assert block_hashes("m:f16:layout1", keys, 16, start=names[:2]) == names  # continued from known names
    # the documented function: sha256 over the previous name and the keys as int64, from the identity's hash
    first = hashlib.sha256(hashlib.sha256(b"strata-kv-blocks/1m:f16:layout1").digest() + b"i"
                           + np.arange(16, dtype=np.int64).tobytes()).digest()
    assert names[0] == first


def test_the_identity_the_salt_and_pictures_change_the_names() -> None:
    keys: list = list(range(32))
    names = block_hashes("m:f16:layout1", keys, 16)
    assert block_hashes("m:int8:layout1", keys, 16)[0] != names[0]  # another KV type
    assert block_hashes("m:f16:layout1", salted(keys, "tenant"), 16)[0] != names[0]
    picture = [*keys[:4], *(("ab12", row) for row in range(8)), *keys[12:]]
    other = [*keys[:4], *(("cd34", row) for row in range(8)), *keys[12:]]
    assert len({block_hashes("m:f16:layout1", k, 16)[0] for k in (keys, picture, other)}) == 3
    with pytest.raises(TypeError, match="float"):
        block_hashes("m", [0.5] * 16, 16)
