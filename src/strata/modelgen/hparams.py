"""Hyper-parameters of the generated models, one frozen set per (architecture, size), and the other choices."""

from __future__ import annotations

import dataclasses
from typing import Any

ARCHS = ("qwen3moe", "qwen3", "llama")
SIZES = ("tiny", "small", "medium")
DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_k")
VOCABS = ("bytes", "qwen")


@dataclasses.dataclass(frozen=True)
class HParams:
    """Shape of a generated model. Expert fields are zero for the dense architectures."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int  # dense FFN width; for qwen3moe only metadata, as in Qwen3-MoE's own config
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ctx_train: int = 4096
    rope_base: float = 1_000_000.0
    rms_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.n_head % self.n_head_kv:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.n_expert_used > self.n_expert:
            raise ValueError(f"n_expert_used {self.n_expert_used} > n_expert {self.n_expert}")


# Sizes on disk in f16, with the `bytes` vocabulary (the `qwen` vocabulary adds 2 * 151936 * n_embd weights):
# tiny a few MB; small ~100-300 MB; medium ~1-2 GB. Widths are multiples of 256 so K-quants apply everywhere.
# qwen3moe medium is Qwen3-30B-A3B scaled down: many small experts, top-8, GQA 4:1.
_TABLE: dict[tuple[str, str], HParams] = {
    ("qwen3moe", "tiny"): HParams(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=768,
                                  n_expert=8, n_expert_used=2, n_ff_exp=256),
    ("qwen3moe", "small"): HParams(n_layer=6, n_embd=512, n_head=8, n_head_kv=4, head_dim=64, n_ff=1536,
                                   n_expert=16, n_expert_used=4, n_ff_exp=512, n_ctx_train=32768),
    ("qwen3moe", "medium"): HParams(n_layer=12, n_embd=1024, n_head=16, n_head_kv=4, head_dim=64, n_ff=3072,
                                    n_expert=64, n_expert_used=8, n_ff_exp=256, n_ctx_train=40960),
    ("qwen3", "tiny"): HParams(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512),
    ("qwen3", "small"): HParams(n_layer=12, n_embd=768, n_head=12, n_head_kv=4, head_dim=64, n_ff=2048,
                                n_ctx_train=32768),
    ("qwen3", "medium"): HParams(n_layer=16, n_embd=2048, n_head=16, n_head_kv=8, head_dim=128, n_ff=5632,
                                 n_ctx_train=40960),
    ("llama", "tiny"): HParams(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512,
                               rope_base=10_000.0, rms_eps=1e-5),
    ("llama", "small"): HParams(n_layer=12, n_embd=768, n_head=12, n_head_kv=4, head_dim=64, n_ff=2048,
                                n_ctx_train=8192, rope_base=500_000.0, rms_eps=1e-5),
    ("llama", "medium"): HParams(n_layer=16, n_embd=2048, n_head=16, n_head_kv=8, head_dim=128, n_ff=5632,
                                 n_ctx_train=8192, rope_base=500_000.0, rms_eps=1e-5),
}


def hparams_for(arch: str, size: str, **overrides: Any) -> HParams:
    """The table's hyper-parameters for (arch, size), with `overrides` (field name -> value) applied.

    Raises:
        ValueError: unknown arch, size or override name, or an inconsistent shape.
    """
    if (arch, size) not in _TABLE:
        raise ValueError(f"unknown model {arch!r} / {size!r}: arch in {ARCHS}, size in {SIZES}")
    fields = {f.name for f in dataclasses.fields(HParams)}
    unknown = set(overrides) - fields
    if unknown:
        raise ValueError(f"unknown hyper-parameters {sorted(unknown)}; known: {sorted(fields)}")
    hp = dataclasses.replace(_TABLE[arch, size], **overrides)
    if arch == "qwen3moe" and not (hp.n_expert and hp.n_expert_used and hp.n_ff_exp):
        raise ValueError("qwen3moe needs n_expert, n_expert_used and n_ff_exp")
    return hp
