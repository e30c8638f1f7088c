"""OpenAI's Predicted Outputs through hypercorn: the client's `prediction` drafts the answer (speculative
decoding), the answer is the model's own, and usage counts the prediction's tokens accepted and rejected; the
history, the status and the metrics show the drafts."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import live_server, server_config
from fakes import ScriptedEngine

USER = [{"role": "user", "content": "Rename x to y."}]
SCRIPT = "def area(y, h):\n    return y * h / 2\n\n\ndef volume(y, h, d):\n    return area(y, h) * d\n"


def test_a_prediction_drafts_the_answer_and_usage_counts_its_tokens(tokenizer):
    engine = ScriptedEngine(tokenizer, tokenizer.encode(SCRIPT, special=True))
    exact, changed = SCRIPT, SCRIPT.replace("y", "x")
    # Fixed-length drafts: the adaptive length follows measured step costs, which a scripted engine on a busy
    # machine makes noise of (its choices are tested on a clock of their own in tests/scheduling)
    config = server_config(speculative={"source": "auto", "adaptive": False})
    with live_server(config, engine, tokenizer) as server, \
            openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        plain = client.chat.completions.create(model="m", messages=USER, temperature=0)
        calls = len(engine.calls)
        right = client.chat.completions.create(model="m", messages=USER, temperature=0,
                                               prediction={"type": "content", "content": exact})
        right_calls = len(engine.calls) - calls
        wrong = client.chat.completions.create(
            model="m", messages=USER, temperature=0,
            prediction={"type": "content", "content": [{"type": "text", "text": changed}]})
        history = httpx.get(server.url + "/v1/history").json()["data"]
        last = httpx.get(server.url + "/v1/status").json()["last"]
        metrics = httpx.get(server.url + "/metrics").text
    n = plain.usage.completion_tokens
    assert right.choices[0].message.content == wrong.choices[0].message.content == plain.choices[0].message.content
    assert "accepted_prediction_tokens" not in plain.usage.completion_tokens_details.model_extra
    details = right.usage.completion_tokens_details
    # Every decode step gives one token beside the draft tokens it accepts (the last step's is the end of turn)
    assert details.rejected_prediction_tokens == 0 and details.accepted_prediction_tokens == n - (right_calls - 1)
    # several tokens a step (up to 8 drafts and one more)
    assert right_calls < n / 3
    details = wrong.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens > 0
    assert history[1]["acceptance_rate"] == 1.0
    assert 0 < history[0]["acceptance_rate"] < 1 and last == history[0]
    verified = sum(row["draft_tokens"] for row in history)
    assert f'strata_draft_tokens_total{{outcome="verified"}} {float(verified)}' in metrics


def test_speculation_off_ignores_a_prediction_but_reports_it(tokenizer):
    engine = ScriptedEngine(tokenizer, tokenizer.encode(SCRIPT, special=True))
    config = server_config(speculative={"source": "off"})
    with live_server(config, engine, tokenizer) as server, httpx.Client(base_url=server.url) as client:
        reply = client.post("/v1/chat/completions", json={
            "messages": USER, "temperature": 0, "prediction": {"type": "content", "content": SCRIPT}}).json()
    assert reply["choices"][0]["message"]["content"] == SCRIPT
    details = reply["usage"]["completion_tokens_details"]
    assert (details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]) == (0, 0)
    assert all(len(call) == 1 for call in engine.calls[1:])


@pytest.mark.parametrize("extra", [{"stop": ["* d"]}, {"max_tokens": 9}, {"logprobs": True, "top_logprobs": 2}],
                         ids=["stop string", "max_tokens", "logprobs"])
def test_stop_strings_max_tokens_and_logprobs_are_those_without_drafts(tokenizer, extra):
    engine = ScriptedEngine(tokenizer, tokenizer.encode(SCRIPT, special=True))
    body = {"messages": USER, "temperature": 0, **extra}
    replies = []
    for config in ({"source": "off"}, {"source": "auto", "adaptive": False}):
        with live_server(server_config(speculative=config), engine, tokenizer) as server, \
                httpx.Client(base_url=server.url) as client:
            replies.append(client.post("/v1/chat/completions", json={
                **body, "prediction": {"type": "content", "content": SCRIPT}}).json())
    (plain,), (drafted,) = (reply["choices"] for reply in replies)
    assert drafted == plain and plain["finish_reason"] == ("length" if "max_tokens" in extra else "stop")
    usage = [reply["usage"] for reply in replies]
    assert usage[0]["completion_tokens"] == usage[1]["completion_tokens"]
    assert usage[1]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
