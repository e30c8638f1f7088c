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
    assert lines[2].startswith("| layout | seqs | tok/s |") and len(lines) == 4 + 2 * len(decode_check.LAYOUTS)
    for (layout, _), pair in zip(decode_check.LAYOUTS, np.reshape(lines[4:], (-1, 2)), strict=True):
        assert [line.split(" | ")[:2] for line in pair] == [[f"| {layout}", "1"], [f"| {layout}", "4"]]
    assert all(r.tok_s > 0 for r in report.rows) and report.bandwidth > 0
    by_layout = {(r.layout, r.n_seq): r for r in report.rows}
    (cpu, _), (resident, _), (capped, _), (none, _) = decode_check.LAYOUTS
    for n_seq in (1, 4):
        assert by_layout[cpu, n_seq].hit_rate is None and by_layout[cpu, n_seq].vs_cpu == 1.0
        assert by_layout[resident, n_seq].hit_rate == 1.0 and by_layout[none, n_seq].hit_rate == 0.0
        assert 0.0 < (by_layout[capped, n_seq].hit_rate or 0.0) < 1.0
        with_bound = [r.layout for r in report.rows if r.n_seq == n_seq and r.of_bound is not None]
        assert with_bound == [resident]


def test_a_steps_bytes_are_the_files_tensors(report: decode_check.Report) -> None:
    """Every weight but the embeddings and the routed experts, k experts a layer for one sequence (between k and
    4 k for four), and the f16 K and V rows each token attends to."""
    hp = hparams_for("qwen3moe", PLAN.size, **PLAN.overrides)
    tensors = GGUFReader(report.path).tensors
    dense = sum(int(t.n_bytes) for t in tensors if "_exps" not in t.name and t.name != "token_embd.weight")
    expert = sum(int(t.n_bytes) for t in tensors if "_exps" in t.name) // (hp.n_layer * hp.n_expert)
    kv_row = 2 * hp.n_head_kv * hp.head_dim * 2 * hp.n_layer  # K and V, f16, every layer

    def kv(positions: list[int]) -> int:
        return sum(p + 1 for p in positions) * kv_row

    first = PLAN.prompt + PLAN.warmup
    one = [kv([first + i]) for i in range(PLAN.steps)]
    want = dense + hp.n_layer * hp.n_expert_used * expert + np.mean(one)
    resident = decode_check.LAYOUTS[1][0]
    rows = {r.n_seq: r for r in report.rows if r.layout == resident}
    assert rows[1].step_bytes == pytest.approx(want, rel=1e-12)
    later = first + PLAN.steps + PLAN.warmup  # sequence 0 goes on; the others start after their prompts
    four = np.mean([kv([later + i] + [first + i] * 3) for i in range(PLAN.steps)])
    fewest = dense + hp.n_layer * hp.n_expert_used * expert + four
    most = dense + hp.n_layer * min(4 * hp.n_expert_used, hp.n_expert) * expert + four
    assert fewest <= (rows[4].step_bytes or 0) <= most
    assert rows[4].bound_tok_s == pytest.approx(4 * report.bandwidth / (rows[4].step_bytes or 1))


def test_main_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert decode_check.main(["--device", "host", "--quick"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("decode check: host, qwen3moe tiny q8_0")
    assert out.count("\n| ") == 1 + 2 * len(decode_check.LAYOUTS)  # the header and the rows
