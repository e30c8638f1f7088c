"""Our `qwen35moe` / `qwen35` files against llama.cpp's converter: a random checkpoint of transformers' real
`Qwen3_5MoeForCausalLM` / `Qwen3_5ForCausalLM` with an MTP layer, converted by `convert_hf_to_gguf.py`, and the
same weights written by `write_model` (mapped by `strata.modelgen.hf_qwen35`), with Qwen's tokenizer: the same
tensors, shapes, types and bytes (F32 bit-equal, Q8_0 the same blocks), and the same metadata, tokenizer included,
but the name the converter makes up. `ssm_a` = -exp(A_log) may differ in the last bit: exp's last bit depends on
the library (the converter's torch.exp against a correctly rounded exp: 1% of values differ by 1 ulp).
"""

from __future__ import annotations

import json
import pathlib

import gguf
import numpy as np
import pytest
import torch
from llama_cpp_convert import convert, save_qwen35
from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

from strata.modelgen.hf_qwen35 import gguf_weights_from_hf, hparams_from_hf
from strata.modelgen.vocab import ENDOFTEXT, get_vocab
from strata.modelgen.writer import chat_template, write_model

PRODUCER_KEYS = {"general.name", "general.size_label"}  # the converter's guesses from the directory name
N_LAYER = 4  # main layers: DeltaNet x3, attention; then one MTP layer
_TEXT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
             vocab_size=151936, max_position_embeddings=4096, rms_norm_eps=1e-6, num_hidden_layers=N_LAYER + 1,
             layer_types=["linear_attention"] * 3 + ["full_attention"] * 2,
             rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                              "mrope_section": [2, 1, 1], "mrope_interleaved": True})
MODELS = {
    "qwen35moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM,
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48)),
    "qwen35": (Qwen3_5TextConfig, Qwen3_5ForCausalLM, dict(intermediate_size=96)),
}
# (arch, converter --outtype = our dtype): the dense model's types follow the MoE's rules; one conversion will do.
CONVERSIONS = [("qwen35moe", "f32"), ("qwen35moe", "q8_0"), ("qwen35", "f32")]


def _checkpoint(arch: str) -> torch.nn.Module:
    config_class, model_class, extra = MODELS[arch]
    torch.manual_seed(0)
    model = model_class(config_class(**_TEXT, **extra))
    with torch.no_grad():  # every tensor distinct and away from its init (norms start at 0 or 1)
        for param in model.parameters():
            param.normal_(0, 0.5)
    return model.float().eval()


@pytest.fixture(scope="module")
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               qwen_tokenizer_dir: pathlib.Path) -> tuple[str, pathlib.Path]:
    arch = request.param
    hf_dir = tmp_path_factory.mktemp(f"{arch}-hf")
    save_qwen35(_checkpoint(arch), hf_dir, qwen_tokenizer_dir)
    # The tokenizer keys our files carry: <|endoftext|> as bos (not prepended) and Qwen3.5's template.
    tokenizer_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    tokenizer_config |= {"bos_token": ENDOFTEXT, "chat_template": chat_template("qwen35")}
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return arch, hf_dir


def _ours(arch: str, hf_dir: pathlib.Path, out: pathlib.Path, dtype: str) -> pathlib.Path:
    import safetensors.numpy

    hp = hparams_from_hf(json.loads((hf_dir / "config.json").read_text()))
    weights = gguf_weights_from_hf(safetensors.numpy.load_file(hf_dir / "model.safetensors"), hp)
    return write_model(out, arch, hp, get_vocab("qwen"), weights, dtype=dtype)


def _metadata(reader: gguf.GGUFReader) -> dict[str, object]:
    return {key: (f.types, f.contents()) for key, f in reader.fields.items()
            if key not in PRODUCER_KEYS and not key.startswith("GGUF.")}


@pytest.mark.parametrize(("checkpoint", "outtype"), CONVERSIONS, indirect=["checkpoint"])
def test_our_file_is_the_converters(checkpoint: tuple[str, pathlib.Path], outtype: str) -> None:
    arch, hf_dir = checkpoint
    theirs = gguf.GGUFReader(convert(hf_dir, hf_dir.parent / f"{arch}-{outtype}-converted.gguf", outtype))
    ours = gguf.GGUFReader(_ours(arch, hf_dir, hf_dir.parent / f"{arch}-{outtype}-ours.gguf", outtype))
    assert theirs.fields["general.architecture"].contents() == arch
    expected, got = _metadata(theirs), _metadata(ours)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == value, key
    expected_tensors = {t.name: t for t in theirs.tensors}
    got_tensors = {t.name: t for t in ours.tensors}
    assert got_tensors.keys() == expected_tensors.keys()
    assert any(".nextn." in name for name in got_tensors)
    for name, t in expected_tensors.items():
        mine = got_tensors[name]
        assert (mine.tensor_type, mine.shape.tolist()) == (t.tensor_type, t.shape.tolist()), name
        if name.endswith(".ssm_a"):
            np.testing.assert_array_max_ulp(mine.data, t.data, maxulp=1)
        else:
            assert np.array_equal(mine.data.view(np.uint8), t.data.view(np.uint8)), name


@pytest.mark.parametrize("checkpoint", ["qwen35moe"], indirect=True)
def test_the_value_heads_are_reordered(checkpoint: tuple[str, pathlib.Path]) -> None:
    """The checkpoint has two value heads per key head, so the tiling is not the identity: a file without it would
    differ, and the test above would catch it. Shown on layer 0's A: stored -exp(A_log), heads (0, 2, 1, 3)."""
    import safetensors.numpy

    _, hf_dir = checkpoint
    state = safetensors.numpy.load_file(hf_dir / "model.safetensors")
    hp = hparams_from_hf(json.loads((hf_dir / "config.json").read_text()))
    a_log = state["model.layers.0.linear_attn.A_log"]
    stored = gguf_weights_from_hf(state, hp)["blk.0.ssm_a"]
    np.testing.assert_array_max_ulp(stored, -np.exp(a_log[[0, 2, 1, 3]]), maxulp=1)


@pytest.mark.parametrize("checkpoint", ["qwen35moe"], indirect=True)
def test_unknown_tensors_are_refused(checkpoint: tuple[str, pathlib.Path]) -> None:
    import safetensors.numpy

    _, hf_dir = checkpoint
    state = safetensors.numpy.load_file(hf_dir / "model.safetensors")
    hp = hparams_from_hf(json.loads((hf_dir / "config.json").read_text()))
    state["model.layers.0.linear_attn.new_thing.weight"] = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="new_thing"):
        gguf_weights_from_hf(state, hp)


@pytest.mark.parametrize("checkpoint", ["qwen35moe"], indirect=True)
def test_packed_experts_map_as_saved_ones(checkpoint: tuple[str, pathlib.Path]) -> None:
    """transformers 5 holds the experts packed in memory (`gate_up_proj` (experts, 2 n_ff, n_embd), `down_proj`)
    and saves them one by one: both map to the same file tensors. (In memory the MTP layer is still decoder layer
    n_layer, which maps to the same tensors as the saved `mtp.layers.0`.)"""
    import safetensors.numpy

    arch, hf_dir = checkpoint
    hp = hparams_from_hf(json.loads((hf_dir / "config.json").read_text()))
    saved = gguf_weights_from_hf(safetensors.numpy.load_file(hf_dir / "model.safetensors"), hp)
    in_memory_state = {name: value.numpy() for name, value in _checkpoint(arch).state_dict().items()}
    assert any(name.endswith("experts.gate_up_proj") for name in in_memory_state)
    in_memory = gguf_weights_from_hf(in_memory_state, hp)
    assert in_memory.keys() == saved.keys() - {name for name in saved if ".nextn." in name}
    for name, value in in_memory.items():
        assert np.array_equal(value, saved[name]), name


@pytest.mark.parametrize("checkpoint", ["qwen35moe"], indirect=True)
def test_a_multimodal_checkpoints_text_maps_alike(checkpoint: tuple[str, pathlib.Path]) -> None:
    """`Qwen3_5MoeForConditionalGeneration` keeps the text model under `model.language_model.` beside the vision
    tower (`model.visual.`, left to the mmproj)."""
    import safetensors.numpy

    _, hf_dir = checkpoint
    hp = hparams_from_hf(json.loads((hf_dir / "config.json").read_text()))
    state = safetensors.numpy.load_file(hf_dir / "model.safetensors")
    multimodal = {name.replace("model.", "model.language_model.", 1): value for name, value in state.items()}
    multimodal["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((96, 32), np.float32)
    assert "model.language_model.layers.0.linear_attn.A_log" in multimodal
    expected, got = gguf_weights_from_hf(state, hp), gguf_weights_from_hf(multimodal, hp)
    assert got.keys() == expected.keys()
    assert all(np.array_equal(got[name], expected[name]) for name in expected)


@pytest.mark.parametrize("checkpoint", ["qwen35"], indirect=True)
def test_a_layer_pattern_the_keys_cannot_describe_is_refused(checkpoint: tuple[str, pathlib.Path]) -> None:
    _, hf_dir = checkpoint
    config = json.loads((hf_dir / "config.json").read_text())
    assert hparams_from_hf(config).recurrent_layers() == (True, True, True, False)
    config["layer_types"] = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    with pytest.raises(ValueError, match="layer_types"):
        hparams_from_hf(config)
