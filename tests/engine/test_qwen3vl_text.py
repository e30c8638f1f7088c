"""The text side of Qwen3-VL and Qwen3-VL-MoE (architectures `qwen3vl`, `qwen3vlmoe`) on text, as llama.cpp's own
converter writes it from a random `Qwen3VLForConditionalGeneration` / `Qwen3VLMoeForConditionalGeneration` with
Qwen's real tokenizer, against the checkpoint in transformers.

On text alone every position's three multi-axis RoPE components are equal, so the interleaved M-RoPE is Qwen3's
RoPE and no deepstack features are added: these files run as Qwen3 / Qwen3-MoE. Pictures need the M-RoPE over
their rows and columns and the deepstack rows, which the engine does not have yet: the encoder's rows are wider
than the text model's (main and deepstack parts side by side), so the server refuses them.
Logits: relative error per position, max|engine - reference| / max|reference|, f32 files and KV cache.
"""

from __future__ import annotations

import pathlib
import shutil

import numpy as np
import pytest
import safetensors.torch
import torch
from gguf import GGUFReader
from llama_cpp_convert import convert, qwen_tokenizer, require_converter
from transformers import (
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

from strata.engine_cffi import Engine
from strata.tokenizer import Tokenizer

N_PROMPT, N_DECODE = 60, 4
TOLERANCE = 1e-4
_VISION = {"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 16,
           "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64, "num_position_embeddings": 64,
           "deepstack_visual_indexes": [0, 1]}
_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 151936, "rms_norm_eps": 1e-6,
         "max_position_embeddings": 4096,
         "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [8, 4, 4],
                             "mrope_interleaved": True}}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1}
MODELS = {"qwen3vl": (Qwen3VLConfig, Qwen3VLForConditionalGeneration, {}),
          "qwen3vlmoe": (Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration, _MOE)}


def _checkpoint(arch: str) -> torch.nn.Module:
    config_class, model_class, extra = MODELS[arch]
    config = config_class(vision_config=_VISION, text_config={**_TEXT, **extra})
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():  # weights of order one (as our writer draws them), so positions and routing matter
        for name, param in model.model.language_model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif "embed_tokens" in name:
                param.normal_(0, 1)
            else:
                param.normal_(0, param.shape[-1 if "experts" in name and "down" not in name else 1] ** -0.5)
    return model.float().eval()


def _experts_as_transformers_4(path: pathlib.Path) -> None:
    """The converter reads Qwen3-VL-MoE's packed experts in transformers 4's layout, gate_up_proj (experts, n_embd,
    2 n_ff) and down_proj (experts, n_ff, n_embd); transformers 5 saves both transposed, which the converter turns
    into a file llama.cpp refuses. Stored here as a transformers 4 checkpoint has them."""
    tensors = safetensors.torch.load_file(path)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    require_converter()
    directory = tmp_path_factory.mktemp("qwen-tokenizer")
    qwen_tokenizer(directory)  # tens of seconds: made once for both models
    return directory


@pytest.fixture(scope="module", params=list(MODELS))
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
              tokenizer_dir: pathlib.Path) -> tuple:
    arch = request.param
    hf_dir = tmp_path_factory.mktemp(f"{arch}-hf")
    model = _checkpoint(arch)
    model.save_pretrained(hf_dir)
    if arch == "qwen3vlmoe":
        _experts_as_transformers_4(hf_dir / "model.safetensors")
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, hf_dir)
    return arch, model, convert(hf_dir, hf_dir.parent / f"{arch}.gguf", "f32")


def test_text_logits_match_the_checkpoint(converted: tuple) -> None:
    arch, model, path = converted
    assert GGUFReader(path).get_field("general.architecture").contents() == arch
    tokens = [int(t) for t in np.random.default_rng(2).integers(0, 151000, N_PROMPT + N_DECODE)]
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([tokens])).logits[0].numpy()
    with Engine.load(path, n_ctx=256, threads=2, kv="f32", n_batch=16) as engine:
        rows = [engine.eval(tokens[:N_PROMPT], all_logits=True)]
        rows += [engine.eval([t])[None] for t in tokens[N_PROMPT:]]
    got = np.concatenate(rows)
    err = np.abs(got - expected).max(axis=-1) / np.abs(expected).max(axis=-1)
    assert err.max() <= TOLERANCE, f"{arch}: relative error per position, max {err.max():.2e} at {err.argmax()}"


def test_the_tokenizer_is_qwens(converted: tuple) -> None:
    _, _, path = converted
    assert GGUFReader(path).get_field("tokenizer.ggml.pre").contents() == "qwen2"
    tok = Tokenizer.from_gguf(path)
    text = "<|im_start|>user\nHello, 1234 Ünïcödé!<|im_end|>"
    assert tok.decode(tok.encode(text)) == text
    assert not tok.add_bos
