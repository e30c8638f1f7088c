"""The encoder for an mmproj file, whichever projector type it holds."""

from __future__ import annotations

import os

import gguf

from strata.vision import qwen3vl
from strata.vision.encoder import Encoder
from strata.vision.mmproj import Mmproj, build_lfm2, open_mmproj, read_hparams


def _build(path: str, reader: gguf.GGUFReader) -> Mmproj | qwen3vl.Qwen3VLMmproj:
    if read_hparams(reader).projector == qwen3vl.PROJECTOR_TYPE:
        return qwen3vl.Qwen3VLMmproj.build(path, reader)
    return build_lfm2(path, reader)


def open_encoder(path: str | os.PathLike[str], threads: int) -> Encoder:
    """The CPU encoder of an `lfm2` or `qwen3vl_merger` file.

    Raises:
        MmprojError: the file cannot be read or is not a model strata-vision runs; the message names the file.
    """
    mmproj = open_mmproj(path, _build)
    if isinstance(mmproj, qwen3vl.Qwen3VLMmproj):
        return qwen3vl.Qwen3VLEncoder(mmproj, threads)
    return Encoder(mmproj, threads)
