"""A draft model in the service (`speculative.draft_model`): loaded beside the model on a context like its own,
drafting for every request, closed with the service; one of another vocabulary stops startup naming the key."""

from __future__ import annotations

from contextlib import aclosing

import pytest
from conftest import server_config
from fakes import SuccessorEngine

from strata.events import ChatRequest, TextDelta
from strata.request_errors import ServiceUnavailable
from strata.service import Service, open_service
from strata.text.sampling import SamplingParams

ASK = ChatRequest(messages=[{"role": "user", "content": "Count to ten."}], sampling=SamplingParams(temperature=0.0),
                  max_tokens=24, enable_thinking=False)


async def answer(config) -> tuple[str, object]:
    async with open_service(config, log=lambda line: None) as service:
        async with aclosing(service.chat(ASK)) as events:
            text = "".join([event.text async for event in events if isinstance(event, TextDelta)])
        draft = service.models.default.draft_model
        return text, (service.history.last, draft)


async def test_the_draft_model_drafts_every_request_and_the_answer_is_the_models(tiny_model):
    plain, _ = await answer(server_config(model=str(tiny_model), context=256, slots=2))
    drafted, (row, draft) = await answer(server_config(
        model=str(tiny_model), context=256, slots=2,
        speculative={"source": "draft_model", "draft_model": str(tiny_model), "adaptive": False}))
    assert drafted == plain
    assert row.draft_tokens > 0 and row.acceptance_rate == 1.0  # the model drafting for itself
    assert (draft.engine.n_ctx, draft.engine.n_seq) == (256, 2)
    with pytest.raises(Exception, match="closed|freed"):  # closed with the service
        draft.engine.seq_n_past(0)


def test_a_draft_model_of_another_vocabulary_stops_startup(tiny_model):
    config = server_config(model=str(tiny_model), context=64,
                           speculative={"source": "draft_model", "draft_model": str(tiny_model)})
    model = SuccessorEngine(n_ctx=64)  # 16 tokens
    with pytest.raises(ServiceUnavailable, match=r"speculative.draft_model: .* 16: a draft model needs the same voc"):
        Service(config).models.default._load_draft_model(model)
