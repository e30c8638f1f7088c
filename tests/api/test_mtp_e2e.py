"""The model's MTP block drafting through hypercorn and the real C engine: a generated qwen35moe with its block,
chat at temperature 0 with speculation off and with the block's drafts (the default source, "auto"): the same
answer, and the history and the metrics show the drafts."""

from __future__ import annotations

import httpx
import openai
from conftest import live_server, server_config

USER = [{"role": "user", "content": "Tell me a story."}]


def test_the_blocks_drafts_leave_the_answer_the_models(tmp_path):
    from strata.modelgen import write_random_model

    path = write_random_model(tmp_path / "q35.gguf", arch="qwen35moe", size="tiny", dtype="q8_0")
    answers, rows = [], []
    for speculative in ({"source": "off"}, {"source": "auto", "adaptive": False, "max_draft": 3}):
        with live_server(server_config(model=str(path), context=256, speculative=speculative)) as server, \
                openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            reply = client.chat.completions.create(model="m", messages=USER, temperature=0, max_tokens=24)
            message = reply.choices[0].message  # a random model's answer: it thinks until max_tokens
            answers.append((message.content or "") + message.model_extra["reasoning_content"])
            rows.append(httpx.get(server.url + "/v1/history").json()["data"][0])
            metrics = httpx.get(server.url + "/metrics").text
    assert answers[0] == answers[1] and answers[0]
    assert rows[0]["draft_tokens"] == 0 and rows[1]["draft_tokens"] > 0
    assert f'strata_draft_tokens_total{{outcome="verified"}} {float(rows[1]["draft_tokens"])}' in metrics
