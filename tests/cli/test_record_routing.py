"""`--record-routing FILE` on `strata generate` and the `record_routing` key of `strata serve`: the engine's
routing trace of what they ran."""

from __future__ import annotations

from pathlib import Path

import httpx
from conftest import live_server, server_config

from strata.cli import main
from strata.experts.trace import read_trace


def test_generate_records_the_prompt_step_then_one_step_per_decoded_token(tmp_path: Path, capsys) -> None:
    trace_path = tmp_path / "trace.bin"
    assert main(["generate", "--prompt", "What is the capital of France?", "--chat", "--max-tokens", "5",
                 "--temperature", "0", "--threads", "1", "--record-routing", str(trace_path)]) == 0
    capsys.readouterr()
    trace = read_trace(trace_path)
    assert (trace.info.model, trace.info.n_layer, trace.info.n_expert_used) == ("strata-demo", 4, 2)
    steps = [[len(record.experts) for record in step] for step in trace.steps()]
    n_prompt = steps[0][0]
    # the first token comes from the prompt's logits; each later one is one decode step
    assert steps == [[n_prompt] * 4] + [[1] * 4] * 4
    assert n_prompt > 5


def test_serve_records_the_requests_steps(tiny_model: Path, tmp_path: Path) -> None:
    trace_path = tmp_path / "served.bin"
    config = server_config(model=str(tiny_model), record_routing=str(trace_path), slots=1, context=128)
    with live_server(config) as server:
        reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hello", "max_tokens": 3,
                                                                   "temperature": 0}, timeout=30)
        assert reply.status_code == 200, reply.text
    trace = read_trace(trace_path)  # complete once the server has closed its engine
    assert trace.n_steps >= 3
    assert {record.layer for record in trace.records} == set(range(trace.info.n_layer))
