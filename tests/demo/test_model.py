"""The torch definitions compute what the C engine and the vision encoder compute, on the files export writes."""

import itertools
import pathlib

import numpy as np
import pytest
import torch

from strata.engine_cffi import Engine
from strata.modelgen.demo import bpe, data, export, train
from strata.modelgen.demo.model import TextModel, VisionModel
from strata.modelgen.writer import chat_template
from strata.text.tokenizer import read_tokenizer_metadata
from strata.vision.encoder import Encoder
from strata.vision.mmproj import Mmproj

CONFIG = train.SMALL_QWEN3MOE


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def vocab() -> bpe.Vocab:
    texts = ["".join(data.render(e, chat_template())) for e in itertools.islice(data.examples(0), 300)]
    return bpe.train_vocab(texts, 64)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, vocab: bpe.Vocab) -> tuple[pathlib.Path, pathlib.Path]:
    out = tmp_path_factory.mktemp("demo")
    # Non-trivial norms and biases, so a mix-up of any tensor shows.
    text, vision = TextModel(CONFIG.text, vocab.n_vocab, seed=1), VisionModel(CONFIG.vision, seed=1)
    with torch.no_grad():
        for p in [*text.parameters(), *vision.parameters()]:
            if p.dim() == 1:
                p.add_(torch.randn(p.shape) * 0.2)
    return export.write_text(out / "t.gguf", text, vocab), export.write_vision(out / "v.gguf", vision)


def test_the_text_model_computes_what_the_engine_computes(files: tuple[pathlib.Path, pathlib.Path]) -> None:
    model = export.read_text(files[0])
    engine = Engine.load(str(files[0]), n_ctx=256, threads=1, kv="f32")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, engine.n_vocab, 40).tolist()
    rows = rng.standard_normal((6, engine.n_embd)).astype(np.float32)  # picture rows at positions 10..15
    expected = engine.eval(tokens, embeds=[(10, rows)], all_logits=True)
    mask = torch.zeros(1, 40, dtype=torch.bool)
    mask[0, 10:16] = True
    with torch.no_grad():
        logits, _ = model(torch.tensor([tokens]), torch.from_numpy(rows), mask)
    assert relative_error(logits[0].numpy(), expected) < 1e-5
    assert (logits[0].numpy().argmax(-1) == expected.argmax(-1)).all()


@pytest.mark.parametrize("grid", [(12, 12), (4, 10), (14, 6), (2, 2)])
def test_the_vision_model_computes_what_the_encoder_computes(files: tuple[pathlib.Path, pathlib.Path],
                                                             grid: tuple[int, int]) -> None:
    model = export.read_vision(files[1])
    encoder = Encoder(Mmproj.load(files[1]), threads=1)
    p = CONFIG.vision.patch_size
    pixels = np.random.default_rng(1).standard_normal((3, grid[0] * p, grid[1] * p)).astype(np.float32)
    with torch.no_grad():
        rows = model(torch.from_numpy(pixels[None]))[0].numpy()
    expected = encoder.encode(pixels)
    assert rows.shape == expected.shape == (grid[0] * grid[1] // 4, CONFIG.text.n_embd)
    assert relative_error(rows, expected) < 1e-5


def test_export_and_read_back_keep_every_weight(files: tuple[pathlib.Path, pathlib.Path]) -> None:
    text, vision = export.read_text(files[0]), export.read_vision(files[1])
    again = files[0].parent / "again.gguf", files[1].parent / "again-v.gguf"
    vocab_again = bpe.Vocab(*(tuple(x) for x in _vocab_of(files[0])))
    export.write_text(again[0], text, vocab_again)
    export.write_vision(again[1], vision)
    assert export.weights_digest(again[0]) == export.weights_digest(files[0])
    assert export.weights_digest(again[1]) == export.weights_digest(files[1])


def _vocab_of(path: pathlib.Path) -> tuple[list[str], list[int], list[str]]:
    meta = read_tokenizer_metadata(path)
    return (meta["tokenizer.ggml.tokens"], [int(t) for t in meta["tokenizer.ggml.token_type"]],
            meta["tokenizer.ggml.merges"])
