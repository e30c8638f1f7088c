"""Choosing a Hugging Face repository's files for `--hf REPO[:QUANT]` (no network: `test_hub_e2e.py` downloads)."""

from __future__ import annotations

import time

import pytest

from strata.config import ConfigError, config_from_dict
from strata.models.hub import HubError, HubRef, Transfer, choose_files, parse_ref, quant_of

REPO = ["README.md", "m-Q4_0.gguf", "m-Q4_K_M.gguf", "m-q8_0.gguf", "m-BF16.gguf", "mmproj-m-BF16.gguf",
        "mmproj-m-F16.gguf", "big/m-Q6_K-00001-of-00002.gguf", "big/m-Q6_K-00002-of-00002.gguf"]


def test_names_parse_with_and_without_a_quant():
    assert parse_ref("owner/name") == HubRef("owner/name", None)
    assert parse_ref("hf:owner/name-GGUF:Q8_0") == HubRef("owner/name-GGUF", "Q8_0")
    assert str(parse_ref("owner/name:Q8_0")) == "hf:owner/name:Q8_0"
    for wrong in ("name", "owner/name:Q8:0", "/name", "owner/"):
        with pytest.raises(HubError, match="not a Hugging Face model name"):
            parse_ref(wrong)


def test_a_malformed_hf_model_is_a_config_error():
    assert config_from_dict({"model": "hf:owner/name:Q8_0"}).model == "hf:owner/name:Q8_0"
    with pytest.raises(ConfigError, match='"model" hf:nobody: not a Hugging Face model name'):
        config_from_dict({"model": "hf:nobody"})


def test_quant_is_the_last_word_of_the_name():
    assert quant_of("Qwen3-8B-Q4_K_M.gguf") == "Q4_K_M"
    assert quant_of("tinyllama-1.1b.Q8_0.gguf") == "Q8_0"
    assert quant_of("big/m-Q6_K-00001-of-00002.gguf") == "Q6_K"


def test_the_quant_asked_for_matches_without_regard_to_case():
    assert choose_files(HubRef("o/m", "Q8_0"), REPO, None).model == "m-q8_0.gguf"
    assert choose_files(HubRef("o/m", "bf16"), REPO, None).model == "m-BF16.gguf"
    # Q4_K does not match Q4_K_M: the quant must end at "." or "-"
    with pytest.raises(HubError, match=r"no GGUF file for quant Q4_K \(there are: BF16, Q4_0, Q4_K_M, Q6_K, q8_0\)"):
        choose_files(HubRef("o/m", "Q4_K"), REPO, None)


def test_without_a_quant_q4_k_m_else_the_first_file():
    assert choose_files(HubRef("o/m", None), REPO, None).model == "m-Q4_K_M.gguf"
    assert choose_files(HubRef("o/m", None), ["b-Q8_0.gguf", "a-F16.gguf"], None).model == "a-F16.gguf"
    with pytest.raises(HubError, match="no GGUF model file"):
        choose_files(HubRef("o/m", None), ["README.md", "mmproj-F16.gguf"], None)


def test_a_split_model_comes_with_every_part_in_order():
    choice = choose_files(HubRef("o/m", "Q6_K"), REPO[::-1], None)
    assert choice.model == "big/m-Q6_K-00001-of-00002.gguf"
    assert choice.parts == ("big/m-Q6_K-00001-of-00002.gguf", "big/m-Q6_K-00002-of-00002.gguf")
    assert choose_files(HubRef("o/m", "Q8_0"), REPO, None).parts == ("m-q8_0.gguf",)
    three = ["m-Q6_K-00001-of-00003.gguf", "m-Q6_K-00003-of-00003.gguf"]
    with pytest.raises(HubError, match=r"^hf:o/m:Q6_K: the split model m-Q6_K-00001-of-00003.gguf lacks 1 of its 3 "
                                       r"parts \(m-Q6_K-00002-of-00003.gguf\)$"):
        choose_files(HubRef("o/m", "Q6_K"), three, None)


def test_the_mmproj_beside_the_model_f16_unless_another_is_asked_for():
    assert choose_files(HubRef("o/m", "Q8_0"), REPO, "F16").mmproj == "mmproj-m-F16.gguf"
    assert choose_files(HubRef("o/m", "Q8_0"), REPO, "BF16").mmproj == "mmproj-m-BF16.gguf"
    assert choose_files(HubRef("o/m", "Q8_0"), REPO, "Q8_0").mmproj == "mmproj-m-BF16.gguf"  # the first there is
    assert choose_files(HubRef("o/m", "Q8_0"), REPO, None).mmproj is None
    assert choose_files(HubRef("o/m", "Q8_0"), ["m-Q8_0.gguf"], "F16").mmproj is None
    folders = ["a/m-Q8_0.gguf", "a/mmproj-BF16.gguf", "b/m-Q4_0.gguf", "b/mmproj-F16.gguf"]
    assert choose_files(HubRef("o/m", "Q8_0"), folders, "F16").mmproj == "a/mmproj-BF16.gguf"


def test_the_progress_line_gives_bytes_rate_and_eta():
    lines: list[str] = []
    transfer = Transfer(total=40_000_000, report=lines.append, name="m-Q8_0.gguf", started=time.monotonic() - 2)
    transfer.advance(10_000_000)
    assert lines == ["m-Q8_0.gguf: 10.0 of 40.0 MB, 5.0 MB/s, ETA 6 s"]
    resumed = Transfer(total=40_000_000, report=lines.append, name="m-Q8_0.gguf", started=time.monotonic() - 2)
    resumed.advance(20_000_000, resumed=True)  # an interrupted download's bytes: not in the rate
    resumed.advance(10_000_000)  # within REPORT_EVERY of the last line: counted, not reported
    assert len(lines) == 2 and resumed.line() == "m-Q8_0.gguf: 30.0 of 40.0 MB, 5.0 MB/s, ETA 2 s"
    resumed.advance(10_000_000)  # the last bytes: reported at once
    assert len(lines) == 3 and lines[-1].startswith("m-Q8_0.gguf: 40.0 of 40.0 MB")


def test_under_another_asgi_server_an_hf_model_is_one_line():
    from strata.model_file import ModelFileError, check_model_file

    with pytest.raises(ModelFileError, match=r"^model hf:o/m:Q8_0: Hugging Face models are downloaded by `strata "
                                             r"serve`; under another ASGI server, name the downloaded file$"):
        check_model_file("hf:o/m:Q8_0")
