"""The trained demo model as two GGUF files: the text model, `qwen35moe` with its MTP block or `qwen3moe` (through
`strata.modelgen.writer`, with Qwen3's chat template, which the demo is trained on), and the lfm2 mmproj encoder,
both float32 so the engine and the encoder compute exactly what was trained."""

from __future__ import annotations

import hashlib
import os
import pathlib
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from strata.modelgen.demo.hybrid import HybridTextModel
from strata.modelgen.demo.model import TextModel, VisionBlock, VisionModel
from strata.modelgen.hparams import HParams
from strata.modelgen.mmproj import add_vision_metadata
from strata.modelgen.vocab import Vocab
from strata.modelgen.writer import write_model
from strata.vision.mmproj import (
    MM_DOWN_BID,
    MM_UP_BID,
    read_hparams,
    tensor_name,
)

_T = gguf.MODEL_TENSOR
TEXT_NAME = "strata-demo"
VISION_NAME = "strata demo vision encoder"


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).numpy().copy()


def write_text(path: str | os.PathLike[str], model: TextModel | HybridTextModel, vocab: Vocab) -> pathlib.Path:
    weights = {name: _numpy(t) for name, t in model.gguf_tensors().items()}
    arch = "qwen35moe" if model.hp.hybrid else "qwen3moe"
    return write_model(path, arch, model.hp, vocab, weights, dtype="f32", name=TEXT_NAME, family="qwen3")


def vision_parameters(model: VisionModel) -> dict[str, torch.Tensor]:
    """mmproj tensor name -> the model's parameter, in the order the file stores them."""
    def linear(kind: gguf.MODEL_TENSOR, layer: torch.nn.Module, bid: int | None = None) -> dict[str, torch.Tensor]:
        weight, bias = layer.weight, layer.bias
        assert isinstance(weight, torch.Tensor) and isinstance(bias, torch.Tensor), f"{layer} has no weight and bias"
        return {tensor_name(kind, "weight", bid): weight, tensor_name(kind, "bias", bid): bias}

    out = linear(_T.V_ENC_EMBD_PATCH, model.patch_embd)
    out[tensor_name(_T.V_ENC_EMBD_POS)] = model.position_embd
    for bid, block in enumerate(model.blk):
        assert isinstance(block, VisionBlock)
        out |= linear(_T.V_ENC_INPUT_NORM, block.ln1, bid)
        out |= linear(_T.V_ENC_ATTN_Q, block.attn_q, bid) | linear(_T.V_ENC_ATTN_K, block.attn_k, bid)
        out |= linear(_T.V_ENC_ATTN_V, block.attn_v, bid) | linear(_T.V_ENC_ATTN_O, block.attn_out, bid)
        out |= linear(_T.V_ENC_POST_ATTN_NORM, block.ln2, bid)
        out |= linear(_T.V_ENC_FFN_UP, block.ffn_up, bid) | linear(_T.V_ENC_FFN_DOWN, block.ffn_down, bid)
    out |= linear(_T.V_POST_NORM, model.post_ln) | linear(_T.V_MM_INP_NORM, model.input_norm)
    return out | linear(_T.V_MMPROJ, model.mm_up, MM_UP_BID) | linear(_T.V_MMPROJ, model.mm_down, MM_DOWN_BID)


def write_vision(path: str | os.PathLike[str], model: VisionModel) -> pathlib.Path:
    hp = model.hp
    writer = gguf.GGUFWriter(os.fspath(path), "clip")
    add_vision_metadata(writer, hp, VISION_NAME)
    for name, param in vision_parameters(model).items():
        writer.add_tensor(name, _numpy(param))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return pathlib.Path(path)


# --- reading back: the torch models holding a file's weights


def _file_tensors(reader: gguf.GGUFReader) -> dict[str, torch.Tensor]:
    return {t.name: torch.from_numpy(np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(
        tuple(int(n) for n in reversed(t.shape))).copy()) for t in reader.tensors}


def text_hparams(reader: gguf.GGUFReader) -> HParams:
    """The hyper-parameters a demo GGUF file stores."""
    arch = reader.fields["general.architecture"].contents()

    def get(key: str) -> Any:
        return reader.fields[key.format(arch=arch)].contents()

    def count(key: str) -> int:
        return int(get(key))

    K, A, S = gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.SSM
    common: dict[str, Any] = dict(
        n_embd=count(K.EMBEDDING_LENGTH), n_head=count(A.HEAD_COUNT), n_head_kv=count(A.HEAD_COUNT_KV),
        head_dim=count(A.KEY_LENGTH), n_expert=count(K.EXPERT_COUNT), n_expert_used=count(K.EXPERT_USED_COUNT),
        n_ff_exp=count(K.EXPERT_FEED_FORWARD_LENGTH), n_ctx_train=count(K.CONTEXT_LENGTH),
        rope_base=float(get(gguf.Keys.Rope.FREQ_BASE)), rms_eps=float(get(A.LAYERNORM_RMS_EPS)))
    if arch == "qwen3moe":
        return HParams(n_layer=count(K.BLOCK_COUNT), n_ff=count(K.FEED_FORWARD_LENGTH), **common)
    n_nextn = count(K.NEXTN_PREDICT_LAYERS)
    return HParams(n_layer=count(K.BLOCK_COUNT) - n_nextn, n_ff=0,
                   n_ff_shexp=count(K.EXPERT_SHARED_FEED_FORWARD_LENGTH),
                   full_attention_interval=count(K.FULL_ATTENTION_INTERVAL), ssm_conv_kernel=count(S.CONV_KERNEL),
                   ssm_state_size=count(S.STATE_SIZE), ssm_group_count=count(S.GROUP_COUNT),
                   ssm_time_step_rank=count(S.TIME_STEP_RANK), ssm_inner_size=count(S.INNER_SIZE),
                   n_rot=count(gguf.Keys.Rope.DIMENSION_COUNT),
                   rope_sections=tuple(int(n) for n in get(gguf.Keys.Rope.DIMENSION_SECTIONS)), n_nextn=n_nextn,
                   **common)


def read_text(path: str | os.PathLike[str]) -> TextModel | HybridTextModel:
    """The torch text model holding the weights of a demo GGUF file."""
    reader = gguf.GGUFReader(os.fspath(path))
    tensors = _file_tensors(reader)
    hp = text_hparams(reader)
    n_vocab = tensors["token_embd.weight"].shape[0]
    if hp.hybrid:
        hybrid = HybridTextModel(hp, n_vocab)
        hybrid.load_gguf(tensors)
        return hybrid
    model = TextModel(hp, n_vocab)
    with torch.no_grad():
        for name, param in model.gguf_tensors().items():
            param.copy_(tensors[name])
    return model


def read_vision(path: str | os.PathLike[str]) -> VisionModel:
    """The torch vision model holding the weights of a demo mmproj file."""
    reader = gguf.GGUFReader(os.fspath(path))
    tensors = _file_tensors(reader)
    model = VisionModel(read_hparams(reader))
    with torch.no_grad():
        for name, param in vision_parameters(model).items():
            param.copy_(tensors[name])
    return model


def weights_digest(path: str | os.PathLike[str]) -> str:
    """sha256 over every tensor's name, type, shape and bytes in file order: equal digests, equal weights."""
    digest = hashlib.sha256()
    for tensor in gguf.GGUFReader(os.fspath(path)).tensors:
        digest.update(f"{tensor.name}:{tensor.tensor_type.name}:{list(map(int, tensor.shape))}\n".encode())
        digest.update(np.ascontiguousarray(tensor.data).tobytes())
    return "sha256:" + digest.hexdigest()
