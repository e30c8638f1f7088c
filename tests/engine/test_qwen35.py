"""Qwen3.5 / Qwen3.6 text models (`qwen35moe`, `qwen35`): hybrid Gated DeltaNet and gated attention layers.

- The gated delta rule alone (`strata_delta_rule`): its chunked form (prompts) and its recurrent form (decode)
  against a plain NumPy reference written from the rule, with the state carried across calls.
- Whole models: random checkpoints of transformers' own classes (`qwen35_checkpoints`), written to GGUF F32 by
  llama.cpp's converter, against the checkpoint in transformers: max |engine - reference| / std(reference) over
  prompts of 1, 17 and 300 tokens (chunk boundaries of the chunked form inside them) and over decode steps after a
  prompt, with full-attention intervals of 2 and 4 and the MoE's shared expert.
- The recurrent state: a prompt fed in calls of 1, 7, 64, 65 and 300 tokens gives the same logits (the conv state
  and the delta-rule state carried across calls); a sequence in a batch equals it alone; resuming from a saved
  state equals processing from scratch, bit for bit; a cut state is refused until loaded or cleared.
- The file: its MTP block loads; an unknown tensor or key is refused in one line naming it.

Measured here (F32, f32 KV cache): the engine against transformers ~3e-6 of the logits' std on every prompt
length and interval; the split prompts agree to ~1e-6.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from engine_helpers import abort_mid_prefill
from gguf import GGUFReader
from gguf_rewrite import rewrite
from strata.engine_cffi._engine import ffi, lib

from strata.engine_cffi import BatchItem, Engine, EngineError
from strata.gguf_file import GGUFFile

TOLERANCE = 1e-3  # max |engine - transformers| / std(transformers logits), the issue's bound
SPLITS_AGREE = 1e-4  # the same prompt in calls of other sizes: float rounding of the two forms
# (arch, full-attention interval, with an MTP block, tied embeddings); 4 layers: both kinds appear
# The fast tier converts one checkpoint (the MoE: every block the dense model has but its FFN, which is Qwen3's)
FAST = [("qwen35moe", 2, True, True)]
SLOW = [("qwen35", 4, False, True), ("qwen35moe", 4, False, False), ("qwen35", 2, True, False)]
Spec = tuple[str, int, bool, bool]
EMBEDDINGS = ("token_embd.weight", "output.weight")


# --- the rule alone


def reference_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                   state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule token by token, in float64: per v head h (reading q/k head h % n_k_heads),
    S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q. Returns the outputs and the final state."""
    n_tok, hk, _ = q.shape
    hv = v.shape[1]
    S = state.astype(np.float64).copy()
    out = np.zeros(v.shape, np.float64)
    for t in range(n_tok):
        for h in range(hv):
            kt, qt = k[t, h % hk].astype(np.float64), q[t, h % hk].astype(np.float64)
            S[h] *= np.exp(g[t, h])
            delta = beta[t, h] * (v[t, h] - S[h].T @ kt)
            S[h] += np.outer(kt, delta)
            out[t, h] = S[h].T @ qt
    return out, S


def engine_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                state: np.ndarray, chunked: bool) -> tuple[np.ndarray, np.ndarray]:
    arrays = [np.ascontiguousarray(a, dtype=np.float32) for a in (q, k, v, g, beta)]
    state = np.array(state, dtype=np.float32)
    out = np.zeros(v.shape, np.float32)
    n_tok, hk, dim = q.shape
    status = lib.strata_delta_rule(*(ffi.from_buffer("float[]", a) for a in arrays), n_tok, hk, v.shape[1], dim,
                                   int(chunked), ffi.from_buffer("float[]", state), ffi.from_buffer("float[]", out))
    assert status == lib.STRATA_OK, ffi.string(lib.strata_last_error()).decode()
    return out, state


def rule_inputs(rng: np.random.Generator, n_tok: int, hk: int = 2, hv: int = 4, dim: int = 16) -> list[np.ndarray]:
    """q, k L2-normed (q also by 1/sqrt(dim)), as the layer hands them over; decays and strengths of the range
    the models give (g = -a softplus(.), beta = sigmoid(.))."""
    q, k = rng.standard_normal((2, n_tok, hk, dim))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) / np.sqrt(dim)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((n_tok, hv, dim))
    g = -rng.uniform(0.001, 2.0, (n_tok, hv))
    beta = rng.uniform(0.0, 1.0, (n_tok, hv))
    return [q, k, v, g, beta]


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("lengths", [[1], [5, 1, 1], [63], [64, 1], [65, 130], [200]])
def test_the_rule_matches_its_reference(chunked: bool, lengths: list[int]) -> None:
    rng = np.random.default_rng(sum(lengths))
    state = 0.1 * rng.standard_normal((4, 16, 16))  # a state left by earlier tokens
    ref_state, ours = state.copy(), state.astype(np.float32)
    for n in lengths:  # calls after calls: the state carries on
        inputs = rule_inputs(rng, n)
        want, ref_state = reference_rule(*inputs, state=ref_state)
        got, ours = engine_rule(*inputs, state=ours, chunked=chunked)
        assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())
    assert np.abs(ours - ref_state).max() <= 1e-5 * max(1.0, np.abs(ref_state).max())


def test_the_chunked_form_equals_the_recurrent_form() -> None:
    rng = np.random.default_rng(7)
    inputs = rule_inputs(rng, 150)
    state = np.zeros((4, 16, 16))
    chunked, s_chunked = engine_rule(*inputs, state=state, chunked=True)
    recurrent, s_recurrent = engine_rule(*inputs, state=state, chunked=False)
    np.testing.assert_allclose(chunked, recurrent, rtol=0, atol=1e-5)
    np.testing.assert_allclose(s_chunked, s_recurrent, rtol=0, atol=1e-5)


# --- whole models against transformers


def _name(spec: Spec) -> str:
    arch, interval, mtp, tied = spec
    return f"{arch}-every{interval}{'-mtp' if mtp else ''}{'-tied' if tied else ''}"


@pytest.fixture(scope="module")
def files(qwen35_files: Callable[[Spec], tuple[torch.nn.Module, pathlib.Path]]
          ) -> Callable[[Spec], tuple[torch.nn.Module, pathlib.Path]]:
    """The checkpoint of a spec and its converted file, made once for the session (the MTP block's tests read
    the fast tier's too)."""
    return qwen35_files


@pytest.fixture(scope="module")
def moe_file(files: Callable[[Spec], tuple[torch.nn.Module, pathlib.Path]]) -> pathlib.Path:
    """The MoE file of FAST, for the tests of the state."""
    return files(FAST[0])[1]


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 151000, n)]


def _reference(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def _distance(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / want.std())


def _check_against_transformers(model: torch.nn.Module, path: pathlib.Path) -> None:
    with Engine.load(path, n_ctx=512, threads=2, kv="f32", n_batch=512) as engine:
        assert engine.recurrent and engine.state_bytes > 0
        for n in (1, 17, 300):
            tokens = _tokens(n, n)
            engine.keep(0)
            got = engine.eval(tokens, all_logits=True)
            assert _distance(got, _reference(model, tokens)) <= TOLERANCE, f"prompt of {n}"
        # decode: a prompt by the chunked form, then steps by the recurrent form
        tokens = _tokens(45, 3)
        engine.keep(0)
        rows = [engine.eval(tokens[:40], all_logits=True)] + [engine.eval([t])[None] for t in tokens[40:]]
        assert _distance(np.concatenate(rows), _reference(model, tokens)) <= TOLERANCE


@pytest.mark.parametrize("spec", FAST, ids=_name)
def test_logits_match_transformers(files: Callable[[Spec], tuple[torch.nn.Module, pathlib.Path]], spec: Spec
                                   ) -> None:
    model, path = files(spec)
    with GGUFFile(path) as file:
        assert file.metadata["general.architecture"] == spec[0]
    _check_against_transformers(model, path)


@pytest.mark.slow
@pytest.mark.parametrize("spec", SLOW, ids=_name)
def test_logits_match_transformers_other_patterns(files: Callable[[Spec], tuple[torch.nn.Module, pathlib.Path]],
                                                  spec: Spec) -> None:
    _check_against_transformers(*files(spec))


def test_the_mtp_block_is_loaded_and_kept(moe_file: pathlib.Path, moe_reader: GGUFReader, tmp_path: pathlib.Path
                                         ) -> None:
    with GGUFFile(moe_file) as file:
        blocks, nextn = file.metadata["qwen35moe.block_count"], file.metadata["qwen35moe.nextn_predict_layers"]
        names = {t.name for t in file.tensors}
    assert nextn == 1 and f"blk.{blocks - 1}.nextn.eh_proj.weight" in names
    broken = _small_copy(moe_reader, tmp_path / "bad-mtp.gguf", drop=f"blk.{blocks - 1}.nextn.eh_proj.weight")
    with pytest.raises(EngineError, match=f"^missing tensor blk.{blocks - 1}.nextn.eh_proj$"):
        Engine.load(broken, n_ctx=64)  # the block is read, not skipped


@pytest.mark.slow
def test_a_file_without_mtp_blocks_loads(files: Callable[[Spec], tuple[torch.nn.Module, pathlib.Path]]) -> None:
    without = files(SLOW[0])[1]  # the dense checkpoint, converted without its MTP block
    with GGUFFile(without) as file:
        assert "qwen35.nextn_predict_layers" not in file.metadata
        assert not any("nextn" in t.name for t in file.tensors)
    with Engine.load(without, n_ctx=64) as engine:
        assert engine.arch == "qwen35" and engine.recurrent


# --- the recurrent state


def test_a_prompt_split_into_calls_gives_the_same_logits(moe_file: pathlib.Path) -> None:
    tokens = _tokens(300, 11)
    with Engine.load(moe_file, n_ctx=512, threads=2, kv="f32", n_batch=512) as engine:
        whole = engine.eval(tokens, all_logits=True)
        for size in (1, 7, 64, 65):
            engine.keep(0)
            rows = [engine.eval(tokens[i:i + size], all_logits=True) for i in range(0, len(tokens), size)]
            assert _distance(np.concatenate(rows), whole) <= SPLITS_AGREE, f"calls of {size}"


def test_a_sequence_in_a_batch_equals_it_alone(moe_file: pathlib.Path) -> None:
    prompts = [_tokens(70, 1), _tokens(9, 2), _tokens(130, 3)]
    with Engine.load(moe_file, n_ctx=256, threads=2, kv="f32", n_seq=3, n_batch=256) as engine:
        alone = []
        for prompt in prompts:
            engine.keep(0)
            alone.append(engine.eval(prompt, all_logits=True))
            alone.append(engine.eval([5])[None])
        engine.keep(0)
        together = engine.eval_batch([BatchItem(s, p, logits="all") for s, p in enumerate(prompts)])
        steps = engine.eval_batch([BatchItem(s, [5]) for s in range(3)])
    for s in range(3):
        np.testing.assert_array_equal(together[s], alone[2 * s])
        np.testing.assert_array_equal(steps[s], alone[2 * s + 1])


def test_a_decode_step_beside_a_prompt_equals_both_alone(moe_file: pathlib.Path) -> None:
    """The batcher's usual step: one sequence's decode token (the recurrent form) and another's prompt chunk (the
    chunked form) in one call."""
    first, second, more = _tokens(30, 1), _tokens(10, 2), _tokens(80, 3)
    with Engine.load(moe_file, n_ctx=256, threads=2, kv="f32", n_seq=2, n_batch=256) as engine:
        engine.eval(first, seq=0)
        engine.eval(second, seq=1)
        mixed = engine.eval_batch([BatchItem(0, [5], logits="all"), BatchItem(1, more, logits="all")])
        engine.keep(0, seq=0)
        engine.keep(0, seq=1)
        engine.eval(first, seq=0)
        alone = [engine.eval([5], seq=0)[None]]
        engine.eval(second, seq=1)
        alone.append(engine.eval(more, seq=1, all_logits=True))
    for got, want in zip(mixed, alone, strict=True):
        np.testing.assert_array_equal(got, want)


def test_resuming_from_a_saved_state_equals_processing_from_scratch(moe_file: pathlib.Path) -> None:
    head, tail = _tokens(90, 4), _tokens(20, 5)
    with Engine.load(moe_file, n_ctx=256, threads=2, kv="f32", n_seq=2) as engine:
        engine.eval(head, seq=0)
        saved = engine.save_state(0)
        assert len(saved) == engine.state_bytes
        scratch = engine.eval(tail, seq=0, all_logits=True)
        # sequence 1: the KV rows of the head, copied from a longer sequence (its state is then invalid), and
        # the state saved at the head's end
        engine.copy_prefix(0, 1, len(head))
        with pytest.raises(EngineError, match="recurrent state was cut back"):
            engine.eval(tail, seq=1)
        engine.load_state(1, saved)
        resumed = engine.eval(tail, seq=1, all_logits=True)
        np.testing.assert_array_equal(resumed, scratch)
        # the state at the end of both is the same too
        assert engine.save_state(1) == engine.save_state(0)


def test_a_whole_copy_takes_the_state_with_it(moe_file: pathlib.Path) -> None:
    head, tail = _tokens(50, 6), _tokens(3, 7)
    with Engine.load(moe_file, n_ctx=128, threads=2, kv="f32", n_seq=2) as engine:
        engine.eval(head, seq=0)
        engine.copy_prefix(0, 1, len(head))
        np.testing.assert_array_equal(engine.eval(tail, seq=1), engine.eval(tail, seq=0))


def test_an_aborted_sequence_keeps_its_rows_and_resumes_from_a_snapshot(moe_file: pathlib.Path) -> None:
    """Its state took in part of a chunk that its cache did not: the engine keeps the finished chunks' KV rows
    and refuses the state until a snapshot is loaded (or the sequence cleared), which then resumes it exactly."""
    prompt = _tokens(300, 9)
    with Engine.load(moe_file, n_ctx=512, threads=2, kv="f32", n_batch=8, n_seq=2) as engine:
        engine.eval(prompt[:8], seq=1)
        snapshot = engine.save_state(1)  # the same prompt's state after its first chunk, on another sequence
        scratch = engine.eval(prompt[8:20], seq=1, all_logits=True)
        abort_mid_prefill(engine, prompt)
        assert engine.n_past >= 8
        with pytest.raises(EngineError, match="recurrent state"):
            engine.eval(prompt[engine.n_past:engine.n_past + 1])
        engine.keep(8)
        engine.load_state(0, snapshot)
        np.testing.assert_array_equal(engine.eval(prompt[8:20], all_logits=True), scratch)


def test_a_checkpoint_restores_the_state_before_a_step(moe_file: pathlib.Path) -> None:
    """A speculative step's rollback: a checkpoint before a step of several tokens (a decode token and its draft,
    beside another sequence's step, in chunks of 4), a keep back and a restore give the state saved there bit for
    bit, and the same logits after; twice in a row (the state and its spare changed places the first time)."""
    head, step, other = _tokens(40, 10), _tokens(6, 11), _tokens(30, 12)
    with Engine.load(moe_file, n_ctx=128, threads=2, kv="f32", n_batch=4, n_seq=2) as engine:
        engine.eval(other, seq=1)
        engine.eval(head, seq=0)
        saved, other_saved = engine.save_state(0), engine.save_state(1)
        want = engine.eval(step[:2], seq=0, all_logits=True)
        engine.keep(len(head), seq=0)
        engine.load_state(0, saved)
        for _ in range(2):
            engine.checkpoint_state(0)
            engine.eval_batch([BatchItem(0, step, None, "all"), BatchItem(1, step[:1], None, "last")])
            engine.keep(len(head), seq=0)  # the draft refused
            engine.restore_state(0)
            assert engine.save_state(0) == saved
        np.testing.assert_array_equal(engine.eval(step[:2], seq=0, all_logits=True), want)
        engine.keep(len(other), seq=1)  # the other sequence took no checkpoint: its state was not kept
        with pytest.raises(EngineError, match="no checkpoint of its state there"):
            engine.restore_state(1)
        engine.load_state(1, other_saved)


def test_a_checkpoint_is_refused_where_it_does_not_hold(moe_file: pathlib.Path) -> None:
    tokens = _tokens(20, 13)
    with Engine.load(moe_file, n_ctx=128, threads=2, kv="f32", n_seq=2) as engine:
        engine.eval(tokens[:10])
        engine.checkpoint_state(0)
        with pytest.raises(EngineError, match="sequence 0 holds 10 positions: no checkpoint"):
            engine.restore_state(0)  # not taken: no eval since
        engine.eval(tokens[10:12])
        with pytest.raises(EngineError, match="holds 12 positions: no checkpoint of its state there"):
            engine.restore_state(0)  # not back at its position
        saved = engine.save_state(0)
        for end in (lambda: engine.load_state(0, saved),  # each ends it
                    lambda: engine.copy_prefix(1, 0, 0),
                    lambda: engine.keep(0)):
            engine.keep(0)
            engine.eval(tokens[:10])
            engine.checkpoint_state(0)
            engine.eval(tokens[10:12])
            engine.keep(12)
            end()
            engine.keep(min(engine.n_past, 10))
            with pytest.raises(EngineError, match="no checkpoint of its state there"):
                engine.restore_state(0)
        engine.eval(tokens[:10])
        engine.keep(5)
        with pytest.raises(EngineError, match="cut back; no checkpoint"):
            engine.checkpoint_state(0)


def test_a_cut_state_is_refused_until_loaded_or_cleared(moe_file: pathlib.Path) -> None:
    tokens = _tokens(40, 8)
    with Engine.load(moe_file, n_ctx=128, threads=2, kv="f32") as engine:
        first = engine.eval(tokens)
        engine.keep(30)
        with pytest.raises(EngineError, match="sequence 0's recurrent state was cut back"):
            engine.eval(tokens[30:])
        with pytest.raises(EngineError, match="recurrent state was cut back; nothing to save"):
            engine.save_state(0)
        with pytest.raises(EngineError, match="a state of 3 bytes"):
            engine.load_state(0, b"abc")
        engine.keep(30)  # keeping what it holds changes nothing
        engine.keep(0)
        np.testing.assert_array_equal(engine.eval(tokens), first)


def test_the_kv_budget_counts_each_slots_recurrent_state(moe_file: pathlib.Path) -> None:
    with Engine.load(moe_file, n_ctx=64, n_seq=2) as engine:
        need = engine.kv_bytes + 2 * engine.state_bytes  # the attention layers' rows, and a state per slot
        assert engine.kv_bytes == 2 * 2 * 64 * 2 * 2 * 32 * 2  # K and V, 2 attention layers of 2 heads of 32, f16
    Engine.load(moe_file, n_ctx=64, n_seq=2, kv_budget=need).close()  # the budget's arithmetic is the engine's
    with pytest.raises(EngineError, match=r"with 0.0 MiB of recurrent state per slot needs 0.1 MiB, over the KV"):
        Engine.load(moe_file, n_ctx=64, n_seq=2, kv_budget=need - 1)


# --- the file


def _small_copy(reader: GGUFReader, out: pathlib.Path, **change: Any) -> pathlib.Path:
    """A copy of a parsed file with `change` (`gguf_rewrite.rewrite`'s), without its tokenizer and with the first
    512 rows of the embeddings (and of the output weight) only: quick to write, and the engine reads no more."""
    rows = {t.name: np.asarray(t.data)[:512] for t in reader.tensors if t.name in EMBEDDINGS}
    return rewrite(reader, out, replace=rows, drop_keys="tokenizer.", **change)


@pytest.fixture(scope="module")
def moe_reader(moe_file: pathlib.Path) -> GGUFReader:
    return GGUFReader(moe_file)


def test_an_unknown_tensor_is_refused(moe_reader: GGUFReader, tmp_path: pathlib.Path) -> None:
    path = _small_copy(moe_reader, tmp_path / "bias.gguf", add={"blk.0.attn_qkv.bias": np.zeros(128, np.float32)})
    with pytest.raises(EngineError, match=r"^tensor blk.0.attn_qkv.bias is not part of qwen35moe as this engine "
                                          r"runs it \(refused: it would change the model's output unseen\)$"):
        Engine.load(path, n_ctx=64)


def test_an_unknown_key_is_refused(moe_reader: GGUFReader, tmp_path: pathlib.Path) -> None:
    path = _small_copy(moe_reader, tmp_path / "key.gguf", keys={"qwen35moe.attention.sliding_window": "128"})
    with pytest.raises(EngineError, match=r"^unknown key qwen35moe.attention.sliding_window in a qwen35moe file"):
        Engine.load(path, n_ctx=64)
