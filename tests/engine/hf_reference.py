"""The independent reference for the engine's numerics: a Hugging Face transformers model (torch, CPU, float32)
holding a GGUF file's weights, dequantised by the `gguf` package itself."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

_MODELS = {"qwen3moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
           "llama": (LlamaConfig, LlamaForCausalLM)}

# GGUF tensor name (after "blk.N.") -> transformers parameter name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight",
    "attn_q_norm": "self_attn.q_norm.weight",
    "attn_k_norm": "self_attn.k_norm.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
    "ffn_gate_inp": "mlp.gate.weight",
    "ffn_down_exps": "mlp.experts.down_proj",
}


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's converter, which reorders each head's rows from halves (rotate_half RoPE) to interleaved
    pairs: stored row (h, i, j) of shape (n_head, rows_per_head / 2, 2) came from row (h, j, i)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _strip(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def read_weights(reader: GGUFReader) -> dict[str, np.ndarray]:
    """GGUF tensor name (without `.weight`) -> float32 array in numpy order (rows last-but-one)."""
    return {_strip(t.name): np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
        tuple(int(n) for n in reversed(t.shape))) for t in reader.tensors}


def _hparams(reader: GGUFReader) -> tuple[str, dict[str, Any]]:
    def get(key: str, default: Any = None) -> Any:
        field = reader.get_field(key)
        return default if field is None else field.contents()

    arch = get("general.architecture")
    a = f"{arch}."
    return arch, {
        "n_layer": get(a + "block_count"), "n_embd": get(a + "embedding_length"),
        "n_head": get(a + "attention.head_count"), "n_head_kv": get(a + "attention.head_count_kv"),
        "head_dim": get(a + "attention.key_length"), "n_ff": get(a + "feed_forward_length"),
        "n_ctx": get(a + "context_length"), "rope_base": get(a + "rope.freq_base"),
        "rms_eps": get(a + "attention.layer_norm_rms_epsilon"), "n_expert": get(a + "expert_count", 0),
        "n_expert_used": get(a + "expert_used_count", 0), "n_ff_exp": get(a + "expert_feed_forward_length", 0),
    }


def _config(arch: str, hp: dict[str, Any], n_vocab: int, tied: bool) -> Any:
    kwargs = dict(vocab_size=n_vocab, hidden_size=hp["n_embd"], intermediate_size=hp["n_ff"],
                  num_hidden_layers=hp["n_layer"], num_attention_heads=hp["n_head"],
                  num_key_value_heads=hp["n_head_kv"], max_position_embeddings=hp["n_ctx"],
                  rms_norm_eps=hp["rms_eps"], tie_word_embeddings=tied,
                  rope_parameters={"rope_type": "default", "rope_theta": hp["rope_base"]})
    if arch == "qwen3moe":
        kwargs.update(moe_intermediate_size=hp["n_ff_exp"], num_experts=hp["n_expert"],
                      num_experts_per_tok=hp["n_expert_used"], norm_topk_prob=True, decoder_sparse_step=1)
    else:
        kwargs["head_dim"] = hp["head_dim"]
    config = _MODELS[arch][0](**kwargs)
    config.head_dim = hp["head_dim"]  # Qwen3MoeConfig takes it as an attribute only
    config._attn_implementation = "eager"
    return config


def _state_dict(arch: str, hp: dict[str, Any], weights: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    state: dict[str, np.ndarray] = {"model.embed_tokens.weight": weights["token_embd"],
                                    "model.norm.weight": weights["output_norm"]}
    if "output" in weights:
        state["lm_head.weight"] = weights["output"]
    for il in range(hp["n_layer"]):
        prefix, w = f"model.layers.{il}.", {k[len(f"blk.{il}."):]: v for k, v in weights.items()
                                             if k.startswith(f"blk.{il}.")}
        if arch == "llama":
            w["attn_q"] = unpermute_qk(w["attn_q"], hp["n_head"])
            w["attn_k"] = unpermute_qk(w["attn_k"], hp["n_head_kv"])
        if arch == "qwen3moe":
            state[prefix + "mlp.experts.gate_up_proj"] = np.concatenate([w.pop("ffn_gate_exps"),
                                                                         w.pop("ffn_up_exps")], axis=1)
        state.update({prefix + _LAYER_NAMES[name]: value for name, value in w.items()})
    return {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in state.items()}  # writable copies


def load_hf_model(path: str | os.PathLike[str]) -> torch.nn.Module:
    """The transformers model (eval mode, float32) with the GGUF file's dequantised weights."""
    reader = GGUFReader(path, "r")
    arch, hp = _hparams(reader)
    weights = read_weights(reader)
    n_vocab = weights["token_embd"].shape[0]
    config = _config(arch, hp, n_vocab, tied="output" not in weights)
    model = _MODELS[arch][1](config)
    model.load_state_dict(_state_dict(arch, hp, weights), strict=not config.tie_word_embeddings)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.float().eval()


def forward_with_routing(model: torch.nn.Module, tokens: list[int]) -> tuple[np.ndarray, list[torch.Tensor]]:
    """Logits (n_tokens, n_vocab) of one forward over `tokens`, and each MoE layer's router probabilities
    (n_tokens, n_expert), softmax of its router logits (none for a dense model)."""
    probs: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out: probs.append(out[0].softmax(-1)))
             for layer in model.model.layers if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0].numpy()
    finally:
        for hook in hooks:
            hook.remove()
    return logits, probs


def reference_logits(model: torch.nn.Module, tokens: list[int]) -> tuple[np.ndarray, np.ndarray | None]:
    """Logits (n_tokens, n_vocab) of one forward over `tokens`, and for MoE models the routing margin per position:
    the smallest, over layers, gap between the k-th and (k+1)-th largest router probability (None if dense)."""
    logits, probs = forward_with_routing(model, tokens)
    if not probs:
        return logits, None
    k = model.config.num_experts_per_tok
    if k == model.config.num_experts:  # every expert is used: there is no choice to flip
        return logits, np.full(len(tokens), np.inf, dtype=np.float32)
    ranked = [p.sort(-1, descending=True).values for p in probs]
    margin = torch.stack([r[:, k - 1] - r[:, k] for r in ranked]).min(0).values.numpy()
    return logits, margin
