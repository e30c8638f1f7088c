"""The MTP block of a Qwen3.5 file as a draft source (`Engine.mtp_draft`, `strata_mtp_draft`).

- Numerics: the engine's drafts' logits against a reference in torch built independently of the engine: the
  trunk's final hidden states from transformers' checkpoint, then [enorm(embedding), hnorm(hidden)] through the
  block's projection, then transformers' own Qwen3.5 decoder layer (gated attention and the MoE) with the block's
  weights, its norm and the model's head; chained on the block's own hidden state and draft. A prompt fed in two
  calls and chunks, then a decode step: the block's KV rows of every earlier position are the eval's.
- A sequence's drafts are the same beside another sequence, after a rejected draft was rolled back (its hidden
  states and the block's rows past the history are scratch), and in a copy of its prefix.
- The block's rows are filled lazily: evals without drafts run it not at all until the held history would lose a
  pair (then once for all of them), a draft fills what waits in one pass, and its drafts are bit for bit those
  of a block filled after every eval; an eval with embedding rows fills at once; imported rows draft.
- With a window (`mtp_window`): evals fill nothing, a draft fills the last N waiting pairs and attends over its
  rows from there (against the reference over the same pairs), the history then grows while it drafts, and
  follows a rollback, a copied prefix and an import.
- An abort raised meanwhile is left for the next eval; a context without the block refuses drafts.

Measured here (F32, f32 KV cache): ~1e-6 of the logits' std, as the trunk.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import numpy as np
import pytest
import torch
from qwen35_checkpoints import mtp_tensors
from strata.engine_cffi._engine import lib

from strata.engine_cffi import BatchItem, Engine, EngineAborted, EngineError

TOLERANCE = 1e-3  # max |engine - reference| / std(reference logits), as the trunk's tests
N_DRAFT = 3


@pytest.fixture(scope="module")
def model_and_file(qwen35_files: Callable[[tuple[str, int, bool, bool]], tuple[torch.nn.Module, pathlib.Path]]
                   ) -> tuple[torch.nn.Module, pathlib.Path]:
    """The fast tier's Qwen3.5 MoE checkpoint (tests/engine/test_qwen35.py), with its MTP block."""
    return qwen35_files(("qwen35moe", 2, True, True))


class Reference:
    """The MTP block in torch: transformers' decoder layer class (one full-attention layer) with the block's
    weights, and the projection and norms around it written out here."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        weights = mtp_tensors(model)
        config = model.config.__class__(**{**model.config.to_dict(), "num_hidden_layers": 1,
                                           "layer_types": ["full_attention"]})
        config._attn_implementation = "eager"
        self.block = model.__class__(config).float().eval()
        state = {f"model.layers.0.{name.removeprefix('mtp.layers.0.')}": w for name, w in weights.items()
                 if name.startswith("mtp.layers.0.")}
        state["model.norm.weight"] = weights["mtp.norm.weight"]
        missing = self.block.load_state_dict(state, strict=False).missing_keys
        assert set(missing) <= {"model.embed_tokens.weight", "lm_head.weight"}
        norm = type(model.model.norm)
        self.enorm, self.hnorm = norm(config.hidden_size, config.rms_norm_eps), norm(config.hidden_size,
                                                                                      config.rms_norm_eps)
        with torch.no_grad():
            self.enorm.weight.copy_(weights["mtp.pre_fc_norm_embedding.weight"])
            self.hnorm.weight.copy_(weights["mtp.pre_fc_norm_hidden.weight"])
        self.fc = weights["mtp.fc.weight"]

    @torch.no_grad()
    def drafts(self, tokens: list[int], token: int, chain: list[int], start: int = 0) -> np.ndarray:
        """The logits of each draft after `tokens` then `token`, chained on `chain` (the drafts taken), the block
        attending over the pairs of positions `start` on."""
        hidden = list(self.model.model(torch.tensor([tokens])).last_hidden_state[0])  # after the output norm
        followers = tokens[1:] + [token]
        out = []
        for draft in [None, *chain]:
            if draft is not None:
                followers.append(draft)
            embed = self.model.model.embed_tokens(torch.tensor(followers))
            pairs = torch.cat([self.enorm(embed), self.hnorm(torch.stack(hidden))], dim=-1) @ self.fc.T
            positions = torch.arange(start, len(followers))[None]
            g = self.block.model(inputs_embeds=pairs[None, start:],  # its norm: shared_head_norm
                                 position_ids=positions).last_hidden_state[0, -1]
            hidden.append(g)
            out.append(self.model.lm_head(g).numpy())
        return np.stack(out)


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 151000, n)]


def _distance(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / want.std())


def test_drafts_match_the_reference(model_and_file: tuple[torch.nn.Module, pathlib.Path]) -> None:
    model, path = model_and_file
    prompt, (decoded, token) = _tokens(40, 1), _tokens(2, 2)
    with Engine.load(path, n_ctx=256, threads=2, kv="f32", n_batch=16, mtp=True) as engine:
        assert engine.has_mtp and engine.mtp
        engine.eval(prompt[:25])  # two calls, chunks of 16: held hidden states between them
        engine.eval(prompt[25:])
        engine.eval([decoded])
        drafts, logits = engine.mtp_draft([0], [41], [token], N_DRAFT, logits=True)
    assert logits is not None and (drafts[0] == logits[0].argmax(-1)).all()
    want = Reference(model).drafts(prompt + [decoded], token, [int(t) for t in drafts[0][:-1]])
    assert _distance(logits[0], want) <= TOLERANCE


def test_drafts_beside_another_sequence_and_after_a_rollback(model_and_file: tuple[torch.nn.Module, pathlib.Path]
                                                              ) -> None:
    path = model_and_file[1]
    prompt, other, (x, token), wrong = _tokens(30, 3), _tokens(20, 4), _tokens(2, 5), _tokens(3, 6)
    with Engine.load(path, n_ctx=128, threads=2, kv="f32", n_batch=64, n_seq=3, mtp=True) as engine:
        engine.eval(prompt + [x], seq=0)
        alone = engine.mtp_draft([0], [31], [token], N_DRAFT, logits=True)
        # beside another sequence's prompt, and after a draft that was verified and rejected
        engine.eval_batch([BatchItem(1, prompt, None, "last"), BatchItem(2, other, None, "last")])
        engine.eval_batch([BatchItem(1, [x, *wrong], None, "all"), BatchItem(2, [token], None, "last")])
        engine.keep(31, seq=1)
        both = engine.mtp_draft([2, 1], [21, 31], [x, token], N_DRAFT, logits=True)
    assert alone[1] is not None and both[1] is not None
    assert (both[0][1] == alone[0][0]).all()
    assert _distance(both[1][1], alone[1][0]) <= TOLERANCE


def test_a_copied_prefix_drafts_as_its_source(model_and_file: tuple[torch.nn.Module, pathlib.Path]) -> None:
    with Engine.load(model_and_file[1], n_ctx=64, threads=2, kv="f32", n_seq=2, mtp=True) as engine:
        engine.eval(_tokens(20, 9))
        engine.copy_prefix(0, 1, 20)  # the block's rows and the held hidden states go along
        drafts, logits = engine.mtp_draft([0, 1], [20, 20], [5, 5], N_DRAFT, logits=True)
    assert logits is not None and (drafts[0] == drafts[1]).all() and (logits[0] == logits[1]).all()


def _decode_then_draft(path: pathlib.Path, steps: list[int], draft_every_step: bool
                       ) -> tuple[list[tuple[int, int]], np.ndarray]:
    """The block's fill counts after a 30-token prompt and after each one-token eval of `steps` (with a draft
    after every eval, or none), then the logits of 3 drafts at the end."""
    with Engine.load(path, n_ctx=512, threads=2, kv="f32", n_batch=64, mtp=True) as engine:
        engine.eval(_tokens(30, 10))
        counts = [engine.mtp_fills()]
        for i, token in enumerate(steps):
            engine.eval([token])
            if draft_every_step:
                engine.mtp_draft([0], [31 + i], [5], 1)
            counts.append(engine.mtp_fills())
        logits = engine.mtp_draft([0], [30 + len(steps)], [7], N_DRAFT, logits=True)[1]
        counts.append(engine.mtp_fills())
    assert logits is not None
    return counts, logits


def test_evals_without_drafts_leave_the_fill_to_the_next_draft(model_and_file: tuple[torch.nn.Module, pathlib.Path]
                                                               ) -> None:
    steps = _tokens(40, 11)
    lazy, lazy_logits = _decode_then_draft(model_and_file[1], steps, draft_every_step=False)
    eager, eager_logits = _decode_then_draft(model_and_file[1], steps, draft_every_step=True)
    assert lazy[:-1] == [(0, 0)] * 41  # no block run in any eval
    assert lazy[-1] == (2, 69)  # the prompt's 29 pairs and the steps' 40 in one fill, 64 rows a pass
    assert eager[1] == (1, 30) and eager[-1] == (40, 69)  # one pass a draft: the pairs its step completed
    assert (lazy_logits == eager_logits).all()


def test_pairs_the_held_history_would_lose_are_filled_at_the_eval(
        model_and_file: tuple[torch.nn.Module, pathlib.Path]) -> None:
    history = lib.STRATA_MTP_HISTORY
    steps = _tokens(history + 20, 12)
    lazy, lazy_logits = _decode_then_draft(model_and_file[1], steps, draft_every_step=False)
    eager, eager_logits = _decode_then_draft(model_and_file[1], steps, draft_every_step=True)
    # the eval at position `history` would push the pair of position 0 out: it fills all `history` pairs there
    runs = [i for i in range(1, len(lazy) - 1) if lazy[i] != lazy[i - 1]]
    assert runs == [history - 29] and lazy[runs[0]][1] == history
    assert lazy[-1][1] == eager[-1][1] == 29 + len(steps)
    assert (lazy_logits == eager_logits).all()


def test_an_eval_with_embedding_rows_fills_at_once(model_and_file: tuple[torch.nn.Module, pathlib.Path]) -> None:
    with Engine.load(model_and_file[1], n_ctx=64, threads=2, kv="f32", mtp=True) as engine:
        rows = np.random.default_rng(13).standard_normal((4, engine.picture_width)).astype(np.float32)
        engine.eval(_tokens(12, 13), embeds=[(3, rows)])  # the held history keeps no embedding rows
        assert engine.mtp_fills() == (1, 11)
        drafts, _ = engine.mtp_draft([0], [12], [5], N_DRAFT)
        assert engine.mtp_fills() == (1, 11) and (drafts >= 0).all()


def test_imported_rows_draft(model_and_file: tuple[torch.nn.Module, pathlib.Path]) -> None:
    with Engine.load(model_and_file[1], n_ctx=64, threads=2, kv="f32", n_seq=2, mtp=True) as engine:
        engine.eval(_tokens(20, 14))
        rows, state = engine.export_kv(0, 0, 20), engine.save_state(0)
        engine.import_kv(1, 0, rows)  # without hidden states: the block's rows there stay as they were
        engine.load_state(1, state)
        engine.eval([5], seq=1)
        drafts, _ = engine.mtp_draft([1], [21], [6], N_DRAFT)
        assert (drafts >= 0).all() and engine.mtp_fills() == (1, 1)  # the pair of position 19 alone


def test_an_abort_meanwhile_is_left_for_the_next_eval(model_and_file: tuple[torch.nn.Module, pathlib.Path]) -> None:
    with Engine.load(model_and_file[1], n_ctx=64, threads=2, kv="f32", mtp=True) as engine:
        engine.eval(_tokens(10, 7))
        engine.abort()
        drafts, _ = engine.mtp_draft([0], [10], [5], N_DRAFT)
        assert (drafts >= 0).all()
        with pytest.raises(EngineAborted):
            engine.eval([5])


def test_drafts_need_the_block_and_its_hidden_state(model_and_file: tuple[torch.nn.Module, pathlib.Path]) -> None:
    path = model_and_file[1]
    with Engine.load(path, n_ctx=64, threads=2) as engine:
        assert engine.has_mtp and not engine.mtp
        with pytest.raises(EngineError, match="runs no MTP block"):
            engine.mtp_draft([0], [1], [5], 2)
    with Engine.load(path, n_ctx=64, threads=2, mtp=True) as engine:
        drafts, _ = engine.mtp_draft([0], [3], [5], 2)  # nothing evaluated: no hidden state held
        assert (drafts == -1).all()
        engine.eval(_tokens(3, 8))
        with pytest.raises(EngineError, match="exceed the context"):
            engine.mtp_draft([0], [3], [5], 63)


WINDOW = 8


def test_a_window_drafts_from_the_last_pairs_and_its_history_grows(
        model_and_file: tuple[torch.nn.Module, pathlib.Path]) -> None:
    model, path = model_and_file
    prompt, steps = _tokens(lib.STRATA_MTP_HISTORY + 20, 15), _tokens(3, 16)
    reference = Reference(model)
    with Engine.load(path, n_ctx=512, threads=2, kv="f32", n_batch=64, mtp=True, mtp_window=WINDOW) as engine:
        engine.eval(prompt)  # longer than the held history: its pairs lapse, unfilled
        assert engine.mtp_fills() == (0, 0)
        n = len(prompt)
        drafts, logits = engine.mtp_draft([0], [n], [steps[0]], N_DRAFT, logits=True)
        assert engine.mtp_fills() == (1, WINDOW)  # the pairs of n - 1 - WINDOW .. n - 2
        start = n - 1 - WINDOW
        want = reference.drafts(prompt, steps[0], [int(t) for t in drafts[0][:-1]], start)
        assert logits is not None and _distance(logits[0], want) <= TOLERANCE
        engine.eval(steps[:2])  # drafting on: each draft fills what its evals completed, from the same start
        drafts, logits = engine.mtp_draft([0], [n + 2], [steps[2]], N_DRAFT, logits=True)
        assert engine.mtp_fills() == (2, WINDOW + 2)
        want = reference.drafts(prompt + steps[:2], steps[2], [int(t) for t in drafts[0][:-1]], start)
        assert logits is not None and _distance(logits[0], want) <= TOLERANCE


def test_a_window_wider_than_the_history_drafts_as_the_whole_history(
        model_and_file: tuple[torch.nn.Module, pathlib.Path]) -> None:
    out = []
    for window in (0, 64):
        with Engine.load(model_and_file[1], n_ctx=128, threads=2, kv="f32", mtp=True, mtp_window=window) as engine:
            engine.eval(_tokens(30, 17))
            out.append((engine.mtp_draft([0], [30], [5], N_DRAFT, logits=True), engine.mtp_fills()))
    (whole, whole_fills), (windowed, windowed_fills) = out
    assert whole_fills == windowed_fills == (1, 29)
    assert (whole[0] == windowed[0]).all() and (whole[1] == windowed[1]).all()


def _window_logits(engine: Engine, seq: int, history: list[int], token: int, start: int,
                   reference: Reference) -> float:
    """The distance of the sequence's drafts after `history` and `token` from the reference over the pairs from
    `start` on."""
    drafts, logits = engine.mtp_draft([seq], [len(history)], [token], N_DRAFT, logits=True)
    assert logits is not None
    return _distance(logits[0], reference.drafts(history, token, [int(t) for t in drafts[0][:-1]], start))


def test_a_windows_history_follows_a_copy_a_rollback_and_an_import(
        model_and_file: tuple[torch.nn.Module, pathlib.Path]) -> None:
    model, path = model_and_file
    reference = Reference(model)
    prompt, more = _tokens(40, 18), _tokens(4, 19)
    start = 40 - 1 - WINDOW
    with Engine.load(path, n_ctx=128, threads=2, kv="f32", n_seq=3, mtp=True, mtp_window=WINDOW) as engine:
        engine.eval(prompt)
        assert _window_logits(engine, 0, prompt, more[0], start, reference) <= TOLERANCE
        engine.copy_prefix(0, 1, 40)  # the copy's history starts where its source's does
        assert _window_logits(engine, 1, prompt, more[1], start, reference) <= TOLERANCE
        # cut back before the history's start: it starts again at the last WINDOW pairs of what is kept
        engine.keep(25)
        assert _window_logits(engine, 0, prompt[:25], more[2], 25 - 1 - WINDOW, reference) <= TOLERANCE
        rows, state = engine.export_kv(1, 0, 40), engine.save_state(1)
        engine.import_kv(2, 0, rows)  # imported rows are not the window's history: it starts after them
        engine.load_state(2, state)
        engine.eval(more[:2], seq=2)
        fills = engine.mtp_fills()
        assert _window_logits(engine, 2, prompt + more[:2], more[2], 40, reference) <= TOLERANCE
        assert engine.mtp_fills()[1] - fills[1] == 1  # the pair of 40: the first whose hidden state seq 2 computed


def test_a_window_wider_than_the_held_history_is_refused(model_and_file: tuple[torch.nn.Module, pathlib.Path]
                                                         ) -> None:
    with pytest.raises(EngineError, match="mtp_window"):
        Engine.load(model_and_file[1], n_ctx=64, threads=2, mtp=True, mtp_window=lib.STRATA_MTP_HISTORY + 1)
