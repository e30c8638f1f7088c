"""Byte-level BPE tokenizer from GGUF metadata (`tokenizer.ggml.model` = `gpt2`), through HF `tokenizers`.

Encoding runs in HF `tokenizers` (BPE over the GGUF tokens and merges, the pre-tokenizer split of
`tokenizer.ggml.pre`, byte-level mapping). Decoding maps ids to their bytes here, so `decode` and the streaming
decoder agree byte for byte.
"""

from __future__ import annotations

import codecs
import dataclasses
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import tokenizers
from gguf import GGUFReader, GGUFValueType, TokenType
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers

from strata.gguf_file import read_metadata
from strata.modelgen.vocab import byte_to_unicode
from strata.text.families import END_OF_TURN_TEXTS


@dataclasses.dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp's `tokenizer.ggml.pre` name splits text before BPE, as the model's own tokenizer.json does."""

    pattern: str  # the split regex
    nfc: bool  # NFC-normalise first (Qwen2's tokenizer does; Llama 3's does not)
    add_bos: bool  # llama.cpp's default for `tokenizer.ggml.add_bos_token` when the file lacks the key


# Qwen2's regex is GPT-4's with single digits; Llama 3's groups up to three digits.
_QWEN2 = PreTokenizer(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                      r"|\s*[\r\n]+|\s+(?!\S)|\s+", nfc=True, add_bos=False)
_LLAMA3 = PreTokenizer(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                       r"|\s*[\r\n]+|\s+(?!\S)|\s+", nfc=False, add_bos=True)
# Qwen3.5's keeps combining marks (\p{M}) in words, where Qwen2's splits them off as punctuation, and normalises
# nothing: a decomposed accent stays two code points, as in Qwen3.5's tokenizer.json and llama.cpp.
_QWEN35 = PreTokenizer(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                       r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+", nfc=False, add_bos=False)
# The names llama.cpp gives the pre-tokenizers of the architectures the engine runs (Qwen3 and Qwen3-MoE: qwen2;
# Qwen3.5 and Qwen3.6: qwen35; Llama 3.x: llama-bpe, with its older spellings).
PRE_TOKENIZERS = {"qwen2": _QWEN2, "qwen35": _QWEN35, "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3}
_ID_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
_SPECIAL_TYPES = (int(TokenType.CONTROL), int(TokenType.USER_DEFINED))
# Fill-in-the-middle: the keys llama.cpp defines for the prefix, suffix and middle tokens (the current names, then
# the older ones it still reads), and the tag sets it recognises by text.
_FIM_KEYS = (("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.fim_mid_token_id"),
             ("tokenizer.ggml.prefix_token_id", "tokenizer.ggml.suffix_token_id", "tokenizer.ggml.middle_token_id"))
_FIM_TAGS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
             ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"), ("<PRE>", "<SUF>", "<MID>"),
             ("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>"))


def fim_ids(meta: dict[str, Any], vocab: dict[str, int]) -> tuple[int, int, int] | None:
    """The (prefix, suffix, middle) token ids of a model's fill-in-the-middle form, or None.

    The file's FIM keys when it has all three in range, else the first tag set whose three tags are all tokens.
    llama.cpp's converter writes no FIM keys, so the files users download (Qwen2.5-Coder's included) carry only the
    tags, and llama.cpp finds them by text the same way.
    """
    n_vocab = len(vocab)
    for keys in _FIM_KEYS:
        if all(key in meta for key in keys):
            ids = tuple(int(meta[key]) for key in keys)
            if all(0 <= i < n_vocab for i in ids):
                return ids[0], ids[1], ids[2]
    for tags in _FIM_TAGS:
        if all(tag in vocab for tag in tags):
            return vocab[tags[0]], vocab[tags[1]], vocab[tags[2]]
    return None


# --- GGUF metadata


def read_tokenizer_metadata(path_or_reader: str | os.PathLike[str] | GGUFReader) -> dict[str, Any]:
    """The `tokenizer.*` keys of a GGUF file: strings, numbers, lists of str, or numpy arrays of numbers."""
    if isinstance(path_or_reader, GGUFReader):
        return {name: _reader_value(field) for name, field in path_or_reader.fields.items()
                if name.startswith("tokenizer.")}
    return {k: v for k, v in read_metadata(path_or_reader).items() if k.startswith("tokenizer.")}


def _reader_value(field: Any) -> Any:
    if field.types[0] == GGUFValueType.ARRAY and field.types[-1] != GGUFValueType.STRING:
        return np.concatenate([field.parts[i] for i in field.data]) if field.data else np.zeros(0)
    return field.contents()


# --- tokenizer


def _id_bytes(tokens: Sequence[str], token_types: Sequence[int]) -> list[bytes]:
    """The bytes each id decodes to: special tokens their text, the others undone from the byte-to-unicode map
    (a token with characters outside the map, such as `[PAD151700]` padding, decodes to its UTF-8 text)."""
    to_byte = {ord(char): chr(byte) for byte, char in byte_to_unicode().items()}
    out = []
    for token, ttype in zip(tokens, token_types, strict=True):
        if ttype in _SPECIAL_TYPES:
            out.append(token.encode("utf-8"))
            continue
        try:
            out.append(token.translate(to_byte).encode("latin-1"))
        except UnicodeEncodeError:
            out.append(token.encode("utf-8"))
    return out


def _hf_tokenizer(model: models.BPE, pre: PreTokenizer) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(model)
    if pre.nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(pre.pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


class StreamDecoder:
    """Incremental detokeniser: `push` returns only complete UTF-8 characters, each exactly once."""

    def __init__(self, id_bytes: Sequence[bytes]) -> None:
        self._id_bytes = id_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """The text completed by `token_id` (empty while a multi-byte character is still open)."""
        return self._utf8.decode(self._id_bytes[token_id])

    def flush(self) -> str:
        """The rest: a character left incomplete at the end becomes U+FFFD."""
        return self._utf8.decode(b"", final=True)


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
    """Byte-level BPE tokenizer of a GGUF model. Build it with `Tokenizer.from_gguf`."""

    hf: tokenizers.Tokenizer = dataclasses.field(repr=False)  # the special tokens as added tokens
    hf_plain: tokenizers.Tokenizer = dataclasses.field(repr=False)  # no added tokens: special text stays text
    id_bytes: tuple[bytes, ...] = dataclasses.field(repr=False)  # (n_vocab,) what each id decodes to
    bos_id: int | None
    add_bos: bool  # prompts start with bos_id (`tokenizer.ggml.add_bos_token`, else the pre-tokenizer's default)
    eos_id: int | None
    eos_ids: frozenset[int]
    chat_template: str | None = dataclasses.field(repr=False)
    control_texts: tuple[str, ...] = dataclasses.field(default=(), repr=False)  # CONTROL tokens (<|im_end|>, ...)
    fim: tuple[int, int, int] | None = None  # the fill-in-the-middle (prefix, suffix, middle) ids (`fim_ids`)

    @classmethod
    def from_gguf(cls, path_or_reader: str | os.PathLike[str] | GGUFReader) -> Tokenizer:
        """The tokenizer stored in a GGUF file's `tokenizer.*` metadata.

        Raises:
            ValueError: not a `gpt2` (byte-level BPE) vocabulary, or an unsupported pre-tokenizer.
        """
        meta = read_tokenizer_metadata(path_or_reader)
        if meta.get("tokenizer.ggml.model") != "gpt2":
            raise ValueError(f"unsupported tokenizer.ggml.model {meta.get('tokenizer.ggml.model')!r}; need gpt2")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [int(TokenType.NORMAL)] * len(tokens))]
        vocab = {token: i for i, token in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        # ignore_merges: a pre-tokenised piece that is itself a token stays whole, as tiktoken does it.
        model = models.BPE(vocab=vocab, merges=merges, ignore_merges=True)
        pre_name = meta.get("tokenizer.ggml.pre", "qwen2")
        if pre_name not in PRE_TOKENIZERS:
            raise ValueError(f"unsupported tokenizer.ggml.pre {pre_name!r}; supported: {sorted(PRE_TOKENIZERS)}")
        pre = PRE_TOKENIZERS[pre_name]
        hf, hf_plain = _hf_tokenizer(model, pre), _hf_tokenizer(model, pre)
        hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                               for i, t in enumerate(types) if t in _SPECIAL_TYPES])
        eos_ids = {int(meta[k]) for k in _ID_KEYS if k in meta}
        # Tokens that end generation whatever the eos key says (llama.cpp also recognises them by name).
        eos_ids |= {vocab[text] for text in END_OF_TURN_TEXTS
                    if text in vocab and types[vocab[text]] == TokenType.CONTROL}
        bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", pre.add_bos)) and bos is not None
        return cls(hf=hf, hf_plain=hf_plain, id_bytes=tuple(_id_bytes(tokens, types)),
                   bos_id=None if bos is None else int(bos), add_bos=add_bos,
                   eos_id=None if eos is None else int(eos),
                   eos_ids=frozenset(eos_ids), chat_template=meta.get("tokenizer.chat_template"),
                   control_texts=tuple(tokens[i] for i, t in enumerate(types) if t == TokenType.CONTROL),
                   fim=fim_ids(meta, vocab))

    @property
    def n_vocab(self) -> int:
        return len(self.id_bytes)

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of `text`. special=True: special-token text (`<|im_end|>`) becomes its id; False: plain text."""
        return (self.hf if special else self.hf_plain).encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a rendered prompt (special-token text becomes ids), starting with BOS when the model wants
        one: added unless the text already begins with it (templates that write `bos_token` themselves)."""
        return self.with_bos(self.encode(text, special=True))

    def with_bos(self, ids: list[int]) -> list[int]:
        """`ids` of a prompt, starting with BOS when the model wants one and they do not already."""
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            return [self.bos_id, *ids]
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`, special tokens included; invalid UTF-8 becomes U+FFFD."""
        return b"".join(self.id_bytes[i] for i in ids).decode("utf-8", errors="replace")

    def token_to_id(self, text: str) -> int | None:
        """Id of a token given as stored (byte-to-unicode form, or a special token's text)."""
        return self.hf.token_to_id(text)

    def require_id(self, text: str) -> int:
        """`token_to_id` of a token the vocabulary must have; KeyError names it when it has not."""
        token_id = self.hf.token_to_id(text)
        if token_id is None:
            raise KeyError(f"the vocabulary has no token {text!r}")
        return token_id

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self.id_bytes)
