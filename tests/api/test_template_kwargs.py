"""`chat_template_kwargs`, the template's extra variables: read on the OpenAI chat, Anthropic Messages and Responses
routes alike, refused with a 400 naming the field when it is not an object or sets the template's own variables,
and given to the template as variables."""

from __future__ import annotations

from typing import Any

import pytest

from strata.api import anthropic, openai_chat, openai_responses
from strata.api.errors import ApiError
from strata.events import ChatRequest
from strata.prompts import Prompts
from strata.request_errors import RequestError
from strata.text.families import QWEN3

KWARGS = {"enable_thinking": False, "preserve_thinking": True, "style": {"depth": [1, "two", None]}}
BODIES = {
    "chat": lambda extra: openai_chat.parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                     **extra}),
    "messages": lambda extra: anthropic.parse_request({"model": "m", "max_tokens": 9, "messages": [
        {"role": "user", "content": "hi"}], **extra}),
    "responses": lambda extra: openai_responses.parse_request({"model": "m", "input": "hi", **extra}),
}


@pytest.mark.parametrize("route", BODIES)
def test_every_route_reads_them(route: str) -> None:
    assert BODIES[route]({"chat_template_kwargs": KWARGS}).template_kwargs == KWARGS
    assert BODIES[route]({}).template_kwargs == {}


@pytest.mark.parametrize("route", BODIES)
@pytest.mark.parametrize(("value", "param"), [
    ([1], "chat_template_kwargs"), ("x", "chat_template_kwargs"),
    ({"messages": []}, "chat_template_kwargs.messages"), ({"tools": None}, "chat_template_kwargs.tools"),
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
])
def test_bad_ones_are_a_400_naming_the_field(route: str, value: Any, param: str) -> None:
    with pytest.raises(ApiError) as refused:
        BODIES[route]({"chat_template_kwargs": value})
    assert (refused.value.status, refused.value.param) == (400, param)


def test_the_template_gets_them_and_they_may_turn_thinking_off(tokenizer) -> None:
    template = "{{ style.depth | tojson }} {{ preserve_thinking }} {{ enable_thinking }}"
    prompts = Prompts(tokenizer, QWEN3, template, n_ctx=64, n_vocab=tokenizer.n_vocab, max_tokens=None)
    request = ChatRequest(messages=[{"role": "user", "content": "hi"}], template_kwargs=KWARGS)
    assert prompts.render(request) == '[1, "two", null] True False'
    with pytest.raises(RequestError) as refused:
        prompts.render(ChatRequest(messages=[], template_kwargs={"messages": []}))
    assert refused.value.param == "chat_template_kwargs"
