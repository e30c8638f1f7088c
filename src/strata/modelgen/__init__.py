"""GGUF models with generated weights: hyper-parameter table, vocabularies (`qwen`, `bytes`), K-quantisers and
the writer. Names are imported on first use, so `strata make-model --help` does not load numpy or gguf."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "write_random_model": "strata.modelgen.writer",
    "permute_llama_qk": "strata.modelgen.writer",
    "unpermute_llama_qk": "strata.modelgen.writer",
    "HParams": "strata.modelgen.hparams",
    "hparams_for": "strata.modelgen.hparams",
    "write_random_mmproj": "strata.modelgen.mmproj",
}
__all__ = [
    "HParams", "hparams_for", "permute_llama_qk", "unpermute_llama_qk", "write_random_mmproj", "write_random_model",
]


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'strata.modelgen' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
