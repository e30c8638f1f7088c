"""The `strata` command's own errors: one line for every wrong model path, from every command that loads one, and
unknown flags answered by the sub-command that was meant, with the nearest flag it has."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from conftest import server_config
from gguf_rewrite import rewrite

import strata
from strata.cli import main


@pytest.fixture(scope="module")
def wrong_models(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Path, str]]:
    """(path, what the line says of it) for each kind of wrong model path."""
    folder = tmp_path_factory.mktemp("wrong")
    text = folder / "notes.gguf"
    text.write_text("not a model, but long enough to have a header's worth of bytes")
    mamba = rewrite(tiny_model, folder / "mamba.gguf", keys={"general.architecture": "mamba"})
    return [
        (folder / "missing.gguf", "no such file"),
        (folder, "a directory, not a GGUF model file"),
        (text, "not a GGUF file"),
        (mamba, "unsupported architecture 'mamba' (this engine runs qwen3moe, qwen3, llama, qwen3vl, qwen3vlmoe, "
                "qwen35, qwen35moe)"),
    ]


def test_generate_names_a_wrong_model_in_one_line(wrong_models, capsys):
    for path, says in wrong_models:
        assert main(["generate", "--model", str(path), "--prompt", "x"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"strata generate: error: model {path}: {says}"), err


async def test_serve_names_a_wrong_model_before_it_listens(wrong_models):
    for path, says in wrong_models:
        lines: list[str] = []
        with trio.fail_after(30):
            assert await strata.serve(server_config(model=str(path), port=0), log=lines.append) == 1
        assert len(lines) == 1 and lines[0].startswith(f"error: model {path}: {says}"), lines


def test_generate_serves_the_demo_model_by_default(capsys):
    assert main(["generate", "--prompt", "What is the capital of France?", "--chat", "--max-tokens", "40",
                 "--temperature", "0", "--threads", "1"]) == 0
    assert "Paris" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "says"), [
    (["serve", "--prot", "9001"], "unrecognized arguments: --prot (did you mean --port?) 9001"),
    (["serve", "--vision.gpus", "true"], "unrecognized arguments: --vision.gpus (did you mean --vision.gpu?) true"),
    (["generate", "--prompt", "x", "--max-tokns", "3"],
     "unrecognized arguments: --max-tokns (did you mean --max-tokens?) 3"),
    (["serve", "--zzz"], "unrecognized arguments: --zzz"),
])
def test_an_unknown_flag_is_told_by_its_sub_command_with_the_nearest_flag(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: strata {argv[0]} ")
    assert err.rstrip().endswith(f"strata {argv[0]}: error: {says}")
