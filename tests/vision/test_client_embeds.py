"""Pre-computed embeddings: made by `strata-vision encode` (a real process), checked against the encoder's READY;
every mismatch is refused with a message that names it."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import strata
from strata.pictures.sources import ImageRejected
from strata.vision.embeds import PrecomputedEmbeds, check_embeds
from strata.vision.protocol import SVE_MAGIC, Capabilities, Ready, encode_sve, parse_sve

from .conftest import N_EMBD_TEXT, noise_png

pytestmark = pytest.mark.timeout(60)

FINGERPRINT = "sha256:" + "ab" * 32
READY = Ready(N_EMBD_TEXT, Capabilities(cuda=False, threads=1, max_tokens=64, fingerprint=FINGERPRINT,
                                        projector="lfm2"))


def sve(n_tokens: int = 4, n_embd: int = N_EMBD_TEXT, nx: int = 2, ny: int = 2) -> bytes:
    rows = np.random.default_rng(0).standard_normal((n_tokens, n_embd)).astype(np.float32)
    return encode_sve(rows, nx, ny)


def test_embeds_from_the_encode_command_pass(tiny_mmproj, tmp_path):
    picture = tmp_path / "p.png"
    picture.write_bytes(noise_png(48, 32, seed=2))
    out = tmp_path / "p.sve"
    env = dict(os.environ, PYTHONPATH=str(Path(strata.__file__).resolve().parents[1]))
    done = subprocess.run([sys.executable, "-m", "strata.vision.worker", "encode", str(picture), "--mmproj",
                           str(tiny_mmproj), "--out", str(out), "--max-tokens", "64"],
                          capture_output=True, text=True, env=env, check=True)
    summary = json.loads(done.stdout)
    ready = Ready(N_EMBD_TEXT, Capabilities(cuda=False, threads=1, max_tokens=64,
                                            fingerprint=summary["fingerprint"], projector="lfm2"))
    data = out.read_bytes()
    embedding = check_embeds(PrecomputedEmbeds("p", data, summary["fingerprint"]), ready, 1 << 20)
    _, rows = parse_sve(data)
    np.testing.assert_array_equal(embedding.rows, rows)
    assert (embedding.nx, embedding.ny, embedding.n_tokens) == (summary["nx"], summary["ny"], summary["n_tokens"])


def corrupt_value(data: bytes) -> bytes:
    values = bytearray(data)
    values[-4:] = np.array([np.nan], "<f4").tobytes()
    return bytes(values)


@pytest.mark.parametrize("data, fingerprint, message", [
    (b"XXXX" + sve()[4:], FINGERPRINT, "magic"),
    (struct.pack("<5i", SVE_MAGIC, 4, 4, 2, N_EMBD_TEXT) + sve()[20:], FINGERPRINT, "4 tokens for a 4x2 grid"),
    (sve(n_embd=16), FINGERPRINT, "rows are 16 wide"),
    (sve()[:-4], FINGERPRINT, "its header needs"),
    (corrupt_value(sve()), FINGERPRINT, "not finite"),
    (sve(n_tokens=100, nx=10, ny=10), FINGERPRINT, "more than this server's max_tokens 64"),
    (sve(), "sha256:" + "cd" * 32, "is not this server's encoder"),
])
def test_each_mismatch_is_named(data, fingerprint, message):
    with pytest.raises(ImageRejected, match=message):
        check_embeds(PrecomputedEmbeds("p", data, fingerprint), READY, 1 << 20)


def test_size_limit():
    with pytest.raises(ImageRejected, match="more than the limit of 100"):
        check_embeds(PrecomputedEmbeds("p", sve(), FINGERPRINT), READY, 100)
