"""The model's MTP block in the service (`speculative.source` "auto" and "mtp"): the engine runs it where the file
has one and every request drafts with it, the answer staying the model's; "mtp" with a file that has none stops
startup naming the key."""

from __future__ import annotations

from contextlib import aclosing
from pathlib import Path

import pytest
from conftest import server_config

from strata.events import ChatRequest, TextDelta
from strata.request_errors import ServiceUnavailable
from strata.service import open_service
from strata.text.sampling import SamplingParams

ASK = ChatRequest(messages=[{"role": "user", "content": "Count to ten."}], sampling=SamplingParams(temperature=0.0),
                  max_tokens=24, enable_thinking=False)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random qwen35moe (Q8_0, byte vocabulary) with its MTP block."""
    from strata.modelgen import write_random_model

    return write_random_model(tmp_path_factory.mktemp("mtp") / "q35.gguf", arch="qwen35moe", size="tiny",
                              dtype="q8_0")


async def answer(config) -> tuple[str, object, bool]:
    async with open_service(config, log=lambda line: None) as service:
        async with aclosing(service.chat(ASK)) as events:
            text = "".join([event.text async for event in events if isinstance(event, TextDelta)])
        model = service.models.default
        return text, service.history.last, model.mtp is not None and model.mtp is model.engine


async def test_the_block_drafts_every_request_and_the_answer_is_the_models(mtp_model):
    plain, _, plain_mtp = await answer(server_config(model=str(mtp_model), context=256))
    drafted, row, runs = await answer(server_config(model=str(mtp_model), context=256,
                                                    speculative={"source": "auto", "adaptive": False}))
    assert drafted == plain and runs and not plain_mtp
    assert row.draft_tokens > 0


async def test_the_mtp_source_needs_a_file_with_the_block(tiny_model):
    with pytest.raises(ExceptionGroup) as failed:  # the service's nursery's
        await answer(server_config(model=str(tiny_model), context=64, speculative={"source": "mtp"}))
    assert failed.group_contains(ServiceUnavailable, match=r"speculative.source is mtp, and .*tiny.gguf has no MTP "
                                                            r"block", depth=None)
