"""The text side of Qwen3-VL and Qwen3-VL-MoE (architectures `qwen3vl`, `qwen3vlmoe`), as llama.cpp's own converter
writes it from a random `Qwen3VLForConditionalGeneration` / `Qwen3VLMoeForConditionalGeneration` with Qwen's real
tokenizer, against the checkpoint in transformers: on text, and on prompts with a picture.

On text alone every position's three multi-axis RoPE components are equal, so the interleaved M-RoPE is Qwen3's
RoPE. A picture's rows get (t, h, w) positions from their place in its grid, the text after it continues from the
largest + 1, and the rows' deepstack slices are added after the first layers: the picture's rows here are random
(main and deepstack parts side by side, as the encoder writes them), given to transformers as precomputed encoder
outputs, so only the text model is compared (tests/vision/test_qwen3vl.py compares the encoder).
Logits: relative error per position, max|engine - reference| / max|reference|, f32 files and KV cache.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from llama_cpp_convert import convert, save_qwen3vl
from transformers import (
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)
from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

from strata.engine_cffi import BatchItem, Engine, PictureRows
from strata.scheduling.batcher import Batcher, Job
from strata.text.sampling import Sampler, SamplingParams
from strata.text.tokenizer import Tokenizer

N_PROMPT, N_DECODE = 60, 4
PICTURE_NY, PICTURE_NX = 3, 5  # merged tokens: not square, so rows and columns are told apart
N_DEEPSTACK = 2
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


@pytest.fixture(scope="module", params=list(MODELS))
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
              qwen_tokenizer_dir: pathlib.Path) -> tuple:
    arch = request.param
    hf_dir = tmp_path_factory.mktemp(f"{arch}-hf")
    model = _checkpoint(arch)
    save_qwen3vl(model, hf_dir, qwen_tokenizer_dir)
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


def _picture_prompt(model: torch.nn.Module, seed: int = 3) -> tuple[list[int], int, np.ndarray]:
    """Text, <|vision_start|>, the picture's pad tokens, <|vision_end|>, text; the index of its first row; random
    rows (n, n_embd * (1 + deepstack)) of order one, as an encoder's are."""
    config, rng = model.config, np.random.default_rng(seed)
    n_rows = PICTURE_NY * PICTURE_NX
    before = [int(t) for t in rng.integers(0, 151000, 9)]
    after = [int(t) for t in rng.integers(0, 151000, 20)]
    ids = [*before, config.vision_start_token_id, *[config.image_token_id] * n_rows, config.vision_end_token_id,
           *after]
    rows = rng.standard_normal((n_rows, _TEXT["hidden_size"] * (1 + N_DEEPSTACK))).astype(np.float32)
    return ids, len(before) + 1, rows


def _reference_with_picture(model: torch.nn.Module, ids: list[int], rows: np.ndarray) -> np.ndarray:
    """The checkpoint's logits with `rows` as its vision tower's output (main rows, then each deepstack layer's)."""
    width = _TEXT["hidden_size"]
    parts = [torch.from_numpy(rows[:, k * width:(k + 1) * width].copy()) for k in range(1 + N_DEEPSTACK)]
    features = BaseModelOutputWithDeepstackFeatures(pooler_output=(parts[0],),
                                                     deepstack_features=[(part,) for part in parts[1:]])
    input_ids = torch.tensor([ids])
    with torch.no_grad():  # the grid in patches: twice the merged grid
        out = model(input_ids=input_ids, image_grid_thw=torch.tensor([[1, 2 * PICTURE_NY, 2 * PICTURE_NX]]),
                    mm_token_type_ids=(input_ids == model.config.image_token_id).int(),
                    mm_encoder_outputs={"image": features})
    return out.logits[0].numpy()


def _relative_error(got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    return np.abs(got - expected).max(axis=-1) / np.abs(expected).max(axis=-1)


def test_picture_logits_match_the_checkpoint(converted: tuple) -> None:
    """A prompt with a picture, cut in two calls inside the picture and in chunks of 16, then decoded a token at
    a time: every position's logits against the checkpoint's forward pass over the whole sequence."""
    arch, model, path = converted
    ids, first, rows = _picture_prompt(model)
    expected = _reference_with_picture(model, ids, rows)
    picture, cut, n_prompt = PictureRows(rows, PICTURE_NX), first + 7, len(ids) - 4
    with Engine.load(path, n_ctx=256, threads=2, kv="f32", n_batch=16) as engine:
        assert engine.picture_width == rows.shape[1]
        got = [engine.eval(ids[:cut], embeds=[(first, picture[:cut - first])], all_logits=True),
               engine.eval(ids[cut:n_prompt], embeds=[(0, picture[cut - first:])], all_logits=True)]
        got += [engine.eval([t])[None] for t in ids[n_prompt:]]
        err = _relative_error(np.concatenate(got), expected)
        assert err.max() <= TOLERANCE, f"{arch}: relative error per position, max {err.max():.2e} at {err.argmax()}"
        # The same rows placed as text tokens (no grid: one-axis positions) miss by far: the test sees the M-RoPE.
        engine.keep(0)
        flat = engine.eval(ids, embeds=[(first, rows)], all_logits=True)
        assert _relative_error(flat, expected)[first + PICTURE_NX:].min() > 100 * TOLERANCE


def test_deepstack_slices_are_added(converted: tuple) -> None:
    """Zero deepstack slices give the checkpoint's logits without deepstack features; the real ones differ."""
    arch, model, path = converted
    ids, first, rows = _picture_prompt(model, seed=4)
    bare = rows.copy()
    bare[:, _TEXT["hidden_size"]:] = 0
    expected = _reference_with_picture(model, ids, bare)
    with Engine.load(path, n_ctx=256, threads=2, kv="f32", n_batch=64) as engine:
        err = _relative_error(engine.eval(ids, embeds=[(first, PictureRows(bare, PICTURE_NX))], all_logits=True),
                              expected)
        assert err.max() <= TOLERANCE, f"{arch}: {err.max():.2e}"
        engine.keep(0)
        full = engine.eval(ids, embeds=[(first, PictureRows(rows, PICTURE_NX))], all_logits=True)
        assert _relative_error(full, expected)[first:].min() > 100 * TOLERANCE


def test_pictures_in_a_batch_and_a_copied_prefix(converted: tuple) -> None:
    """A sequence with a picture evaluated beside another is bit-identical to it alone, and a prefix copied from
    inside the picture continues it as one: the RoPE positions travel with the cache."""
    _, model, path = converted
    ids, first, rows = _picture_prompt(model, seed=5)
    picture = PictureRows(rows, PICTURE_NX)
    with Engine.load(path, n_ctx=128, threads=2, kv="f32", n_batch=64, n_seq=3) as engine:
        alone = engine.eval(ids, embeds=[(first, picture)], all_logits=True, seq=0)
        text = [int(t) for t in np.random.default_rng(6).integers(0, 151000, 30)]
        both = engine.eval_batch([BatchItem(1, text, logits="all"),
                                  BatchItem(2, ids, [(first, picture)], logits="all")])
        assert np.array_equal(both[1], alone)
        cut = first + 8  # inside the picture's second row
        engine.copy_prefix(0, 1, cut)
        rest = engine.eval(ids[cut:], embeds=[(0, picture[cut - first:])], all_logits=True, seq=1)
        assert np.array_equal(rest, alone[cut:])
        engine.keep(cut + 2, seq=0)  # truncated inside the picture, then continued
        again = engine.eval(ids[cut + 2:], embeds=[(0, picture[cut + 2 - first:])], all_logits=True, seq=0)
        assert np.array_equal(again, alone[cut + 2:])


def _answer(batcher: Batcher, *jobs: Job) -> None:
    while any(job.finish is None for job in jobs):
        batcher.step()


def test_the_batcher_cuts_a_picture_into_steps_and_reuses_it(converted: tuple) -> None:
    """Through `generation.Batcher`: a picture prompt that joins a decoding job comes in steps of 8 tokens, cut
    inside the picture; the next turn (that prompt, then more text) reuses the cached picture from its slot. Both
    answers are the ones the same prompts get alone, in one chunk on a fresh context."""
    _, model, path = converted
    ids, first, rows = _picture_prompt(model, seed=7)
    keys = [*ids[:first], *[("picture", r) for r in range(len(rows))], *ids[first + len(rows):]]
    spans = [(first, PictureRows(rows, PICTURE_NX))]
    more = [int(t) for t in np.random.default_rng(8).integers(0, 151000, 6)]
    greedy = SamplingParams(temperature=0.0)

    def turns() -> tuple[Job, Job]:
        return (Job(ids, Sampler(greedy, 151936), 5, set(), keys=keys, spans=spans),
                Job(ids + more, Sampler(greedy, 151936), 5, set(), keys=keys + more, spans=spans))

    alone = []
    for turn in turns():
        with Engine.load(path, n_ctx=128, threads=2, kv="f32", n_batch=128) as engine:
            batcher = Batcher(engine)
            batcher.add(turn)
            _answer(batcher, turn)
            alone.append(turn.tokens)
    with Engine.load(path, n_ctx=128, threads=2, kv="f32", n_batch=128, n_seq=2) as engine:
        batcher = Batcher(engine, step_tokens=8, slowdown=None)  # a budget of tokens: the cuts are known
        talker = Job([1, 2, 3], Sampler(greedy, 151936), 60, set())
        batcher.add(talker)
        batcher.step()  # decoding from now on: the picture prompt joins in steps of 7 tokens
        first_turn, second_turn = turns()
        batcher.add(first_turn)
        _answer(batcher, first_turn)
        batcher.add(second_turn)
        assert second_turn.reused == len(ids)  # the whole first prompt, picture included, from the cache
        _answer(batcher, second_turn)
        batcher.cancel(talker)
        batcher.step()
    assert [first_turn.tokens, second_turn.tokens] == alone
