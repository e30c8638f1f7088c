"""A server restarted on the same `kv_disk` directory answers the same conversation from the disk tier: the
official client's `cached_tokens` counts the tokens read back, and the status and metrics routes show them; a
hybrid model's server resumes from the recurrent state stored beside the blocks."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from conftest import live_server, server_config

from strata.kv_disk import KvDiskError
from strata.modelgen import write_random_model

# about 600 tokens with the tiny model's byte vocabulary
MESSAGES = [{"role": "system", "content": "You are a careful assistant. " * 20},
            {"role": "user", "content": "Summarise the rules of chess in one line. " * 2}]


def _ask(url: str) -> tuple[str, int, int]:
    with openai.OpenAI(base_url=url + "/v1", api_key="unused") as client:
        reply = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return reply.choices[0].message.content or "", usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0


@pytest.mark.parametrize("device", ["cpu", "host"])
def test_cached_tokens_after_a_restart(tiny_model: Path, tmp_path: Path, device: str) -> None:
    config = server_config(model=str(tiny_model), context=1024, device=device,
                           kv_disk={"path": str(tmp_path), "block_tokens": 64})
    with live_server(config) as server:
        text, prompt_tokens, cached = _ask(server.url)
        assert cached == 0
    assert list(tmp_path.glob("*.kvb"))  # saved at the latest when the server stopped
    with live_server(config) as server:
        again, _, cached = _ask(server.url)
        status = httpx.get(server.url + "/v1/status").json()
        metrics = httpx.get(server.url + "/metrics").text
    assert again == text
    assert cached == (prompt_tokens - 1) // 64 * 64 > 0
    assert status["kv_disk"]["blocks"] >= cached // 64 and status["kv_disk"]["read_blocks"] == cached // 64
    assert status["last"]["disk_tokens"] == cached
    assert f'strata_prompt_tokens_total{{source="disk"}} {float(cached)}' in metrics


def test_a_second_server_on_the_directory_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    config = server_config(model=str(tiny_model), context=256, kv_disk={"path": str(tmp_path)})
    with live_server(config), pytest.raises(ExceptionGroup) as refused, live_server(config):  # trio's nursery's
        pass
    assert refused.group_contains(KvDiskError, match="in use by another server")
    with live_server(config):  # the first one's lock went with it
        pass


def test_a_hybrid_model_answers_a_restart_from_its_stored_state(tmp_path: Path) -> None:
    """A Qwen3.5-type model (recurrent layers): the turn after a restart resumes from a state record beside the
    blocks, and its answer is the one the first server gave."""
    model = write_random_model(tmp_path / "hybrid.gguf", arch="qwen35moe", size="tiny", dtype="f32", vocab="bytes",
                               seed=0)
    config = server_config(model=str(model), context=1024, kv_disk={"path": str(tmp_path / "kv"), "block_tokens": 64})
    with live_server(config) as server:
        text, prompt_tokens, cached = _ask(server.url)
        assert cached == 0
    with live_server(config) as server:
        again, _, cached = _ask(server.url)
        status = httpx.get(server.url + "/v1/status").json()
    assert again == text
    # from the state at the prompt's last message boundary, where the assistant's turn opens (13 tokens before
    # its end with this vocabulary): 10 blocks, then the record with the rows past them
    assert cached == prompt_tokens - 13
    disk = status["kv_disk"]
    assert disk["read_blocks"] == cached // 64 + 1 and disk["state_records"] >= 2
    assert status["last"]["disk_tokens"] == cached
