"""`strata make-model` through its command module."""

import argparse
import pathlib

import pytest
from gguf import GGUFReader

from strata.modelgen import cli


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_make_model_writes_and_reports(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "model.gguf"
    assert cli.run(parse(["--arch", "qwen3", "--dtype", "q8_0", "--seed", "5", "--out", str(out)])) == 0
    reader = GGUFReader(out)
    assert reader.fields["general.architecture"].contents() == "qwen3"
    assert {t.tensor_type.name for t in reader.tensors} == {"F32", "Q8_0"}
    n_params = sum(int(t.n_elements) for t in reader.tensors)
    printed = capsys.readouterr().out
    assert str(out) in printed and "qwen3 tiny q8_0" in printed
    assert f"{n_params / 1e6:.1f} M parameters" in printed


def test_make_model_rejects_unknown_choices() -> None:
    with pytest.raises(SystemExit):
        parse(["--arch", "mistral", "--out", "x.gguf"])


def test_make_model_mmproj_matches_the_text_models_width(tmp_path: pathlib.Path) -> None:
    text = tmp_path / "text.gguf"
    assert cli.run(parse(["--arch", "qwen3", "--out", str(text)])) == 0
    vision = tmp_path / "vision.gguf"
    assert cli.run(parse(["--mmproj", "--text-model", str(text), "--out", str(vision)])) == 0
    width = GGUFReader(text).fields["qwen3.embedding_length"].contents()
    fields = GGUFReader(vision).fields
    assert fields["general.architecture"].contents() == "clip"
    assert fields["clip.vision.projection_dim"].contents() == width


def test_make_model_mmproj_needs_a_text_model(tmp_path: pathlib.Path) -> None:
    with pytest.raises(SystemExit, match="--text-model"):
        cli.run(parse(["--mmproj", "--out", str(tmp_path / "v.gguf")]))


def test_make_model_demo_runs_the_training_script(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from strata.modelgen.demo import train

    calls = []
    monkeypatch.setattr(train, "main", lambda argv: calls.append(argv) or 0)
    assert cli.run(parse(["--demo", "--out", str(tmp_path), "--threads", "2"])) == 0
    assert cli.run(parse(["--demo", "--out", str(tmp_path), "--encoder", "old.gguf"])) == 0
    assert calls == [["--out", str(tmp_path), "--threads", "2"],
                     ["--out", str(tmp_path), "--threads", "1", "--encoder", "old.gguf"]]  # the shipped files' count


def test_make_model_hybrid_with_another_interval_and_no_mtp(tmp_path: pathlib.Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hybrid.gguf"
    argv = ["--arch", "qwen35", "--full-attention-interval", "2", "--no-mtp", "--out", str(out)]
    assert cli.run(parse(argv)) == 0
    fields = GGUFReader(out).fields
    assert fields["qwen35.full_attention_interval"].contents() == 2
    assert fields["qwen35.attention.recurrent_layers"].contents() == [True, False, True, False]
    assert "qwen35.nextn_predict_layers" not in fields
    assert "full_attention_interval=2" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--arch", "qwen3", "--no-mtp"], ["--arch", "qwen35moe",
                                                                      "--full-attention-interval", "0"]])
def test_make_model_refuses_hybrid_options_where_they_do_not_apply(argv: list[str], tmp_path: pathlib.Path) -> None:
    with pytest.raises(SystemExit, match="full-attention-interval"):
        cli.run(parse([*argv, "--out", str(tmp_path / "m.gguf")]))
