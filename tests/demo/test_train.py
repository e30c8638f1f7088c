"""Training is reproducible, and the shipped files are what the script's configuration produces."""

import dataclasses
import importlib.resources
import json
import pathlib
import random

import gguf
import pytest

from strata.modelgen.demo import export, polish, train
from strata.text.tokenizer import read_tokenizer_metadata
from strata.vision.mmproj import read_hparams

SHIPPED = pathlib.Path(str(importlib.resources.files("strata.models")))


@pytest.mark.parametrize("arch", train.ARCHS)
def test_training_twice_gives_the_same_files(tmp_path: pathlib.Path, arch: str) -> None:
    small = train.CONFIGS[arch, True]
    first = train.run(small, tmp_path / "a", threads=1, log=False)
    second = train.run(small, tmp_path / "b", threads=1, log=False)
    assert first["weights"] == second["weights"]
    assert first["weights"] == {name: export.weights_digest(tmp_path / "a" / name) for name in first["weights"]}
    longer = train.run(dataclasses.replace(small, steps=small.steps + 1), tmp_path / "c", threads=1, log=False)
    assert longer["weights"]["demo.gguf"] != first["weights"]["demo.gguf"]


def test_training_from_a_given_encoder_starts_from_that_file(tmp_path: pathlib.Path) -> None:
    small = train.CONFIGS["qwen35moe", True]
    encoder = tmp_path / "a" / "demo-mmproj.gguf"
    train.run(small, tmp_path / "a", threads=1, log=False)
    given = train.given_encoder(small, encoder)
    assert given.encoder == export.weights_digest(encoder) and given.vision_steps == 0 and given.probe_steps > 0
    first = train.run(given, tmp_path / "b", threads=1, log=False, encoder=encoder)
    second = train.run(given, tmp_path / "c", threads=1, log=False, encoder=encoder)
    assert first["weights"] == second["weights"] and first["config"]["encoder"] == given.encoder
    with pytest.raises(ValueError, match="starts from the encoder file"):
        train.run(given, tmp_path / "d", threads=1, log=False, encoder=tmp_path / "b" / "demo-mmproj.gguf")


def test_a_polish_starts_from_the_trained_text_model_and_keeps_the_encoder(tmp_path: pathlib.Path) -> None:
    small = train.CONFIGS["qwen35moe", True]
    trained = train.run(small, tmp_path / "a", threads=1, log=False)
    config = dataclasses.replace(polish.POLISH, start=trained["weights"]["demo.gguf"], steps=2, batch=4, warmup=1,
                                 max_len=512)
    first = polish.run(small, config, tmp_path / "a", tmp_path / "b", threads=1, log=False)
    second = polish.run(small, config, tmp_path / "a", tmp_path / "c", threads=1, log=False)
    assert first["weights"] == second["weights"]
    assert first["weights"] == {name: export.weights_digest(tmp_path / "b" / name) for name in first["weights"]}
    assert first["weights"]["demo.gguf"] != trained["weights"]["demo.gguf"]
    assert first["weights"]["demo-mmproj.gguf"] == trained["weights"]["demo-mmproj.gguf"]
    assert first["config"] == trained["config"] and first["train_seconds"] == trained["train_seconds"]
    assert first["polish"]["config"] == train.config_record(config) and first["polish"]["threads"] == 1
    longer = polish.run(small, dataclasses.replace(config, steps=3), tmp_path / "a", tmp_path / "d", threads=1,
                        log=False)
    assert longer["weights"]["demo.gguf"] != first["weights"]["demo.gguf"]
    with pytest.raises(ValueError, match="starts from the text model"):
        polish.run(small, config, tmp_path / "b", tmp_path / "e", threads=1, log=False)


class Stopped(Exception):
    pass


def test_a_stopped_run_resumed_gives_the_same_files(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small = dataclasses.replace(train.CONFIGS["qwen35moe", True], steps=5)
    whole = train.run(small, tmp_path / "a", threads=1, log=False, checkpoint_every=None)
    save = train.save_checkpoint
    saved: list[int] = []

    def save_then_stop(state: dict, path: pathlib.Path) -> None:
        save(state, path)
        saved.append(state["step"])
        raise Stopped

    monkeypatch.setattr(train, "save_checkpoint", save_then_stop)
    with pytest.raises(Stopped):
        train.run(small, tmp_path / "b", threads=1, log=False, checkpoint_every=2)
    monkeypatch.setattr(train, "save_checkpoint", save)
    assert saved == [2] and not (tmp_path / "b" / "demo.gguf").exists()
    resumed = train.run(small, tmp_path / "b", threads=1, log=False, checkpoint_every=2, resume=True)
    assert resumed["weights"] == whole["weights"]
    other = dataclasses.replace(small, lr=small.lr / 2)
    with pytest.raises(ValueError, match="another configuration"):
        train.run(other, tmp_path / "b", threads=1, log=False, checkpoint_every=2, resume=True)


@pytest.fixture(scope="module")
def record() -> dict:
    return json.loads((SHIPPED / "demo.json").read_text())


def test_the_shipped_files_were_trained_with_the_script_configuration(record: dict) -> None:
    assert record["config"] == train.config_record(train.FULL)
    assert record["polish"]["config"] == train.config_record(polish.POLISH)
    for name, digest in record["weights"].items():
        assert export.weights_digest(SHIPPED / name) == digest


def test_the_shipped_text_model_has_the_configured_shape() -> None:
    reader = gguf.GGUFReader(SHIPPED / "demo.gguf")
    hp = export.text_hparams(reader)
    # GGUF stores the epsilon as float32
    assert hp == dataclasses.replace(train.FULL.text, rms_eps=hp.rms_eps)
    assert hp.rms_eps == pytest.approx(train.FULL.text.rms_eps, rel=1e-7)
    assert reader.fields["general.architecture"].contents() == train.SHIPPED_ARCH
    assert read_hparams(gguf.GGUFReader(SHIPPED / "demo-mmproj.gguf")) == train.FULL.vision


def test_the_shipped_vocabulary_is_the_one_trained_on_the_generated_text() -> None:
    meta = read_tokenizer_metadata(SHIPPED / "demo.gguf")
    vocab = train.build_vocab(train.FULL)
    assert meta["tokenizer.ggml.tokens"] == list(vocab.tokens)
    assert meta["tokenizer.ggml.merges"] == list(vocab.merges)
    assert meta["tokenizer.ggml.pre"] == "qwen2"
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>",
                    "</tool_call>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"):
        assert special in meta["tokenizer.ggml.tokens"]
    assert "<tool_call>" in meta["tokenizer.chat_template"]


def test_the_shipped_files_fit_in_the_repository() -> None:
    assert sum((SHIPPED / name).stat().st_size for name in ("demo.gguf", "demo-mmproj.gguf")) <= 20 * 1024**2


def test_training_pictures_get_between_half_the_file_budget_and_all_of_it() -> None:
    rng = random.Random(0)
    budgets = [train._picture_budget(rng, train.FULL.vision) for _ in range(2000)]
    full = train.token_budget(train.FULL.vision)[1]
    assert min(budgets) == full // 2 and max(budgets) == full
    assert 0.7 < budgets.count(full) / len(budgets) < 0.8  # mostly the budget the server uses
