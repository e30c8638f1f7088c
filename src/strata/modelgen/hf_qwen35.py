"""A Hugging Face Qwen3.5 / Qwen3.5-MoE checkpoint as our writers' arguments: its text model and MTP layers for
`write_model` (`qwen35` / `qwen35moe`), its vision tower for `write_qwen35_mmproj`; the hyper-parameters from its
config, and its weights made into what llama.cpp's converter stores.

What the converter changes on the way (`conversion/qwen.py`, `Qwen3NextModel` and `_LinearAttentionVReorderBase`):
- Norms that Qwen3.5 applies as (1 + w) are stored as 1 + w; the gated norm of DeltaNet (`linear_attn.norm`),
  applied as w, is stored as it is.
- `A_log` is stored as `ssm_a` = -exp(A_log); the convolution's (channels, 1, kernel) weight is squeezed.
- With more DeltaNet value heads than key heads, Qwen groups the value heads by key head (k0: v0 v1, k1: v0 v1);
  llama.cpp wants them tiled (v0 of every key head, then v1 of every key head), so every tensor with a value-head
  axis is reordered along it: the v rows of `in_proj_qkv` and of the convolution, the rows of `in_proj_z`,
  `in_proj_a`, `in_proj_b`, `A_log` and `dt_bias`, the columns of `out_proj`.
- The MTP block (`mtp.*`) becomes layer n_layer (and on): `fc` is `nextn.eh_proj`, `pre_fc_norm_embedding` /
  `pre_fc_norm_hidden` / `norm` are `nextn.enorm` / `nextn.hnorm` / `nextn.shared_head_norm`.
- The vision tower (`conversion/qwen3vl.py`): the patch embedding's Conv3D is split into its two temporal kernels;
  the encoder's layer-norm epsilon is the text model's `rms_norm_eps`; the picture side is
  sqrt(num_position_embeddings) patches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gguf
import numpy as np

from strata.modelgen.hparams import HParams
from strata.modelgen.mmproj_qwen35 import MERGE, PATCH_KERNEL_2
from strata.vision.mmproj import VisionHParams, tensor_name
from strata.vision.qwen3vl import PROJECTOR_TYPE

_PREFIXES = ("model.language_model.", "model.")  # ForConditionalGeneration, ForCausalLM
_T = gguf.MODEL_TENSOR


def hparams_from_hf(config: Mapping[str, Any]) -> HParams:
    """The hyper-parameters of a Qwen3.5 text config (`config.json`'s dict, or its `text_config`).

    Raises:
        ValueError: `layer_types` that is not every `full_attention_interval`-th layer full attention (the only
            pattern the converter's keys describe).
    """
    c = dict(config.get("text_config", config))
    rope = c.get("rope_parameters") or {}
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    n_rot = int(head_dim * rope.get("partial_rotary_factor", 0.25))
    sections = list(rope.get("mrope_section", [11, 11, 10]))  # the converter's default when a config has none
    sections += [0] * (4 - len(sections))
    hp = HParams(
        n_layer=c["num_hidden_layers"], n_embd=c["hidden_size"], n_head=c["num_attention_heads"],
        n_head_kv=c["num_key_value_heads"], head_dim=head_dim, n_ff=c.get("intermediate_size") or 0,
        n_expert=c.get("num_experts") or 0, n_expert_used=c.get("num_experts_per_tok") or 0,
        n_ff_exp=c.get("moe_intermediate_size") or 0, n_ff_shexp=c.get("shared_expert_intermediate_size") or 0,
        n_ctx_train=c["max_position_embeddings"], rope_base=float(rope.get("rope_theta", 10_000.0)),
        rms_eps=c["rms_norm_eps"], full_attention_interval=c.get("full_attention_interval", 4),
        ssm_conv_kernel=c["linear_conv_kernel_dim"], ssm_state_size=c["linear_key_head_dim"],
        ssm_group_count=c["linear_num_key_heads"], ssm_time_step_rank=c["linear_num_value_heads"],
        ssm_inner_size=c["linear_num_value_heads"] * c["linear_value_head_dim"], n_rot=n_rot,
        rope_sections=tuple(sections[:4]), n_nextn=c.get("mtp_num_hidden_layers", 0))
    layer_types = c.get("layer_types")
    if layer_types is not None:
        recurrent = tuple(t == "linear_attention" for t in layer_types)
        if recurrent != hp.recurrent_layers():
            raise ValueError(f"layer_types {layer_types} is not one full-attention layer every "
                             f"{hp.full_attention_interval}")
    return hp


def gguf_weights_from_hf(state: Mapping[str, np.ndarray], hp: HParams) -> dict[str, np.ndarray]:
    """Every tensor of the `qwen35` / `qwen35moe` table (`writer.tensor_specs`) by GGUF name, as float32 in numpy
    layout, from a checkpoint's state dict (numpy arrays by Hugging Face name; experts one by one or packed as
    `gate_up_proj` (experts, 2 n_ff, n_embd) / `down_proj` (experts, n_embd, n_ff)). The vision tower is left out.

    Raises:
        ValueError: a tensor this mapping does not know (so nothing is silently dropped).
    """
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for hf_name, value in state.items():
        name = _canonical(hf_name, hp.n_layer)
        if name is None:
            continue
        w = np.asarray(value, np.float32)
        if name in _GLOBAL:
            gguf_name, plus_one = _GLOBAL[name]
            out[gguf_name] = w + np.float32(1) if plus_one else w
            continue
        layer, _, rest = name.removeprefix("layers.").partition(".")
        bid = int(layer)
        if rest.startswith("mlp.experts."):
            _collect_experts(rest, w, bid, experts, out)
            continue
        if rest not in _LAYER:
            raise ValueError(f"unknown tensor {hf_name!r}")
        gguf_kind, plus_one = _LAYER[rest]
        if rest.startswith("linear_attn."):
            w = _delta_net_tensor(rest, w, hp)
        out[f"blk.{bid}.{gguf_kind}"] = w + np.float32(1) if plus_one else w
    for (bid, kind), by_expert in experts.items():
        out[f"blk.{bid}.ffn_{kind}_exps.weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


# HF name (after `_canonical`) -> GGUF name, and whether the converter adds 1.
_GLOBAL = {
    "embed_tokens.weight": ("token_embd.weight", False),
    "norm.weight": ("output_norm.weight", True),
    "lm_head.weight": ("output.weight", False),
}
_LAYER = {
    "input_layernorm.weight": ("attn_norm.weight", True),
    "post_attention_layernorm.weight": ("post_attention_norm.weight", True),
    "self_attn.q_proj.weight": ("attn_q.weight", False),
    "self_attn.k_proj.weight": ("attn_k.weight", False),
    "self_attn.v_proj.weight": ("attn_v.weight", False),
    "self_attn.o_proj.weight": ("attn_output.weight", False),
    "self_attn.q_norm.weight": ("attn_q_norm.weight", True),
    "self_attn.k_norm.weight": ("attn_k_norm.weight", True),
    "linear_attn.in_proj_qkv.weight": ("attn_qkv.weight", False),
    "linear_attn.in_proj_z.weight": ("attn_gate.weight", False),
    "linear_attn.in_proj_a.weight": ("ssm_alpha.weight", False),
    "linear_attn.in_proj_b.weight": ("ssm_beta.weight", False),
    "linear_attn.A_log": ("ssm_a", False),
    "linear_attn.dt_bias": ("ssm_dt.bias", False),
    "linear_attn.conv1d.weight": ("ssm_conv1d.weight", False),
    "linear_attn.norm.weight": ("ssm_norm.weight", False),
    "linear_attn.out_proj.weight": ("ssm_out.weight", False),
    "mlp.gate.weight": ("ffn_gate_inp.weight", False),
    "mlp.shared_expert_gate.weight": ("ffn_gate_inp_shexp.weight", False),
    "mlp.shared_expert.gate_proj.weight": ("ffn_gate_shexp.weight", False),
    "mlp.shared_expert.up_proj.weight": ("ffn_up_shexp.weight", False),
    "mlp.shared_expert.down_proj.weight": ("ffn_down_shexp.weight", False),
    "mlp.gate_proj.weight": ("ffn_gate.weight", False),
    "mlp.up_proj.weight": ("ffn_up.weight", False),
    "mlp.down_proj.weight": ("ffn_down.weight", False),
    "fc.weight": ("nextn.eh_proj.weight", False),
    "pre_fc_norm_embedding.weight": ("nextn.enorm.weight", True),
    "pre_fc_norm_hidden.weight": ("nextn.hnorm.weight", True),
    "mtp_norm.weight": ("nextn.shared_head_norm.weight", True),
}


def _canonical(hf_name: str, n_layer: int) -> str | None:
    """`layers.{i}.…` for a layer's tensor (MTP layers numbered after the main ones, the MTP block's own tensors
    in layer n_layer), the bare name for the others; None for the vision tower."""
    if hf_name.startswith(("model.visual.", "visual.")):
        return None
    if hf_name.startswith("mtp."):
        rest = hf_name.removeprefix("mtp.")
        if rest.startswith("layers."):
            layer, _, tail = rest.removeprefix("layers.").partition(".")
            return f"layers.{n_layer + int(layer)}.{tail}"
        return f"layers.{n_layer}.{'mtp_norm.weight' if rest == 'norm.weight' else rest}"
    for prefix in _PREFIXES:
        if hf_name.startswith(prefix):
            return hf_name.removeprefix(prefix)
    return hf_name


def _collect_experts(rest: str, w: np.ndarray, bid: int, experts: dict[tuple[int, str], dict[int, np.ndarray]],
                     out: dict[str, np.ndarray]) -> None:
    """One expert's matrix (`mlp.experts.{e}.gate_proj.weight`), kept until the layer's are stacked, or a packed
    tensor of them all, split into gate and up."""
    tail = rest.removeprefix("mlp.experts.")
    if tail in ("gate_up_proj", "gate_up_proj.weight"):
        n_ff = w.shape[-2] // 2
        out[f"blk.{bid}.ffn_gate_exps.weight"] = np.ascontiguousarray(w[:, :n_ff])
        out[f"blk.{bid}.ffn_up_exps.weight"] = np.ascontiguousarray(w[:, n_ff:])
    elif tail in ("down_proj", "down_proj.weight"):
        out[f"blk.{bid}.ffn_down_exps.weight"] = w
    else:
        expert, _, kind = tail.partition(".")
        experts.setdefault((bid, kind.removesuffix("_proj.weight")), {})[int(expert)] = w


def _delta_net_tensor(rest: str, w: np.ndarray, hp: HParams) -> np.ndarray:
    """A DeltaNet tensor as the converter stores it: value heads tiled, A as -exp(A_log), the convolution
    squeezed."""
    n_k, n_v = hp.ssm_group_count, hp.ssm_time_step_rank
    head_v = hp.ssm_inner_size // n_v
    qk_rows = 2 * n_k * hp.ssm_state_size

    def tiled(x: np.ndarray, axis: int, head: int) -> np.ndarray:
        if n_k == n_v:
            return x
        x = np.moveaxis(x, axis, 0)
        shape = x.shape
        x = x.reshape(n_k, n_v // n_k, head, *shape[1:]).swapaxes(0, 1).reshape(shape)
        return np.ascontiguousarray(np.moveaxis(x, 0, axis))

    if rest == "linear_attn.conv1d.weight":
        w = w.reshape(w.shape[0], -1)  # (channels, 1, kernel) -> (channels, kernel)
    if rest in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
        return np.concatenate([w[:qk_rows], tiled(w[qk_rows:], 0, head_v)])
    if rest == "linear_attn.in_proj_z.weight":
        return tiled(w, 0, head_v)
    if rest in ("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight", "linear_attn.dt_bias"):
        return tiled(w, 0, 1)
    if rest == "linear_attn.A_log":  # exp correctly rounded to float32; the converter's torch.exp may be 1 ulp off
        return -np.exp(tiled(w, 0, 1).astype(np.float64)).astype(np.float32)
    if rest == "linear_attn.out_proj.weight":
        return tiled(w, 1, head_v)
    return w


def vision_hparams_from_hf(config: Mapping[str, Any], preprocessor: Mapping[str, Any]) -> VisionHParams:
    """The encoder's hyper-parameters from a ForConditionalGeneration `config.json` and its
    `preprocessor_config.json`.

    Raises:
        ValueError: a merge size other than 2 or deepstack layers (Qwen3-VL's, not Qwen3.5's).
    """
    v = config["vision_config"]
    if v.get("spatial_merge_size", MERGE) != MERGE or v.get("deepstack_visual_indexes"):
        raise ValueError("not a Qwen3.5 vision tower: spatial_merge_size must be 2 and there are no deepstack layers")
    side = round(v["num_position_embeddings"] ** 0.5)
    return VisionHParams(
        image_size=side * v["patch_size"], patch_size=v["patch_size"], n_embd=v["hidden_size"],
        n_ff=v["intermediate_size"], n_head=v["num_heads"], n_layer=v["depth"],
        eps=float(np.float32(config["text_config"].get("rms_norm_eps", 1e-6))), n_proj=v["out_hidden_size"],
        merge=MERGE, image_mean=_triple(preprocessor["image_mean"]), image_std=_triple(preprocessor["image_std"]),
        projector=PROJECTOR_TYPE, variant="qwen3-vl")


def gguf_vision_from_hf(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The vision tower's tensors (`model.visual.*` of a state dict, numpy arrays) by mmproj name, float32.

    Raises:
        ValueError: a vision tensor this mapping does not know.
    """
    out: dict[str, np.ndarray] = {}
    for hf_name, value in state.items():
        if not hf_name.startswith(("model.visual.", "visual.")):
            continue
        name = hf_name.removeprefix("model.").removeprefix("visual.")
        w = np.asarray(value, np.float32)
        if name == "patch_embed.proj.weight":  # (n, 3, 2, p, p): one kernel per frame of a temporal patch
            out[tensor_name(_T.V_ENC_EMBD_PATCH)] = np.ascontiguousarray(w[:, :, 0])
            out[PATCH_KERNEL_2] = np.ascontiguousarray(w[:, :, 1])
            continue
        kind, bid, suffix = _vision_name(name)
        if kind is None:
            raise ValueError(f"unknown vision tensor {hf_name!r}")
        out[tensor_name(kind, suffix, bid)] = w
    return out


_VISION_BLOCK = {"norm1": _T.V_ENC_INPUT_NORM, "norm2": _T.V_ENC_POST_ATTN_NORM, "attn.qkv": _T.V_ENC_ATTN_QKV,
                 "attn.proj": _T.V_ENC_ATTN_O, "mlp.linear_fc1": _T.V_ENC_FFN_UP, "mlp.linear_fc2": _T.V_ENC_FFN_DOWN}
_VISION_OTHER = {"patch_embed.proj": (_T.V_ENC_EMBD_PATCH, None), "pos_embed": (_T.V_ENC_EMBD_POS, None),
                 "merger.norm": (_T.V_POST_NORM, None), "merger.linear_fc1": (_T.V_MMPROJ, 0),
                 "merger.linear_fc2": (_T.V_MMPROJ, 2)}


def _vision_name(name: str) -> tuple[gguf.MODEL_TENSOR | None, int | None, str]:
    """(kind, block, suffix) of a tower tensor's name without its `visual.` prefix; kind None if unknown."""
    stem, _, suffix = name.rpartition(".")
    if stem.startswith("blocks."):
        block, _, part = stem.removeprefix("blocks.").partition(".")
        return _VISION_BLOCK.get(part), int(block), suffix
    kind, bid = _VISION_OTHER.get(stem, (None, None))
    return kind, bid, suffix


def _triple(values: Any) -> tuple[float, float, float]:
    a, b, c = (float(np.float32(x)) for x in values)
    return a, b, c
