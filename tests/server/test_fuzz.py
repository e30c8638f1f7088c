"""A bounded fuzz layer: random and half-valid bodies against every chat route of a live server (hypercorn, a
scripted engine). Whatever a client sends, the answer is a JSON error in the route's dialect or a normal reply,
never a 500, and the server keeps serving. 280 bodies, about 10 s on a quiet machine."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import live_server, server_config
from fakes import ScriptedEngine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROUTES = ["/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/messages/count_tokens"]
FIELDS = ["model", "messages", "input", "instructions", "system", "max_tokens", "max_output_tokens", "stream",
          "stop", "stop_sequences", "temperature", "top_p", "top_k", "tools", "tool_choice", "response_format",
          "reasoning_effort", "seed", "n", "chat_template_kwargs", "thinking", "text", "logprobs", "metadata"]
FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

text = st.text(st.characters(codec="utf-8") | st.characters(categories=["Cs"]), max_size=20) | st.sampled_from(
    ["user", "assistant", "system", "tool", "text", "image_url", "function", "<|im_end|>", "", "auto", "none"])
scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | text
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.sampled_from(["role", "content", "type", "text", "name", "id"]) | text,
                                        inner, max_size=4), max_leaves=12)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]) | values,
                                 "content": values})
bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=6) | st.builds(
    lambda messages, extra: {"model": "m", "max_tokens": 4, "messages": messages, **extra},
    st.lists(message, min_size=0, max_size=3), st.dictionaries(st.sampled_from(FIELDS[4:]), values, max_size=3))


@pytest.fixture(scope="module")
def server(tokenizer):
    engine = ScriptedEngine(tokenizer, tokenizer.encode("ok"), n_ctx=512)
    with live_server(server_config(), engine, tokenizer) as live, httpx.Client(base_url=live.url, timeout=30) as c:
        yield c


def assert_clean_answer(reply: httpx.Response, route: str) -> None:
    assert reply.status_code < 500, reply.text
    if reply.status_code >= 400:
        error = reply.json()
        if route.startswith("/v1/messages"):
            assert error["type"] == "error" and isinstance(error["error"]["message"], str)
        else:
            assert isinstance(error["error"]["message"], str)
        assert "Traceback" not in reply.text and "Error:" not in error.get("error", {}).get("message", "")


@pytest.mark.parametrize("route", ROUTES)
@FUZZ
@given(body=bodies | values)
def test_any_json_body_gets_a_clean_answer(server, route, body):
    raw = json.dumps(body).encode()
    assert_clean_answer(server.post(route, content=raw, headers={"content-type": "application/json"}), route)


@pytest.mark.parametrize("route", ROUTES[:2])
@FUZZ
@given(raw=st.binary(max_size=200) | st.builds(lambda b: json.dumps(b).encode()[: len(json.dumps(b)) // 2], bodies))
def test_any_bytes_get_a_clean_answer(server, route, raw):
    assert_clean_answer(server.post(route, content=raw, headers={"content-type": "application/json"}), route)


def test_still_serving_after_the_fuzz(server):
    reply = server.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "ok"
    assert server.get("/health").status_code == 200
