"""Small random Qwen3.5 / Qwen3.6 text checkpoints (`Qwen3_5MoeForCausalLM`, `Qwen3_5ForCausalLM` of the real
config classes) with Qwen's tokenizer, written to GGUF by llama.cpp's own converter: the references for the
engine's `qwen35moe` and `qwen35` architectures.

The weights are drawn of order one (as our generator draws them), so that positions, the recurrent state and the
routing all matter: each matrix N(0, 1/fan_in), the embeddings N(0, 1), the norms near their identity. An MTP
block (`mtp.*`, which the published checkpoints carry and the converter writes by default as a `nextn` block) can be
added to the checkpoint; the forward pass does not run it, so transformers' logits are those without it.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import safetensors.torch
import torch
from llama_cpp_convert import convert
from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

TEXT = {"vocab_size": 151936, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": True}}
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
DENSE = {"intermediate_size": 96}
MODELS = {"qwen35moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, MOE),
          "qwen35": (Qwen3_5TextConfig, Qwen3_5ForCausalLM, DENSE)}


def checkpoint(arch: str, n_layer: int, interval: int, tied: bool = False, seed: int = 0) -> torch.nn.Module:
    """A random model of `arch` whose every `interval`-th layer is full attention, the others Gated DeltaNet; with
    `tied`, the output weight is the embeddings' (half the file: the vocabulary is Qwen's 151,936 tokens)."""
    config_class, model_class, extra = MODELS[arch]
    config = config_class(**TEXT, **extra, num_hidden_layers=n_layer, full_attention_interval=interval,
                          tie_word_embeddings=tied)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # the gated norm multiplies by its weight
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif name.endswith("norm.weight"):  # the others by 1 + weight
                param.copy_(0.1 * torch.randn_like(param))
            elif name.endswith(("A_log", "dt_bias")):
                continue  # the model's own initialisation: decays between e^-16 and e^-0.01 per step
            elif "embed_tokens" in name:
                param.normal_(0, 1)
            else:
                param.normal_(0, param.shape[-1] ** -0.5)
    return model.float().eval()


def mtp_tensors(model: torch.nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    """An MTP block as the published checkpoints name it: a full-attention decoder layer (a copy of the model's
    last one, perturbed) with its own feed-forward, the projection of [embedding, hidden] and three norms; the
    same for the same model and seed."""
    rng = torch.Generator().manual_seed(seed)
    config, n = model.config, model.config.hidden_size
    last = max(i for i, kind in enumerate(config.layer_types) if kind == "full_attention")
    prefix = f"model.layers.{last}."
    tensors = {f"mtp.layers.0.{name[len(prefix):]}": p.detach() + 0.01 * torch.randn(p.shape, generator=rng)
               for name, p in model.named_parameters() if name.startswith(prefix)}
    tensors["mtp.fc.weight"] = torch.randn(n, 2 * n, generator=rng) * (2 * n) ** -0.5
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = 0.1 * torch.randn(n, generator=rng)
    return tensors


def convert_checkpoint(model: torch.nn.Module, directory: pathlib.Path, tokenizer_dir: pathlib.Path,
                       mtp: bool = False, outtype: str = "f32") -> pathlib.Path:
    """Save `model` (with an MTP block if `mtp`) and Qwen's tokenizer in `directory`/hf and convert it; the file
    has the MTP block as the converter writes it by default, or none (`--no-mtp`)."""
    hf = directory / "hf"
    model.save_pretrained(hf)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, hf)
    if mtp:
        weights = hf / "model.safetensors"
        tensors = safetensors.torch.load_file(weights)
        tensors.update({k: v.contiguous() for k, v in mtp_tensors(model).items()})
        safetensors.torch.save_file(tensors, weights, metadata={"format": "pt"})
        config = json.loads((hf / "config.json").read_text())
        config["mtp_num_hidden_layers"] = 1
        (hf / "config.json").write_text(json.dumps(config))
    return convert(hf, directory / f"model-{outtype}.gguf", outtype, *(() if mtp else ("--no-mtp",)))
