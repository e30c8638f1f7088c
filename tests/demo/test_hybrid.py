"""The torch definitions of the demo's qwen35moe text model compute what the C engine computes, on the file export
writes: the trunk's logits (text, and a picture's rows at their multi-axis positions) and the MTP block's chained
drafts; and the chunked delta rule computes what the token-by-token one does."""

import itertools
import pathlib

import numpy as np
import pytest
import torch

from strata.engine_cffi import Engine
from strata.modelgen.demo import bpe, data, export, train
from strata.modelgen.demo.hybrid import (
    HybridTextModel,
    delta_rule_chunked,
    delta_rule_recurrent,
    rope_positions,
)
from strata.modelgen.writer import chat_template
from strata.pictures.rows import PictureRows

HP = train.SMALL_QWEN35MOE.text


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def file(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    texts = ["".join(data.render(e, chat_template())) for e in itertools.islice(data.examples(0), 300)]
    vocab = bpe.train_vocab(texts, 64)
    model = HybridTextModel(HP, vocab.n_vocab, seed=1)
    with torch.no_grad():  # non-trivial norms and biases, so a mix-up of any tensor shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape) * 0.2)
    return export.write_text(tmp_path_factory.mktemp("hybrid") / "t.gguf", model, vocab)


def test_the_chunked_delta_rule_is_the_recurrent_one() -> None:
    gen = torch.Generator().manual_seed(0)
    b, h, t, d = 2, 3, 150, 8  # three chunks, the last one partial
    q, k = (torch.nn.functional.normalize(torch.randn(b, h, t, d, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(b, h, t, d, generator=gen)
    g = -torch.rand(b, h, t, generator=gen)
    beta = torch.rand(b, h, t, generator=gen)
    chunked, recurrent = delta_rule_chunked(q, k, v, g, beta), delta_rule_recurrent(q, k, v, g, beta)
    assert relative_error(chunked.numpy(), recurrent.numpy()) < 1e-5


def test_the_model_computes_the_same_in_chunks_and_token_by_token() -> None:
    model = HybridTextModel(HP, 300, seed=2)
    x = model.embed(torch.randint(0, 300, (2, 70), generator=torch.Generator().manual_seed(3)))
    with torch.no_grad():
        chunked, _ = model.trunk(x)
        recurrent, _ = model.trunk(x, chunked=False)
    assert relative_error(chunked.numpy(), recurrent.numpy()) < 1e-5


def test_positions_follow_the_engine_rules() -> None:
    rope = rope_positions(9, [(2, 2, 3)])  # two text tokens, a picture of 2 x 3 rows, one text token
    assert rope[:, 0].tolist() == [0, 1, 2, 2, 2, 2, 2, 2, 5]
    assert rope[2:8, 1].tolist() == [2, 2, 2, 3, 3, 3] and rope[2:8, 2].tolist() == [2, 3, 4, 2, 3, 4]
    assert rope[8].tolist() == [5, 5, 5]


def test_the_text_model_computes_what_the_engine_computes(file: pathlib.Path) -> None:
    model = export.read_text(file)
    assert isinstance(model, HybridTextModel)
    with Engine.load(str(file), n_ctx=256, threads=1, kv="f32") as engine:
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, engine.n_vocab, 90).tolist()
        rows = rng.standard_normal((6, engine.n_embd)).astype(np.float32)  # a picture of 2 x 3 rows at 10..15
        expected = engine.eval(tokens, embeds=[(10, PictureRows(rows, 3))], all_logits=True)
    mask = torch.zeros(1, 90, dtype=torch.bool)
    mask[0, 10:16] = True
    with torch.no_grad():
        rope = rope_positions(90, [(10, 2, 3)])[None]
        logits, _ = model(torch.tensor([tokens]), torch.from_numpy(rows), mask, rope=rope)
    assert relative_error(logits[0].numpy(), expected) < 1e-5
    assert (logits[0].numpy().argmax(-1) == expected.argmax(-1)).all()


def test_the_mtp_block_drafts_what_the_engine_drafts(file: pathlib.Path) -> None:
    model = export.read_text(file)
    assert isinstance(model, HybridTextModel)
    n_draft = 3
    with Engine.load(str(file), n_ctx=256, threads=1, kv="f32", mtp=True) as engine:
        tokens = np.random.default_rng(1).integers(0, engine.n_vocab, 41).tolist()
        engine.eval(tokens[:30])  # two calls: hidden states held between them
        engine.eval(tokens[30:40])
        drafts, logits = engine.mtp_draft([0], [40], [tokens[40]], n_draft, logits=True)
    assert logits is not None and (drafts[0] == logits[0].argmax(-1)).all()
    with torch.no_grad():
        ids = torch.tensor([tokens])
        hidden, _ = model.trunk(model.embed(ids[:, :40]))
        expected = []
        for draft in drafts[0]:
            # the pairs (h_p, x_{p + 1}); the last one's state and draft are the next pair
            x = model.embed(ids)
            cos, sin = model.angles(torch.arange(ids.shape[1] - 1).view(1, -1, 1).expand(1, -1, 3))
            g, _ = model.mtp(hidden, x[:, 1:], cos, sin)
            expected.append((g[0, -1] @ model.output.T).numpy())
            hidden = torch.cat([hidden, g[:, -1:]], 1)
            ids = torch.cat([ids, torch.tensor([[int(draft)]])], 1)
    assert relative_error(logits[0], np.stack(expected)) < 1e-5
    # the training loss reads the block's logits for every pair the same way
    with torch.no_grad():
        ids = torch.tensor([tokens])
        x = model.embed(ids)
        hidden, _ = model.trunk(x)
        first, _ = model.draft_logits(hidden, x)
    assert relative_error(first[0, -1].numpy(), expected[0]) < 1e-5
