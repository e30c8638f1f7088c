"""The decode check (engine_cffi/decode_check.py) on the host device: every row of its table, and the bytes it
counts for a step against the model file's tensors as the gguf package reads them. No figure is timed here."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from strata.engine_cffi import decode_check
from strata.modelgen.hparams import hparams_for

PLAN = decode_check.QUICK


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> decode_check.Report:
    return decode_check.run("host", PLAN, tmp_path_factory.mktemp("decode-check"))


def test_the_table_has_every_layout_at_one_and_four_sequences(report: decode_check.Report) -> None:
    lines = decode_check.format_table(report).splitlines()
    assert lines[2].startswith("| model | layout | seqs | tok/s |")
    want = [[f"| {m.arch}", layout, n] for m in PLAN.models for layout, _ in decode_check.LAYOUTS for n in ("1", "4")]
    assert [line.split(" | ")[:3] for line in lines[4:4 + len(want)]] == want
    assert [line.split(":")[0] for line in lines[4 + len(want):]] == [f"{m.arch}, 1 / 4 sequences" for m in PLAN.models]
    assert all(r.tok_s > 0 for r in report.rows) and report.bandwidth > 0
    by_layout = {(r.model, r.layout, r.n_seq): r for r in report.rows}
    (cpu, _), (resident, _), (capped, _), (none, _) = decode_check.LAYOUTS
    for arch, n_seq in ((m.arch, n) for m in PLAN.models for n in (1, 4)):
        assert by_layout[arch, cpu, n_seq].hit_rate is None and by_layout[arch, cpu, n_seq].vs_cpu == 1.0
        assert by_layout[arch, resident, n_seq].hit_rate == 1.0 and by_layout[arch, none, n_seq].hit_rate == 0.0
        assert 0.0 < (by_layout[arch, capped, n_seq].hit_rate or 0.0) < 1.0
        with_bound = [r.layout for r in report.rows if (r.model, r.n_seq) == (arch, n_seq) and r.of_bound is not None]
        assert with_bound == [resident]


@pytest.mark.parametrize("index", range(len(PLAN.models)))
def test_a_steps_bytes_are_the_files_tensors(report: decode_check.Report, index: int) -> None:
    """Every weight of the layers a step runs but the embeddings and the routed experts, k experts a layer for one
    sequence (between k and 4 k for four), the f16 K and V rows each token attends to in the attention layers, and
    a hybrid's recurrent state read and written."""
    model = PLAN.models[index]
    hp = hparams_for(model.arch, model.size, **model.overrides)
    tensors = GGUFReader(report.paths[index]).tensors
    mtp = tuple(f"blk.{hp.n_layer + i}." for i in range(hp.n_nextn))
    weights = {t.name: int(t.n_bytes) for t in tensors if not t.name.startswith(mtp)}
    dense = sum(n for name, n in weights.items() if "_exps" not in name and name != "token_embd.weight")
    expert = sum(n for name, n in weights.items() if "_exps" in name) // (hp.n_layer * hp.n_expert)
    kv_row = 2 * hp.n_head_kv * hp.head_dim * 2 * (hp.n_layer - sum(hp.recurrent_layers()))  # K and V, f16
    conv = 2 * hp.ssm_group_count * hp.ssm_state_size + hp.ssm_inner_size
    state = 4 * sum(hp.recurrent_layers()) * ((hp.ssm_conv_kernel - 1) * conv
                                              + hp.ssm_time_step_rank * hp.ssm_state_size ** 2)

    def other(positions: list[int]) -> int:
        return sum(p + 1 for p in positions) * kv_row + 2 * state * len(positions)

    first = PLAN.prompt + PLAN.warmup
    want = dense + hp.n_layer * hp.n_expert_used * expert + np.mean([other([first + i]) for i in range(PLAN.steps)])
    resident = decode_check.LAYOUTS[1][0]
    rows = {r.n_seq: r for r in report.rows if (r.model, r.layout) == (model.arch, resident)}
    assert rows[1].step_bytes == pytest.approx(want, rel=1e-12)
    later = first + PLAN.steps + PLAN.warmup  # sequence 0 goes on; the others start after their prompts
    four = np.mean([other([later + i] + [first + i] * 3) for i in range(PLAN.steps)])
    fewest = dense + hp.n_layer * hp.n_expert_used * expert + four
    most = dense + hp.n_layer * min(4 * hp.n_expert_used, hp.n_expert) * expert + four
    assert fewest <= (rows[4].step_bytes or 0) <= most
    assert rows[4].bound_tok_s == pytest.approx(4 * report.bandwidth / (rows[4].step_bytes or 1))


def test_the_goals_line_reads_the_issues_figures_off_the_rows() -> None:
    names = [layout for layout, _ in decode_check.LAYOUTS]
    tok_s = {names[0]: 10.0, names[1]: 50.0, names[2]: 15.0, names[3]: 12.0}
    rows = [decode_check.Row("m", layout, n, tok_s[layout] * n, 1.0, tok_s[layout] / 10.0, None, None, None,
                             0.5 + n / 10 if layout == names[1] else None) for layout in names for n in (1, 4)]
    assert decode_check.goals(rows) == [
        "m, 1 / 4 sequences: every expert on the card 60% / 90% of the bound (the issue's goal: >= 70%); a third "
        "cached 1.50x / 1.50x the CPU engine's tok/s and 1.25x / 1.25x no cache's (goal: > 1x)"]


def test_main_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert decode_check.main(["--device", "host", "--quick"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("decode check: host; qwen3moe tiny q8_0")
    assert out.count("\n| ") == 1 + 2 * len(decode_check.LAYOUTS) * len(PLAN.models)  # the header and the rows
