"""Hyper-parameters of the generated models, one frozen set per (architecture, size), and the other choices."""

from __future__ import annotations

import dataclasses
from typing import Any

ARCHS = ("qwen3moe", "qwen3", "llama", "qwen35moe", "qwen35")
HYBRID_ARCHS = ("qwen35moe", "qwen35")  # Gated DeltaNet layers between gated full-attention layers
MOE_ARCHS = ("qwen3moe", "qwen35moe")
SIZES = ("tiny", "small", "medium")
DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_k")
VOCABS = ("bytes", "qwen")


@dataclasses.dataclass(frozen=True)
class HParams:
    """Shape of a generated model. Expert fields are zero for the dense architectures; the `ssm_*` fields (named
    after their GGUF keys), the layer pattern, the partial rotary and the MTP layers are the hybrid ones'."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int  # dense FFN width; for qwen3moe only metadata, as in Qwen3-MoE's own config; qwen35moe has none
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ctx_train: int = 4096
    rope_base: float = 1_000_000.0
    rms_eps: float = 1e-6
    n_ff_shexp: int = 0  # the shared expert's width (qwen35moe)
    full_attention_interval: int = 0  # hybrids: every this-many-th layer is full attention, the others DeltaNet
    ssm_conv_kernel: int = 0  # the causal convolution's length
    ssm_state_size: int = 0  # DeltaNet key (and query) head size
    ssm_group_count: int = 0  # DeltaNet key heads
    ssm_time_step_rank: int = 0  # DeltaNet value heads (a multiple of the key heads)
    ssm_inner_size: int = 0  # value heads * value head size
    n_rot: int = 0  # rotated dimensions per attention head; 0: all of head_dim
    rope_sections: tuple[int, ...] = ()  # multi-axis RoPE pairs per axis (t, h, w, extra), summing to n_rot / 2
    n_nextn: int = 0  # MTP layers after the main ones (llama.cpp's `nextn_predict_layers`)

    @property
    def hybrid(self) -> bool:
        return self.full_attention_interval > 0

    @property
    def rope_dims(self) -> int:
        return self.n_rot or self.head_dim

    def recurrent_layers(self) -> tuple[bool, ...]:
        """Per main layer: DeltaNet (True) or full attention (False); the MTP layers after them are attention."""
        if not self.hybrid:
            return (False,) * self.n_layer
        return tuple((i + 1) % self.full_attention_interval != 0 for i in range(self.n_layer))

    def __post_init__(self) -> None:
        if self.n_head % self.n_head_kv:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.n_expert_used > self.n_expert:
            raise ValueError(f"n_expert_used {self.n_expert_used} > n_expert {self.n_expert}")
        if self.rope_dims % 2 or self.rope_dims > self.head_dim:
            raise ValueError(f"n_rot {self.n_rot} must be even and at most head_dim {self.head_dim}")
        if self.rope_sections and sum(self.rope_sections) != self.rope_dims // 2:
            raise ValueError(f"rope_sections {self.rope_sections} must sum to n_rot / 2 = {self.rope_dims // 2}")
        if self.hybrid:
            if not (self.ssm_conv_kernel and self.ssm_state_size and self.ssm_group_count
                    and self.ssm_time_step_rank and self.ssm_inner_size):
                raise ValueError("a hybrid model needs ssm_conv_kernel, ssm_state_size, ssm_group_count, "
                                 "ssm_time_step_rank and ssm_inner_size")
            if len(self.rope_sections) != 4:
                raise ValueError(f"rope_sections {self.rope_sections} must have 4 entries (t, h, w, extra)")
            if self.ssm_time_step_rank % self.ssm_group_count or self.ssm_inner_size % self.ssm_time_step_rank:
                raise ValueError(f"ssm_time_step_rank {self.ssm_time_step_rank} must be a multiple of "
                                 f"ssm_group_count {self.ssm_group_count} and divide ssm_inner_size "
                                 f"{self.ssm_inner_size}")


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

# Qwen3.5/3.6 scaled down: three Gated DeltaNet layers per gated full-attention layer, twice as many DeltaNet value
# heads as key heads (so the converter's V-head reordering shows), a quarter of each attention head rotated by the
# interleaved multi-axis RoPE (sections in Qwen3.5's 11:11:10 proportions), one MTP layer as the converter writes.
# Expert counts avoid 8, for which llama.cpp's quantizer has its own rules (see `writer._qtype`).
_QWEN35_TINY = HParams(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, rope_base=10_000_000.0,
                       full_attention_interval=4, ssm_conv_kernel=4, ssm_state_size=64, ssm_group_count=2,
                       ssm_time_step_rank=4, ssm_inner_size=256, n_rot=16, rope_sections=(3, 3, 2, 0), n_nextn=1)
_QWEN35_SMALL = dataclasses.replace(_QWEN35_TINY, n_layer=8, n_embd=512, n_head=8, head_dim=128, n_ff=1536,
                                    n_ctx_train=32768, ssm_group_count=4, ssm_time_step_rank=8, ssm_inner_size=512,
                                    n_rot=32, rope_sections=(6, 5, 5, 0))
_QWEN35_MEDIUM = dataclasses.replace(_QWEN35_SMALL, n_layer=16, n_embd=1024, n_head=16, n_ff=3072, n_ctx_train=262144,
                                     ssm_state_size=128, ssm_group_count=8, ssm_time_step_rank=16, ssm_inner_size=2048)
_TABLE |= {
    ("qwen35", "tiny"): _QWEN35_TINY,
    ("qwen35", "small"): _QWEN35_SMALL,
    ("qwen35", "medium"): _QWEN35_MEDIUM,
    ("qwen35moe", "tiny"): dataclasses.replace(_QWEN35_TINY, n_ff=0, n_expert=4, n_expert_used=2, n_ff_exp=256,
                                               n_ff_shexp=256),
    ("qwen35moe", "small"): dataclasses.replace(_QWEN35_SMALL, n_ff=0, n_expert=16, n_expert_used=4, n_ff_exp=256,
                                                n_ff_shexp=512),
    ("qwen35moe", "medium"): dataclasses.replace(_QWEN35_MEDIUM, n_ff=0, n_expert=64, n_expert_used=8, n_ff_exp=256,
                                                 n_ff_shexp=512),
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
    if arch in MOE_ARCHS and not (hp.n_expert and hp.n_expert_used and hp.n_ff_exp):
        raise ValueError(f"{arch} needs n_expert, n_expert_used and n_ff_exp")
    if arch == "qwen35moe" and not hp.n_ff_shexp:
        raise ValueError("qwen35moe needs n_ff_shexp (the shared expert)")
    if (arch in HYBRID_ARCHS) != hp.hybrid:
        raise ValueError(f"full_attention_interval {hp.full_attention_interval} does not fit {arch}: hybrids "
                         f"{HYBRID_ARCHS} need one > 0, the others 0")
    return hp
