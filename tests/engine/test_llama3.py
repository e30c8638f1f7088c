"""Llama 3.x as users get it: a `LlamaForCausalLM` with Llama 3's "llama3" RoPE scaling and its real tokenizer,
converted by llama.cpp's own `convert_hf_to_gguf.py`, against the checkpoint itself in transformers.

The converter writes the scaling as the `rope_freqs` tensor (one divisor per frequency) and the tokenizer as
`tokenizer.ggml.pre = llama-bpe` with `add_bos_token`; all three must be read as the checkpoint means them.
Logits: relative error per position, max|engine - reference| / max|reference|, over 320 positions (a chunked
prefill, then decode steps) with an f32 file and an f32 KV cache.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from llama_cpp_convert import convert, llama3_tokenizer, require_converter
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from strata.engine_cffi import Engine
from strata.text.tokenizer import Tokenizer

N_PROMPT, N_DECODE = 312, 8
TOLERANCE = 1e-5  # measured 7e-7; the same weights without the scaling are 1e-2 off
ROPE_LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # Llama 3.2's values
TEXTS = [
    "Hello world! It's 2026: 1234567 apples, 3.14159 pies.",
    "  leading spaces,\ttabs\nnew lines\r\n\n\nand trailing   ",
    "Ünïcödé façade — naïve café; 東京は晴れ 🌤️ ok?",
    "<|start_header_id|>user<|end_header_id|>\n\nWhat's 7*6?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "def f(x):\n    return x**2  # I'VE, we'll, they'd\n",
]


def _config(rope: dict) -> LlamaConfig:
    config = LlamaConfig(vocab_size=128256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128009,
                         rope_parameters=rope)
    config._attn_implementation = "eager"
    return config


def _random_model(seed: int = 0) -> LlamaForCausalLM:
    """Weights of order one (std 1/sqrt(fan_in), as our own writer draws them) so that attention is far from
    uniform and positions matter; transformers' default init (std 0.02) would hide RoPE errors."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_config(ROPE_LLAMA3))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif "embed_tokens" in name:
                param.normal_(0, 1)
            else:
                param.normal_(0, param.shape[1] ** -0.5)
    return model.float().eval()


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> tuple[LlamaForCausalLM, pathlib.Path, pathlib.Path]:
    require_converter()
    hf_dir = tmp_path_factory.mktemp("llama3-hf")
    model = _random_model()
    model.save_pretrained(hf_dir)
    llama3_tokenizer(hf_dir)
    path = convert(hf_dir, hf_dir.parent / "llama3-f32.gguf", "f32")
    return model, hf_dir, path


def _logits(model: LlamaForCausalLM, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def _relative_error(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.abs(a - b).max(axis=-1) / np.abs(b).max(axis=-1)


def test_converter_writes_llama3_scaling_and_tokenizer(llama3: tuple) -> None:
    _, _, path = llama3
    reader = GGUFReader(path)
    assert reader.get_field("tokenizer.ggml.pre").contents() == "llama-bpe"
    assert reader.get_field("tokenizer.ggml.add_bos_token").contents() is True
    assert "rope_freqs.weight" in {t.name for t in reader.tensors}


def test_logits_match_the_checkpoint_at_320_positions(llama3: tuple) -> None:
    model, _, path = llama3
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 128000, N_PROMPT + N_DECODE)]
    expected = _logits(model, tokens)
    with Engine.load(path, n_ctx=512, threads=2, kv="f32", n_batch=64) as engine:
        rows = [engine.eval(tokens[:N_PROMPT], all_logits=True)]
        rows += [engine.eval([t])[None] for t in tokens[N_PROMPT:]]
    err = _relative_error(np.concatenate(rows), expected)
    assert err.max() <= TOLERANCE, f"relative error per position: max {err.max():.2e} at {err.argmax()}"
    # The check can fail: the same weights without the llama3 scaling are far off at these positions.
    unscaled = LlamaForCausalLM(_config({"rope_type": "default", "rope_theta": ROPE_LLAMA3["rope_theta"]}))
    unscaled.load_state_dict(model.state_dict())
    assert _relative_error(_logits(unscaled.float().eval(), tokens), expected)[-32:].max() > 100 * TOLERANCE


def test_tokenizer_matches_llama3s(llama3: tuple) -> None:
    _, hf_dir, path = llama3
    hf = AutoTokenizer.from_pretrained(hf_dir)
    tok = Tokenizer.from_gguf(path)
    assert tok.add_bos and tok.bos_id == 128000 and 128009 in tok.eos_ids
    for text in TEXTS:
        want = hf(text, add_special_tokens=False).input_ids
        assert tok.encode(text, special=True) == want, text
        assert tok.encode_prompt(text) == hf(text).input_ids == [128000, *want]
        assert tok.decode(want) == text
    # a template that writes the BOS itself does not get a second one
    assert tok.encode_prompt("<|begin_of_text|>Hi") == [128000, *tok.encode("Hi")]
