"""Bad input, the API key, and the information routes (`/health`, `/v1/models`, `/status`, `/v1/status`,
`/v1/history`, `/metrics`) through a live server with a scripted engine."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from conftest import live_server, server_config
from fakes import ScriptedEngine
from prometheus_client.parser import text_string_to_metric_families

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
def server(tokenizer):
    engine = ScriptedEngine(tokenizer, tokenizer.encode("fine"), n_ctx=256)
    config = server_config(limits={"max_body_bytes": 20_000})
    with live_server(config, engine, tokenizer) as live:
        yield live


def chat(server: Any, payload: Any = None, **options: Any) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=30, **options)


def assert_openai_error(reply: httpx.Response, status: int, param: str | None = None) -> str:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param
    return error["message"]


@pytest.mark.parametrize(("payload", "param"), [
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0].type"),
    ({"messages": USER, "temperature": "hot"}, "temperature"),
    ({"messages": USER, "temperature": 3}, "temperature"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "n": 2}, "n"),
    ({"messages": USER, "stop": [1]}, "stop[0]"),
    ({"messages": USER, "tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"messages": USER, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"messages": USER, "reasoning_effort": "extreme"}, "reasoning_effort"),
])
def test_bad_requests_get_400_naming_the_field(server, payload, param):
    assert_openai_error(chat(server, payload), 400, param)
    assert chat(server, {"messages": USER}).status_code == 200  # and the server keeps serving


def test_image_parts_get_a_clear_400(server):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    message = assert_openai_error(chat(server, {"messages": [{"role": "user", "content": [image]}]}), 400)
    assert "image" in message


def test_malformed_json_and_oversized_bodies(server):
    reply = httpx.post(server.url + "/v1/chat/completions", content=b'{"messages": [', timeout=30,
                       headers={"content-type": "application/json"})
    assert "not valid JSON" in assert_openai_error(reply, 400)
    big = {"messages": [{"role": "user", "content": "x" * 30_000}]}
    assert "too large" in assert_openai_error(chat(server, big), 413)
    assert chat(server, {"messages": USER}).status_code == 200


def test_prompt_too_long_for_the_context(server):
    reply = chat(server, {"messages": [{"role": "user", "content": "y" * 400}]})
    assert "context" in assert_openai_error(reply, 400)
    streamed = chat(server, {"messages": [{"role": "user", "content": "y" * 400}], "stream": True})
    assert_openai_error(streamed, 400)
    assert [row.finish for row in server.service.history.rows] == ["refused", "refused"]  # not failures


def test_unknown_route_and_method(server):
    assert_openai_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert_openai_error(httpx.get(server.url + "/v1/chat/completions"), 405)


def test_api_key_bearer_or_x_api_key(tokenizer):
    engine = ScriptedEngine(tokenizer, tokenizer.encode("ok"))
    with live_server(server_config(api_key="s3cret"), engine, tokenizer) as live:
        url = live.url + "/v1/chat/completions"
        assert_openai_error(httpx.post(url, json={"messages": USER}), 401)
        assert_openai_error(httpx.post(url, json={"messages": USER}, headers={"authorization": "Bearer nope"}), 401)
        assert httpx.post(url, json={"messages": USER}, headers={"authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.post(url, json={"messages": USER}, headers={"x-api-key": "s3cret"}).status_code == 200
        assert httpx.get(live.url + "/v1/models").status_code == 401
        assert httpx.get(live.url + "/health").status_code == 200  # never needs the key
        anthropic_error = httpx.post(live.url + "/v1/messages", json={}).json()
        assert anthropic_error["type"] == "error" and anthropic_error["error"]["type"] == "authentication_error"


def test_information_routes(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = httpx.get(server.url + "/v1/models").json()
    assert [model["id"] for model in models["data"]] == [server.service.model_name]
    idle = httpx.get(server.url + "/status").json()
    assert idle == {"busy": False, "queued": 0, "phase": "idle", "request": None,
                    "slots": [{"slot": 0, "request": None, "state": "idle", "cached_tokens": 0}]}
    chat(server, {"messages": USER, "max_tokens": 3})
    chat(server, {"messages": USER})
    status = httpx.get(server.url + "/v1/status").json()
    assert status["totals"]["requests"] == 2 and status["totals"]["finishes"] == {"length": 1, "stop": 1}
    assert status["last"]["finish"] == "stop" and status["last"]["output_tokens"] == len("fine")
    assert status["context"] == 256 and status["engine"]["backend"] == "scripted"
    history = httpx.get(server.url + "/v1/history").json()["data"]
    assert [row["finish"] for row in history] == ["stop", "length"]  # newest first
    assert history[0]["reused_tokens"] == history[0]["prompt_tokens"] - 1


def test_metrics_in_prometheus_text(server):
    chat(server, {"messages": USER})
    chat(server, {"messages": USER, "max_tokens": 1})
    text = httpx.get(server.url + "/metrics").text
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(text) for sample in family.samples}
    assert samples[("strata_requests_total", (("finish", "stop"),))] == 1
    assert samples[("strata_requests_total", (("finish", "length"),))] == 1
    assert samples[("strata_tokens_total", (("kind", "generated"),))] == len("fine") + 1
    assert samples[("strata_queue_length", ())] == 0
    assert samples[("strata_busy", ())] == 0


async def test_health_and_chat_answer_503_while_the_model_loads():
    from strata.api import create_app
    from strata.service import Service

    service = Service(server_config())  # never loaded: as during a slow startup
    client = create_app(service=service).test_client()
    health = await client.get("/health")
    assert (health.status_code, await health.get_json()) == (503, {"status": "loading"})
    reply = await client.post("/v1/chat/completions", json={"messages": USER})
    assert reply.status_code == 503
    assert "loading" in (await reply.get_json())["error"]["message"]


def test_every_dialect_has_its_routes():
    # The dialects are imported like any module: one that fails to import stops the server from starting,
    # instead of leaving its routes out.
    from strata.api import create_app
    from strata.service import Service

    app = create_app(service=Service(server_config()))
    posts = {rule.rule for rule in app.url_map.iter_rules() if "POST" in (rule.methods or ())}
    assert posts >= {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
                     "/v1/responses", "/v1/responses/input_tokens"}


async def test_a_failed_send_cancels_the_request():
    import trio

    from strata.api.app import _cancelling_send

    async def broken_send(message: Any) -> None:
        raise trio.BrokenResourceError("the client is gone")

    with trio.CancelScope() as scope:
        await _cancelling_send(broken_send, scope)({"type": "http.response.body", "body": b"x"})
        raise AssertionError("the send should have cancelled the request")
    assert scope.cancelled_caught
