"""The `qwen35` pre-tokenizer of Qwen3.5/3.6 files against llama.cpp: the test vectors llama.cpp keeps for it (its
vocabulary test file, inputs and the ids llama.cpp must produce), and llama.cpp's own tokenizer on that file over
text with combining marks, emoji, code, numbers and whitespace runs. Also: a vocabulary of Qwen3.5's size loads
and finds its special tokens, and an unknown pre-tokenizer is refused in one line.

The vocabulary test file comes from llama-cpp-python's source archive (`scripts/fetch-llama-cpp.sh` puts it in
`.cache/`); the tests that need it are skipped, naming the script, when it is absent.
"""

from __future__ import annotations

import itertools
import pathlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import gguf
import pytest
import tokenizers
from gguf import TokenType

from strata.modelgen.vocab import QWEN_SPECIAL_TOKENS, get_vocab
from strata.text.tokenizer import PRE_TOKENIZERS, Tokenizer, read_tokenizer_metadata

ROOT = pathlib.Path(__file__).resolve().parents[2]
VOCAB = ROOT / ".cache" / "llama.cpp-0.3.36" / "models" / "ggml-vocab-qwen35.gguf"
QWEN35_N_VOCAB = 248320  # Qwen3.5's embedding rows

# Text where Qwen3.5's split differs from Qwen2's (combining marks: decomposed accents, Devanagari, Thai, Arabic
# diacritics, marks alone and stacked), and the usual hard cases (emoji sequences, code, numbers, whitespace runs).
CORPUS = [
    "cafe\u0301 nai\u0308ve re\u0301sume\u0301 \u00c5ngstro\u0308m",
    "e\u0301\u0302\u0303 a\u0300\u0300\u0300 \u0301 alone, \u0301\u0301 twice",
    "हिन्दी भाषा में नमस्ते दुनिया, क्षत्रिय",
    "ภาษาไทย สวัสดีครับ ที่นี่ไม่มีปัญหา",
    "اَلْعَرَبِيَّةُ مَرْحَبًا بِكُمْ فِي الْبَيْتِ",
    "Tiếng Việt có dấu: Cửa Việt, Vieê\u0301t Nam",
    "Emoji: 😀👍🏽👨\u200d👩\u200d👧\u200d👦🇫🇷 ❤️ 🦙.cpp 😶\u200d🌫️",
    "def f(x):\n\tif x > 0:\n\t\treturn x ** 2  # square\n    return -x\n\n\n",
    "Numbers: 3.14159, 1,000,000, 2026-11-30, 0x1F600, -42e-7, ¼ ½ ¾ ²",
    "  leading   and trailing   \n\n  \t mixed \r\n windows\r\n\n\n   ",
    "I'm sure they'll say it's fine; WE'VE heard THAT'S not what you'd expect.",
    "中文分词测试：今天天气很好。日本語のテキスト、한국어 문장",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
]


def split(pre_tokenizer: str, text: str) -> list[str]:
    """The pieces a pre-tokenizer's split pattern cuts `text` into."""
    pattern = tokenizers.Regex(PRE_TOKENIZERS[pre_tokenizer].pattern)
    return [piece for piece, _ in tokenizers.pre_tokenizers.Split(pattern, "isolated").pre_tokenize_str(text)]


def test_combining_marks_stay_in_their_words() -> None:
    assert split("qwen35", "cafe\u0301 ok") == ["cafe\u0301", " ok"]
    assert split("qwen2", "cafe\u0301 ok") == ["cafe", "\u0301", " ok"]
    assert split("qwen35", " नमस्ते") == [" नमस्ते"]
    assert len(split("qwen2", " नमस्ते")) > 1
    # A mark is never punctuation to Qwen3.5: one after a space joins the space, as a letter would.
    assert split("qwen35", "a \u0301b") == ["a", " \u0301b"]
    assert split("qwen35", "x!!\u0301") == ["x", "!!", "\u0301"]


def test_decomposed_text_is_not_normalised() -> None:
    assert not PRE_TOKENIZERS["qwen35"].nfc and PRE_TOKENIZERS["qwen2"].nfc


# --- llama.cpp's vocabulary test file


@pytest.fixture(scope="module")
def vocab_file() -> pathlib.Path:
    if not VOCAB.is_file():
        pytest.skip("llama.cpp's qwen35 vocabulary test file is not in .cache/ (run scripts/fetch-llama-cpp.sh)")
    return VOCAB


@pytest.fixture(scope="module")
def qwen35(vocab_file: pathlib.Path) -> Tokenizer:
    return Tokenizer.from_gguf(vocab_file)


@pytest.fixture(scope="module")
def llama_cpp_vocab(vocab_file: pathlib.Path) -> Iterator[Any]:
    import llama_cpp

    llama = llama_cpp.Llama(str(vocab_file), vocab_only=True, verbose=False)
    yield llama
    llama.close()


def test_the_file_is_a_qwen35_vocabulary(vocab_file: pathlib.Path) -> None:
    assert read_tokenizer_metadata(vocab_file)["tokenizer.ggml.pre"] == "qwen35"


def test_llama_cpps_test_vectors(qwen35: Tokenizer, vocab_file: pathlib.Path) -> None:
    inputs = vocab_file.with_suffix(".gguf.inp").read_text("utf-8").split("\n__ggml_vocab_test__\n")
    outputs = vocab_file.with_suffix(".gguf.out").read_text("utf-8").split("\n")
    assert len(inputs) == len(outputs) > 40
    assert any("\u0301" in text for text in inputs)  # the vectors have decomposed accents
    for text, ids in zip(inputs, outputs, strict=True):
        assert qwen35.encode(text, special=False) == [int(i) for i in ids.split()], repr(text)


@pytest.mark.parametrize("text", CORPUS)
def test_equals_llama_cpp(qwen35: Tokenizer, llama_cpp_vocab: Any, text: str) -> None:
    data = text.encode("utf-8")
    assert qwen35.encode(text, special=False) == llama_cpp_vocab.tokenize(data, add_bos=False, special=False)
    assert qwen35.encode(text, special=True) == llama_cpp_vocab.tokenize(data, add_bos=False, special=True)
    assert qwen35.decode(qwen35.encode(text)) == text


def test_qwen2s_split_would_differ(qwen35: Tokenizer, vocab_file: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """The corpus tells the two pre-tokenizers apart: the same vocabulary read as `qwen2` tokenises it otherwise."""
    meta = read_tokenizer_metadata(vocab_file)
    types = [int(t) for t in meta["tokenizer.ggml.token_type"]]
    as_qwen2 = Tokenizer.from_gguf(write_vocabulary(tmp_path / "qwen2.gguf", meta["tokenizer.ggml.tokens"], types,
                                                    meta["tokenizer.ggml.merges"], "qwen2"))
    differ = [text for text in CORPUS if as_qwen2.encode(text) != qwen35.encode(text)]
    assert len(differ) >= 5, differ


# --- a vocabulary of Qwen3.5's size


def write_vocabulary(path: pathlib.Path, tokens: Sequence[str], types: Sequence[int], merges: Sequence[str],
                     pre: str) -> pathlib.Path:
    """A GGUF file that holds only a byte-level BPE vocabulary (as llama.cpp's vocabulary test files do)."""
    writer = gguf.GGUFWriter(path, "qwen35moe")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(list(tokens).index("<|endoftext|>"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def large_vocab(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, list[str]]:
    """Qwen's BPE vocabulary grown to Qwen3.5's size with words that join two of its words (each with its merge),
    then Qwen's added tokens; and the joined words."""
    qwen = get_vocab("qwen")
    n_bpe = qwen.token_types.index(int(TokenType.CONTROL))
    tokens, merges = list(qwen.tokens[:n_bpe]), list(qwen.merges)
    known, joined = set(tokens), []
    n_joined = QWEN35_N_VOCAB - n_bpe - len(QWEN_SPECIAL_TOKENS)
    words = [token for token in tokens[1000:] if token.isascii() and token.isalpha()]  # no "Ġ": no leading space
    for left, right in itertools.product(words[:400], words[400:800]):
        if len(joined) == n_joined:
            break
        if left + right not in known:
            known.add(left + right)
            joined.append(left + right)
            merges.append(f"{left} {right}")
    types = [int(TokenType.NORMAL)] * (n_bpe + len(joined)) + [int(TokenType.CONTROL)] * len(QWEN_SPECIAL_TOKENS)
    path = write_vocabulary(tmp_path_factory.mktemp("qwen35") / "vocab.gguf", [*tokens, *joined,
                            *QWEN_SPECIAL_TOKENS], types, merges, "qwen35")
    return path, joined


def test_a_vocabulary_of_qwen35s_size_loads_with_its_special_tokens(large_vocab: tuple[pathlib.Path, list[str]]
                                                                     ) -> None:
    path, joined = large_vocab
    start = time.perf_counter()
    tok = Tokenizer.from_gguf(path)
    seconds = time.perf_counter() - start
    assert tok.n_vocab == QWEN35_N_VOCAB
    for text in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                 "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"):
        token_id = tok.token_to_id(text)
        assert token_id is not None and token_id >= QWEN35_N_VOCAB - len(QWEN_SPECIAL_TOKENS)
        assert tok.encode(f"a{text}b") == [*tok.encode("a"), token_id, *tok.encode("b")]
        assert tok.encode(text, special=False) != [token_id]
    assert tok.eos_ids == {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}
    # The ids past Qwen2's BPE ranks are reachable: a joined token's text encodes to it.
    last = tok.token_to_id(joined[-1])
    assert last is not None and last > 151643
    text = tok.decode([last])
    assert tok.encode(text) == [last]
    assert seconds < 30, f"loading took {seconds:.1f} s"


def test_an_unknown_pre_tokenizer_is_refused_in_one_line(tmp_path: pathlib.Path) -> None:
    tokens = ["a", "b", "ab", "<|endoftext|>"]
    path = write_vocabulary(tmp_path / "v.gguf", tokens, [1, 1, 1, int(TokenType.CONTROL)], ["a b"], "qwen99")
    with pytest.raises(ValueError) as refused:
        Tokenizer.from_gguf(path)
    message = str(refused.value)
    assert "\n" not in message and "'qwen99'" in message and "qwen35" in message and "qwen2" in message
