"""The demo model's vocabulary: a byte-level BPE trained with HF `tokenizers` on the training text, then Qwen3's
added tokens, in the GGUF form `strata.text.tokenizer` reads (`gpt2` model, `qwen2` pre-tokenizer)."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable

import tokenizers
from gguf import GGUFWriter, TokenType
from tokenizers import models, normalizers, pre_tokenizers, trainers

from strata.modelgen.vocab import QWEN_SPECIAL_TOKENS, Vocab
from strata.modelgen.writer import add_vocab
from strata.text.tokenizer import PRE_TOKENIZERS, Tokenizer

_SPECIAL_TYPE = {t: TokenType.CONTROL if t.startswith("<|") else TokenType.USER_DEFINED for t in QWEN_SPECIAL_TOKENS}


def _strip_special(text: str) -> str:
    """The text without added-token strings: they never reach the BPE, so no merges are spent on their pieces."""
    for token in QWEN_SPECIAL_TOKENS:
        text = text.replace(token, "\n")
    return text


def train_vocab(texts: Iterable[str], n_merges: int) -> Vocab:
    """A vocabulary of the 256 byte tokens, up to `n_merges` merges learnt from `texts`, then Qwen3's added tokens.

    The pre-tokenizer is the one `strata.text.tokenizer` applies for `qwen2` (split regex, then byte-level mapping), so
    the merges meet the same pieces at training and at use. Training is deterministic for the same texts.
    """
    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(PRE_TOKENIZERS["qwen2"].pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + n_merges, initial_alphabet=alphabet,
                                  show_progress=False, min_frequency=2)
    tok.train_from_iterator((_strip_special(t) for t in texts), trainer)
    model = json.loads(tok.to_str())["model"]
    by_id = sorted(model["vocab"].items(), key=lambda item: item[1])
    tokens = tuple(token for token, _ in by_id) + QWEN_SPECIAL_TOKENS
    types = (int(TokenType.NORMAL),) * len(by_id) + tuple(int(_SPECIAL_TYPE[t]) for t in QWEN_SPECIAL_TOKENS)
    merges = tuple(" ".join(m) if isinstance(m, list) else m for m in model["merges"])
    return Vocab(tokens=tokens, token_types=types, merges=merges)


def write_vocab(path: str | pathlib.Path, vocab: Vocab) -> pathlib.Path:
    """A GGUF file holding only the tokenizer keys and chat template (what `Tokenizer.from_gguf` reads)."""
    path = pathlib.Path(path)
    writer = GGUFWriter(path, "qwen3moe")
    add_vocab(writer, vocab)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.close()
    return path


def tokenizer_of(vocab: Vocab, scratch: str | pathlib.Path) -> Tokenizer:
    """The project's tokenizer for `vocab`, through a vocabulary-only GGUF file in directory `scratch`."""
    return Tokenizer.from_gguf(write_vocab(pathlib.Path(scratch) / "vocab.gguf", vocab))
